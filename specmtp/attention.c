/* Row-invariant attention in one call for every query row of a decode step or verify pass.

specmtp/native.py compiles this file; specmtp/invariant.py calls it. A query row's output
must not depend, to the bit, on what else the call holds: how many rows, which keys the
other rows see, how they are packed. So every value a query row's output depends on is
computed by one fixed sequence of rounded float operations (compiled with -ffp-contract=off,
so no product is fused into a sum, and without -ffast-math, so nothing is reassociated):

- a score: q[0] * k[0], then + q[c] * k[c] for c = 1 .. d - 1 in order (q scaled first);
- the query's maximum score (exact in any order);
- exp(score - maximum) by one polynomial, lane by lane;
- their sum, in the query's key order;
- the sum of exp * value in key order, divided by that sum at the end.

Vectors only run such sequences side by side, one per lane, so it does not matter which
lane a query or key lands in. The keys every row sees (a verify pass's cached prefix) are
read and scored once for all rows, their queries packed LANES to a vector; each row's own
keys past them (its new tokens, or a tree node's ancestors) follow, row by row.

Layouts: q [H, n, d] with the given head and row strides; k and v [Hkv, S, d] with theirs;
float32 or bfloat16 each. out [n, H, d], contiguous, float32 or bfloat16 (rounded to
nearest even). Row r sees keys 0 .. prefix[r] - 1, then extras[extra_start[r] ..
extra_start[r + 1] - 1], in that order. d is a multiple of LANES, at most MAX_D; H / Hkv
query heads share a key head, at most LANES of them. Returns 0; 1 when out of memory, 2
for shapes it does not take.
*/
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define MAX_D 256
#define VALUES 128 /* values converted and summed as a block */

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

typedef uint16_t vh __attribute__((vector_size(LANES * sizeof(uint16_t))));

typedef struct {
    const void *base;
    int64_t head, row;  /* strides, in elements */
    int bf16;
} Tensor;

/* Row i of head h, as d / LANES float vectors (a bfloat16 is a float's upper half). */
static void load_row(vf *out, Tensor t, int h, int64_t i, int dv) {
    int64_t offset = h * t.head + i * t.row;
    for (int c = 0; c < dv; c++) {
        if (t.bf16) {
            vh half;
            memcpy(&half, (const uint16_t *)t.base + offset + c * LANES, sizeof half);
            out[c] = (vf)(__builtin_convertvector(half, vi) << 16);
        } else {
            memcpy(out + c, (const float *)t.base + offset + c * LANES, sizeof(vf));
        }
    }
}

static float element(Tensor t, int64_t offset) {
    if (!t.bf16) return ((const float *)t.base)[offset];
    uint32_t bits = (uint32_t)((const uint16_t *)t.base)[offset] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* Rounded to the nearest bfloat16, ties to even (as torch rounds); NaN stays NaN. */
static uint16_t to_bfloat16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static vf broadcast(float x) { return (vf){0} + x; }

static vf select(vi mask, vf yes, vf no) { return (vf)(((vi)yes & mask) | ((vi)no & ~mask)); }

/* exp, lane by lane (Cephes' single-precision polynomial, about 1 ulp) for x <= 0. */
static vf exp_lanes(vf x) {
    x = select(x < broadcast(-87.0f), broadcast(-87.0f), x);
    vf t = x * broadcast(1.44269504088896341f) + broadcast(0.5f);
    vf n = __builtin_convertvector(__builtin_convertvector(t, vi), vf); /* toward zero */
    n = select(n > t, n - broadcast(1.0f), n);                            /* floor */
    vf r = x - n * broadcast(0.693359375f);
    r = r - n * broadcast(-2.12194440e-4f);
    vf p = broadcast(1.9875691500e-4f);
    p = p * r + broadcast(1.3981999507e-3f);
    p = p * r + broadcast(8.3334519073e-3f);
    p = p * r + broadcast(4.1665795894e-2f);
    p = p * r + broadcast(1.6666665459e-1f);
    p = p * r + broadcast(5.0000001201e-1f);
    vf y = p * (r * r) + r + broadcast(1.0f);
    vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
    return y * (vf)scale;
}

/* Scores of up to LANES queries (transposed: qt[c] holds dimension c of each) against KEYS
keys: for each lane, q[0] * k[0], then + q[c] * k[c] in order; KEYS chains side by side. */
#define KEYS 8
static void scores_block(vf out[KEYS], const vf *qt, const float *keys, int d) {
    vf a[KEYS];
    for (int u = 0; u < KEYS; u++) a[u] = qt[0] * keys[u * d];
    for (int c = 1; c < d; c++)
        for (int u = 0; u < KEYS; u++) a[u] = a[u] + qt[c] * keys[u * d + c];
    for (int u = 0; u < KEYS; u++) out[u] = a[u];
}

/* The same chain for one key. */
static vf scores1(const vf *qt, const float *k, int d) {
    vf a = qt[0] * k[0];
    for (int c = 1; c < d; c++) a = a + qt[c] * k[c];
    return a;
}

static int64_t key_at(int r, int64_t t, int64_t pmin, const int64_t *prefix, const int64_t *start,
                      const int64_t *extras) {
    int64_t own = prefix[r] - pmin; /* the row's prefix keys past the shared ones */
    return t < own ? pmin + t : extras[start[r] + t - own];
}

/* o += e[u * stride] * value u, for the count values of a block, in order. Inlined with a
constant dv where it can be, so o stays in registers. */
static inline __attribute__((always_inline)) void add_values(int dv, vf *o_out, const float *e,
                                                             int64_t stride, const vf *values,
                                                             int64_t count) {
    vf o[MAX_D / LANES];
    for (int c = 0; c < dv; c++) o[c] = o_out[c];
    for (int64_t u = 0; u < count; u++)
        for (int c = 0; c < dv; c++) o[c] = o[c] + e[u * stride] * values[u * dv + c];
    for (int c = 0; c < dv; c++) o_out[c] = o[c];
}

static void add_values_any(int dv, vf *o, const float *e, int64_t stride, const vf *values,
                           int64_t count) {
    if (dv == 4)
        add_values(4, o, e, stride, values, count);
    else
        add_values(dv, o, e, stride, values, count);
}

/* One key head: its G query heads over the n rows. Returns 0, or 1 when out of memory. */
static int attend_head(Tensor q, float scale, Tensor k, Tensor v, int n, int heads, int h,
                       int groups, int d, const int64_t *prefix, const int64_t *start,
                       const int64_t *extras, void *out, int out_bf16) {
    int nq = n * groups, dv = d / LANES, packs = (nq + LANES - 1) / LANES;
    int64_t pmin = prefix[0], tails = 0;
    for (int r = 0; r < n; r++) pmin = prefix[r] < pmin ? prefix[r] : pmin;
    for (int r = 0; r < n; r++) tails += prefix[r] - pmin + start[r + 1] - start[r];
    /* Query j (row j / G, head h * G + j % G) sits in lane j % LANES of pack j / LANES for
       the shared keys, and in lane j % G of its row's pack for the row's own keys. */
    vf *qt = aligned_alloc(64, sizeof(vf) * (size_t)(packs + n) * d);
    vf *shared = aligned_alloc(64, sizeof(vf) * ((size_t)pmin * packs + 1)); /* [pmin, packs] */
    vf *values = aligned_alloc(64, sizeof(vf) * VALUES * (size_t)dv);        /* a block's */
    vf *acc = aligned_alloc(64, sizeof(vf) * (size_t)nq * dv);              /* [nq, dv] */
    vf *tail = aligned_alloc(64, sizeof(vf) * ((size_t)tails + 1));         /* row by row */
    vf *rows = aligned_alloc(64, sizeof(vf) * KEYS * (size_t)dv);           /* [KEYS, dv] */
    int64_t *own_keys = malloc(sizeof(int64_t) * ((size_t)tails + 1));
    float *maxes = malloc(sizeof(float) * (size_t)(packs + n) * LANES);
    vf *sums = aligned_alloc(64, sizeof(vf) * (size_t)packs);
    int failed = !qt || !shared || !values || !acc || !tail || !rows || !own_keys
                 || !maxes || !sums;
    if (failed) goto done;
    memset(qt, 0, sizeof(vf) * (size_t)(packs + n) * d);
    memset(acc, 0, sizeof(vf) * (size_t)nq * dv);
    for (int j = 0; j < nq; j++) {
        int64_t offset = (h * groups + j % groups) * q.head + (j / groups) * q.row;
        for (int c = 0; c < d; c++) {
            float x = element(q, offset + c) * scale;
            qt[(j / LANES) * d + c][j % LANES] = x;
            qt[(packs + j / groups) * d + c][j % groups] = x;
        }
    }
    const float *keys = (const float *)rows;
    /* Scores: the shared keys once for all rows, then each row's own keys. */
    int64_t i = 0;
    for (; i + KEYS <= pmin; i += KEYS) {
        for (int u = 0; u < KEYS; u++) load_row(rows + u * dv, k, h, i + u, dv);
        for (int p = 0; p < packs; p++) {
            vf block[KEYS];
            scores_block(block, qt + p * d, keys, d);
            for (int u = 0; u < KEYS; u++) shared[(i + u) * packs + p] = block[u];
        }
    }
    for (; i < pmin; i++) {
        load_row(rows, k, h, i, dv);
        for (int p = 0; p < packs; p++) shared[i * packs + p] = scores1(qt + p * d, keys, d);
    }
    int64_t at = 0;
    for (int r = 0; r < n; r++)
        for (int64_t t = 0; t < prefix[r] - pmin + start[r + 1] - start[r]; t++, at++) {
            own_keys[at] = key_at(r, t, pmin, prefix, start, extras);
            load_row(rows, k, h, own_keys[at], dv);
            tail[at] = scores1(qt + (packs + r) * d, keys, d);
        }
    /* Each query's maximum over all its keys (exact in any order). */
    for (int p = 0; p < packs; p++) {
        vf top = broadcast(-__builtin_inff());
        for (i = 0; i < pmin; i++) top = select(shared[i * packs + p] > top, shared[i * packs + p], top);
        memcpy(maxes + p * LANES, &top, sizeof top);
    }
    at = 0;
    for (int r = 0; r < n; r++)
        for (int64_t t = 0; t < prefix[r] - pmin + start[r + 1] - start[r]; t++, at++)
            for (int g = 0; g < groups; g++) {
                float *top = maxes + r * groups + g;
                *top = tail[at][g] > *top ? tail[at][g] : *top;
            }
    for (int r = 0; r < n; r++)
        for (int l = 0; l < LANES; l++)
            maxes[(packs + r) * LANES + l] = l < groups ? maxes[r * groups + l] : 0.0f;
    /* exp(score - max) in place; the shared ones summed lane by lane in key order. */
    for (int p = 0; p < packs; p++) sums[p] = broadcast(0.0f);
    for (i = 0; i < pmin; i++)
        for (int p = 0; p < packs; p++) {
            vf top;
            memcpy(&top, maxes + p * LANES, sizeof top);
            shared[i * packs + p] = exp_lanes(shared[i * packs + p] - top);
            sums[p] = sums[p] + shared[i * packs + p];
        }
    /* exp * value over the shared keys, block by block (each block's values converted once
       and still in cache for every query), in key order for each query. */
    for (int64_t first = 0; first < pmin; first += VALUES) {
        int64_t count = pmin - first < VALUES ? pmin - first : VALUES;
        for (int64_t u = 0; u < count; u++) load_row(values + u * dv, v, h, first + u, dv);
        for (int j = 0; j < nq; j++) {
            const float *e = (const float *)(shared + first * packs + j / LANES) + j % LANES;
            add_values_any(dv, acc + j * dv, e, (int64_t)packs * LANES, values, count);
        }
    }
    /* Then each row's own keys, in order; the sums finished; the outputs divided. */
    at = 0;
    for (int r = 0; r < n; r++) {
        int64_t own = prefix[r] - pmin + start[r + 1] - start[r];
        vf top;
        memcpy(&top, maxes + (packs + r) * LANES, sizeof top);
        for (int64_t t = 0; t < own; t++) tail[at + t] = exp_lanes(tail[at + t] - top);
        for (int g = 0; g < groups; g++) {
            int j = r * groups + g;
            float sum = sums[j / LANES][j % LANES];
            for (int64_t t = 0; t < own; t++) {
                sum = sum + tail[at + t][g];
                load_row(rows, v, h, own_keys[at + t], dv);
                add_values_any(dv, acc + j * dv, (const float *)(tail + at + t) + g, 0, rows, 1);
            }
            sum = sum > 0.0f ? sum : 1.0f; /* a row that sees no key (padding) gets zeros */
            int64_t offset = ((int64_t)r * heads + h * groups + g) * d;
            for (int c = 0; c < d; c++) {
                float x = acc[j * dv + c / LANES][c % LANES] / sum;
                if (out_bf16)
                    ((uint16_t *)out)[offset + c] = to_bfloat16(x);
                else
                    ((float *)out)[offset + c] = x;
            }
        }
        at += own;
    }
done:
    free(qt), free(shared), free(values), free(acc), free(tail), free(rows);
    free(own_keys);
    free(maxes), free(sums);
    return failed;
}

int specmtp_attention(const void *q, int q_bf16, int64_t q_head_stride, int64_t q_row_stride,
                      float scale, const void *k, const void *v, int kv_bf16,
                      int64_t k_head_stride, int64_t k_row_stride, int64_t v_head_stride,
                      int64_t v_row_stride, int n, int heads, int kv_heads, int d,
                      const int64_t *prefix, const int64_t *extra_start, const int64_t *extras,
                      void *out, int out_bf16) {
    int groups = heads / kv_heads;
    if (d % LANES || d > MAX_D || groups > LANES || groups * kv_heads != heads) return 2;
    Tensor qt = {q, q_head_stride, q_row_stride, q_bf16};
    Tensor kt = {k, k_head_stride, k_row_stride, kv_bf16};
    Tensor vt = {v, v_head_stride, v_row_stride, kv_bf16};
    for (int h = 0; h < kv_heads; h++)
        if (attend_head(qt, scale, kt, vt, n, heads, h, groups, d, prefix, extra_start, extras,
                        out, out_bf16))
            return 1;
    return 0;
}
