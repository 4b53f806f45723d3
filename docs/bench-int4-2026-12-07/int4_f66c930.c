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
#define ROWS 2 /* input rows per pass over a tile's weights */
#define TILE 4 /* blocks side by side: 4 x 2 int sums and 4 x 2 float sums in registers */

static float input(const void *x, int bf16, int64_t i) {
    if (!bf16)
        return ((const float *)x)[i];
    uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static void store(void *y, int bf16, int64_t i, float value) {
    if (!bf16) {
        ((float *)y)[i] = value;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    ((uint16_t *)y)[i] = (uint16_t)(bits >> 16);
}

/* Row i of x as u8 with its low and step (as int8.c's), and its sums per group over step. */
static void quantize_row(const void *x, int bf16, int64_t i, int64_t k, uint8_t *u, float *low,
                         float *step, float *group_sums) {
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t c = 0; c < k; c++) {
        float v = input(x, bf16, i * k + c);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    float s = (hi - lo) / 255.0f;
    if (!(s > 0.0f))
        s = 1.0f;
    for (int64_t g = 0; g < k / GROUP_SIZE; g++) {
        float sum = 0.0f;
        for (int64_t c = g * GROUP_SIZE; c < (g + 1) * GROUP_SIZE; c++) {
            float v = input(x, bf16, i * k + c);
            float q = rintf((v - lo) / s);
            u[c] = (uint8_t)(q < 0.0f ? 0.0f : (q > 255.0f ? 255.0f : q));
            sum += v;
        }
        group_sums[g] = sum / s; /* X / step: tile_sums adds it inside the step's product */
    }
    *low = lo;
    *step = s;
}

/* For `width` blocks from `records` and `rows` input rows: sums[b][i][r] = sum_g a * S +
b * X / step, so that step * sums is the dot product less low * C. Constants after
inlining, so the sums stay in registers. */
static inline __attribute__((always_inline)) void tile_sums(const uint8_t *u, int64_t k,
                                                            const float *group_sums,
                                                            const uint8_t *records, int rows,
                                                            int width, float *sums) {
    int64_t groups = k / GROUP_SIZE;
    __m512 scaled[TILE][ROWS];
    for (int b = 0; b < width; b++)
        for (int i = 0; i < rows; i++)
            scaled[b][i] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    for (int64_t g = 0; g < groups; g++) {
        __m512i acc[TILE][ROWS];
        for (int b = 0; b < width; b++)
            for (int i = 0; i < rows; i++)
                acc[b][i] = _mm512_setzero_si512();
        for (int jj = 0; jj < 4; jj++) {
            int32_t first[ROWS], second[ROWS];
            for (int i = 0; i < rows; i++) {
                const uint8_t *at = u + i * k + g * GROUP_SIZE + jj * 8;
                memcpy(first + i, at, sizeof first[i]);
                memcpy(second + i, at + 4, sizeof second[i]);
            }
            for (int b = 0; b < width; b++) {
                __m512i v = _mm512_loadu_si512(
                    (const void *)(records + (b * groups + g) * RECORD + jj * 64));
                __m512i lo = _mm512_sub_epi8(_mm512_and_si512(v, nibble), eight);
                __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), eight);
                for (int i = 0; i < rows; i++) {
                    acc[b][i] = _mm512_dpbusd_epi32(acc[b][i], _mm512_set1_epi32(first[i]), lo);
                    acc[b][i] = _mm512_dpbusd_epi32(acc[b][i], _mm512_set1_epi32(second[i]), hi);
                }
            }
        }
        for (int b = 0; b < width; b++) {
            const uint8_t *scales = records + (b * groups + g) * RECORD + 256;
            __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
            __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 32)));
            for (int i = 0; i < rows; i++) {
                __m512 x = _mm512_set1_ps(group_sums[i * groups + g]);
                scaled[b][i] = _mm512_fmadd_ps(x, m, scaled[b][i]);
                scaled[b][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[b][i]), a, scaled[b][i]);
            }
        }
    }
    for (int b = 0; b < width; b++)
        for (int i = 0; i < rows; i++)
            _mm512_storeu_ps(sums + (b * ROWS + i) * BLOCK, scaled[b][i]);
}

#define ROWS_CASE(width, rows)                                                            \
    case rows:                                                                           \
        tile_sums(u, k, group_sums, records, rows, width, sums);                         \
        break;
#define WIDTH_CASE(width)                                                                 \
    case width:                                                                          \
        switch (rows) {                                                                  \
            ROWS_CASE(width, 1)                                                          \
            ROWS_CASE(width, 2)                                                          \
        }                                                                                \
        break;

static void sums_of(const uint8_t *u, int64_t k, const float *group_sums,
                    const uint8_t *records, int rows, int width, float *sums) {
    switch (width) {
        WIDTH_CASE(1)
        WIDTH_CASE(2)
        WIDTH_CASE(3)
        WIDTH_CASE(4)
    }
}

int specmtp_int4_linear(const void *x, int bf16, int64_t m, int64_t k, const uint8_t *records,
                        int64_t n, const float *qsums, const float *bias, void *y, int threads) {
    int64_t groups = k / GROUP_SIZE, blocks = (n + BLOCK - 1) / BLOCK;
    int64_t tiles = (blocks + TILE - 1) / TILE;
    uint8_t *u = aligned_alloc(64, (size_t)((m * k + 63) / 64 * 64));
    float *low = malloc(sizeof(float) * (size_t)m), *step = malloc(sizeof(float) * (size_t)m);
    float *group_sums = malloc(sizeof(float) * (size_t)(m * groups));
    if (!u || !low || !step || !group_sums) {
        free(u), free(low), free(step), free(group_sums);
        return 1;
    }
    for (int64_t i = 0; i < m; i++)
        quantize_row(x, bf16, i, k, u + i * k, low + i, step + i, group_sums + i * groups);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        float sums[TILE * ROWS * BLOCK];
        int width = blocks - t * TILE < TILE ? (int)(blocks - t * TILE) : TILE;
        for (int64_t i0 = 0; i0 < m; i0 += ROWS) {
            int rows = m - i0 < ROWS ? (int)(m - i0) : ROWS;
            sums_of(u + i0 * k, k, group_sums + i0 * groups,
                    records + t * TILE * groups * RECORD, rows, width, sums);
            for (int b = 0; b < width; b++)
                for (int i = 0; i < rows; i++)
                    for (int r = 0; r < BLOCK; r++) {
                        int64_t o = (t * TILE + b) * BLOCK + r, row = i0 + i;
                        if (o >= n)
                            break;
                        int64_t at = (b * ROWS + i) * BLOCK + r;
                        float dot = step[row] * sums[at] + low[row] * qsums[o];
                        store(y, bf16, row * n + o, dot + (bias ? bias[o] : 0.0f));
                    }
        }
    }
    free(u), free(low), free(step), free(group_sums);
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
