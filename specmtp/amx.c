/* bfloat16 products on AMX tiles: y = x @ W^T + b, every row of y computed alone.

specmtp/native.py compiles this file; specmtp/amx.py calls it. A verify pass multiplies a
few rows (1-32) by every weight matrix of the target, and for exact bfloat16 decoding each
row must get the bits a one-row step gives it (invariant.py). Here that holds by
construction: rows go through the tiles in blocks of 16 (the last zero-padded), and one
tile product (TDPBF16PS) computes each row of its result from that row of A alone, so a
row's sums are the same whatever else its block holds. The order of the additions is
fixed: for each output, the fp32 accumulator takes the inputs 32 at a time, in order.
On CPUs with AMX (Intel Xeon from Sapphire Rapids on) the tiles do 16 rows' products at
about the cost of one, so a pass of 16 rows reads the weights once, as a step does.

W is stored as the tiles read it: 16 outputs by 32 inputs a tile, the inputs paired
(VNNI), four tiles (64 outputs) side by side, then the next 32 inputs:

    packed[g][c][j][r][o][t] = W[64 g + 16 j + o][32 c + 2 r + t]   (j < 4, r, o < 16, t < 2)

zero beyond n outputs and k inputs. x [m, k] bfloat16, contiguous; bias [n] bfloat16 or
NULL; y [m, n] bfloat16, rounded to nearest even from acc + bias in float32. Groups of 64
outputs are shared among `threads` OpenMP threads. Returns 0; 1 when out of memory, 2
where this build or this process has no AMX (specmtp_amx_ready says which).
*/
#define _GNU_SOURCE /* syscall */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROWS 16    /* rows of a block: a tile's height */
#define INPUTS 32  /* inputs a tile product sums: 16 pairs */
#define OUTPUTS 16 /* outputs of a tile */
#define SIDE 4     /* tiles of outputs summed side by side (a group: 64 outputs) */
#define TILE_VALUES (ROWS * INPUTS)

int64_t specmtp_amx_packed_values(int64_t n, int64_t k) {
    int64_t groups = (n + SIDE * OUTPUTS - 1) / (SIDE * OUTPUTS);
    int64_t chunks = (k + INPUTS - 1) / INPUTS;
    return groups * chunks * SIDE * TILE_VALUES;
}

/* w [n, k] bfloat16 (row stride `stride` values) into the layout above. */
void specmtp_amx_pack(const uint16_t *w, int64_t n, int64_t k, int64_t stride,
                      uint16_t *packed) {
    int64_t groups = (n + SIDE * OUTPUTS - 1) / (SIDE * OUTPUTS);
    int64_t chunks = (k + INPUTS - 1) / INPUTS;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t c = 0; c < chunks; c++)
            for (int j = 0; j < SIDE; j++) {
                uint16_t *tile = packed + ((g * chunks + c) * SIDE + j) * TILE_VALUES;
                for (int r = 0; r < INPUTS / 2; r++)
                    for (int o = 0; o < OUTPUTS; o++)
                        for (int t = 0; t < 2; t++) {
                            int64_t row = g * SIDE * OUTPUTS + j * OUTPUTS + o;
                            int64_t col = c * INPUTS + 2 * r + t;
                            tile[(r * OUTPUTS + o) * 2 + t] =
                                row < n && col < k ? w[row * stride + col] : 0;
                        }
            }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes[16];
    uint8_t rows[16];
} TileConfig;

static int ready = -1; /* unknown, then 1 where the kernel asked for and got the tiles */

/* Whether this process may use the tiles: Linux grants them on request, once a process. */
int specmtp_amx_ready(void) {
    if (ready < 0)
        ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

/* One row's `width` sums of a group (plus bias) rounded to bfloat16 by vcvtneps2bf16
   (nearest even), 16 at a time, the last ones of a narrow group under a mask. */
static void store_row(const float *sums, const uint16_t *bias, int64_t width, uint16_t *y) {
    for (int64_t o = 0; o < width; o += OUTPUTS) {
        __mmask16 mask = width - o >= OUTPUTS ? 0xFFFF : (__mmask16)((1u << (width - o)) - 1);
        __m512 value = _mm512_maskz_loadu_ps(mask, sums + o);
        if (bias) {
            __m256i half = _mm256_maskz_loadu_epi16(mask, bias + o);
            value = _mm512_add_ps(
                value, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16)));
        }
        _mm256_mask_storeu_epi16(y + o, mask, (__m256i)_mm512_cvtneps_pbh(value));
    }
}

int specmtp_amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                       int64_t n, const uint16_t *bias, uint16_t *y, int threads) {
    if (!specmtp_amx_ready())
        return 2;
    int64_t chunks = (k + INPUTS - 1) / INPUTS, kp = chunks * INPUTS;
    int64_t blocks = (m + ROWS - 1) / ROWS;
    int64_t groups = (n + SIDE * OUTPUTS - 1) / (SIDE * OUTPUTS);
    /* The rows, zero-padded to whole blocks and tiles, in this thread's scratch buffer
       (kept between calls: a fresh one each call would fault its pages in every time). */
    static _Thread_local uint16_t *scratch = NULL;
    static _Thread_local size_t capacity = 0;
    size_t need = (size_t)(blocks * ROWS * kp);
    if (need > capacity) {
        free(scratch);
        scratch = malloc(need * sizeof *scratch);
        capacity = scratch ? need : 0;
        if (!scratch)
            return 1;
    }
    uint16_t *a = scratch; /* the OpenMP threads below see this thread's buffer */
    for (int64_t i = 0; i < blocks * ROWS; i++) {
        int64_t copied = i < m ? k : 0;
        if (copied)
            memcpy(a + i * kp, x + i * k, (size_t)k * sizeof *a);
        memset(a + i * kp + copied, 0, (size_t)(kp - copied) * sizeof *a);
    }
#pragma omp parallel num_threads(threads)
    {
        TileConfig config = {0};
        config.palette = 1;
        for (int t = 0; t < 8; t++) {
            config.rows[t] = ROWS;
            config.bytes[t] = 64;
        }
        _tile_loadconfig(&config);
        float sums[ROWS][SIDE * OUTPUTS];
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *weights = packed + g * chunks * SIDE * TILE_VALUES;
            for (int64_t b = 0; b < blocks; b++) {
                const uint16_t *rows = a + b * ROWS * kp;
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t c = 0; c < chunks; c++) {
                    const uint16_t *tiles = weights + c * SIDE * TILE_VALUES;
                    _tile_loadd(4, rows + c * INPUTS, kp * sizeof *a);
                    _tile_loadd(5, tiles, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, tiles + TILE_VALUES, 64);
                    _tile_dpbf16ps(1, 4, 6);
                    _tile_loadd(5, tiles + 2 * TILE_VALUES, 64);
                    _tile_dpbf16ps(2, 4, 5);
                    _tile_loadd(6, tiles + 3 * TILE_VALUES, 64);
                    _tile_dpbf16ps(3, 4, 6);
                }
                _tile_stored(0, &sums[0][0], sizeof sums[0]);
                _tile_stored(1, &sums[0][OUTPUTS], sizeof sums[0]);
                _tile_stored(2, &sums[0][2 * OUTPUTS], sizeof sums[0]);
                _tile_stored(3, &sums[0][3 * OUTPUTS], sizeof sums[0]);
                int64_t first = g * SIDE * OUTPUTS;
                int64_t width = n - first < SIDE * OUTPUTS ? n - first : SIDE * OUTPUTS;
                for (int64_t i = b * ROWS; i < m && i < (b + 1) * ROWS; i++)
                    store_row(sums[i - b * ROWS], bias ? bias + first : NULL, width,
                              y + i * n + first);
            }
        }
        _tile_release();
    }
    return 0;
}

#else

int specmtp_amx_ready(void) { return 0; }

int specmtp_amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed,
                       int64_t n, const uint16_t *bias, uint16_t *y, int threads) {
    (void)x, (void)m, (void)k, (void)packed, (void)n, (void)bias, (void)y, (void)threads;
    return 2;
}

#endif
