/* GGUF block formats dequantized to float32 in one pass over memory: the CPU fast path of
 * formats/gguf_blocks.py (`dequantize_into`), compiled once per machine by gguf_native.py.
 *
 * Every value is the one formats/gguf_blocks.py's torch code and the gguf package's reference
 * compute: the same float32 multiplications and additions in the same order. The build passes
 * -ffp-contract=off so that no multiply-add is fused (a fused one rounds once, not twice), and
 * the tests compare every format bit for bit against the torch path.
 *
 * Layouts (llama.cpp's ggml-common.h) are described in gguf_blocks.py. Block pointers are
 * `restrict`: without it a uint8_t pointer may alias the output, and the loops do not vectorize.
 */
#include <stdint.h>
#include <string.h>

#include <pthread.h>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* IEEE half -> float, exact for every half (subnormals and infinities included). With F16C the
 * CPU's own conversion, which also makes a signalling NaN quiet; every caller multiplies or adds
 * the value before it is stored, which makes it quiet anyway, so the two agree bit for bit. */
static inline float half_to_float(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
#if defined(__F16C__)
    return _cvtsh_ss((unsigned short)h);
#else
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: man * 2^-24, renormalised */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400u));
            bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) { /* infinity or NaN, its payload kept */
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static void q8_0(const uint8_t *restrict b, float *restrict w) {
    float d = half_to_float(b);
    const int8_t *q = (const int8_t *)(b + 2);
    for (int i = 0; i < 32; i++) w[i] = (float)q[i] * d;
}

#if defined(__AVX2__)
/* Q4_0 / Q4_1 with AVX2: the 16 code bytes widened to 32 floats, then the same multiply and add
 * (separate instructions: _mm256_mul_ps rounds, then _mm256_add_ps rounds, as the scalar code). */
static void q4_avx2(const uint8_t *restrict b, float *restrict w, int with_min) {
    float d = half_to_float(b), m = with_min ? half_to_float(b + 2) : 0.0f;
    __m128i qs = _mm_loadu_si128((const __m128i *)(b + (with_min ? 4 : 2)));
    __m128i lo = _mm_and_si128(qs, _mm_set1_epi8(0x0f));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), _mm_set1_epi8(0x0f));
    __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    __m256i shift = _mm256_set1_epi32(with_min ? 0 : 8);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int k = 0; k < 4; k++) {
        __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[k]), shift);
        __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(q), vd);
        _mm256_storeu_ps(w + 8 * k, with_min ? _mm256_add_ps(x, vm) : x);
    }
}
#endif

static void q4(const uint8_t *restrict b, float *restrict w, int with_min) {
#if defined(__AVX2__)
    q4_avx2(b, w, with_min);
#else
    float d = half_to_float(b), m = with_min ? half_to_float(b + 2) : 0.0f;
    const uint8_t *qs = b + (with_min ? 4 : 2);
    int q[32];
    for (int i = 0; i < 16; i++) {
        q[i] = qs[i] & 0x0f;
        q[i + 16] = qs[i] >> 4;
    }
    if (with_min) {
        for (int i = 0; i < 32; i++) {
            float x = d * (float)q[i];
            w[i] = x + m;
        }
    } else {
        for (int i = 0; i < 32; i++) w[i] = d * (float)(q[i] - 8);
    }
#endif
}

static void q5(const uint8_t *restrict b, float *restrict w, int with_min) {
    float d = half_to_float(b), m = with_min ? half_to_float(b + 2) : 0.0f;
    const uint8_t *p = b + (with_min ? 4 : 2);
    uint32_t qh = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
    const uint8_t *qs = p + 4;
    for (int i = 0; i < 32; i++) {
        int q = (i < 16 ? (qs[i] & 0x0f) : (qs[i - 16] >> 4)) | (int)(((qh >> i) & 1u) << 4);
        if (with_min) {
            float x = d * (float)q;
            w[i] = x + m;
        } else {
            w[i] = d * (float)(q - 16);
        }
    }
}

/* Q4_K / Q5_K: 8 sub-blocks of 32, six-bit scale and minimum each. */
static void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

static void q45_k(const uint8_t *restrict b, float *restrict w, int five) {
    float d = half_to_float(b), dmin = half_to_float(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        k_scale_min(scales, j, &sc, &mn);
        float dd = d * (float)sc, dm = dmin * (float)mn;
        const uint8_t *src = qs + (j / 2) * 32;
        for (int l = 0; l < 32; l++) {
            int q = (j & 1) ? (src[l] >> 4) : (src[l] & 0x0f);
            if (five) q |= ((qh[l] >> j) & 1) << 4;
            float x = dd * (float)q;
            w[j * 32 + l] = x - dm;
        }
    }
}

static void q6_k(const uint8_t *restrict b, float *restrict w) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *scales = (const int8_t *)(b + 192);
    float d = half_to_float(b + 208);
    float ds[16];
    for (int j = 0; j < 16; j++) ds[j] = d * (float)scales[j];
    for (int i = 0; i < 256; i++) {
        int h = i / 128, r = i % 128;
        int low = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0f;
        int high = (qh[h * 32 + r % 32] >> (2 * (r / 32))) & 3;
        int q = (int)(int8_t)(uint8_t)(low | (high << 4)) - 32;
        w[i] = ds[i / 16] * (float)q;
    }
}

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q5_0 = 3, Q5_1 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7, F16 = 8, BF16 = 9 };
static const int BLOCK_BYTES[] = {34, 18, 20, 22, 24, 144, 176, 210, 2, 2};
static const int BLOCK_WEIGHTS[] = {32, 32, 32, 32, 32, 256, 256, 256, 1, 1};

/* Halves from..to-1 to floats, as torch converts them: exact, a NaN made quiet (F16C does that
 * itself; the portable conversion keeps the payload, so the quiet bit is set here). */
static void f16_range(const uint8_t *restrict src, float *restrict dst, int64_t from, int64_t to) {
    int64_t i = from;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= to; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
#endif
    for (; i < to; i++) {
        float f = half_to_float(src + 2 * i);
        uint32_t bits;
        memcpy(&bits, &f, 4);
        if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) bits |= 0x00400000u;
        memcpy(dst + i, &bits, 4);
    }
}

/* bfloat16s from..to-1 to floats: the upper half of each float's bits (exact, NaNs as they are). */
static void bf16_range(const uint8_t *restrict src, float *restrict dst, int64_t from, int64_t to) {
    for (int64_t i = from; i < to; i++) {
        uint32_t bits = ((uint32_t)src[2 * i] | ((uint32_t)src[2 * i + 1] << 8)) << 16;
        memcpy(dst + i, &bits, 4);
    }
}

static void dequantize_range(const uint8_t *src, float *dst, int64_t from, int64_t to, int kind) {
    if (kind == F16 || kind == BF16) {
        (kind == F16 ? f16_range : bf16_range)(src, dst, from, to);
        return;
    }
    const int64_t size = BLOCK_BYTES[kind], per = BLOCK_WEIGHTS[kind];
    for (int64_t i = from; i < to; i++) {
        const uint8_t *b = src + i * size;
        float *w = dst + i * per;
        switch (kind) {
            case Q8_0: q8_0(b, w); break;
            case Q4_0: q4(b, w, 0); break;
            case Q4_1: q4(b, w, 1); break;
            case Q5_0: q5(b, w, 0); break;
            case Q5_1: q5(b, w, 1); break;
            case Q4_K: q45_k(b, w, 0); break;
            case Q5_K: q45_k(b, w, 1); break;
            default: q6_k(b, w); break;
        }
    }
}

typedef struct {
    const uint8_t *const *srcs;
    float *const *dsts;
    const int64_t *n_blocks;
    const int *kinds;
    int count;
    int64_t from, to; /* this job's share of the blocks of all the tensors, in order */
} dequantize_job;

static void *dequantize_job_run(void *arg) {
    const dequantize_job *j = (const dequantize_job *)arg;
    int64_t start = 0;
    for (int i = 0; i < j->count && start < j->to; start += j->n_blocks[i], i++) {
        int64_t lo = j->from > start ? j->from - start : 0;
        int64_t hi = j->to - start < j->n_blocks[i] ? j->to - start : j->n_blocks[i];
        if (lo < hi) dequantize_range(j->srcs[i], j->dsts[i], lo, hi, j->kinds[i]);
    }
    return NULL;
}

#define MAX_THREADS 16
#define SPLIT_BLOCKS 32768 /* fewer blocks than this in all: one thread (starting one costs ~0.1 ms) */

/* `count` tensors: n_blocks[i] blocks of format kinds[i] from srcs[i] into dsts[i] (n_blocks[i] *
 * weights per block floats). `threads` > 1 splits all their blocks between the calling thread and
 * threads - 1 POSIX threads started for the call (a thread that cannot be started leaves its share
 * to the caller); a caller passes a whole layer's tensors at once so that the split pays for the
 * threads it starts. F16 and BF16 "blocks" are single weights (a layer's 16-bit float tensors
 * widened to float32 here, not by torch on the loader thread). Returns 0, or -1 for an unknown
 * kind or a negative count (before anything is written).
 *
 * Not OpenMP: libgomp (the one torch loads too, shared by soname) keeps a thread team for every
 * thread that ever entered a parallel region, and while a team lives beside torch's own, libgomp
 * counts more threads than CPUs and stops torch's workers from spinning between parallel regions.
 * Measured on a 2-vCPU machine with the layer loader dequantizing through OpenMP: the small
 * matmuls of the compute thread ran 2-4x slower for as long as the loader lived (a self-q8 draft
 * level took 67-125 ms; 43-47 ms without OpenMP). */
int dequantize_many(const uint8_t *const *srcs, float *const *dsts, const int64_t *n_blocks, const int *kinds,
                    int count, int threads) {
    int64_t total = 0;
    for (int i = 0; i < count; i++) {
        if (kinds[i] < 0 || kinds[i] > BF16 || n_blocks[i] < 0) return -1;
        total += n_blocks[i];
    }
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1 || total < SPLIT_BLOCKS) threads = 1;
    dequantize_job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < threads; t++) {
        jobs[t] = (dequantize_job){srcs, dsts, n_blocks, kinds, count, total * t / threads, total * (t + 1) / threads};
        if (t > 0) started[t] = pthread_create(&ids[t], NULL, dequantize_job_run, &jobs[t]) == 0;
    }
    dequantize_job_run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else dequantize_job_run(&jobs[t]);
    }
    return 0;
}
