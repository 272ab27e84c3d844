/*
 * Batched page copies between an engine's paged KV cache and the shared pool.
 *
 * One call moves every segment of every block of a request: the Python side computes
 * the (address, pool offset, length) triples with numpy and this loop runs without the
 * GIL (ctypes releases it). Three ways to copy are here: glibc memcpy per piece,
 * non-temporal stores (no read-for-ownership of the destination lines; AVX2 in four
 * side-by-side streams, SSE2 fallback), and either of them split over two threads. Which
 * one wins depends on the host: on one of this kind non-temporal stores reached ~14 GB/s
 * against ~8 for glibc, on another glibc won. So this file does not choose: the Python
 * side (pegaflow/client/pages.py) measures them on the first real copies and keeps the
 * fastest.
 *
 * Built as a CPython extension module only so the install compiles it; it is called
 * through ctypes and exports no Python methods.
 */
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PF_HAVE_NT 1
#endif

#define PF_NT_MIN 4096 /* below this, ordinary stores are as fast and keep lines cached */

#ifdef PF_HAVE_NT
/* SSE2 (every x86-64): 64 bytes per step, destination aligned to 16. */
static void copy_nt_sse2(char *dst, const char *src, int64_t len) {
    int64_t head = (int64_t)((16 - ((uintptr_t)dst & 15)) & 15);
    if (head) {
        memcpy(dst, src, (size_t)head);
        dst += head; src += head; len -= head;
    }
    int64_t body = len & ~(int64_t)63;
    for (int64_t j = 0; j < body; j += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + j));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + j + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + j + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + j + 48));
        _mm_stream_si128((__m128i *)(dst + j), a);
        _mm_stream_si128((__m128i *)(dst + j + 16), b);
        _mm_stream_si128((__m128i *)(dst + j + 32), c);
        _mm_stream_si128((__m128i *)(dst + j + 48), d);
    }
    if (len > body) memcpy(dst + body, src + body, (size_t)(len - body));
}

__attribute__((target("avx2"))) static inline void nt64_avx2(char *dst, const char *src) {
    __m256i a = _mm256_loadu_si256((const __m256i *)src);
    __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
    _mm256_stream_si256((__m256i *)dst, a);
    _mm256_stream_si256((__m256i *)(dst + 32), b);
}

/*
 * AVX2: the piece is cut into four quarters copied side by side, 64 bytes of each per
 * step (glibc's "large_memcpy_4x" idea: four concurrent DRAM streams instead of one).
 * Measured on 64 KiB pieces: ~14 GB/s vs ~11 (SSE2, one stream) and ~8 for glibc memcpy
 * on one host of this kind; 8.6 GB/s vs 7.0 (one stream) and 5.7 (glibc) on another.
 *
 * No software prefetch. A non-temporal prefetch of the source (_MM_HINT_NTA, 1 KiB ahead
 * in each stream) kept the L3 warmer for the node on the first host (~3% copy speed) but
 * cut this loop to 4.1 GB/s on the second (8.6 without it, same pieces, same run): the
 * hardware prefetcher follows four sequential streams by itself.
 */
__attribute__((target("avx2"))) static void copy_nt_avx2(char *dst, const char *src, int64_t len) {
    int64_t head = (int64_t)((32 - ((uintptr_t)dst & 31)) & 31);
    if (head) {
        memcpy(dst, src, (size_t)head);
        dst += head; src += head; len -= head;
    }
    int64_t q = (len / 4) & ~(int64_t)63;
    for (int64_t j = 0; j < q; j += 64) {
        nt64_avx2(dst + j, src + j);
        nt64_avx2(dst + q + j, src + q + j);
        nt64_avx2(dst + 2 * q + j, src + 2 * q + j);
        nt64_avx2(dst + 3 * q + j, src + 3 * q + j);
    }
    int64_t done = 4 * q;
    int64_t body = done + ((len - done) & ~(int64_t)63);
    for (int64_t j = done; j < body; j += 64) nt64_avx2(dst + j, src + j);
    if (len > body) memcpy(dst + body, src + body, (size_t)(len - body));
}

static int have_avx2 = -1;
#endif

static inline void copy_one(char *dst, const char *src, int64_t len, int nt) {
#ifdef PF_HAVE_NT
    if (nt && len >= PF_NT_MIN) {
        if (have_avx2)
            copy_nt_avx2(dst, src, len);
        else
            copy_nt_sse2(dst, src, len);
        return;
    }
#endif
    memcpy(dst, src, (size_t)len);
}

/* Kernels, by number (the Python side measures them where it runs and keeps the winner). */
#define PF_KERNEL_MEMCPY 0 /* glibc memcpy per piece */
#define PF_KERNEL_NT 1     /* non-temporal stores for pieces >= PF_NT_MIN (AVX2 or SSE2) */

static void copy_range(char *pool, const int64_t *offs, const uint64_t *addrs, const int64_t *lens,
                       int64_t lo, int64_t hi, int to_pool, int nt) {
    for (int64_t i = lo; i < hi; i++) {
        char *p = pool + offs[i];
        char *a = (char *)(uintptr_t)addrs[i];
        if (to_pool)
            copy_one(p, a, lens[i], nt);
        else
            copy_one(a, p, lens[i], nt);
    }
#ifdef PF_HAVE_NT
    if (nt) _mm_sfence();
#endif
}

/*
 * Two threads share one request by taking slices of PF_SLICE_BYTES from a shared cursor,
 * not a half each. The helper is a new thread on the other CPU, and on VMs of this kind an
 * idle CPU takes 0.05-0.7 ms to wake (docs/benchmarks.md): with fixed halves the caller
 * finished its half and then waited for the late helper's whole half; with slices it goes
 * on taking them, and the helper takes whatever is left when it starts.
 *
 * Not done: yielding the CPU (sched_yield) between slices, so that an RPC thread woken
 * behind a copy runs sooner. With 8 engine clients saving 16 MiB requests on 2 cores
 * (bench/saturation.py, 256 KiB pages) it made the saturation throughput 6-10% lower
 * (713-745 requests/s against 795-826) and, at the same 390 requests/s, Query p99 no
 * better (1252-1687 us against 1067-1373). At "50% of saturation" it looked like a win
 * (666-878 us against 1204-1384) only because that level's rate was lower.
 */
#define PF_SLICE_BYTES (1 << 20)

struct pf_job {
    char *pool;
    const int64_t *offs;
    const uint64_t *addrs;
    const int64_t *lens;
    const int64_t *cuts; /* slice k is pieces [cuts[k], cuts[k + 1]) */
    int64_t nslices;
    int64_t next; /* the next slice to take (atomic) */
    int to_pool, nt;
};

static void pf_job_drain(struct pf_job *j) {
    for (;;) {
        int64_t k = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED);
        if (k >= j->nslices) break;
        copy_range(j->pool, j->offs, j->addrs, j->lens, j->cuts[k], j->cuts[k + 1], j->to_pool, j->nt);
    }
}

static void *pf_job_run(void *arg) {
    pf_job_drain((struct pf_job *)arg);
    return NULL;
}

/* Kernels this build can run: bit k set = kernel k available. */
int pf_kernels(void) {
#ifdef PF_HAVE_NT
    return (1 << PF_KERNEL_MEMCPY) | (1 << PF_KERNEL_NT);
#else
    return 1 << PF_KERNEL_MEMCPY;
#endif
}

/* Which non-temporal variant PF_KERNEL_NT runs here: 2 = AVX2, 1 = SSE2, 0 = none. */
int pf_nt_variant(void) {
#ifdef PF_HAVE_NT
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 2 : 1;
#else
    return 0;
#endif
}

/*
 * For i in [0, n): if to_pool, copy lens[i] bytes from address addrs[i] to pool + offs[i];
 * otherwise the other way, with kernel PF_KERNEL_*. threads = 2 starts a second thread
 * (pthread_create costs ~20-50 us, nothing against a request of megabytes; the caller asks
 * for it only where it measured a gain) and both take slices of about PF_SLICE_BYTES until
 * none is left. Returns 0, or -1 when the second thread could not start (then all was
 * copied here).
 */
int pf_copy_segments(char *pool, const int64_t *offs, const uint64_t *addrs, const int64_t *lens,
                     int64_t n, int to_pool, int kernel, int threads) {
    int nt = 0;
#ifdef PF_HAVE_NT
    if (have_avx2 < 0) {
        __builtin_cpu_init();
        have_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    nt = kernel == PF_KERNEL_NT;
#endif
    if (threads < 2 || n < 2) {
        copy_range(pool, offs, addrs, lens, 0, n, to_pool, nt);
        return 0;
    }
    /* Slice boundaries at whole pieces: at most one per piece plus the end. */
    int64_t stack_cuts[257];
    int64_t *cuts = n < 256 ? stack_cuts : (int64_t *)malloc((size_t)(n + 1) * sizeof(int64_t));
    if (cuts == NULL) {
        copy_range(pool, offs, addrs, lens, 0, n, to_pool, nt);
        return 0;
    }
    int64_t nslices = 0, acc = 0;
    cuts[0] = 0;
    for (int64_t i = 0; i < n; i++) {
        acc += lens[i];
        if (acc >= PF_SLICE_BYTES || i == n - 1) {
            cuts[++nslices] = i + 1;
            acc = 0;
        }
    }
    struct pf_job job = {pool, offs, addrs, lens, cuts, nslices, 0, to_pool, nt};
    int rc = 0;
    pthread_t t;
    if (nslices < 2 || pthread_create(&t, NULL, pf_job_run, &job) != 0) {
        rc = nslices < 2 ? 0 : -1;
        pf_job_drain(&job);
    } else {
        pf_job_drain(&job);
        pthread_join(t, NULL);
    }
    if (cuts != stack_cuts) free(cuts);
    return rc;
}

static struct PyModuleDef pagecopy_module = {PyModuleDef_HEAD_INIT, "_pagecopy",
                                             "Native page copies (called through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__pagecopy(void) { return PyModule_Create(&pagecopy_module); }
