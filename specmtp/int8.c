/* int8 products for drafters: y = x @ W^T + b with W in int8 (one scale per output row)
and each row of x quantized to 8 bits by its own range, at each call.

specmtp/native.py compiles this file; specmtp/int8.py calls it. A draft step multiplies a
few rows by every weight matrix of the draft, so its cost is the bytes of weights read: the
kernel streams them once for all rows and keeps the rows in L1. With AVX512-VNNI, one
vpdpbusd multiplies 4 u8 inputs by 4 s8 weights for 16 output rows at once and adds the
four products to 16 int32 sums, so W is stored interleaved for it:

    packed[block][j][r][t] = W[16 * block + r][4 * j + t]    (r < 16, t < 4)

one 64-byte load per 4 inputs of 16 rows; a row's input bytes x[4j .. 4j+3] are broadcast
to the 16 lanes. Compiled without VNNI, the kernel takes nothing (returns 2) and int8.py
uses fbgemm's product.

Input rows: x[m] ~ low[m] + step[m] * u with u in 0 .. 255 (u8), low the row's minimum and
step its range / 255, so a row's output does not depend on the other rows of the call.
Then x[m] . (scale[n] * W[n]) = scale[n] * (step[m] * sum(u * W[n]) + low[m] * wsum[n]),
wsum[n] = sum(W[n]): int32 sums, exact; float after.

x [m, k] float32 or bfloat16, contiguous; packed [ceil(n/16)][kp/4][16][4] int8, kp = k
rounded up to 4 (zero padding); scale, wsum [ceil(n/16) * 16] (zero padding); bias [n] or
NULL; y [m, n], the dtype of x (bfloat16 rounded to nearest even). Returns 0; 1 when out of
memory, 2 without VNNI. Rows of output blocks are shared among `threads` OpenMP threads.
*/
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 1 where this build has the kernel (the compiler targets AVX512-VNNI), else 0. */
int specmtp_int8_vnni(void) {
#ifdef __AVX512VNNI__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512VNNI__
#include <immintrin.h>

#define BLOCK 16 /* output rows per block: one int32 vector */
#define GROUP 4  /* input rows summed per pass over a tile's weights */
#define TILE 4   /* blocks summed side by side: 16 sums in registers, each input broadcast
                    feeding 4 products (4 rows of 4864 x 896 in cache: 0.25 -> 0.19 ms
                    against one block at a time) */

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

/* Row i of x as u8 (kp bytes, padding 0) with its low and step. */
static void quantize_row(const void *x, int bf16, int64_t i, int64_t k, int64_t kp,
                         uint8_t *u, float *low, float *step) {
    float lo = INFINITY, hi = -INFINITY;
    for (int64_t c = 0; c < k; c++) {
        float v = input(x, bf16, i * k + c);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    float s = (hi - lo) / 255.0f;
    if (!(s > 0.0f))
        s = 1.0f; /* a constant row: every u is 0 */
    for (int64_t c = 0; c < k; c++) {
        float q = rintf((input(x, bf16, i * k + c) - lo) / s);
        u[c] = (uint8_t)(q < 0.0f ? 0.0f : (q > 255.0f ? 255.0f : q));
    }
    memset(u + k, 0, (size_t)(kp - k));
    *low = lo;
    *step = s;
}

/* sums[w][i][r] = sum over j, t of u[i][4j + t] * packed[w][j][r][t] for `rows` input rows
and `width` blocks side by side (constants after inlining, so the sums stay in registers:
each broadcast input feeds `width` products). */
static inline __attribute__((always_inline)) void tile_sums(const uint8_t *u, int64_t kp,
                                                            const int8_t *packed, int rows,
                                                            int width, int32_t *sums) {
    __m512i acc[TILE][GROUP];
    for (int b = 0; b < width; b++)
        for (int i = 0; i < rows; i++)
            acc[b][i] = _mm512_setzero_si512();
    for (int64_t c = 0; c < kp; c += 4) {
        __m512i w[TILE];
        for (int b = 0; b < width; b++)
            w[b] = _mm512_loadu_si512((const void *)(packed + (b * kp + c) * BLOCK));
        for (int i = 0; i < rows; i++) {
            int32_t four;
            memcpy(&four, u + i * kp + c, sizeof four);
            __m512i input = _mm512_set1_epi32(four);
            for (int b = 0; b < width; b++)
                acc[b][i] = _mm512_dpbusd_epi32(acc[b][i], input, w[b]);
        }
    }
    for (int b = 0; b < width; b++)
        for (int i = 0; i < rows; i++)
            _mm512_storeu_si512((void *)(sums + (b * GROUP + i) * BLOCK), acc[b][i]);
}

#define ROWS_CASE(width, rows)                                                            \
    case rows:                                                                           \
        tile_sums(u, kp, packed, rows, width, sums);                                     \
        break;
#define WIDTH_CASE(width)                                                                 \
    case width:                                                                          \
        switch (rows) {                                                                  \
            ROWS_CASE(width, 1)                                                          \
            ROWS_CASE(width, 2)                                                          \
            ROWS_CASE(width, 3)                                                          \
            ROWS_CASE(width, 4)                                                          \
        }                                                                                \
        break;

/* tile_sums with rows (1 .. GROUP) and width (1 .. TILE) as constants. */
static void sums_of(const uint8_t *u, int64_t kp, const int8_t *packed, int rows, int width,
                    int32_t *sums) {
    switch (width) {
        WIDTH_CASE(1)
        WIDTH_CASE(2)
        WIDTH_CASE(3)
        WIDTH_CASE(4)
    }
}

int specmtp_int8_linear(const void *x, int bf16, int64_t m, int64_t k, const int8_t *packed,
                        int64_t n, const float *scale, const int32_t *wsum, const float *bias,
                        void *y, int threads) {
    int64_t kp = (k + 3) / 4 * 4, blocks = (n + BLOCK - 1) / BLOCK;
    int64_t tiles = (blocks + TILE - 1) / TILE;
    uint8_t *u = aligned_alloc(64, (size_t)((m * kp + 63) / 64 * 64));
    float *low = malloc(sizeof(float) * (size_t)m), *step = malloc(sizeof(float) * (size_t)m);
    if (!u || !low || !step) {
        free(u), free(low), free(step);
        return 1;
    }
    for (int64_t i = 0; i < m; i++)
        quantize_row(x, bf16, i, k, kp, u + i * kp, low + i, step + i);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        int32_t sums[TILE * GROUP * BLOCK];
        int width = blocks - t * TILE < TILE ? (int)(blocks - t * TILE) : TILE;
        for (int64_t i0 = 0; i0 < m; i0 += GROUP) {
            int rows = m - i0 < GROUP ? (int)(m - i0) : GROUP;
            sums_of(u + i0 * kp, kp, packed + t * TILE * BLOCK * kp, rows, width, sums);
            for (int b = 0; b < width; b++)
                for (int i = 0; i < rows; i++)
                    for (int r = 0; r < BLOCK; r++) {
                        int64_t o = (t * TILE + b) * BLOCK + r, row = i0 + i;
                        if (o >= n)
                            break;
                        int32_t sum = sums[(b * GROUP + i) * BLOCK + r];
                        float dot = step[row] * (float)sum + low[row] * (float)wsum[o];
                        store(y, bf16, row * n + o, scale[o] * dot + (bias ? bias[o] : 0.0f));
                    }
        }
    }
    free(u), free(low), free(step);
    return 0;
}

#else /* no VNNI: int8.py keeps fbgemm's product */

int specmtp_int8_linear(const void *x, int bf16, int64_t m, int64_t k, const int8_t *packed,
                        int64_t n, const float *scale, const int32_t *wsum, const float *bias,
                        void *y, int threads) {
    (void)x, (void)bf16, (void)m, (void)k, (void)packed, (void)n, (void)scale, (void)wsum;
    (void)bias, (void)y, (void)threads;
    return 2;
}

#endif
