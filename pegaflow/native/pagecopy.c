/*
 * Batched page copies between an engine's paged KV cache and the shared pool.
 *
 * One call moves every segment of every block of a request: the Python side computes
 * the (address, pool offset, length) triples with numpy and this loop runs without the
 * GIL (ctypes releases it). Large pieces are copied with non-temporal stores on x86-64,
 * both ways: chunked memcpy of 64 KiB pieces otherwise pays a read-for-ownership of every
 * destination line and reaches only ~2/3 of memcpy bandwidth (measured here: 6.8 vs
 * 10.8 GB/s); pool pages are not read again by this core soon, and a loaded KV block is
 * read by attention only after the whole load.
 *
 * Built as a CPython extension module only so the install compiles it; it is called
 * through ctypes and exports no Python methods.
 */
#include <Python.h>
#include <stdint.h>
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
 * Measured here on 64 KiB pieces: ~14 GB/s vs ~11 (SSE2, one stream) and ~8 for glibc
 * memcpy of 16 MiB chunks, against ~15 GB/s for one 512 MiB memcpy.
 */
__attribute__((target("avx2"))) static void copy_nt_avx2(char *dst, const char *src, int64_t len) {
    int64_t head = (int64_t)((32 - ((uintptr_t)dst & 31)) & 31);
    if (head) {
        memcpy(dst, src, (size_t)head);
        dst += head; src += head; len -= head;
    }
    int64_t q = (len / 4) & ~(int64_t)63;
    for (int64_t j = 0; j < q; j += 64) {
        /* Non-temporal prefetch of the source: a 16 MiB request otherwise sweeps the whole
         * L3 and the node (and engine) run cold afterwards: the node's Reserve/Query after
         * a copy took ~330 us instead of ~230 (64 blocks), for ~3% of copy speed. */
        _mm_prefetch(src + j + 1024, _MM_HINT_NTA);
        _mm_prefetch(src + q + j + 1024, _MM_HINT_NTA);
        _mm_prefetch(src + 2 * q + j + 1024, _MM_HINT_NTA);
        _mm_prefetch(src + 3 * q + j + 1024, _MM_HINT_NTA);
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

static void copy_one(char *dst, const char *src, int64_t len, int nt) {
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

/*
 * For i in [0, n): if to_pool, copy lens[i] bytes from address addrs[i] to pool + offs[i];
 * otherwise the other way. nt: use non-temporal stores for large pieces (x86-64 only).
 */
void pf_copy_segments(char *pool, const int64_t *offs, const uint64_t *addrs, const int64_t *lens,
                      int64_t n, int to_pool, int nt) {
#ifdef PF_HAVE_NT
    if (have_avx2 < 0) {
        __builtin_cpu_init();
        have_avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
#endif
    for (int64_t i = 0; i < n; i++) {
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

static struct PyModuleDef pagecopy_module = {PyModuleDef_HEAD_INIT, "_pagecopy",
                                             "Native page copies (called through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__pagecopy(void) { return PyModule_Create(&pagecopy_module); }
