/* The per-key paths of pegaflow.policy.tinylfu.TinyLFU in C: record, estimate, admit.
 *
 * TinyLFU owns the state (the count-min table and the doorkeeper are its bytearrays, the
 * sample count is its attribute); a Sketch only holds views of the two buffers and the
 * constants, so the Python and C paths read and write the very same memory. Every
 * function here is the line-for-line twin of the pure-Python scalar reference the tests
 * compare against (tests/oracles/tinylfu_scalar.py; there is no fallback at run time):
 * the same splitmix-shaped mixing, double hashing, 4-bit saturating counters, doorkeeper
 * probes and aging at the same access.
 *
 * Why C: a scalar record in Python is a few dozen bytecodes (~1.5 us here); pegaflow
 * replay records every block access and asks admission for every eviction, and numpy's
 * fixed cost per call dominates at a request's ~30 keys. Here a key costs tens of ns.
 *
 * Threads: the GIL is held throughout (never released), like the Python paths on the
 * same buffers; the owner serialises calls. The exported views keep the bytearrays from
 * being resized under the Sketch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define C1 0xBF58476D1CE4E5B9ULL
#define C2 0x94D049BB133111EBULL

typedef struct {
    PyObject_HEAD
    Py_buffer table; /* depth * width / 2 bytes, two 4-bit counters per byte */
    Py_buffer door;  /* door_bits / 8 bytes */
    int have_table, have_door;
    uint64_t seed_mix, wmask, dmask, door_step0;
    Py_ssize_t depth, row_bytes, sample_size;
    int use_door;
} Sketch;

static inline void split(const Sketch *s, uint64_t key, uint64_t *h1, uint64_t *h2) {
    uint64_t x = (key ^ s->seed_mix) * C1;
    x ^= x >> 29;
    x *= C2;
    x ^= x >> 32;
    *h1 = x >> 32;
    *h2 = (x & 0xFFFFFFFFULL) | 1;
}

static void age(Sketch *s, Py_ssize_t *samples) {
    uint8_t *t = (uint8_t *)s->table.buf;
    Py_ssize_t n = s->table.len;
    for (Py_ssize_t i = 0; i < n; i++) t[i] = (uint8_t)((t[i] >> 1) & 0x77);
    memset(s->door.buf, 0, (size_t)s->door.len);
    *samples /= 2;
}

/* One access; returns 1 if it aged the sketch. */
static inline int record_one(Sketch *s, uint64_t key, Py_ssize_t *samples) {
    uint64_t h1, h2;
    split(s, key, &h1, &h2);
    if (s->use_door) {
        uint8_t *d = (uint8_t *)s->door.buf;
        uint64_t p = (h1 + s->door_step0 * h2) & s->dmask;
        uint64_t q = (p + h2) & s->dmask;
        if (!((d[p >> 3] >> (p & 7)) & (d[q >> 3] >> (q & 7)) & 1)) {
            d[p >> 3] |= (uint8_t)(1u << (p & 7));
            d[q >> 3] |= (uint8_t)(1u << (q & 7));
            if (++*samples >= s->sample_size) {
                age(s, samples);
                return 1;
            }
            return 0;
        }
    }
    uint8_t *t = (uint8_t *)s->table.buf;
    for (Py_ssize_t row = 0; row < s->depth; row++) {
        uint64_t j = h1 & s->wmask;
        uint8_t *b = t + row * s->row_bytes + (j >> 1);
        int sh = (int)((j & 1) << 2);
        if (((*b >> sh) & 15) != 15) *b = (uint8_t)(*b + (1u << sh));
        h1 += h2;
    }
    if (++*samples >= s->sample_size) {
        age(s, samples);
        return 1;
    }
    return 0;
}

static inline long estimate_one(const Sketch *s, uint64_t key) {
    uint64_t h1, h2;
    split(s, key, &h1, &h2);
    long est = 0;
    if (s->use_door) {
        const uint8_t *d = (const uint8_t *)s->door.buf;
        uint64_t p = (h1 + s->door_step0 * h2) & s->dmask;
        uint64_t q = (p + h2) & s->dmask;
        est = (d[p >> 3] >> (p & 7)) & (d[q >> 3] >> (q & 7)) & 1;
    }
    const uint8_t *t = (const uint8_t *)s->table.buf;
    long m = 15;
    for (Py_ssize_t row = 0; row < s->depth; row++) {
        uint64_t j = h1 & s->wmask;
        long v = (t[row * s->row_bytes + (j >> 1)] >> ((j & 1) << 2)) & 15;
        if (v < m) {
            if (!v) return est;
            m = v;
        }
        h1 += h2;
    }
    return est + m;
}

/* Any Python integer mod 2**64 (negative ones too), as ``key & (2**64 - 1)``. */
static inline int as_key(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

static int Sketch_init(Sketch *self, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"table", "door", "depth", "width", "door_bits", "door_step0",
                         "seed_mix", "sample_size", "use_door", NULL};
    PyObject *table, *door;
    Py_ssize_t depth, width, door_bits, door_step0, sample_size;
    unsigned long long seed_mix;
    int use_door;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOnnnnKnp", kw, &table, &door, &depth, &width,
                                     &door_bits, &door_step0, &seed_mix, &sample_size, &use_door))
        return -1;
    if (depth < 1 || width < 2 || (width & (width - 1)) || door_bits < 8 ||
        (door_bits & (door_bits - 1)) || sample_size < 1 || depth > PY_SSIZE_T_MAX / (width / 2)) {
        PyErr_SetString(PyExc_ValueError, "bad sketch geometry");
        return -1;
    }
    if (self->have_table || self->have_door) {
        PyErr_SetString(PyExc_RuntimeError, "Sketch is already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(table, &self->table, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    self->have_table = 1;
    if (PyObject_GetBuffer(door, &self->door, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    self->have_door = 1;
    if (self->table.len != depth * (width / 2) || self->door.len != door_bits / 8) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the sketch geometry");
        return -1;
    }
    self->depth = depth;
    self->row_bytes = width / 2;
    self->wmask = (uint64_t)(width - 1);
    self->dmask = (uint64_t)(door_bits - 1);
    self->door_step0 = (uint64_t)door_step0;
    self->seed_mix = (uint64_t)seed_mix;
    self->sample_size = sample_size;
    self->use_door = use_door;
    return 0;
}

static void Sketch_dealloc(Sketch *self) {
    if (self->have_table) PyBuffer_Release(&self->table);
    if (self->have_door) PyBuffer_Release(&self->door);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int ready(Sketch *self) {
    if (!self->have_table || !self->have_door) {
        PyErr_SetString(PyExc_RuntimeError, "Sketch is not initialised");
        return 0;
    }
    return 1;
}

/* record(key, samples) -> (samples, agings) */
static PyObject *Sketch_record(Sketch *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t key;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "record(key, samples)");
        return NULL;
    }
    if (!ready(self) || as_key(args[0], &key) < 0) return NULL;
    Py_ssize_t samples = PyLong_AsSsize_t(args[1]);
    if (samples == -1 && PyErr_Occurred()) return NULL;
    int aged = record_one(self, key, &samples);
    return Py_BuildValue("(ni)", samples, aged);
}

/* A buffer of native 8-byte integers (struct codes q Q l L n N, native order): what the
 * Python path takes as ints. Floats of the same size (d) are keys there for nobody. */
static int int64_format(const Py_buffer *v) {
    if (v->itemsize != 8) return 0;
    const char *f = v->format == NULL ? "B" : v->format;
    if (*f == '@' || *f == '=') f++;
#if PY_LITTLE_ENDIAN
    else if (*f == '<') f++;
#else
    else if (*f == '>' || *f == '!') f++;
#endif
    return f[0] != '\0' && strchr("qQlLnN", f[0]) != NULL && f[1] == '\0';
}

/* record_many(keys, samples) -> (samples, agings); keys: a list/tuple of ints or a
 * contiguous buffer of 8-byte integers (a uint64/int64 ndarray). */
static PyObject *Sketch_record_many(Sketch *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "record_many(keys, samples)");
        return NULL;
    }
    if (!ready(self)) return NULL;
    Py_ssize_t samples = PyLong_AsSsize_t(args[1]);
    if (samples == -1 && PyErr_Occurred()) return NULL;
    long agings = 0;
    PyObject *keys = args[0];
    if (!PyList_Check(keys) && !PyTuple_Check(keys) && PyObject_CheckBuffer(keys)) {
        Py_buffer view;
        if (PyObject_GetBuffer(keys, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
        if (!int64_format(&view)) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "a key buffer must hold 8-byte integers");
            return NULL;
        }
        const uint64_t *k = (const uint64_t *)view.buf;
        Py_ssize_t n = view.len / 8;
        for (Py_ssize_t i = 0; i < n; i++) agings += record_one(self, k[i], &samples);
        PyBuffer_Release(&view);
        return Py_BuildValue("(nl)", samples, agings);
    }
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence of integers");
    if (seq == NULL) return NULL;
    /* A key that is no int converts through its __index__, which may change a list of keys
     * under us: the length is read again per key (as a Python for loop does) and the key is
     * held while it converts. */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        uint64_t key;
        PyObject *item = Py_NewRef(PySequence_Fast_GET_ITEM(seq, i));
        int err = as_key(item, &key);
        Py_DECREF(item);
        if (err < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        agings += record_one(self, key, &samples);
    }
    Py_DECREF(seq);
    return Py_BuildValue("(nl)", samples, agings);
}

static PyObject *Sketch_estimate(Sketch *self, PyObject *key_obj) {
    uint64_t key;
    if (!ready(self) || as_key(key_obj, &key) < 0) return NULL;
    return PyLong_FromLong(estimate_one(self, key));
}

/* admit(candidate, victim) -> estimate(candidate) > estimate(victim) */
static PyObject *Sketch_admit(Sketch *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t c, v;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "admit(candidate, victim)");
        return NULL;
    }
    if (!ready(self) || as_key(args[0], &c) < 0 || as_key(args[1], &v) < 0) return NULL;
    return PyBool_FromLong(estimate_one(self, c) > estimate_one(self, v));
}

static PyMethodDef Sketch_methods[] = {
    {"record", (PyCFunction)(void (*)(void))Sketch_record, METH_FASTCALL,
     "record(key, samples) -> (samples, agings): one access of key."},
    {"record_many", (PyCFunction)(void (*)(void))Sketch_record_many, METH_FASTCALL,
     "record_many(keys, samples) -> (samples, agings): record per key, in order."},
    {"estimate", (PyCFunction)Sketch_estimate, METH_O, "estimate(key) -> int (0..16)."},
    {"admit", (PyCFunction)(void (*)(void))Sketch_admit, METH_FASTCALL,
     "admit(candidate, victim) -> bool: estimate(candidate) > estimate(victim)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SketchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pegaflow.core._sketch.Sketch",
    .tp_basicsize = sizeof(Sketch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Views of a TinyLFU's count-min table and doorkeeper with its per-key paths in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Sketch_init,
    .tp_dealloc = (destructor)Sketch_dealloc,
    .tp_methods = Sketch_methods,
};

/* block_keys(salt, hashes) -> [int]: the twin of pegaflow.core.block_index.block_keys,
 * int.from_bytes(h[:8], "little") ^ salt for each bytes object h. */
static PyObject *block_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t salt;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "block_keys(salt, hashes)");
        return NULL;
    }
    if (as_key(args[0], &salt) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[1], "hashes must be a sequence of bytes");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *out = PyList_New(n);
    if (out == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = items[i];
        if (!PyBytes_Check(h)) {
            PyErr_Format(PyExc_TypeError, "a block hash must be bytes, got %.100s", Py_TYPE(h)->tp_name);
            goto fail;
        }
        const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(h);
        Py_ssize_t len = PyBytes_GET_SIZE(h);
        uint64_t k = 0;
        for (Py_ssize_t j = (len < 8 ? len : 8) - 1; j >= 0; j--) k = (k << 8) | b[j];
        PyObject *v = PyLong_FromUnsignedLongLong(k ^ salt);
        if (v == NULL) goto fail;
        PyList_SET_ITEM(out, i, v);
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"block_keys", (PyCFunction)(void (*)(void))block_keys, METH_FASTCALL,
     "block_keys(salt, hashes) -> [int]: low 64 bits (little-endian) of each hash xor salt."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sketch_module = {
    PyModuleDef_HEAD_INIT, "_sketch", "TinyLFU's per-key paths in C (see pegaflow/policy/tinylfu.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__sketch(void) {
    if (PyType_Ready(&SketchType) < 0) return NULL;
    PyObject *m = PyModule_Create(&sketch_module);
    if (m == NULL) return NULL;
    Py_INCREF(&SketchType);
    if (PyModule_AddObject(m, "Sketch", (PyObject *)&SketchType) < 0) {
        Py_DECREF(&SketchType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
