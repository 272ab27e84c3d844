/* pegaflow.core.block_index.Block as a C type: the same attributes, constructor, key and
 * repr as the Python class in block_index.py (which stays as the fallback for a source
 * tree without the build), at a fraction of the cost to create.
 *
 * Why: every miss of the index creates one Block; as a Python class with __slots__ that
 * is an __init__ frame, seven attribute stores and a GC-tracked allocation (~340 ns on
 * the 2-core machine). Here it is one untracked allocation and a vectorcall. A Block refers only to its Namespace (a frozen dataclass)
 * and its hash (bytes), neither of which can refer back, so it needs no GC support
 * (the index stores only ints in its other fields; a cycle through a Block would leak).
 *
 * Threads: every function here runs with the GIL held and never releases it; the node
 * calls them from its event loop only (worker threads merely read Block attributes).
 * Other threads can run only inside the Python calls place() makes (allocator, admission,
 * a size comparison), which it treats as re-entrant. No Py_mod_gil slot: a free-threaded
 * build re-enables the GIL on import.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>

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
static PyObject *one;  /* RESIDENT */
static PyObject *str_free_bytes;
static PyObject *str_alloc;
static PyObject *str_state;
static PyObject *str_salt;
static PyObject *str_admit;

/* A new PENDING block; size is ns.page_bytes (a new reference, stolen). */
static PyObject *block_make_sized(PyTypeObject *type, PyObject *ns, PyObject *hash, PyObject *offset,
                                  PyObject *reclaimable, PyObject *size) {
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

static PyObject *block_make(PyTypeObject *type, PyObject *ns, PyObject *hash, PyObject *offset,
                            PyObject *reclaimable) {
    PyObject *size = PyObject_GetAttr(ns, str_page_bytes);
    if (size == NULL) return NULL;
    return block_make_sized(type, ns, hash, offset, reclaimable, size);
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

/* A member deleted with `del b.x` is NULL: what reading it does on the Python class. */
static int block_has(PyObject *v, const char *name) {
    if (v != NULL) return 1;
    PyErr_Format(PyExc_AttributeError, "'Block' object has no attribute '%s'", name);
    return 0;
}

/* key: (ns.id, hash) */
static PyObject *Block_key(Block *b, void *closure) {
    if (!block_has(b->ns, "ns") || !block_has(b->hash, "hash")) return NULL;
    PyObject *id = PyObject_GetAttr(b->ns, str_id);
    if (id == NULL) return NULL;
    PyObject *out = PyTuple_Pack(2, id, b->hash);
    Py_DECREF(id);
    return out;
}

/* Block(ns='name', hash=<first 12 hex digits>, offset=N, pins=N) */
static PyObject *Block_repr(Block *b) {
    if (!block_has(b->ns, "ns") || !block_has(b->hash, "hash") || !block_has(b->offset, "offset") ||
        !block_has(b->pins, "pins"))
        return NULL;
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
    {"reclaimable", T_OBJECT_EX, offsetof(Block, reclaimable), 0, "its class: reclaimable (evicted first) or retained"},
    {NULL},
};

static PyGetSetDef Block_getset[] = {
    {"key", (getter)Block_key, NULL, "(namespace id, hash)", NULL},
    {NULL},
};

static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pegaflow.core._blockindex.Block",
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


/* ---- LRU: the index's eviction order, an OrderedDict[Block, None] in what the index uses.
 *
 * Keys by identity (as Block hashes and compares), values always None. Methods and
 * semantics are OrderedDict's: setting a present key keeps its place, move_to_end(k, last)
 * and popitem(last) and pop(k[, default]) raise KeyError as OrderedDict does, iteration is
 * oldest first and fails if the order changes under it. Why not OrderedDict: each of its
 * operations is a dict operation plus a lookup in a second index of its linked list
 * (2-4 hash probes, ~130 ns here); this is one probe into a table of node numbers and a
 * doubly linked list of nodes in one array. */

typedef struct {
    PyObject *key; /* NULL for a free node */
    Py_ssize_t prev, next;
} Node;

typedef struct {
    PyObject_HEAD
    Node *nodes;
    Py_ssize_t nodes_cap, free_node; /* free nodes are chained through next */
    Py_ssize_t head, tail, len;      /* head: oldest; -1 when empty */
    Py_ssize_t *slots;               /* node number, EMPTY or TOMB */
    Py_ssize_t mask, used;           /* used: live + tombstones */
    unsigned long long version;
} LRU;

#define EMPTY (-1)
#define TOMB (-2)

static inline size_t ptr_hash(PyObject *k) {
    size_t x = (size_t)k >> 4;
    return (size_t)(x * 0x9E3779B97F4A7C15ULL) >> 7;
}

/* Slot of key, or -1; *ins (if given) gets the slot to insert into when absent. */
static inline Py_ssize_t find_slot(LRU *l, PyObject *key, Py_ssize_t *ins) {
    size_t i = ptr_hash(key) & (size_t)l->mask;
    Py_ssize_t first_tomb = -1;
    for (;;) {
        Py_ssize_t n = l->slots[i];
        if (n == EMPTY) {
            if (ins) *ins = first_tomb >= 0 ? first_tomb : (Py_ssize_t)i;
            return -1;
        }
        if (n == TOMB) {
            if (first_tomb < 0) first_tomb = (Py_ssize_t)i;
        } else if (l->nodes[n].key == key) {
            return (Py_ssize_t)i;
        }
        i = (i + 1) & (size_t)l->mask;
    }
}

static int rehash(LRU *l, Py_ssize_t nslots) {
    Py_ssize_t *slots = PyMem_Malloc(sizeof(Py_ssize_t) * nslots);
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < nslots; i++) slots[i] = EMPTY;
    size_t mask = (size_t)nslots - 1;
    for (Py_ssize_t n = l->head; n >= 0; n = l->nodes[n].next) {
        size_t i = ptr_hash(l->nodes[n].key) & mask;
        while (slots[i] != EMPTY) i = (i + 1) & mask;
        slots[i] = n;
    }
    PyMem_Free(l->slots);
    l->slots = slots;
    l->mask = nslots - 1;
    l->used = l->len;
    return 0;
}

static inline void unlink_node(LRU *l, Py_ssize_t n) {
    Node *x = &l->nodes[n];
    if (x->prev >= 0) l->nodes[x->prev].next = x->next; else l->head = x->next;
    if (x->next >= 0) l->nodes[x->next].prev = x->prev; else l->tail = x->prev;
}

static inline void link_tail(LRU *l, Py_ssize_t n) {
    Node *x = &l->nodes[n];
    x->prev = l->tail;
    x->next = -1;
    if (l->tail >= 0) l->nodes[l->tail].next = n; else l->head = n;
    l->tail = n;
}

static inline void link_head(LRU *l, Py_ssize_t n) {
    Node *x = &l->nodes[n];
    x->next = l->head;
    x->prev = -1;
    if (l->head >= 0) l->nodes[l->head].prev = n; else l->tail = n;
    l->head = n;
}

/* Appends key (new reference taken) at the newest end; no-op if present. */
static int lru_add(LRU *l, PyObject *key) {
    Py_ssize_t ins = -1;
    if (find_slot(l, key, &ins) >= 0) return 0;
    if (l->free_node < 0) {
        Py_ssize_t cap = l->nodes_cap ? l->nodes_cap * 2 : 64;
        Node *nodes = PyMem_Realloc(l->nodes, sizeof(Node) * cap);
        if (nodes == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (Py_ssize_t i = l->nodes_cap; i < cap; i++) {
            nodes[i].key = NULL;
            nodes[i].next = i + 1 < cap ? i + 1 : -1;
        }
        l->free_node = l->nodes_cap;
        l->nodes = nodes;
        l->nodes_cap = cap;
    }
    Py_ssize_t n = l->free_node;
    l->free_node = l->nodes[n].next;
    Py_INCREF(key);
    l->nodes[n].key = key;
    link_tail(l, n);
    if (l->slots[ins] == EMPTY) l->used++;
    l->slots[ins] = n;
    l->len++;
    l->version++;
    if (l->used * 3 >= (l->mask + 1) * 2) {
        Py_ssize_t nslots = l->mask + 1;
        while (l->len * 3 >= nslots) nslots *= 2; /* after: at most a third full */
        if (rehash(l, nslots) < 0) return -1;
    }
    return 0;
}

/* Removes the key at slot i; returns its reference (the caller owns it). */
static inline PyObject *lru_take(LRU *l, Py_ssize_t i) {
    Py_ssize_t n = l->slots[i];
    PyObject *key = l->nodes[n].key;
    unlink_node(l, n);
    l->nodes[n].key = NULL;
    l->nodes[n].next = l->free_node;
    l->free_node = n;
    l->slots[i] = TOMB;
    l->len--;
    l->version++;
    return key;
}

static PyObject *LRU_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "LRU() takes no arguments");
        return NULL;
    }
    LRU *l = (LRU *)type->tp_alloc(type, 0);
    if (l == NULL) return NULL;
    l->head = l->tail = l->free_node = -1;
    l->slots = PyMem_Malloc(sizeof(Py_ssize_t) * 8);
    if (l->slots == NULL) {
        Py_DECREF(l);
        return PyErr_NoMemory();
    }
    for (int i = 0; i < 8; i++) l->slots[i] = EMPTY;
    l->mask = 7;
    return (PyObject *)l;
}

static int LRU_clear(LRU *l) {
    for (Py_ssize_t n = l->head; n >= 0;) {
        Py_ssize_t next = l->nodes[n].next;
        Py_CLEAR(l->nodes[n].key);
        n = next;
    }
    l->head = l->tail = -1;
    l->len = 0;
    if (l->nodes != NULL) { /* every node free again */
        for (Py_ssize_t i = 0; i < l->nodes_cap; i++) l->nodes[i].next = i + 1 < l->nodes_cap ? i + 1 : -1;
        l->free_node = l->nodes_cap ? 0 : -1;
    }
    if (l->slots != NULL) {
        for (Py_ssize_t i = 0; i <= l->mask; i++) l->slots[i] = EMPTY;
    }
    l->used = 0;
    l->version++;
    return 0;
}

static int LRU_traverse(LRU *l, visitproc visit, void *arg) {
    for (Py_ssize_t n = l->head; n >= 0; n = l->nodes[n].next) Py_VISIT(l->nodes[n].key);
    return 0;
}

static void LRU_dealloc(LRU *l) {
    PyObject_GC_UnTrack(l);
    LRU_clear(l);
    PyMem_Free(l->nodes);
    PyMem_Free(l->slots);
    Py_TYPE(l)->tp_free((PyObject *)l);
}

static Py_ssize_t LRU_length(LRU *l) { return l->len; }

static int LRU_contains(LRU *l, PyObject *key) { return find_slot(l, key, NULL) >= 0; }

static int LRU_ass_sub(LRU *l, PyObject *key, PyObject *value) {
    if (value != NULL) return lru_add(l, key);
    Py_ssize_t i = find_slot(l, key, NULL);
    if (i < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return -1;
    }
    Py_DECREF(lru_take(l, i));
    return 0;
}

static PyObject *LRU_subscript(LRU *l, PyObject *key) {
    if (find_slot(l, key, NULL) < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    Py_RETURN_NONE;
}

static int parse_last(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t first, int *last,
                      const char *what) {
    *last = 1;
    PyObject *v = NULL;
    if (nargs > first + 1) {
        PyErr_Format(PyExc_TypeError, "%s: too many arguments", what);
        return -1;
    }
    if (nargs == first + 1) v = args[first];
    if (kwnames != NULL) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, i);
            if (v != NULL || !PyUnicode_Check(name) || PyUnicode_CompareWithASCIIString(name, "last") != 0) {
                PyErr_Format(PyExc_TypeError, "%s: unexpected keyword argument", what);
                return -1;
            }
            v = args[nargs + i];
        }
    }
    if (v != NULL) {
        int t = PyObject_IsTrue(v);
        if (t < 0) return -1;
        *last = t;
    }
    return 0;
}

/* move_to_end(key, last=True) */
static PyObject *LRU_move_to_end(LRU *l, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    int last;
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "move_to_end(key, last=True)");
        return NULL;
    }
    if (parse_last(args, nargs, kwnames, 1, &last, "move_to_end") < 0) return NULL;
    Py_ssize_t i = find_slot(l, args[0], NULL);
    if (i < 0) {
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    Py_ssize_t n = l->slots[i];
    if (last ? l->tail != n : l->head != n) {
        unlink_node(l, n);
        if (last) link_tail(l, n); else link_head(l, n);
        l->version++;
    }
    Py_RETURN_NONE;
}

/* popitem(last=True) -> (key, None) */
static PyObject *LRU_popitem(LRU *l, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    int last;
    if (parse_last(args, nargs, kwnames, 0, &last, "popitem") < 0) return NULL;
    if (l->len == 0) {
        PyErr_SetString(PyExc_KeyError, "dictionary is empty");
        return NULL;
    }
    PyObject *key = l->nodes[last ? l->tail : l->head].key;
    Py_ssize_t i = find_slot(l, key, NULL);
    key = lru_take(l, i);
    PyObject *out = PyTuple_Pack(2, key, Py_None);
    Py_DECREF(key);
    return out;
}

/* pop(key[, default]) -> None (the value) or default */
static PyObject *LRU_pop(LRU *l, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "pop(key[, default])");
        return NULL;
    }
    Py_ssize_t i = find_slot(l, args[0], NULL);
    if (i < 0) {
        if (nargs == 2) return Py_NewRef(args[1]);
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    Py_DECREF(lru_take(l, i));
    Py_RETURN_NONE;
}

typedef struct {
    PyObject_HEAD
    LRU *lru; /* NULL once exhausted (as OrderedDict's iterator: StopIteration from then on) */
    Py_ssize_t node;
    unsigned long long version;
} LRUIter;

static PyTypeObject LRUIterType;

static PyObject *LRU_iter(LRU *l) {
    LRUIter *it = PyObject_New(LRUIter, &LRUIterType);
    if (it == NULL) return NULL;
    Py_INCREF(l);
    it->lru = l;
    it->node = l->head;
    it->version = l->version;
    return (PyObject *)it;
}

static void LRUIter_dealloc(LRUIter *it) {
    Py_XDECREF(it->lru);
    PyObject_Free(it);
}

static PyObject *LRUIter_next(LRUIter *it) {
    if (it->lru == NULL) return NULL;
    if (it->node < 0) { /* past the last key: done, whatever changed since (as OrderedDict) */
        Py_CLEAR(it->lru);
        return NULL;
    }
    if (it->version != it->lru->version) {
        PyErr_SetString(PyExc_RuntimeError, "LRU mutated during iteration");
        return NULL;
    }
    Node *x = &it->lru->nodes[it->node];
    it->node = x->next;
    return Py_NewRef(x->key);
}

static PyTypeObject LRUIterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pegaflow.core._blockindex.LRUIterator",
    .tp_basicsize = sizeof(LRUIter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)LRUIter_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)LRUIter_next,
};

static PyMappingMethods LRU_as_mapping = {
    .mp_length = (lenfunc)LRU_length,
    .mp_subscript = (binaryfunc)LRU_subscript,
    .mp_ass_subscript = (objobjargproc)LRU_ass_sub,
};

static PySequenceMethods LRU_as_sequence = {
    .sq_contains = (objobjproc)LRU_contains,
};

static PyMethodDef LRU_methods[] = {
    {"move_to_end", (PyCFunction)(void (*)(void))LRU_move_to_end, METH_FASTCALL | METH_KEYWORDS,
     "move_to_end(key, last=True): to the newest (or, last=False, oldest) end; KeyError if absent."},
    {"popitem", (PyCFunction)(void (*)(void))LRU_popitem, METH_FASTCALL | METH_KEYWORDS,
     "popitem(last=True) -> (key, None): remove the newest (or oldest) entry."},
    {"pop", (PyCFunction)(void (*)(void))LRU_pop, METH_FASTCALL, "pop(key[, default])."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LRUType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pegaflow.core._blockindex.LRU",
    .tp_basicsize = sizeof(LRU),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "An insertion-ordered set of objects by identity with OrderedDict's methods (the index's LRU).",
    .tp_new = LRU_new,
    .tp_dealloc = (destructor)LRU_dealloc,
    .tp_traverse = (traverseproc)LRU_traverse,
    .tp_clear = (inquiry)LRU_clear,
    .tp_as_mapping = &LRU_as_mapping,
    .tp_as_sequence = &LRU_as_sequence,
    .tp_iter = (getiterfunc)LRU_iter,
    .tp_methods = LRU_methods,
};


/* block_key's 64 bits: the hash's first 8 bytes, little-endian (fewer: zero-extended). */
static inline uint64_t low64(PyObject *bytes) {
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(bytes);
    Py_ssize_t len = PyBytes_GET_SIZE(bytes);
    uint64_t k = 0;
    for (Py_ssize_t j = (len < 8 ? len : 8) - 1; j >= 0; j--) k = (k << 8) | b[j];
    return k;
}

/* v is the int x exactly (an int of any size; no exception left set). */
static inline int int_is(PyObject *v, long x) {
    if (!PyLong_CheckExact(v)) return 0;
    int overflow;
    long got = PyLong_AsLongAndOverflow(v, &overflow);
    return !overflow && got == x;
}

/* ---- place: the block index's reserve/insert loop for its steady state, in C.
 *
 * place(blocks, lru, ns, hashes, start, reclaimable, made, evicted, out, alloc, need, admission[, rlru])
 *   -> (stop, refused)
 *
 * Runs BlockIndex._reserve's loop over hashes[start:] for as long as every step is one
 * of its common cases, and returns the index of the first hash it left to the Python
 * loop (len(hashes) when it did them all). The caller guarantees the rest of the case:
 * blocks is ns's table, lru the retained order, rlru (None or absent: empty) the
 * reclaimable one, no namespace quota to apply. The cases:
 *
 * - the hash is in blocks: out gets None; a RESIDENT, unpinned block is moved to the
 *   newest end of its class's order, lru or rlru (what touch() does). A pinned one stops
 *   here, and so does any RESIDENT one under admission (touch() records it there).
 * - it is not, and alloc.free_bytes >= need: the page is alloc.alloc(ns.page_bytes)
 *   (an exception stops here, cleared: the Python loop makes the same call and handles it);
 * - it is not, and the pool is full: the head of rlru, or of lru when rlru is empty (a
 *   Block of ns, else stop: another namespace's victim lives in another table, the Python
 *   loop's; none, stop) is judged
 *   by admission.admit(block_key(hash), block_key(head.hash)) if admission is not None (refused: stop with refused=True, nothing popped: the Python
 *   loop counts the refusal and ends the request), then popped and dropped from blocks,
 *   appended to evicted, and its page taken.
 * - either way a new PENDING Block(ns, hash, page, reclaimable) goes into blocks and is
 *   appended to made (and to out, unless out is None).
 *
 * The Python loop stays the definition; tests run both on the same operations. */
/* place()'s step for one hash: a new block at ``offset`` in ``blocks`` (the namespace's
 * table), appended to ``made`` and to ``out`` unless it is None. 0, or -1 with an exception. */
static int put_block(PyObject *blocks, PyObject *made, PyObject *out, PyObject *ns, PyObject *h,
                     PyObject *offset, PyObject *reclaimable, PyObject *size) {
    PyObject *b = block_make_sized(&BlockType, ns, h, offset, reclaimable, Py_NewRef(size));
    if (b == NULL) return -1;
    int rc = (PyDict_SetItem(blocks, h, b) < 0 || PyList_Append(made, b) < 0 ||
              (out != Py_None && PyList_Append(out, b) < 0)) ? -1 : 0;
    Py_DECREF(b);
    return rc;
}

static PyObject *place(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12 && nargs != 13) {
        PyErr_SetString(PyExc_TypeError,
                        "place(blocks, lru, ns, hashes, start, reclaimable, made, evicted, out, alloc, need, admission"
                        "[, rlru])");
        return NULL;
    }
    LRU *rlru = NULL; /* the reclaimable order; NULL: empty */
    if (nargs == 13 && args[12] != Py_None) {
        if (Py_TYPE(args[12]) != &LRUType) {
            PyErr_SetString(PyExc_TypeError, "place: rlru must be an LRU or None");
            return NULL;
        }
        rlru = (LRU *)args[12];
    }
    PyObject *blocks = args[0], *ns = args[2], *hashes = args[3], *reclaimable = args[5];
    PyObject *made = args[6], *evicted = args[7], *out = args[8], *alloc = args[9], *need = args[10];
    PyObject *admission = args[11];
    int refused = 0;
    uint64_t salt = 0;
    if (admission != Py_None) {
        PyObject *so = PyObject_GetAttr(ns, str_salt);
        if (so == NULL) return NULL;
        salt = (uint64_t)PyLong_AsUnsignedLongLongMask(so);
        Py_DECREF(so);
        if (PyErr_Occurred()) return NULL;
    }
    if (!PyDict_CheckExact(blocks) || Py_TYPE(args[1]) != &LRUType || !PyList_CheckExact(hashes) ||
        !PyList_CheckExact(made) || !PyList_CheckExact(evicted) || (out != Py_None && !PyList_CheckExact(out))) {
        PyErr_SetString(PyExc_TypeError, "place: dict, LRU, namespace, list, int, bool, list, list, list or None");
        return NULL;
    }
    LRU *lru = (LRU *)args[1];
    Py_ssize_t i = PyLong_AsSsize_t(args[4]);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0) {
        PyErr_SetString(PyExc_ValueError, "place: start must be >= 0");
        return NULL;
    }
    PyObject *size = PyObject_GetAttr(ns, str_page_bytes);
    if (size == NULL) return NULL;
    /* The allocator and the admission policy are Python calls: own what they could
     * change under us (a tuple of the hashes; the victim across admit()). */
    int pool_full = 0;
    PyObject *hs = PyList_AsTuple(hashes);
    if (hs == NULL) {
        Py_DECREF(size);
        return NULL;
    }
    for (; i < PyTuple_GET_SIZE(hs); i++) {
        PyObject *h = PyTuple_GET_ITEM(hs, i);
        PyObject *found = PyDict_GetItemWithError(blocks, h); /* borrowed */
        if (found == NULL && PyErr_Occurred()) goto error;
        if (found != NULL) {
            if (Py_TYPE(found) != &BlockType) break;
            Block *e = (Block *)found;
            /* Anything unusual (a deleted attribute, a state that is no int) is the Python loop's. */
            if (e->state == NULL || !PyLong_CheckExact(e->state)) break;
            int resident = int_is(e->state, 1);
            if (resident) {
                if (admission != Py_None || e->pins == NULL || !int_is(e->pins, 0)) break;
                LRU *own = e->reclaimable == Py_False ? lru : e->reclaimable == Py_True ? rlru : NULL;
                if (own == NULL) break;
                Py_ssize_t slot = find_slot(own, found, NULL);
                if (slot < 0) break;
                Py_ssize_t n = own->slots[slot];
                if (own->tail != n) {
                    unlink_node(own, n);
                    link_tail(own, n);
                    own->version++;
                }
            }
            if (out != Py_None && PyList_Append(out, Py_None) < 0) goto error;
            continue;
        }
        int has_free = 0;
        if (!pool_full) {
            PyObject *free = PyObject_GetAttr(alloc, str_free_bytes);
            if (free == NULL) goto error;
            has_free = PyObject_RichCompareBool(free, need, Py_GE);
            Py_DECREF(free);
            if (has_free < 0) goto error;
            /* Full stays full here: a victim's page goes to the new block, nothing is freed. */
            pool_full = !has_free;
        }
        if (has_free) {
            PyObject *page = PyObject_CallMethodOneArg(alloc, str_alloc, size);
            if (page == NULL) {
                /* KeyboardInterrupt, SystemExit: not the allocator's failure to retry, propagated
                 * (the Python loop catches OutOfSpace only). */
                if (!PyErr_ExceptionMatches(PyExc_Exception)) goto error;
                PyErr_Clear();
                break;
            }
            int rc = put_block(blocks, made, out, ns, h, page, reclaimable, size);
            Py_DECREF(page);
            if (rc < 0) goto error;
            continue;
        }
        /* The reclaimable order goes first (BlockIndex._allocate). */
        LRU *vl = rlru != NULL && rlru->head >= 0 ? rlru : lru;
        if (vl->head < 0) break;
        PyObject *head = vl->nodes[vl->head].key;
        if (Py_TYPE(head) != &BlockType) break;
        Block *victim = (Block *)head;
        if (victim->ns != ns || victim->size == NULL) break;
        if (victim->size != size) {
            /* Not the same int object: the comparison may run Python code, which could drop the
             * head from the LRU (and free it) or replace its size: hold both across it. */
            PyObject *vsize = Py_NewRef(victim->size);
            Py_INCREF(head);
            int eq = PyObject_RichCompareBool(vsize, size, Py_EQ);
            int moved = vl->head < 0 || vl->nodes[vl->head].key != head ||
                        (vl == lru && rlru != NULL && rlru->head >= 0);
            Py_DECREF(vsize);
            Py_DECREF(head);
            if (eq < 0) goto error;
            if (!eq || moved) break;
        }
        if (admission != Py_None) {
            if (!PyBytes_Check(h) || victim->hash == NULL || !PyBytes_Check(victim->hash)) break;
            PyObject *ck = PyLong_FromUnsignedLongLong(low64(h) ^ salt);
            PyObject *vk = ck == NULL ? NULL : PyLong_FromUnsignedLongLong(low64(victim->hash) ^ salt);
            Py_INCREF(head);
            PyObject *ok = vk == NULL ? NULL : PyObject_CallMethodObjArgs(admission, str_admit, ck, vk, NULL);
            Py_XDECREF(ck);
            Py_XDECREF(vk);
            int moved = vl->head < 0 || vl->nodes[vl->head].key != head ||
                        (vl == lru && rlru != NULL && rlru->head >= 0);
            Py_DECREF(head);
            if (ok == NULL) goto error;
            if (moved) {
                Py_DECREF(ok);
                PyErr_SetString(PyExc_RuntimeError, "the LRU changed during an admission call");
                goto error;
            }
            int yes = PyObject_IsTrue(ok);
            Py_DECREF(ok);
            if (yes < 0) goto error;
            if (!yes) {
                refused = 1;
                break;
            }
        }
        /* Still the head (checked after every Python call above); a deleted hash or offset is
         * the Python loop's to report. */
        if (victim->hash == NULL || victim->offset == NULL) break;
        PyObject *vkey = lru_take(vl, find_slot(vl, head, NULL)); /* the LRU's reference */
        if (PyDict_DelItem(blocks, victim->hash) < 0 || PyList_Append(evicted, vkey) < 0) {
            Py_DECREF(vkey);
            goto error;
        }
        int rc = put_block(blocks, made, out, ns, h, victim->offset, reclaimable, size); /* vkey holds victim */
        Py_DECREF(vkey);
        if (rc < 0) goto error;
    }
    Py_DECREF(size);
    Py_DECREF(hs);
    return Py_BuildValue("(nO)", i, refused ? Py_True : Py_False);
error:
    Py_DECREF(size);
    Py_DECREF(hs);
    return NULL;
}

/* settle(made, lru): commit of fresh blocks, as BlockIndex.insert does it: every block's
 * state becomes RESIDENT (1) and it is appended to lru, in order. */
static PyObject *settle(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_CheckExact(args[0]) || Py_TYPE(args[1]) != &LRUType) {
        PyErr_SetString(PyExc_TypeError, "settle(made: list, lru: LRU)");
        return NULL;
    }
    PyObject *made = args[0];
    LRU *lru = (LRU *)args[1];
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(made); i++) {
        /* Held: setting the state (or dropping the old one) may run Python code that
         * changes made. */
        PyObject *b = Py_NewRef(PyList_GET_ITEM(made, i));
        if (Py_TYPE(b) == &BlockType) {
            Py_XSETREF(((Block *)b)->state, Py_NewRef(one));
        } else if (PyObject_SetAttr(b, str_state, one) < 0) {
            Py_DECREF(b);
            return NULL;
        }
        int err = lru_add(lru, b);
        Py_DECREF(b);
        if (err < 0) return NULL;
    }
    Py_RETURN_NONE;
}

/* reclass(blocks, hashes, reclaimable, source, target, moved, parked): BlockIndex.reclassify's
 * loop. For each hash of the list whose block in ``blocks`` (the namespace's table) is RESIDENT
 * and not yet of class ``reclaimable`` (a bool): its ``reclaimable`` is set, it is appended to
 * ``moved``, and, unpinned, it leaves ``source`` for the newest end of ``target`` (the two LRUs
 * of the classes); an unpinned block that is not in ``source`` (parked by a victim search under
 * namespace quotas) goes to ``parked`` for the Python caller. Pinned blocks only change class:
 * unpin() puts them into their class's LRU. Absent, PENDING or foreign objects are skipped.
 * tests/oracles/block_index_py.py has the same in Python; tests hold the two equal. */
static PyObject *reclass(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 || !PyDict_CheckExact(args[0]) || !PyList_CheckExact(args[1]) || !PyBool_Check(args[2]) ||
        Py_TYPE(args[3]) != &LRUType || Py_TYPE(args[4]) != &LRUType || !PyList_CheckExact(args[5]) ||
        !PyList_CheckExact(args[6])) {
        PyErr_SetString(PyExc_TypeError,
                        "reclass(blocks: dict, hashes: list, reclaimable: bool, source: LRU, target: LRU, "
                        "moved: list, parked: list)");
        return NULL;
    }
    PyObject *blocks = args[0], *value = args[2], *moved = args[5], *parked = args[6];
    LRU *source = (LRU *)args[3], *target = (LRU *)args[4];
    if (source == target) {
        PyErr_SetString(PyExc_ValueError, "reclass: source and target are the same LRU");
        return NULL;
    }
    /* A tuple of the hashes: nothing below runs Python code, but the list is the caller's. */
    PyObject *hs = PyList_AsTuple(args[1]);
    if (hs == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(hs); i++) {
        PyObject *found = PyDict_GetItemWithError(blocks, PyTuple_GET_ITEM(hs, i)); /* borrowed */
        if (found == NULL) {
            if (PyErr_Occurred()) goto error;
            continue;
        }
        if (Py_TYPE(found) != &BlockType) continue;
        Block *b = (Block *)found;
        if (b->state == NULL || !int_is(b->state, 1) || b->reclaimable == value || b->pins == NULL) continue;
        Py_INCREF(found); /* held while its fields change */
        Py_SETREF(b->reclaimable, Py_NewRef(value));
        int err = PyList_Append(moved, found);
        if (!err && int_is(b->pins, 0)) {
            Py_ssize_t slot = find_slot(source, found, NULL);
            if (slot >= 0) {
                Py_DECREF(lru_take(source, slot)); /* ``found`` is still held */
                err = lru_add(target, found);
            } else {
                err = PyList_Append(parked, found);
            }
        }
        Py_DECREF(found);
        if (err < 0) goto error;
    }
    Py_DECREF(hs);
    Py_RETURN_NONE;
error:
    Py_DECREF(hs);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"place", (PyCFunction)(void (*)(void))place, METH_FASTCALL,
     "place(blocks, lru, ns, hashes, start, reclaimable, made, evicted, out, alloc, need, admission[, rlru]) -> "
     "(stop, refused)."},
    {"settle", (PyCFunction)(void (*)(void))settle, METH_FASTCALL,
     "settle(made, lru): state RESIDENT and appended to lru, for each block in order."},
    {"reclass", (PyCFunction)(void (*)(void))reclass, METH_FASTCALL,
     "reclass(blocks, hashes, reclaimable, source, target, moved, parked): move blocks between the classes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef blockindex_module = {
    PyModuleDef_HEAD_INIT, "_blockindex", "The block index's Block and LRU in C (see pegaflow/core/block_index.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__blockindex(void) {
    str_page_bytes = PyUnicode_InternFromString("page_bytes");
    str_id = PyUnicode_InternFromString("id");
    str_name = PyUnicode_InternFromString("name");
    zero = PyLong_FromLong(0);
    one = PyLong_FromLong(1);
    str_free_bytes = PyUnicode_InternFromString("free_bytes");
    str_alloc = PyUnicode_InternFromString("alloc");
    str_state = PyUnicode_InternFromString("state");
    str_salt = PyUnicode_InternFromString("salt");
    str_admit = PyUnicode_InternFromString("admit");
    if (str_salt == NULL || str_admit == NULL) return NULL;
    if (zero == NULL || one == NULL || str_free_bytes == NULL || str_alloc == NULL || str_state == NULL) return NULL;
    if (str_page_bytes == NULL || str_id == NULL || str_name == NULL) return NULL;
    if (PyType_Ready(&BlockType) < 0 || PyType_Ready(&LRUType) < 0 || PyType_Ready(&LRUIterType) < 0) return NULL;
    PyObject *m = PyModule_Create(&blockindex_module);
    if (m == NULL) return NULL;
    Py_INCREF(&BlockType);
    if (PyModule_AddObject(m, "Block", (PyObject *)&BlockType) < 0) {
        Py_DECREF(&BlockType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&LRUType);
    if (PyModule_AddObject(m, "LRU", (PyObject *)&LRUType) < 0) {
        Py_DECREF(&LRUType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
