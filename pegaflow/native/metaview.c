/* pegaflow.meta._metaview.View: an in-memory view of the global prefix index (issue #55).
 *
 * What it holds: per namespace id (0 .. MAX_NAMESPACES - 1), for every block hash
 * (HASH_BYTES bytes) some node slot holds, two 64-bit masks of node slots (0 .. MAX_SLOTS
 * - 1): `l1`, the slots holding it in DRAM, and `ssd`, the slots holding it only on their
 * SSD tier. The two are disjoint; a block no slot holds has no entry. That is exactly
 * what pegaflow/meta/index.py keeps in Redis per nid (a holder entry with or without the
 * tier bit), so walk() answers what index.prefix_tiers() computes from the same events.
 * Which nid a slot stands for is the caller's business (pegaflow/meta/view.py).
 *
 * Why C: a lookup walks a 128-hash prefix and an event applies up to 512 hashes; a
 * Python dict view costs ~110-125 us per walk and 106-136 B per block (bench/grpc_floor.py,
 * "table"). Here one call does the whole walk or the whole entry, from the request's or
 * the event's bytes, with no Python object per hash.
 *
 * Layout, per namespace (a Table), chosen for memory (the goal is <= ~46 B per block):
 * - `ent`: the entries, dense (no holes), 32 B each: the hash as two uint64 (as stored in
 *   memory, unaligned reads via memcpy) and the two masks. It grows by 1/8 of itself
 *   (large reallocs are mremap'd by glibc: no copy), and shrinks when under half used.
 *   Entries of one event are appended together, so the blocks of a chain sit side by side
 *   and a prefix walk reads them nearly sequentially.
 * - `idx`: open addressing with linear probing, 2^bits uint32 slots: 0 is empty, else the
 *   entry's position + 1 in the low `bits` bits and, above them, the top bits of the
 *   key's mixed hash (a tag: a probe derefs an entry only when the tag matches; no tag
 *   left at bits == 32). The mixed hash is seeded per view (a node cannot aim collisions
 *   at a replica's table). Load <= LOAD_NUM / LOAD_DEN (0.7): the insert that would pass
 *   it first doubles `idx` and re-inserts every entry (entries do not move).
 *   So a block costs 32 B + 4 B / load (0.35 .. 0.7) + the slack of `ent`: 38-48 B.
 * - Deletion (an evict, a cleared slot): backward-shift deletion in `idx` (no tombstones:
 *   probe lengths never degrade), then the last entry moves into the hole of `ent` and
 *   its one `idx` slot is re-pointed (found by comparing slot values, no key reads).
 *
 * Threads: every function runs with the GIL held and never releases it, so each call is
 * atomic for Python threads; the costs it holds the GIL for are stated in
 * pegaflow/meta/view.py (measured by bench/meta_view.py). No Py_mod_gil slot: a
 * free-threaded build re-enables the GIL on import. A View holds no Python objects (no GC).
 *
 * Errors: bad arguments raise before anything changes. MemoryError while growing in the
 * middle of an update leaves that update's earlier hashes applied (each is idempotent, so
 * applying the whole entry again is correct).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HASH_BYTES 16       /* pegaflow.core.identity.HASH_BYTES (view.py checks they agree) */
#define MAX_SLOTS 64        /* node slots: one bit each of a uint64 mask */
#define MAX_NAMESPACES 65536 /* namespace ids: tables are found by index in an array */
#define MIN_BITS 10         /* a new table's idx: 1024 slots (4 KiB) */
#define MAX_BITS 32         /* idx slots hold position + 1 in `bits` bits of a uint32 */
#define LOAD_NUM 7          /* grow idx before the load passes 0.7: linear probing's */
#define LOAD_DEN 10         /* expected probes stay ~2 (hit) / ~6 (miss) at worst */
#define ENT_MIN 64          /* first allocation of a table's entries */
#define ENT_DOUBLE_UNTIL 1024 /* below this, `ent` doubles; above, it grows by 1/8 */

typedef struct {
    uint64_t k0, k1; /* the block hash */
    uint64_t l1;     /* slots holding it in DRAM */
    uint64_t ssd;    /* slots holding it only on SSD */
} Entry;

typedef struct {
    uint32_t *idx;
    Entry *ent;
    uint64_t n, cap; /* entries used / allocated */
    unsigned bits;   /* idx has 1 << bits slots */
} Table;

typedef struct {
    PyObject_HEAD
    Table **tabs; /* by namespace id; NULL: no entry in that namespace */
    Py_ssize_t ntabs;
    uint64_t seed;
    uint64_t entries; /* over every namespace */
} View;

/* A splitmix64-shaped finalizer of both halves: real block hashes are uniform already,
 * but tests and tools use structured ones, and the seed keeps tables unpredictable. */
static inline uint64_t mix(uint64_t k0, uint64_t k1, uint64_t seed) {
    uint64_t x = (k0 ^ seed) + k1 * 0x9E3779B97F4A7C15ULL;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

static inline void load_key(const char *p, uint64_t *k0, uint64_t *k1) {
    memcpy(k0, p, 8);
    memcpy(k1, p + 8, 8);
}

static inline uint64_t slot_mask(const Table *t) { return (1ULL << t->bits) - 1; }
static inline uint32_t pos_mask(const Table *t) { return (uint32_t)((1ULL << t->bits) - 1); }
static inline uint32_t tag_of(const Table *t, uint64_t h) { return (uint32_t)((h >> 32) << t->bits); }

/* The entry of (k0, k1): its position in `ent`, or -1. *at: its idx slot, or the empty
 * slot where it would go. */
static inline int64_t find(const Table *t, uint64_t k0, uint64_t k1, uint64_t h, uint64_t *at) {
    uint64_t mask = slot_mask(t);
    uint32_t low = pos_mask(t), tag = tag_of(t, h);
    uint64_t p = h & mask;
    for (;;) {
        uint32_t s = t->idx[p];
        if (s == 0) {
            *at = p;
            return -1;
        }
        if (((s ^ tag) & ~low) == 0) {
            const Entry *e = &t->ent[(s & low) - 1];
            if (e->k0 == k0 && e->k1 == k1) {
                *at = p;
                return (int64_t)(s & low) - 1;
            }
        }
        p = (p + 1) & mask;
    }
}

/* idx slot of the entry at position i (compares slot values only). */
static inline uint64_t slot_of(const Table *t, uint64_t i, uint64_t seed) {
    const Entry *e = &t->ent[i];
    uint64_t mask = slot_mask(t);
    uint32_t low = pos_mask(t);
    uint64_t p = mix(e->k0, e->k1, seed) & mask;
    while ((t->idx[p] & low) != i + 1) p = (p + 1) & mask;
    return p;
}

/* Point fresh idx (all zero, 1 << bits slots) at every entry. */
static void idx_fill(Table *t, uint64_t seed) {
    uint64_t mask = slot_mask(t);
    for (uint64_t i = 0; i < t->n; i++) {
        const Entry *e = &t->ent[i];
        uint64_t h = mix(e->k0, e->k1, seed);
        uint64_t p = h & mask;
        while (t->idx[p]) p = (p + 1) & mask;
        t->idx[p] = tag_of(t, h) | (uint32_t)(i + 1);
    }
}

static int idx_grow(Table *t, uint64_t seed) {
    if (t->bits >= MAX_BITS) {
        PyErr_SetString(PyExc_MemoryError, "metaview: a namespace's table is full (2^32 index slots)");
        return -1;
    }
    uint32_t *fresh = PyMem_RawCalloc((size_t)1 << (t->bits + 1), sizeof(uint32_t));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_RawFree(t->idx);
    t->idx = fresh;
    t->bits++;
    idx_fill(t, seed);
    return 0;
}

static int ent_reserve(Table *t, uint64_t want) {
    if (want <= t->cap) return 0;
    uint64_t cap = t->cap < ENT_MIN ? ENT_MIN : t->cap;
    while (cap < want) cap = cap < ENT_DOUBLE_UNTIL ? cap * 2 : cap + cap / 8;
    Entry *e = PyMem_RawRealloc(t->ent, (size_t)cap * sizeof(Entry));
    if (e == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->ent = e;
    t->cap = cap;
    return 0;
}

/* Give back `ent` memory when under half of it is used (a failed shrink changes nothing). */
static void ent_trim(Table *t) {
    if (t->cap <= ENT_DOUBLE_UNTIL || t->n >= t->cap / 2) return;
    uint64_t cap = t->n + t->n / 8;
    if (cap < ENT_DOUBLE_UNTIL) cap = ENT_DOUBLE_UNTIL;
    Entry *e = PyMem_RawRealloc(t->ent, (size_t)cap * sizeof(Entry));
    if (e != NULL) {
        t->ent = e;
        t->cap = cap;
    }
}

/* Backward-shift deletion of idx slot `hole`: each later slot of the cluster whose home is
 * not in (hole, j] moves back into the hole. No tombstones. */
static void idx_delete(Table *t, uint64_t hole, uint64_t seed) {
    uint64_t mask = slot_mask(t);
    uint32_t low = pos_mask(t);
    uint64_t j = hole;
    for (;;) {
        j = (j + 1) & mask;
        uint32_t s = t->idx[j];
        if (s == 0) break;
        const Entry *e = &t->ent[(s & low) - 1];
        uint64_t home = mix(e->k0, e->k1, seed) & mask;
        if (((j - home) & mask) < ((j - hole) & mask)) continue; /* home in (hole, j]: stays */
        t->idx[hole] = s;
        hole = j;
    }
    t->idx[hole] = 0;
}

/* Remove the entry at position i (idx slot `at`): the last entry moves into its place. */
static void ent_remove(Table *t, uint64_t i, uint64_t at, uint64_t seed) {
    idx_delete(t, at, seed);
    uint64_t last = t->n - 1;
    if (i != last) {
        uint64_t p = slot_of(t, last, seed);
        t->idx[p] = (t->idx[p] & ~pos_mask(t)) | (uint32_t)(i + 1);
        t->ent[i] = t->ent[last];
    }
    t->n = last;
}

static Table *table_new(void) {
    Table *t = PyMem_RawCalloc(1, sizeof(Table));
    if (t == NULL) return NULL;
    t->bits = MIN_BITS;
    t->idx = PyMem_RawCalloc((size_t)1 << MIN_BITS, sizeof(uint32_t));
    if (t->idx == NULL) {
        PyMem_RawFree(t);
        return NULL;
    }
    return t;
}

static void table_free(Table *t) {
    if (t == NULL) return;
    PyMem_RawFree(t->idx);
    PyMem_RawFree(t->ent);
    PyMem_RawFree(t);
}

static size_t table_bytes(const Table *t) {
    return sizeof(Table) + ((size_t)1 << t->bits) * sizeof(uint32_t) + (size_t)t->cap * sizeof(Entry);
}

/* --- arguments -------------------------------------------------------------------------- */

/* The hashes of a call: one bytes-like object (the concatenation, as events carry them)
 * or a sequence of HASH_BYTES-byte bytes objects (as a gRPC request's repeated field). */
typedef struct {
    Py_buffer buf;
    int have_buf;
    PyObject *fast; /* the sequence as a list or tuple */
    Py_ssize_t n;
} Hashes;

static int hashes_get(PyObject *obj, Hashes *hs) {
    memset(hs, 0, sizeof(*hs));
    if (PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &hs->buf, PyBUF_SIMPLE) < 0) return -1;
        hs->have_buf = 1;
        if (hs->buf.len % HASH_BYTES) {
            PyErr_Format(PyExc_ValueError, "hashes: %zd bytes is not a multiple of %d (one block hash is %d bytes)",
                         hs->buf.len, HASH_BYTES, HASH_BYTES);
            PyBuffer_Release(&hs->buf);
            hs->have_buf = 0;
            return -1;
        }
        hs->n = hs->buf.len / HASH_BYTES;
        return 0;
    }
    hs->fast = PySequence_Fast(obj, "hashes must be bytes (the concatenated hashes) or a sequence of bytes");
    if (hs->fast == NULL) return -1;
    hs->n = PySequence_Fast_GET_SIZE(hs->fast);
    PyObject **items = PySequence_Fast_ITEMS(hs->fast);
    for (Py_ssize_t j = 0; j < hs->n; j++) {
        if (!PyBytes_Check(items[j])) {
            PyErr_Format(PyExc_TypeError, "hash %zd is %.100s, expected bytes", j, Py_TYPE(items[j])->tp_name);
            Py_CLEAR(hs->fast);
            return -1;
        }
        if (PyBytes_GET_SIZE(items[j]) != HASH_BYTES) {
            PyErr_Format(PyExc_ValueError, "hash %zd has %zd bytes, expected %d", j, PyBytes_GET_SIZE(items[j]),
                         HASH_BYTES);
            Py_CLEAR(hs->fast);
            return -1;
        }
    }
    return 0;
}

static inline const char *hash_at(const Hashes *hs, Py_ssize_t j) {
    if (hs->have_buf) return (const char *)hs->buf.buf + j * HASH_BYTES;
    return PyBytes_AS_STRING(PySequence_Fast_ITEMS(hs->fast)[j]);
}

static void hashes_release(Hashes *hs) {
    if (hs->have_buf) PyBuffer_Release(&hs->buf);
    hs->have_buf = 0;
    Py_CLEAR(hs->fast);
}

static int get_ns(PyObject *o, long *ns) {
    *ns = PyLong_AsLong(o);
    if (*ns == -1 && PyErr_Occurred()) return -1;
    if (*ns < 0 || *ns >= MAX_NAMESPACES) {
        PyErr_Format(PyExc_ValueError, "namespace id %ld out of range: a view holds ids 0..%d", *ns,
                     MAX_NAMESPACES - 1);
        return -1;
    }
    return 0;
}

static int get_slot(PyObject *o, long *slot) {
    *slot = PyLong_AsLong(o);
    if (*slot == -1 && PyErr_Occurred()) return -1;
    if (*slot < 0 || *slot >= MAX_SLOTS) {
        PyErr_Format(PyExc_ValueError, "node slot %ld out of range: a view holds node slots 0..%d", *slot,
                     MAX_SLOTS - 1);
        return -1;
    }
    return 0;
}

static int get_mask(PyObject *o, uint64_t *m) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "live_mask must be an int, not %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    *m = PyLong_AsUnsignedLongLong(o);
    if (*m == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "live_mask must be in 0..2**64 - 1 (bit k: node slot k)");
        return -1;
    }
    return 0;
}

static inline Table *table_at(View *v, long ns) { return ns < v->ntabs ? v->tabs[ns] : NULL; }

static Table *table_make(View *v, long ns) {
    if (ns >= v->ntabs) {
        Py_ssize_t n = v->ntabs ? v->ntabs : 4;
        while (n <= ns) n *= 2;
        if (n > MAX_NAMESPACES) n = MAX_NAMESPACES;
        Table **tabs = PyMem_RawRealloc(v->tabs, (size_t)n * sizeof(Table *));
        if (tabs == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        memset(tabs + v->ntabs, 0, (size_t)(n - v->ntabs) * sizeof(Table *));
        v->tabs = tabs;
        v->ntabs = n;
    }
    if (v->tabs[ns] == NULL) {
        v->tabs[ns] = table_new();
        if (v->tabs[ns] == NULL) PyErr_NoMemory();
    }
    return v->tabs[ns];
}

/* After removals: trim `ent`, free a table left empty. */
static void table_settle(View *v, long ns) {
    Table *t = v->tabs[ns];
    if (t->n == 0) {
        table_free(t);
        v->tabs[ns] = NULL;
    } else {
        ent_trim(t);
    }
}

/* --- the type ------------------------------------------------------------------------------ */

static int View_init(View *self, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"seed", NULL};
    unsigned long long seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|K:View", kw, &seed)) return -1;
    if (self->tabs != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "View.__init__ called twice");
        return -1;
    }
    self->seed = seed;
    return 0;
}

static void View_dealloc(View *self) {
    for (Py_ssize_t i = 0; i < self->ntabs; i++) table_free(self->tabs[i]);
    PyMem_RawFree(self->tabs);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* update(ns, slot, add, ssd, hashes) -> pairs changed: add (or change the tier of) / evict
 * `slot` for every hash, in order. */
static PyObject *View_update(View *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "update() takes 5 arguments (ns, slot, add, ssd, hashes), got %zd", nargs);
        return NULL;
    }
    long ns, slot;
    if (get_ns(args[0], &ns) < 0 || get_slot(args[1], &slot) < 0) return NULL;
    int add = PyObject_IsTrue(args[2]);
    if (add < 0) return NULL;
    int ssd = PyObject_IsTrue(args[3]);
    if (ssd < 0) return NULL;
    Hashes hs;
    if (hashes_get(args[4], &hs) < 0) return NULL;

    const uint64_t bit = 1ULL << slot, seed = self->seed;
    uint64_t changed = 0;
    int failed = 0;
    Table *t = table_at(self, ns);
    if (add && hs.n > 0 && t == NULL) {
        t = table_make(self, ns);
        failed = t == NULL;
    }
    for (Py_ssize_t j = 0; t != NULL && !failed && j < hs.n; j++) {
        uint64_t k0, k1, at;
        load_key(hash_at(&hs, j), &k0, &k1);
        uint64_t h = mix(k0, k1, seed);
        int64_t i = find(t, k0, k1, h, &at);
        if (add) {
            if (i < 0) {
                if ((t->n + 1) * LOAD_DEN > ((uint64_t)1 << t->bits) * LOAD_NUM) {
                    if (idx_grow(t, seed) < 0) {
                        failed = 1;
                        break;
                    }
                    find(t, k0, k1, h, &at);
                }
                if (ent_reserve(t, t->n + 1) < 0) {
                    failed = 1;
                    break;
                }
                Entry *e = &t->ent[t->n];
                e->k0 = k0;
                e->k1 = k1;
                e->l1 = ssd ? 0 : bit;
                e->ssd = ssd ? bit : 0;
                t->idx[at] = tag_of(t, h) | (uint32_t)(t->n + 1);
                t->n++;
                self->entries++;
                changed++;
            } else {
                Entry *e = &t->ent[i];
                uint64_t *mine = ssd ? &e->ssd : &e->l1, *other = ssd ? &e->l1 : &e->ssd;
                if (!(*mine & bit)) {
                    *mine |= bit;
                    *other &= ~bit;
                    changed++;
                }
            }
        } else if (i >= 0) {
            Entry *e = &t->ent[i];
            if ((e->l1 | e->ssd) & bit) {
                e->l1 &= ~bit;
                e->ssd &= ~bit;
                changed++;
                if (!(e->l1 | e->ssd)) {
                    ent_remove(t, (uint64_t)i, at, seed);
                    self->entries--;
                }
            }
        }
    }
    if (t != NULL && !add) table_settle(self, ns);
    hashes_release(&hs);
    if (failed) return NULL;
    return PyLong_FromUnsignedLongLong(changed);
}

/* clear_slot(slot) -> pairs removed: `slot` holds nothing any more, in every namespace. */
static PyObject *View_clear_slot(View *self, PyObject *arg) {
    long slot;
    if (get_slot(arg, &slot) < 0) return NULL;
    const uint64_t bit = 1ULL << slot, keep = ~bit;
    uint64_t removed = 0;
    for (Py_ssize_t ns = 0; ns < self->ntabs; ns++) {
        Table *t = self->tabs[ns];
        if (t == NULL) continue;
        /* Downwards: the entry that ent_remove moves into a hole is one already cleared. */
        for (uint64_t i = t->n; i-- > 0;) {
            Entry *e = &t->ent[i];
            if (!((e->l1 | e->ssd) & bit)) continue;
            removed++;
            e->l1 &= keep;
            e->ssd &= keep;
            if (!(e->l1 | e->ssd)) {
                ent_remove(t, i, slot_of(t, i, self->seed), self->seed);
                self->entries--;
            }
        }
        table_settle(self, (long)ns);
    }
    return PyLong_FromUnsignedLongLong(removed);
}

/* clear_slot_part(slot, cursor, budget) -> (removed, cursor): clear_slot() in steps that
 * each visit at most `budget` entries, so no step holds the GIL long (a whole pass is ~10 ms
 * per 1M entries). Pass cursor 0 to start and the returned cursor to go on; 0 back: done.
 * The cursor names a namespace and how many of its entries are left to visit, downwards
 * (cursor = ns << CURSOR_NS_SHIFT | (left + 1)). Other slots' updates between steps are fine:
 * an entry below `left` that still holds the slot only ever moves further down (the last
 * entry fills a hole), entries added land at the end, past `left`. The caller must apply
 * nothing for `slot` until the pass is done (it would land where the pass has been). */
#define CURSOR_NS_SHIFT 34
static PyObject *View_clear_slot_part(View *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "clear_slot_part() takes 3 arguments (slot, cursor, budget), got %zd", nargs);
        return NULL;
    }
    long slot;
    if (get_slot(args[0], &slot) < 0) return NULL;
    unsigned long long cursor = PyLong_AsUnsignedLongLong(args[1]);
    if (cursor == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    long long budget = PyLong_AsLongLong(args[2]);
    if (budget == -1 && PyErr_Occurred()) return NULL;
    if (budget < 1) {
        PyErr_SetString(PyExc_ValueError, "budget must be at least 1 entry");
        return NULL;
    }
    Py_ssize_t ns = (Py_ssize_t)(cursor >> CURSOR_NS_SHIFT);
    uint64_t left = cursor ? (cursor & ((1ULL << CURSOR_NS_SHIFT) - 1)) - 1 : UINT64_MAX; /* MAX: from the top */
    if (ns >= MAX_NAMESPACES) {
        PyErr_SetString(PyExc_ValueError, "cursor is not one clear_slot_part returned");
        return NULL;
    }
    const uint64_t bit = 1ULL << slot, keep = ~bit;
    uint64_t removed = 0;
    for (; ns < self->ntabs; ns++, left = UINT64_MAX) {
        Table *t = self->tabs[ns];
        if (t == NULL) continue;
        if (left > t->n) left = t->n;
        while (left > 0 && budget > 0) {
            uint64_t i = --left;
            budget--;
            Entry *e = &t->ent[i];
            if (!((e->l1 | e->ssd) & bit)) continue;
            removed++;
            e->l1 &= keep;
            e->ssd &= keep;
            if (!(e->l1 | e->ssd)) {
                ent_remove(t, i, slot_of(t, i, self->seed), self->seed);
                self->entries--;
            }
        }
        if (left > 0) /* out of budget inside this table */
            return Py_BuildValue("(KK)", (unsigned long long)removed,
                                 ((unsigned long long)ns << CURSOR_NS_SHIFT) | (unsigned long long)(left + 1));
        table_settle(self, (long)ns);
    }
    return Py_BuildValue("(KK)", (unsigned long long)removed, 0ULL);
}

/* walk(ns, hashes, live_mask) -> [(slot, prefix_len, ssd_blocks)], by slot: for every slot
 * of live_mask holding block 0, the number of leading blocks it holds (any tier) and how
 * many of those it holds only on SSD (index.prefix_tiers). */
static PyObject *View_walk(View *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "walk() takes 3 arguments (ns, hashes, live_mask), got %zd", nargs);
        return NULL;
    }
    long ns;
    uint64_t cur;
    if (get_ns(args[0], &ns) < 0 || get_mask(args[2], &cur) < 0) return NULL;
    Hashes hs;
    if (hashes_get(args[1], &hs) < 0) return NULL;
    const Table *t = table_at(self, ns);
    uint64_t start = 0;
    uint32_t len[MAX_SLOTS], ssd[MAX_SLOTS];
    Py_ssize_t i = 0;
    if (t != NULL && hs.n > 0) {
        memset(ssd, 0, sizeof(ssd));
        for (; i < hs.n && cur; i++) {
            uint64_t k0, k1, at;
            load_key(hash_at(&hs, i), &k0, &k1);
            int64_t e = find(t, k0, k1, mix(k0, k1, self->seed), &at);
            uint64_t held = 0, on_ssd = 0;
            if (e >= 0) {
                held = t->ent[e].l1 | t->ent[e].ssd;
                on_ssd = t->ent[e].ssd;
            }
            for (uint64_t gone = cur & ~held; gone; gone &= gone - 1) len[__builtin_ctzll(gone)] = (uint32_t)i;
            cur &= held;
            if (i == 0) start = cur;
            for (uint64_t m = on_ssd & cur; m; m &= m - 1) ssd[__builtin_ctzll(m)]++;
        }
        for (; cur; cur &= cur - 1) len[__builtin_ctzll(cur)] = (uint32_t)i; /* held to the end */
    }
    hashes_release(&hs);
    PyObject *out = PyList_New(__builtin_popcountll(start));
    if (out == NULL) return NULL;
    Py_ssize_t k = 0;
    for (; start; start &= start - 1) {
        int b = __builtin_ctzll(start);
        PyObject *row = PyTuple_New(3);
        if (row == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyObject *a = PyLong_FromLong(b), *l = PyLong_FromUnsignedLong(len[b]), *s = PyLong_FromUnsignedLong(ssd[b]);
        if (a == NULL || l == NULL || s == NULL) {
            Py_XDECREF(a);
            Py_XDECREF(l);
            Py_XDECREF(s);
            Py_DECREF(row);
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(row, 0, a);
        PyTuple_SET_ITEM(row, 1, l);
        PyTuple_SET_ITEM(row, 2, s);
        PyList_SET_ITEM(out, k++, row);
    }
    return out;
}

/* holders(ns, hash) -> (l1 mask, ssd mask); (0, 0) when no slot holds it. */
static PyObject *View_holders(View *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "holders() takes 2 arguments (ns, hash), got %zd", nargs);
        return NULL;
    }
    long ns;
    if (get_ns(args[0], &ns) < 0) return NULL;
    Hashes hs;
    if (hashes_get(args[1], &hs) < 0) return NULL;
    if (hs.n != 1) {
        PyErr_Format(PyExc_ValueError, "holders() takes one hash of %d bytes, got %zd hashes", HASH_BYTES, hs.n);
        hashes_release(&hs);
        return NULL;
    }
    uint64_t k0, k1, at, l1 = 0, ssd = 0;
    load_key(hash_at(&hs, 0), &k0, &k1);
    hashes_release(&hs);
    const Table *t = table_at(self, ns);
    if (t != NULL) {
        int64_t e = find(t, k0, k1, mix(k0, k1, self->seed), &at);
        if (e >= 0) {
            l1 = t->ent[e].l1;
            ssd = t->ent[e].ssd;
        }
    }
    return Py_BuildValue("(KK)", (unsigned long long)l1, (unsigned long long)ssd);
}

/* dump(ns) -> {hash: (l1 mask, ssd mask)} of every block of the namespace (tests, tools). */
static PyObject *View_dump(View *self, PyObject *arg) {
    long ns;
    if (get_ns(arg, &ns) < 0) return NULL;
    PyObject *out = PyDict_New();
    if (out == NULL) return NULL;
    const Table *t = table_at(self, ns);
    for (uint64_t i = 0; t != NULL && i < t->n; i++) {
        const Entry *e = &t->ent[i];
        char key[HASH_BYTES];
        memcpy(key, &e->k0, 8);
        memcpy(key + 8, &e->k1, 8);
        PyObject *k = PyBytes_FromStringAndSize(key, HASH_BYTES);
        PyObject *v = k ? Py_BuildValue("(KK)", (unsigned long long)e->l1, (unsigned long long)e->ssd) : NULL;
        if (v == NULL || PyDict_SetItem(out, k, v) < 0) {
            Py_XDECREF(k);
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(k);
        Py_DECREF(v);
    }
    return out;
}

/* index_slots(ns) -> slots of the namespace's open-addressing index (0: no table). */
static PyObject *View_index_slots(View *self, PyObject *arg) {
    long ns;
    if (get_ns(arg, &ns) < 0) return NULL;
    const Table *t = table_at(self, ns);
    return PyLong_FromUnsignedLongLong(t ? (1ULL << t->bits) : 0);
}

static PyObject *View_nbytes(View *self, void *closure) {
    size_t n = sizeof(View) + (size_t)self->ntabs * sizeof(Table *);
    for (Py_ssize_t i = 0; i < self->ntabs; i++)
        if (self->tabs[i] != NULL) n += table_bytes(self->tabs[i]);
    return PyLong_FromSize_t(n);
}

static Py_ssize_t View_len(View *self) { return (Py_ssize_t)self->entries; }

static PyMethodDef View_methods[] = {
    {"update", (PyCFunction)(void (*)(void))View_update, METH_FASTCALL,
     "update(ns, slot, add, ssd, hashes) -> int: add (in DRAM, or only on SSD when ssd) or evict slot for every "
     "hash, in order; returns the (block, slot) pairs that changed."},
    {"clear_slot", (PyCFunction)View_clear_slot, METH_O,
     "clear_slot(slot) -> int: slot holds nothing any more (one pass over every entry); returns pairs removed."},
    {"clear_slot_part", (PyCFunction)(void (*)(void))View_clear_slot_part, METH_FASTCALL,
     "clear_slot_part(slot, cursor, budget) -> (removed, cursor): clear_slot in steps of at most budget entries "
     "visited; cursor 0 starts, 0 returned: done."},
    {"walk", (PyCFunction)(void (*)(void))View_walk, METH_FASTCALL,
     "walk(ns, hashes, live_mask) -> [(slot, prefix_len, ssd_blocks)]: per live slot holding block 0, its "
     "leading blocks and how many of them only on SSD; by slot."},
    {"holders", (PyCFunction)(void (*)(void))View_holders, METH_FASTCALL,
     "holders(ns, hash) -> (l1_mask, ssd_mask)"},
    {"dump", (PyCFunction)View_dump, METH_O, "dump(ns) -> {hash: (l1_mask, ssd_mask)}"},
    {"index_slots", (PyCFunction)View_index_slots, METH_O,
     "index_slots(ns) -> int: slots of the namespace's index (0: none)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef View_getset[] = {
    {"nbytes", (getter)View_nbytes, NULL, "bytes allocated for the view (tables, entries, index slots)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods View_as_sequence = {
    .sq_length = (lenfunc)View_len,
};

static PyTypeObject ViewType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pegaflow.meta._metaview.View",
    .tp_basicsize = sizeof(View),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, /* view.py's PrefixView adds the typed apply */
    .tp_doc = "An in-memory view of the global prefix index: per (namespace id, block hash), the node slots "
              "holding it in DRAM and only on SSD.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)View_init,
    .tp_dealloc = (destructor)View_dealloc,
    .tp_methods = View_methods,
    .tp_getset = View_getset,
    .tp_as_sequence = &View_as_sequence,
};

static struct PyModuleDef metaview_module = {
    PyModuleDef_HEAD_INIT, "pegaflow.meta._metaview",
    "The metaserver's in-memory prefix index view in C (see pegaflow/meta/view.py).", -1, NULL,
};

PyMODINIT_FUNC PyInit__metaview(void) {
    if (PyType_Ready(&ViewType) < 0) return NULL;
    PyObject *m = PyModule_Create(&metaview_module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "View", (PyObject *)&ViewType) < 0 ||
        PyModule_AddIntConstant(m, "HASH_BYTES", HASH_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_SLOTS", MAX_SLOTS) < 0 ||
        PyModule_AddIntConstant(m, "MAX_NAMESPACES", MAX_NAMESPACES) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
