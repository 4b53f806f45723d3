/* 4-bit products for draft models: y = x @ W^T + bias with W in 4 bits, one step and one
midpoint per 32 inputs of an output row, and each row of x quantized to 8 bits by its own
range at each call (as int8.c). A draft step's cost is the bytes of weights it reads; 4-bit
weights with their fp16 steps and midpoints read 0.625 bytes a weight against int8's 1.

Weights: W[n][c] ~ a[n][g] * (q[n][c] - 8) + b[n][g], q in 0 .. 15, g = c / 32 (GROUP_SIZE):
b is the group's midpoint, so the weights the inputs meet, q - 8, are centred (an input's
rounding error then meets weights of both signs, as in int8.c, rather than all positive
ones, which made every such error count). With AVX512-VNNI, vpdpbusd multiplies 4 u8
inputs by 4 s8 weights for 16 output rows at once, so q is stored interleaved as int8.c
stores its weights, two 4-input steps per 64-byte vector (low and high nibbles), and each
(block of 16 rows, group) is one record:

    record[block][g] = 4 x 64 bytes of nibbles (q), then a[16] and b[16] as fp16 (320 bytes)
    nibble byte jj * 64 + r * 4 + t: low = q[16 block + r][32 g + 8 jj + t],
                                      high = q[16 block + r][32 g + 8 jj + 4 + t]

Inputs: x[m] ~ low[m] + step[m] * u, u in 0 .. 255. Then for output row o,
x[m] . W[o] = step[m] * sum_g a[o][g] * S[m][o][g] + low[m] * C[o] + sum_g b[o][g] * X[m][g]
with S = sum over the group of u * (q - 8) (int32, exact), C[o] = sum_g a[o][g] * sum over
the group of (q - 8) (given), X[m][g] = the sum of x[m] over group g (float, from x itself).
The kernel multiplies q as stored and takes 8 * (the group's sum of u) back out of the
int32 sum: the same S, two operations a weight vector fewer.

A pass over a tile's weights serves 2 input rows (tiles of 4 blocks) when the call has 1 or
2 rows, else 4 (tiles of 2 blocks), so a draft tree's 4-row step unpacks each weight vector
once, not twice. Each output's float operations are the same in either shape, so a row's
result does not depend on the rows beside it.

x [m, k] float32 or bfloat16, contiguous, k a multiple of 32; records as above for
ceil(n / 16) blocks (rows past n zero); C [ceil(n/16) * 16]; bias [n] or NULL; y [m, n] in
x's dtype. Returns 0; 1 when out of memory, 2 without VNNI.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int specmtp_int4_vnni(void) {
#ifdef __AVX512VNNI__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512VNNI__
#include <immintrin.h>

#define BLOCK 16
#define GROUP_SIZE 32
#define RECORD 320 /* bytes of a (block, group) record */
/* Rows of x a pass over a tile's weights serves, and the blocks side by side in a tile:
with one or two rows 4 blocks (8 int and 8 float sums in registers), with more 2 blocks and
4 rows (again 8 and 8), so that a row pass unpacks each weight vector for 4 rows, not 2. */
#define NARROW_ROWS 2
#define NARROW_TILE 4
#define WIDE_ROWS 4
#define WIDE_TILE 2
#define MOST 4 /* the most rows or blocks of either shape */

/* 16 inputs from x[i ..] as floats. */
static inline __m512 inputs16(const void *x, int bf16, int64_t i) {
    if (!bf16)
        return _mm512_loadu_ps((const float *)x + i);
    __m256i halves = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

/* y[row][o0 .. o0 + count) = step * sums + low * C + bias for the 16 sums at `sums`,
rounded to bfloat16 (to nearest, ties to even) where y is. */
static inline void store16(void *y, int bf16, int64_t at, int count, __m512 sums, float step,
                           float low, const float *qsums, const float *bias) {
    __mmask16 mask = (__mmask16)(count >= 16 ? 0xFFFF : (1u << count) - 1u);
    __m512 dot = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(step), sums),
                               _mm512_mul_ps(_mm512_set1_ps(low), _mm512_maskz_loadu_ps(mask, qsums)));
    if (bias)
        dot = _mm512_add_ps(dot, _mm512_maskz_loadu_ps(mask, bias));
    if (!bf16) {
        _mm512_mask_storeu_ps((float *)y + at, mask, dot);
        return;
    }
    __m512i bits = _mm512_castps_si512(dot);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    _mm256_mask_storeu_epi16((uint16_t *)y + at, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}

/* Row i of x as u8 with its low and step (as int8.c's), and per group its sum over step
and the sum of its u. */
static void quantize_row(const void *x, int bf16, int64_t i, int64_t k, uint8_t *u, float *low,
                         float *step, float *group_sums, int32_t *u_sums) {
    const void *row = bf16 ? (const void *)((const uint16_t *)x + i * k)
                           : (const void *)((const float *)x + i * k);
    __m512 lo16 = _mm512_set1_ps(INFINITY), hi16 = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < k; c += 16) {
        __m512 v = inputs16(row, bf16, c);
        lo16 = _mm512_min_ps(lo16, v);
        hi16 = _mm512_max_ps(hi16, v);
    }
    float lo = _mm512_reduce_min_ps(lo16), hi = _mm512_reduce_max_ps(hi16);
    float s = (hi - lo) / 255.0f;
    if (!(s > 0.0f))
        s = 1.0f;
    const __m512 low16 = _mm512_set1_ps(lo), step16 = _mm512_set1_ps(s);
    const __m512 zero = _mm512_setzero_ps(), most = _mm512_set1_ps(255.0f);
    for (int64_t g = 0; g < k / GROUP_SIZE; g++) {
        __m512 sum = zero;
        __m512i count = _mm512_setzero_si512();
        for (int half = 0; half < 2; half++) {
            int64_t c = g * GROUP_SIZE + half * 16;
            __m512 v = inputs16(row, bf16, c);
            __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_sub_ps(v, low16), step16),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            __m512i whole = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, zero), most));
            _mm_storeu_si128((__m128i *)(u + c), _mm512_cvtepi32_epi8(whole));
            count = _mm512_add_epi32(count, whole);
            sum = _mm512_add_ps(sum, v);
        }
        group_sums[g] = _mm512_reduce_add_ps(sum) / s; /* X / step: tile_sums adds it inside */
        u_sums[g] = _mm512_reduce_add_epi32(count);
    }
    *low = lo;
    *step = s;
}

/* For `width` blocks from `records` and `rows` input rows: sums[b][i][r] = sum_g a * S + b * X / step, so that step * sums is the dot product less
low * C. The nibbles q (0 .. 15) are multiplied as they are, and S = sum u * q - 8 * sum u.
Constants after inlining, so the sums stay in registers. */
static inline __attribute__((always_inline)) void tile_sums(const uint8_t *u, int64_t k,
                                                            const float *group_sums,
                                                            const int32_t *u_sums,
                                                            const uint8_t *records, int rows,
                                                            int width, float *sums) {
    int64_t groups = k / GROUP_SIZE;
    __m512 scaled[MOST][MOST];
    for (int b = 0; b < width; b++)
        for (int i = 0; i < rows; i++)
            scaled[b][i] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[MOST][MOST];
        for (int b = 0; b < width; b++)
            for (int i = 0; i < rows; i++)
                acc[b][i] = _mm512_setzero_si512();
        for (int jj = 0; jj < 4; jj++) {
            __m512i first[MOST], second[MOST];
            for (int i = 0; i < rows; i++) {
                const uint8_t *at = u + i * k + g * GROUP_SIZE + jj * 8;
                int32_t four[2];
                memcpy(four, at, sizeof four);
                first[i] = _mm512_set1_epi32(four[0]);
                second[i] = _mm512_set1_epi32(four[1]);
            }
            for (int b = 0; b < width; b++) {
                __m512i v = _mm512_loadu_si512(
                    (const void *)(records + (b * groups + g) * RECORD + jj * 64));
                __m512i lo = _mm512_and_si512(v, nibble);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                for (int i = 0; i < rows; i++) {
                    acc[b][i] = _mm512_dpbusd_epi32(acc[b][i], first[i], lo);
                    acc[b][i] = _mm512_dpbusd_epi32(acc[b][i], second[i], hi);
                }
            }
        }
        for (int b = 0; b < width; b++) {
            const uint8_t *scales = records + (b * groups + g) * RECORD + 256;
            __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
            __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32)));
            for (int i = 0; i < rows; i++) {
                __m512i exact = _mm512_sub_epi32(acc[b][i], _mm512_set1_epi32(8 * u_sums[i * groups + g]));
                __m512 x = _mm512_set1_ps(group_sums[i * groups + g]);
                scaled[b][i] = _mm512_fmadd_ps(x, m, scaled[b][i]);
                scaled[b][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), a, scaled[b][i]);
            }
        }
    }
    for (int b = 0; b < width; b++)
        for (int i = 0; i < rows; i++)
            _mm512_storeu_ps(sums + (b * MOST + i) * BLOCK, scaled[b][i]);
}

#define ROWS_CASE(width, rows)                                                            \
    case rows:                                                                           \
        tile_sums(u, k, group_sums, u_sums, records, rows, width, sums);                 \
        break;
#define NARROW_CASE(width)                                                                \
    case width:                                                                          \
        switch (rows) {                                                                  \
            ROWS_CASE(width, 1)                                                          \
            ROWS_CASE(width, 2)                                                          \
        }                                                                                \
        break;
#define WIDE_CASE(width)                                                                  \
    case width:                                                                          \
        switch (rows) {                                                                  \
            ROWS_CASE(width, 1)                                                          \
            ROWS_CASE(width, 2)                                                          \
            ROWS_CASE(width, 3)                                                          \
            ROWS_CASE(width, 4)                                                          \
        }                                                                                \
        break;

/* tile_sums with its rows and width as constants: a narrow tile's (1 .. 4 blocks, 1 .. 2
rows) or a wide pass's (1 .. 2 blocks, 1 .. 4 rows). */
static void sums_of(const uint8_t *u, int64_t k, const float *group_sums,
                    const int32_t *u_sums, const uint8_t *records, int wide, int rows,
                    int width, float *sums) {
    if (wide) {
        switch (width) {
            WIDE_CASE(1)
            WIDE_CASE(2)
        }
        return;
    }
    switch (width) {
        NARROW_CASE(1)
        NARROW_CASE(2)
        NARROW_CASE(3)
        NARROW_CASE(4)
    }
}

int specmtp_int4_linear(const void *x, int bf16, int64_t m, int64_t k, const uint8_t *records,
                        int64_t n, const float *qsums, const float *bias, void *y, int threads) {
    int64_t groups = k / GROUP_SIZE, blocks = (n + BLOCK - 1) / BLOCK;
    int wide = m > NARROW_ROWS;
    int64_t tile = wide ? WIDE_TILE : NARROW_TILE, pass = wide ? WIDE_ROWS : NARROW_ROWS;
    int64_t tiles = (blocks + tile - 1) / tile;
    uint8_t *u = aligned_alloc(64, (size_t)((m * k + 63) / 64 * 64));
    float *low = malloc(sizeof(float) * (size_t)m), *step = malloc(sizeof(float) * (size_t)m);
    float *group_sums = malloc(sizeof(float) * (size_t)(m * groups));
    int32_t *u_sums = malloc(sizeof(int32_t) * (size_t)(m * groups));
    if (!u || !low || !step || !group_sums || !u_sums) {
        free(u), free(low), free(step), free(group_sums), free(u_sums);
        return 1;
    }
    for (int64_t i = 0; i < m; i++)
        quantize_row(x, bf16, i, k, u + i * k, low + i, step + i, group_sums + i * groups,
                     u_sums + i * groups);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        float sums[MOST * MOST * BLOCK];
        int width = blocks - t * tile < tile ? (int)(blocks - t * tile) : (int)tile;
        for (int64_t i0 = 0; i0 < m; i0 += pass) {
            int rows = m - i0 < pass ? (int)(m - i0) : (int)pass;
            sums_of(u + i0 * k, k, group_sums + i0 * groups, u_sums + i0 * groups,
                    records + t * tile * groups * RECORD, wide, rows, width, sums);
            for (int b = 0; b < width; b++) {
                int64_t o = (t * tile + b) * BLOCK;
                int count = n - o < BLOCK ? (int)(n - o) : BLOCK;
                for (int i = 0; i < rows; i++) {
                    int64_t row = i0 + i;
                    store16(y, bf16, row * n + o, count, _mm512_loadu_ps(sums + (b * MOST + i) * BLOCK),
                            step[row], low[row], qsums + o, bias ? bias + o : NULL);
                }
            }
        }
    }
    free(u), free(low), free(step), free(group_sums), free(u_sums);
    return 0;
}

#else

int specmtp_int4_linear(const void *x, int bf16, int64_t m, int64_t k, const uint8_t *records,
                        int64_t n, const float *qsums, const float *bias, void *y, int threads) {
    (void)x, (void)bf16, (void)m, (void)k, (void)records, (void)n, (void)qsums, (void)bias;
    (void)y, (void)threads;
    return 2;
}

#endif
