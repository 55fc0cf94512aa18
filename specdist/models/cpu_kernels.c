/* CPU kernels for x86 with AVX2 (see cpu_kernels.py): matmuls on GGUF's own 4- and 8-bit blocks, and
 * causal attention over a slot KV cache (at the end of this file).
 *
 * Matmuls:
 *
 * y[m, n] = sum_k x[m, k] * W[n, k], with W stored as blocks of 32 input columns of one row:
 *   Q4 (GGUF Q4_0 and Q4_1): 16 bytes of codes c in 0..15 (byte i: element i in its low nibble,
 *       element i + 16 in its high nibble) and a float pair (d, m): w = d * c + m  (Q4_0: m = -8 d).
 *   Q8 (GGUF Q8_0): 32 signed bytes c and a float d: w = d * c.
 * Each row of x is first quantized per block of 32 to signed bytes (d_x = max |x| / 127,
 * q = round-to-even(x / d_x)), as llama.cpp does, so that a block's dot product is one integer
 * multiply-add of bytes:
 *   Q4: d * d_x * sum(c * q) + m * (d_x * sum(q))      Q8: d * d_x * sum(c * q)
 * Every output element is computed by the same instruction sequence whatever the number of rows
 * of x and wherever it falls in a tile, so a row's result does not depend on the batch around it.
 * Threads: OpenMP over blocks of output rows, in the process's OpenMP runtime (torch's).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 32         /* elements per block */
#define ROWS_TILE 4   /* rows of x sharing one unpacked weight block */
#define N_CHUNK 16    /* output rows per scheduling unit */
/* Weights below this many elements run on the calling thread: waking a team costs more than it saves. */
#define PARALLEL_MIN_WEIGHTS (1 << 16)

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x [M, K] float -> q [M, K] int8, d [M, K/32], s [M, K/32] (s = d * sum(q) over the block). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s) {
    const int64_t G = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < M * G; ++i) {
        const float *xb = x + i * QK;
        __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
        __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
        __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float dx = amax / 127.0f;
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        /* round to nearest even (the default MXCSR mode), then pack 4 x 8 int32 to 32 int8 */
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
        __m256i total = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
        t = _mm_hadd_epi32(t, t);
        t = _mm_hadd_epi32(t, t);
        __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
        __m256i p = _mm256_packs_epi16(p01, p23);
        /* packs works within 128-bit lanes: put the 32-bit groups back in element order */
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + i * QK), p);
        /* a NaN or infinity in the block makes its scale NaN, so that it reaches the output */
        const float poison = 0.0f * hsum8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
        d[i] = dx + poison;
        s[i] = dx * (float)_mm_cvtsi128_si32(t) + poison;
    }
}

typedef struct {
    int8_t *q;
    float *d, *s;
} quantized_x;

static int quantize_input(const float *x, int64_t M, int64_t K, quantized_x *qx) {
    const int64_t G = K / QK;
    qx->q = (int8_t *)aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    qx->d = (float *)malloc(sizeof(float) * (size_t)(M * G));
    qx->s = (float *)malloc(sizeof(float) * (size_t)(M * G));
    if (!qx->q || !qx->d || !qx->s) {
        free(qx->q); free(qx->d); free(qx->s);
        return -1;
    }
    quantize_rows(x, M, K, qx->q, qx->d, qx->s);
    return 0;
}

static void release_input(quantized_x *qx) {
    free(qx->q); free(qx->d); free(qx->s);
}

/* Dot of n floats (the Q4 bias term: sum over blocks of m * s). */
static inline float dot_floats(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float tail = 0.0f;
    for (; i < n; ++i) tail += a[i] * b[i];
    return hsum8(acc) + tail;
}

/* Block g of one Q4 weight row against R rows of quantized x, into acc[0..R). */
static inline __attribute__((always_inline)) void q4_block(const uint8_t *w, const float *dm, int64_t G,
                                                            const quantized_x *qx, int64_t m0, int R, int64_t g,
                                                            __m256 *acc) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)(w + g * 16));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256i wv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), low4), _mm_and_si128(raw, low4));
    const float dw = dm[g];
    for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * G + g;
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(qx->q + i * QK));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), _mm256_set1_epi16(1));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * qx->d[i]), acc[r]);
    }
}

/* The block sums of one weight row against R rows of quantized x (R a constant after inlining), into
 * SUMS[0..R). Blocks alternate between two accumulators per row, so that consecutive multiply-adds do not
 * wait on each other. */
#define ROW_SUMS(BLOCK_FN, W, S, SUMS)                                                                  \
    do {                                                                                                \
        __m256 acc0[ROWS_TILE], acc1[ROWS_TILE];                                                        \
        for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();                            \
        int64_t g = 0;                                                                                  \
        for (; g + 2 <= G; g += 2) {                                                                    \
            BLOCK_FN(W, S, G, qx, m0, R, g, acc0);                                                      \
            BLOCK_FN(W, S, G, qx, m0, R, g + 1, acc1);                                                  \
        }                                                                                               \
        if (g < G) BLOCK_FN(W, S, G, qx, m0, R, g, acc0);                                               \
        for (int r = 0; r < R; ++r) SUMS[r] = hsum8(_mm256_add_ps(acc0[r], acc1[r]));                  \
    } while (0)

/* One Q4 weight row against R rows of quantized x: the block sums plus the m terms. */
static inline __attribute__((always_inline)) void q4_row(const uint8_t *w, const float *dm, int64_t G,
                                                          const quantized_x *qx, int64_t m0, int R,
                                                          float *y, int64_t N, int64_t n) {
    float sums[ROWS_TILE];
    ROW_SUMS(q4_block, w, dm, sums);
    for (int r = 0; r < R; ++r) y[(m0 + r) * N + n] = sums[r] + dot_floats(dm + G, qx->s + (m0 + r) * G, G);
}

/* Block g of one Q8 weight row against R rows of quantized x, into acc[0..R). */
static inline __attribute__((always_inline)) void q8_block(const int8_t *w, const float *d, int64_t G,
                                                            const quantized_x *qx, int64_t m0, int R, int64_t g,
                                                            __m256 *acc) {
    const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + g * QK));
    const __m256i wabs = _mm256_sign_epi8(wv, wv);  /* |c|: Q8_0 codes stay in -127..127 */
    const float dw = d[g];
    for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * G + g;
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(qx->q + i * QK));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wv)), _mm256_set1_epi16(1));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * qx->d[i]), acc[r]);
    }
}

/* One Q8 weight row against R rows of quantized x. */
static inline __attribute__((always_inline)) void q8_row(const int8_t *w, const float *d, int64_t G,
                                                          const quantized_x *qx, int64_t m0, int R,
                                                          float *y, int64_t N, int64_t n) {
    float sums[ROWS_TILE];
    ROW_SUMS(q8_block, w, d, sums);
    for (int r = 0; r < R; ++r) y[(m0 + r) * N + n] = sums[r];
}

/* Rows of x in tiles of ROWS_TILE; the last tile's size picks an inlined copy with a constant row count. */
#define TILED(ROW_FN, W, S, WSTRIDE, SSTRIDE)                                                          \
    for (int64_t m0 = 0; m0 < M; m0 += ROWS_TILE) {                                                    \
        const int64_t rows = M - m0 < ROWS_TILE ? M - m0 : ROWS_TILE;                                  \
        for (int64_t n = c * N_CHUNK; n < n_end; ++n) {                                                \
            switch (rows) {                                                                            \
            case 4: ROW_FN(W + n * (WSTRIDE), S + n * (SSTRIDE), G, &qx, m0, 4, y, N, n); break;       \
            case 3: ROW_FN(W + n * (WSTRIDE), S + n * (SSTRIDE), G, &qx, m0, 3, y, N, n); break;       \
            case 2: ROW_FN(W + n * (WSTRIDE), S + n * (SSTRIDE), G, &qx, m0, 2, y, N, n); break;       \
            default: ROW_FN(W + n * (WSTRIDE), S + n * (SSTRIDE), G, &qx, m0, 1, y, N, n); break;      \
            }                                                                                          \
        }                                                                                              \
    }

/* The body of a block matmul: quantize x, then output rows in chunks of N_CHUNK over the threads. */
#define BLOCK_MATMUL(ROW_FN, W, S, WSTRIDE, SSTRIDE)                                                  \
    quantized_x qx;                                                                                    \
    if (quantize_input(x, M, K, &qx)) return -1;                                                       \
    const int64_t G = K / QK;                                                                          \
    const int64_t chunks = (N + N_CHUNK - 1) / N_CHUNK;                                                \
    _Pragma("omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)")                    \
    for (int64_t c = 0; c < chunks; ++c) {                                                             \
        const int64_t n_end = (c + 1) * N_CHUNK < N ? (c + 1) * N_CHUNK : N;                           \
        TILED(ROW_FN, W, S, WSTRIDE, SSTRIDE)                                                          \
    }                                                                                                  \
    release_input(&qx);                                                                                \
    return 0;

/* Q4: qs [N, K/32, 16] bytes, dm [N, 2, K/32] floats (the row's d, then its m). y [M, N].
 * Returns 0, or -1 without memory. */
int specdist_q4_mm(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *dm, int64_t N, float *y) {
    BLOCK_MATMUL(q4_row, qs, dm, G * 16, 2 * G)
}

/* Q8: qs [N, K] signed bytes, d [N, K/32] floats. y [M, N]. Returns 0, or -1 without memory. */
int specdist_q8_mm(const float *x, int64_t M, int64_t K, const int8_t *qs, const float *d, int64_t N, float *y) {
    BLOCK_MATMUL(q8_row, qs, d, K, G)
}

/* ---------------------------------------------------------------------------------------------
 * Attention of each query over its own keys in a slot KV cache, one (request, head, query) at a time.
 *
 * q: element (b, h, t, :) at q + b * qs_b + h * qs_h + t * qs_t (hd contiguous floats).
 * k_cache, v_cache: [slots, Hkv, L1, hd] floats; request b reads slot slots[b], head h reads kv head
 *   h / (Hq / Hkv). The query at position p = qpos[b * T + t] sees keys j with lo <= j <= p, where
 *   lo = p - window + 1 for a sliding window (window > 0), else 0.
 * Scores s_j = scale * q . k_j (soft-capped, cap * tanh(s_j / cap), when softcap > 0), softmax in
 * key order, out = sum_j softmax_j v_j, written to out [B, T, Hq, hd] (the layout o_proj reads).
 * Every output row is a function of its query and its keys alone, summed in one fixed order, so it
 * does not depend on the batch, the number of queries in the call or the cache's other contents.
 * Returns 0, or -1 without memory.
 */
static inline float dot_row(const float *a, const float *b, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float tail = 0.0f;
    for (; i < n; ++i) tail += a[i] * b[i];
    return hsum8(_mm256_add_ps(acc0, acc1)) + tail;
}

int specdist_attention(const float *q, int64_t B, int64_t Hq, int64_t T, int64_t hd,
                       int64_t qs_b, int64_t qs_h, int64_t qs_t,
                       const float *k_cache, const float *v_cache, int64_t Hkv, int64_t L1,
                       const int64_t *slots, const int64_t *qpos, int64_t window, float scale, float softcap,
                       float *out) {
    const int64_t rows = B * Hq * T, group = Hq / Hkv;
    int64_t max_keys = 1, work = 0;
    for (int64_t i = 0; i < B * T; ++i) {
        max_keys = qpos[i] + 1 > max_keys ? qpos[i] + 1 : max_keys;
        work += (qpos[i] + 1) * Hq * hd;
    }
    int failed = 0;
#pragma omp parallel if (work >= PARALLEL_MIN_WEIGHTS)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)max_keys);
        float *acc = (float *)malloc(sizeof(float) * (size_t)hd);
        if (!scores || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            if (!scores || !acc) continue;
            const int64_t b = r / (Hq * T), h = (r / T) % Hq, t = r % T;
            const int64_t p = qpos[b * T + t];
            const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
            const float *qv = q + b * qs_b + h * qs_h + t * qs_t;
            const int64_t base = (slots[b] * Hkv + h / group) * L1;
            const float *kb = k_cache + base * hd, *vb = v_cache + base * hd;
            float m = -INFINITY;
            for (int64_t j = lo; j <= p; ++j) {
                float s = scale * dot_row(qv, kb + j * hd, hd);
                if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                scores[j - lo] = s;
                m = s > m ? s : m;
            }
            float total = 0.0f;
            for (int64_t c = 0; c < hd; ++c) acc[c] = 0.0f;
            for (int64_t j = lo; j <= p; ++j) {
                const float e = expf(scores[j - lo] - m);
                total += e;
                const float *vj = vb + j * hd;
                const __m256 ev = _mm256_set1_ps(e);
                int64_t c = 0;
                for (; c + 8 <= hd; c += 8)
                    _mm256_storeu_ps(acc + c, _mm256_fmadd_ps(ev, _mm256_loadu_ps(vj + c), _mm256_loadu_ps(acc + c)));
                for (; c < hd; ++c) acc[c] += e * vj[c];
            }
            float *o = out + ((b * T + t) * Hq + h) * hd;
            const float inv = 1.0f / total;
            for (int64_t c = 0; c < hd; ++c) o[c] = acc[c] * inv;
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------
 * RMS norm of each row: out[m, :] = x[m, :] / sqrt(mean(x[m, :]^2) + eps) * w, the sum of squares
 * taken in one fixed order per row. x, out [M, D] contiguous floats; w [D].
 */
void specdist_rms_norm(const float *x, int64_t M, int64_t D, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static) if (M * D >= PARALLEL_MIN_WEIGHTS)
    for (int64_t m = 0; m < M; ++m) {
        const float *xr = x + m * D;
        float *o = out + m * D;
        const float inv = 1.0f / sqrtf(dot_row(xr, xr, D) / (float)D + eps);
        int64_t c = 0;
        const __m256 iv = _mm256_set1_ps(inv);
        for (; c + 8 <= D; c += 8)
            _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + c), iv), _mm256_loadu_ps(w + c)));
        for (; c < D; ++c) o[c] = xr[c] * inv * w[c];
    }
}

/* ---------------------------------------------------------------------------------------------
 * One attention layer's cache work and attention in one call: rotary embedding (the HF models'
 * half rotation over the whole head: r = x * cos + [-x2, x1] * sin) of the new keys and queries,
 * the new keys and values written into the cache at their positions, then specdist_attention's
 * rows. q [B, T, Hq, hd], k and v [B, T, Hkv, hd]: strided views (token stride qs_t / ks_t / vs_t,
 * request stride *_b, heads contiguous rows of hd); cos, sin [B, T, hd] contiguous; write_pos [B, T]
 * (padded tokens write the scratch column). Returns 0, or -1 without memory.
 */
static inline void rotate_row(const float *x, const float *c, const float *s, int64_t hd, float *out) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] - x[i + half] * s[i];
    for (int64_t i = half; i < hd; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

int specdist_rope_attention(const float *q, const float *k, const float *v, int64_t B, int64_t T, int64_t Hq,
                            int64_t Hkv, int64_t hd, int64_t qs_b, int64_t qs_t, int64_t ks_b, int64_t ks_t,
                            int64_t vs_b, int64_t vs_t, const float *cos_t, const float *sin_t,
                            float *k_cache, float *v_cache, int64_t L1, const int64_t *slots,
                            const int64_t *write_pos, const int64_t *qpos, int64_t window, float scale,
                            float softcap, float *out) {
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) {
            const float *c = cos_t + (b * T + t) * hd, *s = sin_t + (b * T + t) * hd;
            const int64_t pos = write_pos[b * T + t];
            for (int64_t h = 0; h < Hkv; ++h) {
                const int64_t at = ((slots[b] * Hkv + h) * L1 + pos) * hd;
                rotate_row(k + b * ks_b + t * ks_t + h * hd, c, s, hd, k_cache + at);
                memcpy(v_cache + at, v + b * vs_b + t * vs_t + h * hd, sizeof(float) * (size_t)hd);
            }
        }
    float *qr = (float *)malloc(sizeof(float) * (size_t)(B * T * Hq * hd));  /* rotated queries [B, T, Hq, hd] */
    if (!qr) return -1;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < Hq; ++h)
                rotate_row(q + b * qs_b + t * qs_t + h * hd, cos_t + (b * T + t) * hd, sin_t + (b * T + t) * hd, hd,
                           qr + ((b * T + t) * Hq + h) * hd);
    const int rc = specdist_attention(qr, B, Hq, T, hd, T * Hq * hd, hd, Hq * hd, k_cache, v_cache, Hkv, L1, slots,
                                      qpos, window, scale, softcap, out);
    free(qr);
    return rc;
}
