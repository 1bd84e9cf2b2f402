/* This machine's peaks, measured as `bench --profile` reports against them: how many f32 FMAs,
 * 16-bit and 8-bit integer dot products and streamed bytes the cores can do a second, with the
 * instructions the kernels of this build use (zmm on AVX-512, ymm on AVX2, scalar portable).
 *
 * Why measured and not computed from a datasheet: cloud CPUs report bare names, clocks under
 * load differ from the nameplate, and Zen 4 splits 512-bit operations into two 256-bit halves,
 * so flags alone do not give the rate. Each probe runs independent chains (more than the
 * instruction's latency times its throughput) on every thread for `seconds`, counting whole
 * blocks; the rate is the sum over threads of work over each thread's own time.
 *
 * what: 0 f32 FMA (flop/s, 2 a lane), 1 int16 pair dot (vpdpwssd or vpmaddwd+vpaddd; 2 ops a
 * MAC), 2 int8 dot (vpdpbusd or vpmaddubsw+vpmaddwd+vpaddd; 2 ops a MAC), 3 streaming read of a
 * buffer of `bytes` (plain loads summed; bytes/s).
 */
#include "common.h"

#define PEAK_CHAINS 12
#define PEAK_BLOCK 4096 /* iterations between clock reads */

static volatile int64_t peak_sink;

/* keeps the compiler from hoisting or folding a probe's loop-invariant operands: the register is
 * "changed" every iteration at no cost */
#define OPAQUE(x) __asm__ volatile("" : "+v"(x))

static double now(void) {
#ifdef _OPENMP
    return omp_get_wtime();
#else
    return 0.0;
#endif
}

/* one thread's part: work units done and seconds taken */
static void peak_thread(int what, double seconds, const uint8_t *buf, int64_t len, double *work, double *took) {
    const double t0 = now();
    double t = t0, done = 0;
    int64_t sink = 0;
#if UB_AVX512
    if (what == 0) {
        __m512 acc[PEAK_CHAINS];
        __m512 a = _mm512_set1_ps(0.999999f);
        const __m512 b = _mm512_set1_ps(1e-7f);
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm512_set1_ps((float)c);
        while (t - t0 < seconds) {
            for (int i = 0; i < PEAK_BLOCK; i++) {
                OPAQUE(a);
                for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
            }
            done += (double)PEAK_BLOCK * PEAK_CHAINS * 16 * 2;
            t = now();
        }
        for (int c = 0; c < PEAK_CHAINS; c++) sink += (int64_t)_mm512_reduce_add_ps(acc[c]);
    } else if (what == 1 || what == 2) {
        __m512i acc[PEAK_CHAINS];
        __m512i a = _mm512_set1_epi16(3);
        const __m512i b = _mm512_set1_epi16(-2);
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm512_set1_epi32(c);
        while (t - t0 < seconds) {
            for (int i = 0; i < PEAK_BLOCK; i++) {
                OPAQUE(a);
                for (int c = 0; c < PEAK_CHAINS; c++) {
#ifdef __AVX512VNNI__
                    acc[c] = what == 1 ? _mm512_dpwssd_epi32(acc[c], a, b) : _mm512_dpbusd_epi32(acc[c], a, b);
#else
                    const __m512i p = what == 1 ? _mm512_madd_epi16(a, b)
                                                : _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), _mm512_set1_epi16(1));
                    acc[c] = _mm512_add_epi32(acc[c], p);
#endif
                }
            }
            done += (double)PEAK_BLOCK * PEAK_CHAINS * (what == 1 ? 32 : 64) * 2;
            t = now();
        }
        for (int c = 0; c < PEAK_CHAINS; c++) sink += _mm512_reduce_add_epi32(acc[c]);
    }
#elif UB_AVX2
    if (what == 0) {
        __m256 acc[PEAK_CHAINS];
        __m256 a = _mm256_set1_ps(0.999999f);
        const __m256 b = _mm256_set1_ps(1e-7f);
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm256_set1_ps((float)c);
        while (t - t0 < seconds) {
            for (int i = 0; i < PEAK_BLOCK; i++) {
                OPAQUE(a);
                for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
            }
            done += (double)PEAK_BLOCK * PEAK_CHAINS * 8 * 2;
            t = now();
        }
        for (int c = 0; c < PEAK_CHAINS; c++) sink += (int64_t)hsum(acc[c]);
    } else if (what == 1 || what == 2) {
        __m256i acc[PEAK_CHAINS];
        __m256i a = _mm256_set1_epi16(3);
        const __m256i b = _mm256_set1_epi16(-2);
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = _mm256_set1_epi32(c);
        while (t - t0 < seconds) {
            for (int i = 0; i < PEAK_BLOCK; i++) {
                OPAQUE(a);
                for (int c = 0; c < PEAK_CHAINS; c++) {
#ifdef __AVXVNNI__
                    acc[c] = what == 1 ? _mm256_dpwssd_avx_epi32(acc[c], a, b) : _mm256_dpbusd_avx_epi32(acc[c], a, b);
#else
                    const __m256i p = what == 1 ? _mm256_madd_epi16(a, b)
                                                : _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
                    acc[c] = _mm256_add_epi32(acc[c], p);
#endif
                }
            }
            done += (double)PEAK_BLOCK * PEAK_CHAINS * (what == 1 ? 16 : 32) * 2;
            t = now();
        }
        for (int c = 0; c < PEAK_CHAINS; c++) {
            int32_t v[8];
            _mm256_storeu_si256((__m256i *)v, acc[c]);
            for (int l = 0; l < 8; l++) sink += v[l];
        }
    }
#else
    if (what == 0) {
        float acc[PEAK_CHAINS];
        volatile float va = 0.999999f;
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = (float)c;
        while (t - t0 < seconds) {
            for (int i = 0; i < PEAK_BLOCK; i++)
                for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = fmaf(acc[c], va, 1e-7f);
            done += (double)PEAK_BLOCK * PEAK_CHAINS * 2;
            t = now();
        }
        for (int c = 0; c < PEAK_CHAINS; c++) sink += (int64_t)acc[c];
    } else if (what == 1 || what == 2) {
        int32_t acc[PEAK_CHAINS];
        volatile int16_t vb = -2;
        for (int c = 0; c < PEAK_CHAINS; c++) acc[c] = c;
        while (t - t0 < seconds) {
            for (int i = 0; i < PEAK_BLOCK; i++)
                for (int c = 0; c < PEAK_CHAINS; c++) acc[c] += (int16_t)(3 + c) * vb;
            done += (double)PEAK_BLOCK * PEAK_CHAINS * 2;
            t = now();
        }
        for (int c = 0; c < PEAK_CHAINS; c++) sink += acc[c];
    }
#endif
    if (what == 3) {
        while (t - t0 < seconds) {
#if UB_AVX512
            __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
            for (int64_t o = 0; o + 256 <= len; o += 256) {
                s0 = _mm512_add_epi64(s0, _mm512_load_si512((const void *)(buf + o)));
                s1 = _mm512_add_epi64(s1, _mm512_load_si512((const void *)(buf + o + 64)));
                s2 = _mm512_add_epi64(s2, _mm512_load_si512((const void *)(buf + o + 128)));
                s3 = _mm512_add_epi64(s3, _mm512_load_si512((const void *)(buf + o + 192)));
            }
            sink += _mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
#elif UB_AVX2
            __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
            for (int64_t o = 0; o + 128 <= len; o += 128) {
                s0 = _mm256_add_epi64(s0, _mm256_load_si256((const __m256i *)(buf + o)));
                s1 = _mm256_add_epi64(s1, _mm256_load_si256((const __m256i *)(buf + o + 32)));
                s2 = _mm256_add_epi64(s2, _mm256_load_si256((const __m256i *)(buf + o + 64)));
                s3 = _mm256_add_epi64(s3, _mm256_load_si256((const __m256i *)(buf + o + 96)));
            }
            int64_t v[4];
            _mm256_storeu_si256((__m256i *)v, _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3)));
            sink += v[0] + v[1] + v[2] + v[3];
#else
            const int64_t *p = (const int64_t *)buf;
            int64_t s = 0;
            for (int64_t o = 0; o < len / 8; o++) s += p[o];
            sink += s;
#endif
            done += (double)len;
            t = now();
        }
    }
    peak_sink += sink;
    *work = done;
    *took = t - t0;
}

/* the rate of `what` on nth threads over about `seconds` (see above); 0 if it cannot be had */
double ub_peak(int what, int nth, double seconds, int64_t bytes) {
#ifndef _OPENMP
    (void)what, (void)nth, (void)seconds, (void)bytes;
    return 0.0;
#else
    if (nth < 1 || nth > 1024 || what < 0 || what > 3) return 0.0;
    uint8_t *buf = NULL;
    const int64_t part = what == 3 ? bytes / nth / 256 * 256 : 0;
    if (what == 3) {
        if (part < 256) return 0.0;
        buf = aligned_alloc(64, (size_t)(part * nth));
        if (buf == NULL) return 0.0;
    }
    double work[1024] = {0}, took[1024] = {0};
#pragma omp parallel num_threads(nth)
    {
        const int i = omp_get_thread_num();
        if (buf != NULL) memset(buf + part * i, i + 1, (size_t)part); /* each thread's pages first touched by it */
#pragma omp barrier
        peak_thread(what, seconds, buf != NULL ? buf + part * i : NULL, part, &work[i], &took[i]);
    }
    free(buf);
    double rate = 0;
    for (int i = 0; i < nth; i++) rate += took[i] > 0 ? work[i] / took[i] : 0;
    return rate;
#endif
}
