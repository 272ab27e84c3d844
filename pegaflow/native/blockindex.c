/* pegaflow.node.block_index.Block as a C type: the same attributes, constructor, key and
 * repr as the Python class in block_index.py (which stays as the fallback for a source
 * tree without the build), at a fraction of the cost to create.
 *
 * Why: every miss of the index creates one Block; as a Python class with __slots__ that
 * is an __init__ frame, seven attribute stores and a GC-tracked allocation (~340 ns on
 * the 2-core machine). Here it is one untracked allocation and a vectorcall. A Block refers only to its Namespace (a frozen dataclass)
 * and its hash (bytes), neither of which can refer back, so it needs no GC support.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

/* Every field is an object member (T_OBJECT_EX): CPython specialises reads and writes of
 * those in the interpreter (LOAD_ATTR_SLOT / STORE_ATTR_SLOT), as for a __slots__ class,
 * while C integer members would take the generic attribute path on every access. */
typedef struct {
    PyObject_HEAD
    PyObject *ns;
    PyObject *hash;
    PyObject *offset;
    PyObject *size;
    PyObject *state;
    PyObject *pins;
    PyObject *reclaimable;
} Block;

static PyTypeObject BlockType;
static PyObject *str_page_bytes;
static PyObject *str_id;
static PyObject *str_name;

static PyObject *zero; /* PENDING, and no pins */

static PyObject *block_make(PyTypeObject *type, PyObject *ns, PyObject *hash, PyObject *offset,
                            PyObject *reclaimable) {
    PyObject *size = PyObject_GetAttr(ns, str_page_bytes);
    if (size == NULL) return NULL;
    Block *b = (Block *)type->tp_alloc(type, 0);
    if (b == NULL) {
        Py_DECREF(size);
        return NULL;
    }
    Py_INCREF(ns);
    b->ns = ns;
    Py_INCREF(hash);
    b->hash = hash;
    Py_INCREF(offset);
    b->offset = offset;
    b->size = size;
    Py_INCREF(zero);
    b->state = zero;
    Py_INCREF(zero);
    b->pins = zero;
    if (reclaimable == NULL) reclaimable = Py_False;
    Py_INCREF(reclaimable);
    b->reclaimable = reclaimable;
    return (PyObject *)b;
}

/* Block(ns, hash_, offset, reclaimable=False) */
static PyObject *Block_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"ns", "hash_", "offset", "reclaimable", NULL};
    PyObject *ns, *hash, *offset, *reclaimable = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|O:Block", kw, &ns, &hash, &offset, &reclaimable))
        return NULL;
    return block_make(type, ns, hash, offset, reclaimable);
}

static PyObject *Block_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames == NULL && (nargs == 3 || nargs == 4))
        return block_make((PyTypeObject *)type, args[0], args[1], args[2], nargs == 4 ? args[3] : NULL);
    /* Keywords or a wrong count: the general path (and its error messages). */
    PyObject *tuple = PyTuple_New(nargs);
    if (tuple == NULL) return NULL;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(tuple, i, args[i]);
    }
    PyObject *kwds = NULL;
    if (kwnames != NULL) {
        kwds = PyDict_New();
        if (kwds == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++) {
            if (PyDict_SetItem(kwds, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) {
                Py_DECREF(tuple);
                Py_DECREF(kwds);
                return NULL;
            }
        }
    }
    PyObject *out = Block_new((PyTypeObject *)type, tuple, kwds);
    Py_DECREF(tuple);
    Py_XDECREF(kwds);
    return out;
}

static void Block_dealloc(Block *b) {
    Py_XDECREF(b->ns);
    Py_XDECREF(b->hash);
    Py_XDECREF(b->offset);
    Py_XDECREF(b->size);
    Py_XDECREF(b->state);
    Py_XDECREF(b->pins);
    Py_XDECREF(b->reclaimable);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

/* key: (ns.id, hash) */
static PyObject *Block_key(Block *b, void *closure) {
    PyObject *id = PyObject_GetAttr(b->ns, str_id);
    if (id == NULL) return NULL;
    PyObject *out = PyTuple_Pack(2, id, b->hash);
    Py_DECREF(id);
    return out;
}

/* Block(ns='name', hash=<first 12 hex digits>, offset=N, pins=N) */
static PyObject *Block_repr(Block *b) {
    PyObject *name = PyObject_GetAttr(b->ns, str_name);
    if (name == NULL) return NULL;
    PyObject *hex = PyObject_CallMethod(b->hash, "hex", NULL);
    if (hex == NULL) {
        Py_DECREF(name);
        return NULL;
    }
    PyObject *short_hex = PySequence_GetSlice(hex, 0, 12);
    Py_DECREF(hex);
    if (short_hex == NULL) {
        Py_DECREF(name);
        return NULL;
    }
    PyObject *out = PyUnicode_FromFormat("Block(ns=%R, hash=%U, offset=%S, pins=%S)", name, short_hex,
                                         b->offset, b->pins);
    Py_DECREF(name);
    Py_DECREF(short_hex);
    return out;
}

static PyMemberDef Block_members[] = {
    {"ns", T_OBJECT_EX, offsetof(Block, ns), 0, "the Namespace"},
    {"hash", T_OBJECT_EX, offsetof(Block, hash), 0, "the 16-byte block hash"},
    {"offset", T_OBJECT_EX, offsetof(Block, offset), 0, "page offset in the pool"},
    {"size", T_OBJECT_EX, offsetof(Block, size), 0, "page bytes (the namespace's)"},
    {"state", T_OBJECT_EX, offsetof(Block, state), 0, "PENDING (0) or RESIDENT (1)"},
    {"pins", T_OBJECT_EX, offsetof(Block, pins), 0, "leases and transfers holding the page"},
    {"reclaimable", T_OBJECT_EX, offsetof(Block, reclaimable), 0, "a copy pulled from a peer"},
    {NULL},
};

static PyGetSetDef Block_getset[] = {
    {"key", (getter)Block_key, NULL, "(namespace id, hash)", NULL},
    {NULL},
};

static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pegaflow._blockindex.Block",
    .tp_basicsize = sizeof(Block),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One page of the pool holding one block. Mutable, owned by BlockIndex.",
    .tp_new = Block_new,
    .tp_vectorcall = Block_vectorcall,
    .tp_dealloc = (destructor)Block_dealloc,
    .tp_repr = (reprfunc)Block_repr,
    .tp_members = Block_members,
    .tp_getset = Block_getset,
};

static struct PyModuleDef blockindex_module = {
    PyModuleDef_HEAD_INIT, "_blockindex", "The block index's Block in C (see pegaflow/node/block_index.py).", -1,
    NULL,
};

PyMODINIT_FUNC PyInit__blockindex(void) {
    str_page_bytes = PyUnicode_InternFromString("page_bytes");
    str_id = PyUnicode_InternFromString("id");
    str_name = PyUnicode_InternFromString("name");
    zero = PyLong_FromLong(0);
    if (zero == NULL) return NULL;
    if (str_page_bytes == NULL || str_id == NULL || str_name == NULL) return NULL;
    if (PyType_Ready(&BlockType) < 0) return NULL;
    PyObject *m = PyModule_Create(&blockindex_module);
    if (m == NULL) return NULL;
    Py_INCREF(&BlockType);
    if (PyModule_AddObject(m, "Block", (PyObject *)&BlockType) < 0) {
        Py_DECREF(&BlockType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
