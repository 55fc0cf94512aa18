/* CPU kernels for x86 with AVX2 (see cpu_kernels.py): matmuls on GGUF's own 2- to 8-bit blocks, a dense
 * float32 matmul for a few rows, and causal attention over a slot KV cache (after them).
 *
 * Matmuls:
 *
 * y[m, n] = sum_k x[m, k] * W[n, k], W stored as blocks of 32 input columns of one row:
 *   Q4 (GGUF Q4_0 and Q4_1): codes c in 0..15 and a float pair (d, m): w = d * c + m  (Q4_0: m = -8 d).
 *   Q8 (GGUF Q8_0): signed codes c and a float d: w = d * c.
 *   Q5 (GGUF Q5_0, Q5_1 and Q5_K): 5-bit codes c in 0..31 (a nibble and a high bit) and a float pair (d, m):
 *   w = d * c + m (Q5_0: c = q + 16, m = -16 d).
 *   Q4_16 (GGUF Q3_K; Q6_K where its codes fit): codes c = q + 8 in 0..15 and a float d per 16: w = d * (c - 8).
 *   Q6_16 (GGUF Q6_K): 6-bit codes c = q in 0..63 (a nibble and 2 high bits) and a float d per 16: w = d * (c - 32).
 *   Q7_16 (GGUF IQ2_XS and IQ2_S): 7-bit codes c = q + 64 in 0..127, a byte each, and a float d per 16: w = d * (c - 64).
 *   Q2M_16 (GGUF Q2_K): 2-bit codes c = q in 0..3 and a float pair (d, m) per 16: w = d * c + m.
 *   IQ4 (GGUF IQ4_NL and IQ4_XS): 4-bit indices i into IQ4_VALUES (16 signed bytes) and a float d: w = d * v[i].
 * Each row of x is first quantized per block of 32 to signed bytes (d_x = max |x| / 127,
 * q = round-to-even(x / d_x)), as llama.cpp does, so that a block's dot product is an exact sum of byte
 * products (vpmaddubsw):
 *   Q4, Q5: d * d_x * sum(c * q) + m * (d_x * sum(q))      Q8: d * d_x * sum(c * q)
 * A weight's scales (and offsets) are float32; or float16 where every one of them is a float16 value (GGUF's
 * Q4_0, Q4_1, Q8_0, Q5_0 and Q5_1 store theirs so), converted exactly on load; or, for the K-quants, their file's
 * form (IQ4_XS's and the IQ grid types' too): a float16 factor per 256 elements times a small integer per block or per
 * 16, multiplied on load (exact in float32). The products are the same bits as with float32 scales, at fewer bytes: a Q4 block reads 0.625 bytes a
 * weight with float16 scales and 0.59 with a Q4_K super-block's, instead of 0.75 (block_scale).
 * The weights are repacked at load (cpu_kernels.py pack_q4 / pack_q5 / pack_q6 / pack_q8 / pack_q2) in groups of 8
 * rows whose codes interleave 4 bytes at a time, so that one 32-byte vector holds 4 codes of each of the 8 rows and one
 * multiply-add against 4 bytes of x broadcast to every lane yields 8 outputs' partial sums side by side:
 * no horizontal sums, and each loaded (and unpacked) weight vector serves a tile of rows of x: up to the kind's largest
 * tile (4 to 7 rows, DEFINE_MATMUL's TILE), the call's rows split into tiles whose sizes differ by at most one (so no
 * tile of one row follows full ones).
 * Every output element is computed by the same instruction sequence whatever the number of rows of x and
 * wherever it falls in a tile (its block's exact integer sum, then one float multiply-add per block in
 * block order), so a row's result does not depend on the batch around it.
 * Threads: OpenMP over groups of 8 output columns, in the process's OpenMP runtime (torch's).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The block size QK, the kinds of a matmul (LIN_*) with each block kind's code bytes, scale layout and tile, the parts
 * of a layer (LAYER_*) and IQ4_VALUES come from specdist/models/kernel_abi.py, which setup.py passes as -D macros:
 * the Python side reads the same definitions. SPECDIST_ABI is their digest with this file's. */
#ifndef SPECDIST_ABI
#error "compile through setup.py (pip install .): specdist/models/kernel_abi.py defines the macros this file uses"
#endif

/* The digest in an ELF section of its own (.specdist_abi): cpu_kernels.py reads it from the library file's bytes and
 * refuses a library built from another source before loading it, so none of that library's code (its constructors
 * run as it loads) ever runs. */
__attribute__((used, section(".specdist_abi"))) static const char specdist_abi_note[] = SPECDIST_ABI;

#define MAX_TILE 7    /* the most rows of x sharing one loaded (and unpacked) weight block (BLOCK_TILE inlines 1-7) */
/* Weights below this many elements run on the calling thread: waking a team costs more than it saves. */
#define PARALLEL_MIN_WEIGHTS (1 << 16)
/* A group's first tile of rows reads its weights from memory (the later tiles find them in L1): each of its blocks
 * prefetches the code bytes this far ahead (the groups lie one after another). Measured 1-7% faster forwards at 1-4
 * rows here, and 1.3-1.5x faster on a head too large for the caches (Q8, 49152 x 576) at 5-12 rows. */
#define PREFETCH_BYTES 4096
#define HEADS_TILE 3  /* query heads of one KV head that share each loaded key and value row in attention */

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* x [M, K] float -> q [M, K] int8, d [M, K/32], s [M, K/32] (s = d * sum(q) over the block), hs [M, K/32, 2]
 * (d * sum(q) over each half of the block). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s, float *hs) {
    const int64_t G = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
#pragma omp parallel for schedule(static) if (M * K >= PARALLEL_MIN_WEIGHTS)
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
        const __m256i first = _mm256_add_epi32(i0, i1), second = _mm256_add_epi32(i2, i3);  /* elements 0-15, 16-31 */
        __m128i t = _mm_hadd_epi32(_mm_add_epi32(_mm256_castsi256_si128(first), _mm256_extracti128_si256(first, 1)),
                                   _mm_add_epi32(_mm256_castsi256_si128(second), _mm256_extracti128_si256(second, 1)));
        t = _mm_hadd_epi32(t, t);  /* lanes 0, 1: the halves' sums */
        const int32_t half0 = _mm_cvtsi128_si32(t), half1 = _mm_extract_epi32(t, 1);
        __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
        __m256i p = _mm256_packs_epi16(p01, p23);
        /* packs works within 128-bit lanes: put the 32-bit groups back in element order */
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + i * QK), p);
        /* a NaN or infinity in the block makes its scale NaN, so that it reaches the output */
        const float poison = 0.0f * hsum8(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
        d[i] = dx + poison;
        s[i] = dx * (float)(half0 + half1) + poison;
        hs[2 * i] = dx * (float)half0 + poison;
        hs[2 * i + 1] = dx * (float)half1 + poison;
    }
}

typedef struct {
    int8_t *q;
    float *d, *s, *h;  /* quantize_rows' d, s and hs */
} quantized_x;

static int quantize_input(const float *x, int64_t M, int64_t K, quantized_x *qx) {
    const int64_t G = K / QK;
    qx->q = (int8_t *)aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    qx->d = (float *)malloc(sizeof(float) * (size_t)(M * G));
    qx->s = (float *)malloc(sizeof(float) * (size_t)(M * G));
    qx->h = (float *)malloc(sizeof(float) * (size_t)(2 * M * G));
    if (!qx->q || !qx->d || !qx->s || !qx->h) {
        free(qx->q); free(qx->d); free(qx->s); free(qx->h);
        return -1;
    }
    quantize_rows(x, M, K, qx->q, qx->d, qx->s, qx->h);
    return 0;
}

static void release_input(quantized_x *qx) {
    free(qx->q); free(qx->d); free(qx->s); free(qx->h);
}

/* One dword of a row's quantized block (4 bytes) in every 32-bit lane. */
static inline __m256i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* How a matmul's block scales are stored (cpu_kernels.py packed_scales / pack_super_scales). */
enum { SCALES_F32 = 0, SCALES_F16 = 1, SCALES_SUPER = 2 };
/* Bytes of one super-block's scales for 8 rows: FLOATS vectors of 8 float32 factors, then PER_BLOCK vectors of 8 int8
 * multipliers for each of its 8 blocks. */
#define SUPER_BYTES(FLOATS, PER_BLOCK) (32 * (FLOATS) + 64 * (PER_BLOCK))

/* The 8 rows' scale vector j (0 .. per_block - 1) of block g; mode, per_block and floats are constants after inlining.
 *   SCALES_F32, SCALES_F16: [G, per_block, 8] float32, or float16 values converted exactly.
 *   SCALES_SUPER (GGUF's K-quants, whose scales are a float16 factor per 256 elements times a small integer per block
 *   or per 16): [G / 8] super-blocks of SUPER_BYTES(floats, per_block) bytes. Vector j is the block's int8 multipliers
 *   j times factor vector j * floats / per_block: the only one (floats = 1), or with floats = 2 (d, -dmin) the first
 *   for the scales and the second for the offsets (Q4_K: j = 0, 1; Q2_K: j = 0, 1 and 2, 3). The product of a float16 value and an
 *   int8 is exact in float32, so the scale has the bits of the one computed at load, at an eighth of its bytes. */
static inline __attribute__((always_inline)) __m256 block_scale(const void *s, int64_t g, int j, int mode, int per_block,
                                                                int floats) {
    if (mode == SCALES_SUPER) {
        const char *sb = (const char *)s + (g / 8) * SUPER_BYTES(floats, per_block);
        const __m256 factor = _mm256_loadu_ps((const float *)sb + 8 * (j * floats / per_block));
        const __m128i ints = _mm_loadl_epi64((const __m128i *)(sb + 32 * floats + 8 * ((g % 8) * per_block + j)));
        return _mm256_mul_ps(factor, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ints)));
    }
    const int64_t i = 8 * (g * per_block + j);
    return mode == SCALES_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)s + i)))
                              : _mm256_loadu_ps((const float *)s + i);
}

/* Outputs of one group of 8 weight rows (columns of y) for R rows of quantized x (R a constant after
 * inlining), into acc[0..R): lane c of acc[r] is y[r, 8 * group + c].
 * Q4 group: codes [G, 4, 32] bytes: vector j of block g holds, at byte 4 c + e, element 4 j + e of row c in
 * its low nibble and element 16 + 4 j + e in its high nibble; scales (block_scale's layout, two vectors a block):
 * the 8 rows' d, then their m.
 * A block's byte products summed in 16 bits are exact: 8 multiply-adds of pairs, each at most 2 * 15 * 127. */
static inline __attribute__((always_inline)) void q4_group(const uint8_t *codes, const void *scales, int64_t G,
                                                            const quantized_x *qx, int64_t m0, int R, int prefetch,
                                                            int mode, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        const uint8_t *block = codes + g * 128;
        if (prefetch) {  /* a hint: never faults, also past the last group */
            _mm_prefetch((const char *)block + PREFETCH_BYTES, _MM_HINT_T0);
            _mm_prefetch((const char *)block + PREFETCH_BYTES + 64, _MM_HINT_T0);
        }
        __m256i sums[MAX_TILE];  /* [R] 16 lanes of 16 bits: two per weight row */
        for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 32 * j));
            const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            for (int r = 0; r < R; ++r) {
                const int8_t *xb = qx->q + ((m0 + r) * G + g) * QK;
                sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(lo, broadcast4(xb + 4 * j)));
                sums[r] = _mm256_add_epi16(sums[r], _mm256_maddubs_epi16(hi, broadcast4(xb + 16 + 4 * j)));
                /* With several rows, an empty asm that claims to change sums[r]: the compiler keeps each
                 * row's running sum in a register instead of reassociating the block's products into a tree
                 * whose partial sums spill to the stack (integer sums: the bits are the same either way;
                 * 20-30% faster at 4 rows and more). One row does not spill, and its loads schedule better
                 * without it. */
                if (R > 1) __asm__("" : "+x"(sums[r]));
            }
        }
        const __m256 d = block_scale(scales, g, 0, mode, 2, 2), m = block_scale(scales, g, 1, mode, 2, 2);
        for (int r = 0; r < R; ++r) {
            const int64_t i = (m0 + r) * G + g;
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r], ones));  /* [8] block dots */
            acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(qx->d[i])), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(qx->s[i]), acc[r]);
        }
    }
}

/* Q5 group: 5-bit codes c in 0..31, [G, 5, 32] bytes: their low 4 bits in q4_group's layout, then one vector of their
 * high bits whose byte 4 c + e holds element 4 j + e of row c at bit j and element 16 + 4 j + e at bit 4 + j;
 * scales as q4_group's ((d, m) a block): w = d * c + m. Each half's 16-bit pair sums add up over the block (4
 * multiply-adds of pairs, each at most 2 * 31 * 127); the halves are widened to 32 bits apart before they are added. */
static inline __attribute__((always_inline)) void q5_group(const uint8_t *codes, const void *scales, int64_t G,
                                                            const quantized_x *qx, int64_t m0, int R, int prefetch,
                                                            int mode, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        const uint8_t *block = codes + g * 160;
        if (prefetch)
            for (int l = 0; l < 3; ++l) _mm_prefetch((const char *)block + PREFETCH_BYTES + 64 * l, _MM_HINT_T0);
        __m256i first[MAX_TILE], second[MAX_TILE];  /* [R] 16-bit pair sums of each half, two per weight row */
        for (int r = 0; r < R; ++r) first[r] = second[r] = _mm256_setzero_si256();
        const __m256i high = _mm256_loadu_si256((const __m256i *)(block + 128));
        for (int j = 0; j < 4; ++j) {
            /* bit j (first half) or 4 + j (second half) of the high bits to bit 4 (within its byte: a 16-bit shift by at
             * most 4 moves no bit it keeps across bytes) */
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 32 * j));
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, low4),
                                               _mm256_and_si256(_mm256_slli_epi16(high, 4 - j), bit4));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low4),
                                               _mm256_and_si256(_mm256_srli_epi16(high, j), bit4));
            for (int r = 0; r < R; ++r) {
                const int8_t *xb = qx->q + ((m0 + r) * G + g) * QK;
                first[r] = _mm256_add_epi16(first[r], _mm256_maddubs_epi16(lo, broadcast4(xb + 4 * j)));
                second[r] = _mm256_add_epi16(second[r], _mm256_maddubs_epi16(hi, broadcast4(xb + 16 + 4 * j)));
                if (R > 1) __asm__("" : "+x"(first[r]), "+x"(second[r]));  /* as in q4_group */
            }
        }
        const __m256 d = block_scale(scales, g, 0, mode, 2, 2), m = block_scale(scales, g, 1, mode, 2, 2);
        for (int r = 0; r < R; ++r) {
            const int64_t i = (m0 + r) * G + g;
            const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(first[r], ones), _mm256_madd_epi16(second[r], ones));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(qx->d[i])), acc[r]);
            acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(qx->s[i]), acc[r]);
        }
    }
}

/* Unsigned codes with a scale per 16, each half of a block summed apart; bits (2, 4, 6 or 7) a constant after inlining.
 * 4 (GGUF Q3_K, and Q6_K tensors whose codes fit in 4 bits): q4_group's codes c = q + 8 in 0..15 (the low nibbles hold
 * elements 0..15 of a block, the high ones 16..31), w = d_h (c - 8) with d_h the scale of the element's half
 * (block_scale's layout, two vectors a block): each half's exact byte sum times its scale, minus 8 d_h times the x
 * half's sum. 6 (GGUF Q6_K): c = q in 0..63, w = d_h (c - 32), [G, 6, 32] bytes: its low 4 bits as the 4-bit codes,
 * then its high 2 bits as the 2-bit codes below. 7 (GGUF IQ2_XS, IQ2_S): c = q + 64 in 0..127, w = d_h (c - 64), [G, 8, 32]
 * bytes as q8_group's codes (vector j: elements 4 j + e of the first half, vector 4 + j: 16 + 4 j + e). 2 (GGUF Q2_K): 2-bit codes c = q in 0..3, [G, 2, 32] bytes: byte
 * 4 c + e of vector h holds element 16 h + 4 j + e of row c at bits 2 j, and w = d_h c + m_h with an offset per half
 * (four vectors a block: d_0, d_1, m_0, m_1).
 * The 16-bit pair sums of 2- and 4-bit codes add up over a block (4 multiply-adds of pairs, each at most
 * 2 * 15 * 127); 6- and 7-bit codes' pairs (at most 2 * 127 * 127 < 2^15) are widened to 32 bits at each multiply-add. */
static inline __attribute__((always_inline)) void halves_16(const uint8_t *codes, const void *scales, int64_t G,
                                                             const quantized_x *qx, int64_t m0, int R, int prefetch,
                                                             int mode, int bits, __m256 *acc) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03), ones = _mm256_set1_epi16(1);
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    const __m256 minus_mid = _mm256_set1_ps(bits == 7 ? -64.0f : bits == 6 ? -32.0f : -8.0f);  /* the zero point, negated */
    const int mins = bits == 2, wide = bits >= 6, per_block = mins ? 4 : 2, floats = mins ? 2 : 1;
    const int block_bytes = bits == 7 ? 256 : 32 * bits;
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        const uint8_t *block = codes + g * block_bytes;
        if (prefetch)
            for (int l = 0; l < block_bytes / 64; ++l)
                _mm_prefetch((const char *)block + PREFETCH_BYTES + 64 * l, _MM_HINT_T0);
        /* [R] pair sums of each half, two per weight row: 16 bits (2- and 4-bit codes) or 32 (6- and 7-bit) */
        __m256i first[MAX_TILE], second[MAX_TILE];
        for (int r = 0; r < R; ++r) first[r] = second[r] = _mm256_setzero_si256();
        /* 2-bit codes (or 6-bit codes' high bits): the block's two vectors (one a half), loaded once for four shifts */
        const uint8_t *twos = bits == 6 ? block + 128 : block;
        const __m256i half0 = bits == 2 || bits == 6 ? _mm256_loadu_si256((const __m256i *)twos) : _mm256_setzero_si256();
        const __m256i half1 = bits == 2 || bits == 6 ? _mm256_loadu_si256((const __m256i *)(twos + 32)) : _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
            __m256i lo, hi;
            if (bits == 2) {
                lo = _mm256_and_si256(_mm256_srli_epi16(half0, 2 * j), low2);
                hi = _mm256_and_si256(_mm256_srli_epi16(half1, 2 * j), low2);
            } else if (bits == 7) {
                lo = _mm256_loadu_si256((const __m256i *)(block + 32 * j));
                hi = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * j));
            } else {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 32 * j));
                lo = _mm256_and_si256(raw, low4);
                hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            }
            if (bits == 6) {  /* bits 2 j, 2 j + 1 of the high parts to bits 4, 5 (no bit crosses a byte it is kept in) */
                const __m256i h0 = j < 2 ? _mm256_slli_epi16(half0, 4 - 2 * j) : _mm256_srli_epi16(half0, 2 * j - 4);
                const __m256i h1 = j < 2 ? _mm256_slli_epi16(half1, 4 - 2 * j) : _mm256_srli_epi16(half1, 2 * j - 4);
                lo = _mm256_or_si256(lo, _mm256_and_si256(h0, bits45));
                hi = _mm256_or_si256(hi, _mm256_and_si256(h1, bits45));
            }
            for (int r = 0; r < R; ++r) {
                const int8_t *xb = qx->q + ((m0 + r) * G + g) * QK;
                const __m256i a = _mm256_maddubs_epi16(lo, broadcast4(xb + 4 * j));
                const __m256i b = _mm256_maddubs_epi16(hi, broadcast4(xb + 16 + 4 * j));
                if (wide) {
                    first[r] = _mm256_add_epi32(first[r], _mm256_madd_epi16(a, ones));
                    second[r] = _mm256_add_epi32(second[r], _mm256_madd_epi16(b, ones));
                } else {
                    first[r] = _mm256_add_epi16(first[r], a);
                    second[r] = _mm256_add_epi16(second[r], b);
                }
                if (R > 1) __asm__("" : "+x"(first[r]), "+x"(second[r]));  /* as in q4_group */
            }
        }
        const __m256 d0 = block_scale(scales, g, 0, mode, per_block, floats);
        const __m256 d1 = block_scale(scales, g, 1, mode, per_block, floats);
        const __m256 m0v = mins ? block_scale(scales, g, 2, mode, per_block, floats) : _mm256_mul_ps(minus_mid, d0);
        const __m256 m1v = mins ? block_scale(scales, g, 3, mode, per_block, floats) : _mm256_mul_ps(minus_mid, d1);
        for (int r = 0; r < R; ++r) {
            const int64_t i = (m0 + r) * G + g;
            const __m256 xd = _mm256_set1_ps(qx->d[i]);
            const __m256i f = wide ? first[r] : _mm256_madd_epi16(first[r], ones);  /* [8] 32-bit half dots */
            const __m256i s = wide ? second[r] : _mm256_madd_epi16(second[r], ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(f), _mm256_mul_ps(d0, xd), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d1, xd), acc[r]);
            acc[r] = _mm256_fmadd_ps(m0v, _mm256_set1_ps(qx->h[2 * i]), acc[r]);
            acc[r] = _mm256_fmadd_ps(m1v, _mm256_set1_ps(qx->h[2 * i + 1]), acc[r]);
        }
    }
}

/* halves_16 with its code width fixed: the GROUP_FN signature BLOCK_MATMUL calls. */
#define HALVES_16_GROUP(NAME, BITS)                                                                        \
    static inline __attribute__((always_inline)) void NAME(const uint8_t *codes, const void *scales, int64_t G, \
                                                           const quantized_x *qx, int64_t m0, int R,          \
                                                           int prefetch, int mode, __m256 *acc) {             \
        halves_16(codes, scales, G, qx, m0, R, prefetch, mode, BITS, acc);                                 \
    }
HALVES_16_GROUP(q2m_16_group, 2)  /* GGUF Q2_K */
HALVES_16_GROUP(q4_16_group, 4)   /* GGUF Q3_K */
HALVES_16_GROUP(q6_16_group, 6)   /* GGUF Q6_K, IQ1_M */
HALVES_16_GROUP(q7_16_group, 7)   /* GGUF IQ2_XS, IQ2_S */

/* IQ4_VALUES (kernel_abi.py): GGUF's IQ4_NL table (IQ4_XS's too), the signed byte an index of IQ4 codes stands for;
 * set twice in a vector (one per 128-bit lane, as vpshufb looks up in each lane). */

/* Q8 group: codes [G, 8, 32] signed bytes: vector j of block g holds, at byte 4 c + e, element 4 j + e of
 * row c; or, with iq4 (GGUF IQ4_NL, IQ4_XS), q4_group's nibble layout ([G, 4, 32]) of indices into IQ4_VALUES, looked
 * up into those bytes once for all the rows of x. Scales (block_scale's layout, one vector a block): each row's scale
 * for the block. vpmaddubsw takes one unsigned operand: |w| times x with w's sign. */
static inline __attribute__((always_inline)) void q8_blocks(const int8_t *codes, const void *scales, int64_t G,
                                                             const quantized_x *qx, int64_t m0, int R, int prefetch,
                                                             int mode, int iq4, __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
    const __m256i values = _mm256_setr_epi8(IQ4_VALUES, IQ4_VALUES);
    const int block_bytes = iq4 ? 128 : 256;
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
        const int8_t *block = codes + g * block_bytes;
        if (prefetch)
            for (int l = 0; l < block_bytes / 64; ++l)
                _mm_prefetch((const char *)block + PREFETCH_BYTES + 64 * l, _MM_HINT_T0);
        __m256i sums[MAX_TILE];  /* [R] 8 lanes of 32 bits: one per weight row */
        for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
            __m256i w;
            if (iq4) {  /* elements 4 j + e: vector j % 4's low nibbles for j < 4, its high ones after */
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(block + 32 * (j % 4)));
                w = _mm256_shuffle_epi8(values, _mm256_and_si256(j < 4 ? raw : _mm256_srli_epi16(raw, 4), low4));
            } else {
                w = _mm256_loadu_si256((const __m256i *)(block + 32 * j));
            }
            const __m256i wabs = _mm256_sign_epi8(w, w);
            for (int r = 0; r < R; ++r) {
                const __m256i xv = broadcast4(qx->q + ((m0 + r) * G + g) * QK + 4 * j);
                sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, w)), ones));
                if (R > 1) __asm__("" : "+x"(sums[r]));  /* a running sum in a register, as in q4_group */
            }
        }
        const __m256 d = block_scale(scales, g, 0, mode, 1, 1);
        for (int r = 0; r < R; ++r)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, _mm256_set1_ps(qx->d[(m0 + r) * G + g])),
                                     acc[r]);
    }
}

static inline __attribute__((always_inline)) void q8_group(const int8_t *codes, const void *scales, int64_t G,
                                                            const quantized_x *qx, int64_t m0, int R, int prefetch,
                                                            int mode, __m256 *acc) {
    q8_blocks(codes, scales, G, qx, m0, R, prefetch, mode, 0, acc);
}

static inline __attribute__((always_inline)) void iq4_group(const uint8_t *codes, const void *scales, int64_t G,
                                                             const quantized_x *qx, int64_t m0, int R, int prefetch,
                                                             int mode, __m256 *acc) {
    q8_blocks((const int8_t *)codes, scales, G, qx, m0, R, prefetch, mode, 1, acc);
}

/* Lanes of v into y[n0 .. min(n0 + 8, N)). */
static inline void store_group(float *y, int64_t N, int64_t n0, __m256 v) {
    if (n0 + 8 <= N) {
        _mm256_storeu_ps(y + n0, v);
        return;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    for (int64_t c = 0; n0 + c < N; ++c) y[n0 + c] = lanes[c];
}

/* One tile of rows through GROUP_FN with the row count and the scales' mode as constants; row counts above the kind's
 * TILE (a constant) never occur and their copies are not compiled. */
#define TILE_CASE(GROUP_FN, MODE, TILE, R)                                                          \
    case R:                                                                                         \
        if ((R) <= (TILE)) GROUP_FN(cw, sw, G, &qx, m0, R, prefetch, MODE, acc);                    \
        break;
#define BLOCK_TILE(GROUP_FN, MODE, TILE)                                                            \
    switch (rows) { /* a constant row count per call: each inlines with its loops unrolled */     \
    TILE_CASE(GROUP_FN, MODE, TILE, 7) TILE_CASE(GROUP_FN, MODE, TILE, 6)                         \
    TILE_CASE(GROUP_FN, MODE, TILE, 5) TILE_CASE(GROUP_FN, MODE, TILE, 4)                         \
    TILE_CASE(GROUP_FN, MODE, TILE, 3) TILE_CASE(GROUP_FN, MODE, TILE, 2)                         \
    default: GROUP_FN(cw, sw, G, &qx, m0, 1, prefetch, MODE, acc); break;                         \
    }
_Static_assert(MAX_TILE == 7, "BLOCK_TILE inlines tiles of 1 to 7 rows");

/* A group's super-block scales as float32 vectors ([G, per_block, 8]: SCALES_F32's layout), the products block_scale
 * computes, so that a call of several tiles multiplies them out once per group instead of once per tile. */
static inline __attribute__((always_inline)) void expand_super(const void *s, int64_t G, int per_block, int floats,
                                                               float *out) {
    for (int64_t g = 0; g < G; ++g)
        for (int j = 0; j < per_block; ++j)
            _mm256_storeu_ps(out + 8 * (g * per_block + j), block_scale(s, g, j, SCALES_SUPER, per_block, floats));
}

/* The body of a block matmul: quantize x, then groups of 8 output columns over the threads, rows of x in
 * ceil(M / TILE) tiles of M / tiles or one more rows (each tile's size and the scales' mode pick an inlined copy).
 * PER_BLOCK and FLOATS: the scale vectors a block and the factor vectors a super-block (block_scale). Super-block
 * scales are multiplied out as each block is reached in a call of one tile (bound by the weights' bytes), and once
 * per group into a thread's buffer in calls of several tiles (bound by the arithmetic, which the products would add
 * to per tile). */
#define BLOCK_MATMUL(GROUP_FN, CODES, SCALES, CODE_BYTES, PER_BLOCK, FLOATS, TILE)                  \
    const int64_t G = K / QK, groups = (N + 7) / 8;                                                 \
    if (mode == SCALES_SUPER && G % 8) return -2; /* super-blocks of 256 elements */                \
    quantized_x qx;                                                                                 \
    if (quantize_input(x, M, K, &qx)) return -1;                                                    \
    const int64_t tiles = (M + (TILE) - 1) / (TILE);                                                \
    const int one_tile = tiles == 1;                                                                \
    const int64_t scale_stride = mode == SCALES_SUPER ? G / 8 * SUPER_BYTES(FLOATS, PER_BLOCK)      \
                                                      : G * 8 * (PER_BLOCK) * (mode == SCALES_F16 ? 2 : 4); \
    _Pragma("omp parallel if (N * K >= PARALLEL_MIN_WEIGHTS)")                                      \
    {                                                                                               \
        /* the group's expanded super-block scales (NULL: one tile, or no memory: products per tile) */ \
        float *expanded = mode == SCALES_SUPER && !one_tile                                         \
                              ? (float *)malloc(sizeof(float) * (size_t)(G * 8 * (PER_BLOCK))) : NULL; \
        _Pragma("omp for schedule(static)")                                                         \
        for (int64_t c = 0; c < groups; ++c) {                                                      \
            __m256 acc[MAX_TILE];                                                                  \
            const void *cw = CODES + c * G * (CODE_BYTES);                                          \
            const void *sw = (const char *)(SCALES) + c * scale_stride; /* the group's scales */    \
            if (expanded) {                                                                         \
                expand_super(sw, G, PER_BLOCK, FLOATS, expanded);                                   \
                sw = expanded;                                                                      \
            }                                                                                       \
            for (int64_t t = 0, m0 = 0; t < tiles; ++t) {                                           \
                const int rows = (int)(M / tiles + (t < M % tiles)), prefetch = t == 0;             \
                if (mode == SCALES_SUPER && !expanded) {                                            \
                    BLOCK_TILE(GROUP_FN, SCALES_SUPER, TILE)                                        \
                } else if (mode == SCALES_F16) {                                                    \
                    BLOCK_TILE(GROUP_FN, SCALES_F16, TILE)                                          \
                } else {                                                                            \
                    BLOCK_TILE(GROUP_FN, SCALES_F32, TILE)                                          \
                }                                                                                   \
                for (int r = 0; r < rows; ++r) store_group(y + (m0 + r) * N, N, 8 * c, acc[r]);     \
                m0 += rows;                                                                         \
            }                                                                                       \
        }                                                                                           \
        free(expanded);                                                                             \
    }                                                                                               \
    release_input(&qx);                                                                             \
    return 0;

/* The block matmul of each kind (specdist_block_mm calls them): y [M, N] = x [M, K] @ W.T, W's codes
 * [ceil(N/8), G, CODE_BYTES] (pack_q4's 128 bytes a block of 8 rows, IQ4's too; pack_q5's 160; pack_q6's 192;
 * pack_q8's 256; pack_q2's 64) and its scales sc in a mode
 * (SCALES_F32, SCALES_F16, SCALES_SUPER: block_scale's layouts with PER_BLOCK vectors a block and FLOATS factors a
 * super-block, for each group of 8 rows in turn). TILE: the most rows of x a loaded weight vector serves, the fastest
 * of 3 to 8 on this AVX2 core over 5-32 rows (BENCHMARKS.md): larger tiles unpack each weight vector for more rows,
 * until the running sums and accumulators no longer fit the 16 vector registers (tiles of 8 spill). Returns 0, -1
 * without memory, or -2 for super-block scales of a K that is not a multiple of 256. */
#define DEFINE_MATMUL(NAME, GROUP_FN, CODE_T, CODE_BYTES, PER_BLOCK, FLOATS, TILE)                           \
    static int NAME(const float *x, int64_t M, int64_t K, const CODE_T *qs, const void *sc, int mode, int64_t N, \
                    float *y) {                                                                              \
        BLOCK_MATMUL(GROUP_FN, qs, sc, CODE_BYTES, PER_BLOCK, FLOATS, TILE)                                  \
    }

DEFINE_MATMUL(matmul_q4, q4_group, uint8_t, Q4_CODE_BYTES, Q4_PER_BLOCK, Q4_FLOATS, Q4_TILE)         /* Q4_0, Q4_1, Q4_K: (d, m) a block */
DEFINE_MATMUL(matmul_q5, q5_group, uint8_t, Q5_CODE_BYTES, Q5_PER_BLOCK, Q5_FLOATS, Q5_TILE)         /* Q5_0, Q5_1, Q5_K: (d, m) a block */
DEFINE_MATMUL(matmul_q4_16, q4_16_group, uint8_t, Q4_16_CODE_BYTES, Q4_16_PER_BLOCK, Q4_16_FLOATS, Q4_16_TILE)   /* Q3_K: c = q + 8, d per 16 */
DEFINE_MATMUL(matmul_q2m_16, q2m_16_group, uint8_t, Q2M_16_CODE_BYTES, Q2M_16_PER_BLOCK, Q2M_16_FLOATS, Q2M_16_TILE)  /* Q2_K: 2-bit codes, (d_0, d_1, m_0, m_1) a block */
DEFINE_MATMUL(matmul_q6_16, q6_16_group, uint8_t, Q6_16_CODE_BYTES, Q6_16_PER_BLOCK, Q6_16_FLOATS, Q6_16_TILE)   /* Q6_K: 6-bit codes (c = q), d per 16 */
DEFINE_MATMUL(matmul_q7_16, q7_16_group, uint8_t, Q7_16_CODE_BYTES, Q7_16_PER_BLOCK, Q7_16_FLOATS, Q7_16_TILE)   /* IQ2_XS, IQ2_S: 7-bit codes (c = q + 64) in bytes, d per 16 */
DEFINE_MATMUL(matmul_q8, q8_group, int8_t, Q8_CODE_BYTES, Q8_PER_BLOCK, Q8_FLOATS, Q8_TILE)          /* Q8_0, Q5_0: d a block */
DEFINE_MATMUL(matmul_iq4, iq4_group, uint8_t, IQ4_CODE_BYTES, IQ4_PER_BLOCK, IQ4_FLOATS, IQ4_TILE)       /* IQ4_NL, IQ4_XS: indices into IQ4_VALUES, d a block */

/* ---------------------------------------------------------------------------------------------
 * Dense float32: y [M, N] = x [M, K] @ W.T, W [N, K] as torch's Linear holds it (row-major, unpacked).
 * For the few rows of a decode or verification step: each (x row, W row) pair is a dot product of 8 lanes
 * over K in order, then one horizontal sum (and the K % 8 tail in order), so an output does not depend on
 * M or on the rows beside it. Tiles of up to F32_ROWS rows of x against F32_COLS rows of W: 12
 * accumulators, each loaded W vector serving 3 rows of x and each x vector 4 rows of W; the W rows
 * (F32_COLS x K elements) stay in L1 while every tile of x passes, so W is read from memory once. Threads over
 * groups of W rows, as the block matmuls.
 *
 * W may be stored as float32, bfloat16 or float16 (WT_F32, WT_BF16, WT_F16): a half-width element converts
 * exactly to the float32 it stands for on load (bf16: the upper 16 bits; f16: vcvtph2ps), and the arithmetic
 * after the load is the same instructions in the same order, so a weight held in half width wherever it is
 * exact gives the bits float32 storage gives, reading half the bytes.
 */
#define F32_ROWS 3
#define F32_COLS 4
/* Every tile prefetches the weights this far ahead (a few groups of W rows): over a float32 model's layers,
 * calls of 3-7 rows ran 1.1-1.26x faster here than on the hardware prefetchers alone; one row unchanged. */
#define F32_PREFETCH_BYTES 65536

enum { WT_F32 = 0, WT_BF16 = 1, WT_F16 = 2 };

/* 8 weights from element i of a row stored as wt, as float32 (exact). */
static inline __attribute__((always_inline)) __m256 load_w8(const void *w, int64_t i, int wt) {
    if (wt == WT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    if (wt == WT_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    return _mm256_loadu_ps((const float *)w + i);
}

static inline __attribute__((always_inline)) float load_w1(const void *w, int64_t i, int wt) {
    if (wt == WT_BF16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    if (wt == WT_F16) return _cvtsh_ss(((const uint16_t *)w)[i]);
    return ((const float *)w)[i];
}

static inline __attribute__((always_inline)) void f32_tile(const float *x, int64_t K, const void *w, int wt, int C,
                                                            int R, float out[F32_ROWS][F32_COLS]) {
    const int64_t esize = wt == WT_F32 ? 4 : 2;
    __m256 acc[F32_ROWS][F32_COLS];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        if ((k & (64 / esize - 1)) == 0)  /* each W row's line F32_PREFETCH_BYTES ahead: a hint, never faults */
            for (int c = 0; c < C; ++c)
                _mm_prefetch((const char *)w + (c * K + k) * esize + F32_PREFETCH_BYTES, _MM_HINT_T0);
        __m256 xv[F32_ROWS];
        for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
        for (int c = 0; c < C; ++c) {  /* 12 accumulators, 3 x vectors and one W vector: the 16 registers */
            const __m256 wv = load_w8(w, c * K + k, wt);
            for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
            float sum = hsum8(acc[r][c]);
            /* the K % 8 tail: fmaf rounds once per element whatever the compiler would contract */
            for (int64_t j = k; j < K; ++j) sum = fmaf(x[r * K + j], load_w1(w, c * K + j, wt), sum);
            out[r][c] = sum;
        }
}

/* One group of C (constant after inlining) rows of W against every tile of x. */
static inline __attribute__((always_inline)) void f32_group(const float *x, int64_t M, int64_t K, const void *w,
                                                             int wt, int C, int64_t N, int64_t n0, float *y) {
    float out[F32_ROWS][F32_COLS];
    for (int64_t m0 = 0; m0 < M; m0 += F32_ROWS) {
        const int rows = M - m0 < F32_ROWS ? (int)(M - m0) : F32_ROWS;
        switch (rows) { /* a constant row count per call: each inlines with its loops unrolled */
        case 3: f32_tile(x + m0 * K, K, w, wt, C, 3, out); break;
        case 2: f32_tile(x + m0 * K, K, w, wt, C, 2, out); break;
        default: f32_tile(x + m0 * K, K, w, wt, C, 1, out); break;
        }
        for (int r = 0; r < rows; ++r)
            for (int c = 0; c < C; ++c) y[(m0 + r) * N + n0 + c] = out[r][c];
    }
}

/* The threaded loop over groups of F32_COLS W rows, W stored as WT (a literal: each caller's OpenMP region is
 * its own function, with the element conversion compiled in). */
#define DENSE_MM(WT, ESIZE)                                                                                    \
    const int64_t groups = (N + F32_COLS - 1) / F32_COLS;                                                    \
    _Pragma("omp parallel for schedule(static) if (N * K >= PARALLEL_MIN_WEIGHTS)")                           \
    for (int64_t g = 0; g < groups; ++g) {                                                                     \
        const int64_t n0 = g * F32_COLS;                                                                       \
        const void *wg = (const char *)w + n0 * K * (ESIZE);                                                   \
        switch (N - n0 < F32_COLS ? (int)(N - n0) : F32_COLS) {                                               \
        case 4: f32_group(x, M, K, wg, WT, 4, N, n0, y); break;                                               \
        case 3: f32_group(x, M, K, wg, WT, 3, N, n0, y); break;                                               \
        case 2: f32_group(x, M, K, wg, WT, 2, N, n0, y); break;                                               \
        default: f32_group(x, M, K, wg, WT, 1, N, n0, y); break;                                              \
        }                                                                                                      \
    }                                                                                                          \
    return 0;

int specdist_f32_mm(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y) {
    DENSE_MM(WT_F32, 4)
}

/* As specdist_f32_mm, W [N, K] bfloat16 (raw 16-bit patterns). */
int specdist_bf16_mm(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y) {
    DENSE_MM(WT_BF16, 2)
}

/* As specdist_f32_mm, W [N, K] IEEE float16. */
int specdist_f16_mm(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *y) {
    DENSE_MM(WT_F16, 2)
}

/* ---------------------------------------------------------------------------------------------
 * Attention of each query over its own keys in a slot KV cache, one (request, query, KV head) at a time: the
 * query heads that share a KV head (GQA's group) are computed together, HEADS_TILE at a time, each key and
 * value vector loaded and converted once for all of them.
 *
 * q: element (b, h, t, :) at q + b * qs_b + h * qs_h + t * qs_t (hd contiguous floats).
 * k_cache, v_cache: [S, Hkv, L1, hd], float32, or IEEE float16 when kv16 (half the bytes to read: at
 *   16 requests attention is bound by reading the cache); request b reads slot slots[b], head h reads kv head
 *   h / (Hq / Hkv). The query at position p = qpos[b * T + t] sees keys j with lo <= j <= p, where
 *   lo = p - window + 1 for a sliding window (window > 0), else 0.
 * Scores s_j = scale * q . k_j (soft-capped, cap * tanh(s_j / cap), when softcap > 0), softmax over
 * them, out = sum_j softmax_j v_j, written to out [B, T, Hq, hd] (the layout o_proj reads).
 * Every output row is a function of its query and its keys alone, summed in one fixed order, so it
 * does not depend on the batch, the number of queries in the call, the heads computed beside it or the
 * cache's other contents.
 * Returns 0, -1 without memory, or BAD_INDEX (nothing read) for a slot or position outside the cache.
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

/* e^x of 8 floats (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, e^r = 1 + r + r^2 P(r)), x clamped below
 * at -87 (e^-87 is still a normal float); a NaN stays NaN (maxps returns its second operand then). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* ln 2 in two parts: exact n * hi */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* 8 cache elements at element index i of row p as floats: float16 (kv16, exact in float32) or float32. */
static inline __attribute__((always_inline)) __m256 load_kv8(const void *p, int64_t i, int kv16) {
    return kv16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}

/* Cache element i of row p as a float. */
static inline float load_kv(const void *p, int64_t i, int kv16) {
    return kv16 ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* Row j of a [.., hd] cache block: its first element. */
static inline const void *kv_row(const void *block, int64_t j, int64_t hd, int kv16) {
    return (const char *)block + j * hd * (kv16 ? 2 : 4);
}

/* Scores of nr query rows (nr <= HEADS_TILE) against 4 keys (rows of hd floats, hd % 8 == 0): lane c of
 * out[r] is qv[r] . keys[c], summed as 8 lanes over hd in order, then ((l0 + l1) + (l2 + l3)) +
 * ((l4 + l5) + (l6 + l7)). Each key vector is loaded (and converted from float16) once for all nr rows. */
static inline __attribute__((always_inline)) void scores4(const float *const qv[], int nr, const void *const keys[4],
                                                          int64_t hd, int kv16, __m128 out[]) {
    __m256 a[HEADS_TILE][4];
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < hd; i += 8) {
        __m256 qi[HEADS_TILE];
        for (int r = 0; r < nr; ++r) qi[r] = _mm256_loadu_ps(qv[r] + i);
        for (int c = 0; c < 4; ++c) {
            const __m256 k = load_kv8(keys[c], i, kv16);
            for (int r = 0; r < nr; ++r) a[r][c] = _mm256_fmadd_ps(qi[r], k, a[r][c]);
        }
    }
    for (int r = 0; r < nr; ++r) {
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
        out[r] = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    }
}

/* Softmax weights of one row in place: w[0 .. n) holds its scaled scores and w[n .. n rounded up to 8) copies
 * of its last one (so a chunk of 8 needs no mask for the max); the scores are soft-capped, then w[j] becomes
 * exp(w[j] - max), the lanes past n zeroed. Returns 1 / sum. */
static inline __attribute__((always_inline)) float softmax_row(float *w, int64_t n, float softcap) {
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        if (softcap > 0.0f)
            for (int c = 0; c < 8; ++c) w[j0 + c] = softcap * tanhf(w[j0 + c] / softcap);
        mx = _mm256_max_ps(mx, _mm256_loadu_ps(w + j0));  /* repeated lanes do not change the max */
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(h));
    __m256 total = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(w + j0), m));
        if (j0 + 8 > n) {  /* zero the repeated lanes */
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j0)), lane)));
        }
        _mm256_storeu_ps(w + j0, e);
        total = _mm256_add_ps(total, e);
    }
    return 1.0f / hsum8(total);
}

/* Columns c0 .. c0 + 8 vecs of nr rows' outputs: o[r][c] = inv[r] * sum_j w[r][j] v_j[c], j ascending from 0,
 * each value vector loaded (and converted) once for all nr rows. */
static inline __attribute__((always_inline)) void values_slice(const float *const w[], const float inv[], int nr,
                                                               const void *vb, int64_t n, int64_t hd, int64_t c0,
                                                               int vecs, int kv16, float *const o[]) {
    __m256 acc[HEADS_TILE][4];
    for (int r = 0; r < nr; ++r)
        for (int v = 0; v < vecs; ++v) acc[r][v] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
        __m256 e[HEADS_TILE];
        for (int r = 0; r < nr; ++r) e[r] = _mm256_set1_ps(w[r][j]);
        const void *vj = kv_row(vb, j, hd, kv16);
        for (int v = 0; v < vecs; ++v) {
            const __m256 x = load_kv8(vj, c0 + 8 * v, kv16);
            for (int r = 0; r < nr; ++r) acc[r][v] = _mm256_fmadd_ps(e[r], x, acc[r][v]);
        }
    }
    for (int r = 0; r < nr; ++r)
        for (int v = 0; v < vecs; ++v)
            _mm256_storeu_ps(o[r] + c0 + 8 * v, _mm256_mul_ps(acc[r][v], _mm256_set1_ps(inv[r])));
}

/* nr query rows (query heads of one KV head, nr <= HEADS_TILE) over the same keys 0 .. n - 1 of blocks kb, vb
 * (vectorized; hd % 8 == 0): scores 4 keys at a time up to n rounded up to 8 (keys past the last repeat it,
 * so each row's w ends as softmax_row wants), softmax weights per row, then the weighted sum of values in
 * slices of 32 columns. Every row gets the bits it gets alone (nr = 1): its scores, sums and their order
 * do not depend on the other rows. w[r]: scratch of n + 8 floats each. */
static inline __attribute__((always_inline)) void attend_heads(const float *const qv[], int nr, const void *kb,
                                                                const void *vb, int64_t n, int64_t hd, float scale,
                                                                float softcap, float *const w[], float *const o[],
                                                                int kv16) {
    const __m128 sc = _mm_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += 4) {  /* up to n rounded up to 4; then copies of key n - 1 to 8 */
        const void *keys[4];
        for (int c = 0; c < 4; ++c) keys[c] = kv_row(kb, j0 + c < n ? j0 + c : n - 1, hd, kv16);
        __m128 s[HEADS_TILE];
        scores4(qv, nr, keys, hd, kv16, s);
        for (int r = 0; r < nr; ++r) _mm_storeu_ps(w[r] + j0, _mm_mul_ps(s[r], sc));
    }
    const int64_t filled = (n + 3) / 4 * 4, padded = (n + 7) / 8 * 8;
    for (int r = 0; r < nr; ++r)
        for (int64_t j = filled; j < padded; ++j) w[r][j] = w[r][n - 1];  /* the score key n - 1 gives, bit for bit */
    float inv[HEADS_TILE];
    for (int r = 0; r < nr; ++r) inv[r] = softmax_row(w[r], n, softcap);
    for (int64_t c0 = 0; c0 < hd; c0 += 32) {
        switch (hd - c0 >= 32 ? 4 : (int)((hd - c0) / 8)) {  /* constant vector counts: accumulators stay in registers */
            case 4: values_slice((const float *const *)w, inv, nr, vb, n, hd, c0, 4, kv16, o); break;
            case 3: values_slice((const float *const *)w, inv, nr, vb, n, hd, c0, 3, kv16, o); break;
            case 2: values_slice((const float *const *)w, inv, nr, vb, n, hd, c0, 2, kv16, o); break;
            default: values_slice((const float *const *)w, inv, nr, vb, n, hd, c0, 1, kv16, o); break;
        }
    }
}

/* The same row for any hd, one key at a time (libm's expf). krow: scratch of hd floats (a float16 key). */
static void attend_row_scalar(const float *qv, const void *kb, const void *vb, int64_t lo, int64_t p,
                              int64_t hd, float scale, float softcap, float *w, float *o, int kv16, float *krow) {
    float m = -INFINITY;
    for (int64_t j = lo; j <= p; ++j) {
        const void *kj = kv_row(kb, j, hd, kv16);
        if (kv16)
            for (int64_t c = 0; c < hd; ++c) krow[c] = load_kv(kj, c, 1);
        float s = scale * dot_row(qv, kv16 ? krow : (const float *)kj, hd);
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        w[j - lo] = s;
        m = s > m ? s : m;
    }
    float total = 0.0f;
    for (int64_t c = 0; c < hd; ++c) o[c] = 0.0f;
    for (int64_t j = lo; j <= p; ++j) {
        const float e = expf(w[j - lo] - m);
        total += e;
        const void *vj = kv_row(vb, j, hd, kv16);
        for (int64_t c = 0; c < hd; ++c) o[c] += e * load_kv(vj, c, kv16);
    }
    const float inv = 1.0f / total;
    for (int64_t c = 0; c < hd; ++c) o[c] *= inv;
}

/* The return of an attention call handed a slot outside [0, S) or a position outside [0, L1): nothing was read or
 * written. The Python side checks the indices too, with messages, but keeps its verdict for index tensors it has
 * seen (their versions unchanged); this check holds whatever happened to them since (an in-place edit under
 * inference mode, which keeps no version). O(B T) compares. */
#define BAD_INDEX (-3)

static int indices_outside(int64_t B, int64_t T, int64_t S, int64_t L1, const int64_t *slots, const int64_t *pos) {
    for (int64_t b = 0; b < B; ++b)
        if (slots[b] < 0 || slots[b] >= S) return 1;
    for (int64_t i = 0; pos != NULL && i < B * T; ++i)
        if (pos[i] < 0 || pos[i] >= L1) return 1;
    return 0;
}

int specdist_attention(const float *q, int64_t B, int64_t Hq, int64_t T, int64_t hd,
                       int64_t qs_b, int64_t qs_h, int64_t qs_t,
                       const void *k_cache, const void *v_cache, int kv16, int64_t Hkv, int64_t S, int64_t L1,
                       const int64_t *slots, const int64_t *qpos, int64_t window, float scale, float softcap,
                       float *out) {
    if (indices_outside(B, T, S, L1, slots, qpos)) return BAD_INDEX;
    const int64_t group = Hq / Hkv, items = B * T * Hkv;  /* an item: one query's heads over one KV head */
    int64_t max_keys = 1, work = 0;
    for (int64_t i = 0; i < B * T; ++i) {
        max_keys = qpos[i] + 1 > max_keys ? qpos[i] + 1 : max_keys;
        work += (qpos[i] + 1) * Hq * hd;
    }
    const int64_t stride = max_keys + 8;  /* one row's scores, then weights */
    int failed = 0;
#pragma omp parallel if (work >= PARALLEL_MIN_WEIGHTS)
    {
        /* HEADS_TILE rows' scratch, then a float16 key row for attend_row_scalar */
        float *scratch = (float *)malloc(sizeof(float) * (size_t)(HEADS_TILE * stride + hd));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
        /* dynamic: an item's keys grow with its query position, so a prefill's later items cost up to T times its
         * first ones, and equal contiguous shares would leave one thread three quarters of the work (1.5-1.7x slower
         * attention at 400-800 prompt tokens; verifications, whose items cost alike, measured the same either way) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; ++it) {
            if (!scratch) continue;
            const int64_t b = it / (T * Hkv), t = (it / Hkv) % T, g = it % Hkv;
            const int64_t p = qpos[b * T + t];
            const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0, n = p - lo + 1;
            const int64_t base = (slots[b] * Hkv + g) * L1;
            const void *kb = kv_row(k_cache, base, hd, kv16), *vb = kv_row(v_cache, base, hd, kv16);
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += HEADS_TILE) {
                const int nr = (g + 1) * group - h0 < HEADS_TILE ? (int)((g + 1) * group - h0) : HEADS_TILE;
                const float *qv[HEADS_TILE];
                float *o[HEADS_TILE], *w[HEADS_TILE];
                for (int r = 0; r < nr; ++r) {
                    qv[r] = q + b * qs_b + (h0 + r) * qs_h + t * qs_t;
                    o[r] = out + ((b * T + t) * Hq + h0 + r) * hd;
                    w[r] = scratch + r * stride;
                }
                if (hd % 8 != 0) {
                    for (int r = 0; r < nr; ++r)
                        attend_row_scalar(qv[r], kb, vb, lo, p, hd, scale, softcap, w[r], o[r], kv16,
                                          scratch + HEADS_TILE * stride);
                    continue;
                }
                const void *kr = kv_row(kb, lo, hd, kv16), *vr = kv_row(vb, lo, hd, kv16);
                /* inlined copies with the row count and the loads fixed */
#define ATTEND(NR, KV16) attend_heads(qv, NR, kr, vr, n, hd, scale, softcap, w, o, KV16)
                if (kv16) {
                    if (nr == 3) ATTEND(3, 1); else if (nr == 2) ATTEND(2, 1); else ATTEND(1, 1);
                } else {
                    if (nr == 3) ATTEND(3, 0); else if (nr == 2) ATTEND(2, 0); else ATTEND(1, 0);
                }
#undef ATTEND
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------------------------
 * RMS norm of each row: out[m, :] = x[m, :] / sqrt(mean(x[m, :]^2) + eps) * w, the sum of squares
 * taken in one fixed order per row. x, out [M, D] contiguous floats; w [D].
 */
static inline void rms_norm_row(const float *xr, int64_t D, const float *w, float eps, float *o) {
    const float inv = 1.0f / sqrtf(dot_row(xr, xr, D) / (float)D + eps);  /* every xr[c] read before o[c] is written */
    int64_t c = 0;
    const __m256 iv = _mm256_set1_ps(inv);
    for (; c + 8 <= D; c += 8)
        _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + c), iv), _mm256_loadu_ps(w + c)));
    for (; c < D; ++c) o[c] = xr[c] * inv * w[c];
}

void specdist_rms_norm(const float *x, int64_t M, int64_t D, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static) if (M * D >= PARALLEL_MIN_WEIGHTS)
    for (int64_t m = 0; m < M; ++m) rms_norm_row(x + m * D, D, w, eps, out + m * D);
}

/* ---------------------------------------------------------------------------------------------
 * One attention layer's cache work and attention in one call: rotary embedding (the HF models'
 * half rotation over the whole head: r = x * cos + [-x2, x1] * sin) of the new keys and queries,
 * the new keys and values written into the cache at their positions, then specdist_attention's
 * rows. q [B, T, Hq, hd], k and v [B, T, Hkv, hd]: strided views (token stride qs_t / ks_t / vs_t,
 * request stride *_b, heads contiguous rows of hd); cos, sin [B, T, hd] contiguous; write_pos [B, T]
 * (padded tokens write the scratch column). A float16 cache (kv16) stores each key and value rounded to
 * nearest even. Returns 0, -1 without memory, or BAD_INDEX (nothing written) for a slot or position outside the cache.
 */
static inline void rotate_row(const float *x, const float *c, const float *s, int64_t hd, float *out) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] - x[i + half] * s[i];
    for (int64_t i = half; i < hd; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

/* hd floats into a cache row: copied, or rounded to float16 (nearest even). */
static void store_kv(const float *x, int64_t hd, void *dst, int kv16) {
    if (!kv16) {
        memcpy(dst, x, sizeof(float) * (size_t)hd);
        return;
    }
    uint16_t *d = (uint16_t *)dst;
    int64_t i = 0;
    for (; i + 8 <= hd; i += 8)
        _mm_storeu_si128((__m128i *)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < hd; ++i) d[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

int specdist_rope_attention(const float *q, const float *k, const float *v, int64_t B, int64_t T, int64_t Hq,
                            int64_t Hkv, int64_t hd, int64_t qs_b, int64_t qs_t, int64_t ks_b, int64_t ks_t,
                            int64_t vs_b, int64_t vs_t, const float *cos_t, const float *sin_t,
                            void *k_cache, void *v_cache, int kv16, int64_t S, int64_t L1, const int64_t *slots,
                            const int64_t *write_pos, const int64_t *qpos, int64_t window, float scale,
                            float softcap, float *out) {
    if (indices_outside(B, T, S, L1, slots, write_pos) || indices_outside(B, T, S, L1, slots, qpos)) return BAD_INDEX;
    /* rotated queries [B, T, Hq, hd], then one rotated key row */
    float *qr = (float *)malloc(sizeof(float) * (size_t)((B * T * Hq + 1) * hd));
    if (!qr) return -1;
    float *kr = qr + B * T * Hq * hd;
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) {
            const float *c = cos_t + (b * T + t) * hd, *s = sin_t + (b * T + t) * hd;
            const int64_t pos = write_pos[b * T + t];
            for (int64_t h = 0; h < Hkv; ++h) {
                const int64_t row = (slots[b] * Hkv + h) * L1 + pos;
                void *krow = (void *)kv_row(k_cache, row, hd, kv16);
                if (kv16) {  /* rotated in float32, then rounded into the row */
                    rotate_row(k + b * ks_b + t * ks_t + h * hd, c, s, hd, kr);
                    store_kv(kr, hd, krow, 1);
                } else {
                    rotate_row(k + b * ks_b + t * ks_t + h * hd, c, s, hd, (float *)krow);
                }
                store_kv(v + b * vs_b + t * vs_t + h * hd, hd, (void *)kv_row(v_cache, row, hd, kv16), kv16);
            }
        }
    for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t)
            for (int64_t h = 0; h < Hq; ++h)
                rotate_row(q + b * qs_b + t * qs_t + h * hd, cos_t + (b * T + t) * hd, sin_t + (b * T + t) * hd, hd,
                           qr + ((b * T + t) * Hq + h) * hd);
    const int rc = specdist_attention(qr, B, Hq, T, hd, T * Hq * hd, hd, Hq * hd, k_cache, v_cache, kv16, Hkv, S, L1,
                                      slots, qpos, window, scale, softcap, out);
    free(qr);
    return rc;
}

/* ---------------------------------------------------------------------------------------------
 * One Llama-style decoder layer on blocks in one call, in place on h [M, D] (M = B * T rows):
 *   x = rms_norm(h) (norm1);  q, k, v = x @ Wqkv.T;  [q, k = each head rms_norm'd (q_norm, k_norm: Qwen3)];
 *   a = specdist_rope_attention(q, k, v);  h += a @ Wo.T;
 *   x = rms_norm(h) (norm2);  g, u = x @ Wgu.T;  h += (silu(g) * u) @ Wdown.T
 * with silu(g) = g / (1 + e^-g). Each matmul is one of the block kernels or a dense one (float32, bfloat16 or
 * float16 weights) by its weight's kind (specdist_block_mm's), plus its bias if any, so a row's result is computed
 * as the layer-by-layer calls compute it, alone, whatever the rows around it. The call replaces about ten
 * Python-level operations a layer, over a third of a batch-1 forward's time.
 * lin[6]: Wq, Wk, Wv, Wo [D, Hq hd], Wgu [2 I, D], Wdown [D, I] (n = rows): Wq [Hq hd, D] and so on, or Wq the fused
 * Wqkv [(Hq + 2 Hkv) hd, D] with Wk, Wv of n = 0 (separate ones where their kinds differ: a Q4_K_M file's Q6_K
 * value projection beside Q4_K queries and keys).
 * scratch: M * (2 D + (Hq + 2 Hkv) hd + Hq hd + 3 I) floats, and M * Hq hd more with separate q, k, v. The cache
 * arguments are specdist_rope_attention's.
 * part: LAYER_WHOLE; or (a tensor-parallel rank, whose o and down projections hold its input columns) LAYER_ATTENTION,
 * which stops with the o projection's partial output in scratch [M (D + (Hq + 2 Hkv) hd + Hq hd), + M D), h
 * untouched, and LAYER_MLP, which runs the rest from h (the caller has added the summed partials) and stops with the
 * down projection's partial output there.
 * Returns 0, -1 without memory, or BAD_INDEX (h untouched) for a slot or position outside the cache.
 */
typedef struct {
    const void *codes;   /* pack_q4 / q5 / q6 / q7 / q8 / q2 codes, or the dense weight [n, K] (float32, bfloat16, float16) */
    const void *scales;  /* the blocks' scales (NULL for dense weights) */
    int64_t n;           /* output rows */
    int64_t kind;        /* LIN_Q4, LIN_Q8, LIN_F32, LIN_BF16, LIN_F16, LIN_Q6_16, LIN_Q5, LIN_Q4_16, LIN_Q2M_16,
                          * LIN_IQ4 or LIN_Q7_16; a block kind may carry LIN_HALF_SCALES (float16 scales) or LIN_SUPER_SCALES (K-quant
                          * super-block scales) */
    const float *bias;   /* [n] added to every output row (Qwen2's q/k/v), or NULL */
} block_linear;


static void add_rows(float *h, const float *a, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(h + i, _mm256_add_ps(_mm256_loadu_ps(h + i), _mm256_loadu_ps(a + i)));
    for (; i < n; ++i) h[i] += a[i];
}

/* y [M, n] = x [M, K] @ W.T (+ bias: one float32 add an element, as torch's y + b after the matmul). */
static int block_mm(const block_linear *w, const float *x, int64_t M, int64_t K, float *y) {
    int rc;
    const int mode = w->kind & LIN_HALF_SCALES ? SCALES_F16 : w->kind & LIN_SUPER_SCALES ? SCALES_SUPER : SCALES_F32;
    switch (w->kind & ~(LIN_HALF_SCALES | LIN_SUPER_SCALES)) {
    case LIN_Q8: rc = matmul_q8(x, M, K, (const int8_t *)w->codes, w->scales, mode, w->n, y); break;
    case LIN_Q6_16: rc = matmul_q6_16(x, M, K, (const uint8_t *)w->codes, w->scales, mode, w->n, y); break;
    case LIN_Q5: rc = matmul_q5(x, M, K, (const uint8_t *)w->codes, w->scales, mode, w->n, y); break;
    case LIN_Q4_16: rc = matmul_q4_16(x, M, K, (const uint8_t *)w->codes, w->scales, mode, w->n, y); break;
    case LIN_Q2M_16: rc = matmul_q2m_16(x, M, K, (const uint8_t *)w->codes, w->scales, mode, w->n, y); break;
    case LIN_Q7_16: rc = matmul_q7_16(x, M, K, (const uint8_t *)w->codes, w->scales, mode, w->n, y); break;
    case LIN_IQ4: rc = matmul_iq4(x, M, K, (const uint8_t *)w->codes, w->scales, mode, w->n, y); break;
    case LIN_F32: rc = specdist_f32_mm(x, M, K, (const float *)w->codes, w->n, y); break;
    case LIN_BF16: rc = specdist_bf16_mm(x, M, K, (const uint16_t *)w->codes, w->n, y); break;
    case LIN_F16: rc = specdist_f16_mm(x, M, K, (const uint16_t *)w->codes, w->n, y); break;
    default: rc = matmul_q4(x, M, K, (const uint8_t *)w->codes, w->scales, mode, w->n, y); break;
    }
    if (rc == 0 && w->bias != NULL)
        for (int64_t m = 0; m < M; ++m) add_rows(y + m * w->n, w->bias, w->n);
    return rc;
}

/* y [M, N] = x [M, K] @ W.T for a block-quantized W (codes and scales as the kind's function above takes them;
 * kind: a block kind with its scales' flag). Returns 0, -1 without memory, -2 for super-block scales of a K that is not
 * a multiple of 256. */
int specdist_block_mm(const float *x, int64_t M, int64_t K, const void *codes, const void *scales, int64_t kind,
                      int64_t N, float *y) {
    const block_linear w = {codes, scales, N, kind, NULL};
    return block_mm(&w, x, M, K, y);
}

/* y [M, sum n] = x [M, K] @ [W0; W1; ...].T for the parts of one matmul (n = 0 ends them): a single part straight
 * into y, several each into tmp [M, n] and then beside one another in y's rows. */
static int parts_mm(const block_linear *w, int parts, const float *x, int64_t M, int64_t K, float *y, float *tmp) {
    int64_t width = 0;
    for (int i = 0; i < parts && w[i].n > 0; ++i) width += w[i].n;
    if (parts == 1 || w[1].n == 0) return block_mm(w, x, M, K, y);
    for (int64_t i = 0, col = 0; i < parts && w[i].n > 0; col += w[i].n, ++i) {
        if (block_mm(&w[i], x, M, K, tmp)) return -1;
        for (int64_t m = 0; m < M; ++m) memcpy(y + m * width + col, tmp + m * w[i].n, sizeof(float) * (size_t)w[i].n);
    }
    return 0;
}

/* act[m, i] = silu(gu[m, i]) * gu[m, I + i]; e^-g from exp8 with -g capped at 88 (e^88 is finite: silu of a
 * very negative g is then -0 or a denormal, as it should be). */
static void silu_mul(const float *gu, int64_t M, int64_t I, float *act) {
#pragma omp parallel for schedule(static) if (M * I >= PARALLEL_MIN_WEIGHTS)
    for (int64_t m = 0; m < M; ++m) {
        const float *g = gu + m * 2 * I, *u = g + I;
        float *o = act + m * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_sub_ps(_mm256_setzero_ps(), gv)));
            const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; ++i) {
            const float ng = -g[i] < 88.0f ? -g[i] : 88.0f;
            o[i] = g[i] / (1.0f + expf(ng)) * u[i];
        }
    }
}

int specdist_decoder_layer(float *h, int64_t B, int64_t T, int64_t D, const float *norm1, const float *norm2,
                         float eps, const float *q_norm, const float *k_norm, float qk_eps,
                         const block_linear *lin, int64_t Hq, int64_t Hkv, int64_t hd,
                         const float *cos_t, const float *sin_t, void *k_cache, void *v_cache, int kv16, int64_t S,
                         int64_t L1, const int64_t *slots, const int64_t *write_pos, const int64_t *qpos, int64_t window,
                         float scale, float softcap, float *scratch, int part) {
    const int64_t M = B * T, nq = Hq * hd, nqkv = lin[0].n + lin[1].n + lin[2].n, I = lin[4].n / 2;
    float *x = scratch, *qkv = x + M * D, *a = qkv + M * nqkv, *p = a + M * nq, *gu = p + M * D, *act = gu + M * 2 * I;
    float *tmp = act + M * I;  /* a part of q, k, v where they are separate (at most Hq hd columns) */
    if (part == LAYER_MLP) goto mlp;
    specdist_rms_norm(h, M, D, norm1, eps, x);
    if (parts_mm(lin, 3, x, M, D, qkv, tmp)) return -1;
    if (q_norm != NULL)  /* each head's query and key RMS-normed over hd before the rotation (Qwen3) */
        for (int64_t m = 0; m < M; ++m) {
            float *row = qkv + m * nqkv;
            for (int64_t j = 0; j < Hq; ++j) rms_norm_row(row + j * hd, hd, q_norm, qk_eps, row + j * hd);
            for (int64_t j = 0; j < Hkv; ++j) rms_norm_row(row + nq + j * hd, hd, k_norm, qk_eps, row + nq + j * hd);
        }
    const int rc = specdist_rope_attention(qkv, qkv + nq, qkv + nq + Hkv * hd, B, T, Hq, Hkv, hd, T * nqkv, nqkv,
                                           T * nqkv, nqkv, T * nqkv, nqkv, cos_t, sin_t, k_cache, v_cache, kv16, S, L1,
                                           slots, write_pos, qpos, window, scale, softcap, a);
    if (rc) return rc;
    if (block_mm(&lin[3], a, M, nq, p)) return -1;
    if (part == LAYER_ATTENTION) return 0;
    add_rows(h, p, M * D);
mlp:
    specdist_rms_norm(h, M, D, norm2, eps, x);
    if (block_mm(&lin[4], x, M, D, gu)) return -1;
    silu_mul(gu, M, I, act);
    if (block_mm(&lin[5], act, M, I, p)) return -1;
    if (part == LAYER_MLP) return 0;
    add_rows(h, p, M * D);
    return 0;
}
