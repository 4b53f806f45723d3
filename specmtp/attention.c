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

/* One key head's work: its G query heads over the n rows, and the buffers it fills. */
typedef struct {
    int n, groups, d, dv, nq, packs;
    int64_t pmin, tails; /* keys every row sees; the rows' own keys past them, in all */
    const int64_t *prefix, *start, *extras;
    vf *qt;        /* [packs + n, d]: queries by dimension; query j (row j / G, head h * G +
                      j % G) in lane j % LANES of pack j / LANES, then in lane j % G of its
                      row's pack (packs + j / G) */
    vf *shared;    /* [pmin, packs]: the shared keys' scores, then their exps */
    vf *tail;      /* [tails]: each row's own keys' scores, then exps (lane g: head g) */
    int64_t *own;  /* [tails]: those keys */
    vf *rows;      /* [KEYS, dv]: key or value rows converted */
    vf *values;    /* [VALUES, dv]: a block of shared values converted */
    vf *acc;       /* [nq, dv]: each query's sum of exp * value */
    float *maxes;  /* [packs + n, LANES]: each query's maximum score, in both lane orders */
    vf *sums;      /* [packs]: each query's sum of exps over the shared keys */
} Work;

static int64_t own_count(const Work *w, int r) {
    return w->prefix[r] - w->pmin + w->start[r + 1] - w->start[r];
}

static void pack_queries(Work *w, Tensor q, float scale, int h) {
    memset(w->qt, 0, sizeof(vf) * (size_t)(w->packs + w->n) * w->d);
    for (int j = 0; j < w->nq; j++) {
        int64_t offset = (h * w->groups + j % w->groups) * q.head + (j / w->groups) * q.row;
        for (int c = 0; c < w->d; c++) {
            float x = element(q, offset + c) * scale;
            w->qt[(j / LANES) * w->d + c][j % LANES] = x;
            w->qt[(w->packs + j / w->groups) * w->d + c][j % w->groups] = x;
        }
    }
}

/* Scores: the shared keys once for all rows, KEYS at a time; then each row's own keys. */
static void score(Work *w, Tensor k, int h) {
    const float *keys = (const float *)w->rows;
    int64_t i = 0;
    for (; i + KEYS <= w->pmin; i += KEYS) {
        for (int u = 0; u < KEYS; u++) load_row(w->rows + u * w->dv, k, h, i + u, w->dv);
        for (int p = 0; p < w->packs; p++) {
            vf block[KEYS];
            scores_block(block, w->qt + p * w->d, keys, w->d);
            for (int u = 0; u < KEYS; u++) w->shared[(i + u) * w->packs + p] = block[u];
        }
    }
    for (; i < w->pmin; i++) {
        load_row(w->rows, k, h, i, w->dv);
        for (int p = 0; p < w->packs; p++)
            w->shared[i * w->packs + p] = scores1(w->qt + p * w->d, keys, w->d);
    }
    int64_t at = 0;
    for (int r = 0; r < w->n; r++)
        for (int64_t t = 0; t < own_count(w, r); t++, at++) {
            w->own[at] = key_at(r, t, w->pmin, w->prefix, w->start, w->extras);
            load_row(w->rows, k, h, w->own[at], w->dv);
            w->tail[at] = scores1(w->qt + (w->packs + r) * w->d, keys, w->d);
        }
}

/* Each query's maximum over all its keys (exact in any order); exp(score - maximum) in
   place; the shared keys' exps summed lane by lane in key order. */
static void exponentiate(Work *w) {
    for (int p = 0; p < w->packs; p++) {
        vf top = broadcast(-__builtin_inff());
        for (int64_t i = 0; i < w->pmin; i++) {
            vf s = w->shared[i * w->packs + p];
            top = select(s > top, s, top);
        }
        memcpy(w->maxes + p * LANES, &top, sizeof top);
    }
    int64_t at = 0;
    for (int r = 0; r < w->n; r++)
        for (int64_t t = 0; t < own_count(w, r); t++, at++)
            for (int g = 0; g < w->groups; g++) {
                float *top = w->maxes + r * w->groups + g;
                *top = w->tail[at][g] > *top ? w->tail[at][g] : *top;
            }
    for (int r = 0; r < w->n; r++)
        for (int l = 0; l < LANES; l++)
            w->maxes[(w->packs + r) * LANES + l] = l < w->groups ? w->maxes[r * w->groups + l] : 0;
    for (int p = 0; p < w->packs; p++) {
        vf top, sum = broadcast(0.0f);
        memcpy(&top, w->maxes + p * LANES, sizeof top);
        for (int64_t i = 0; i < w->pmin; i++) {
            w->shared[i * w->packs + p] = exp_lanes(w->shared[i * w->packs + p] - top);
            sum = sum + w->shared[i * w->packs + p];
        }
        w->sums[p] = sum;
    }
    at = 0;
    for (int r = 0; r < w->n; r++) {
        vf top;
        memcpy(&top, w->maxes + (w->packs + r) * LANES, sizeof top);
        for (int64_t t = 0; t < own_count(w, r); t++, at++) w->tail[at] = exp_lanes(w->tail[at] - top);
    }
}

/* Each query's exp * value summed in key order: the shared values block by block (each
   block converted once and still in cache for every query), then its row's own; divided
   by the sum of its exps; written to out [n, H, d]. */
static void sum_values(Work *w, Tensor v, int h, int heads, void *out, int out_bf16) {
    int dv = w->dv;
    memset(w->acc, 0, sizeof(vf) * (size_t)w->nq * dv);
    for (int64_t first = 0; first < w->pmin; first += VALUES) {
        int64_t count = w->pmin - first < VALUES ? w->pmin - first : VALUES;
        for (int64_t u = 0; u < count; u++) load_row(w->values + u * dv, v, h, first + u, dv);
        for (int j = 0; j < w->nq; j++) {
            const float *e = (const float *)(w->shared + first * w->packs + j / LANES) + j % LANES;
            add_values_any(dv, w->acc + j * dv, e, (int64_t)w->packs * LANES, w->values, count);
        }
    }
    int64_t at = 0;
    for (int r = 0; r < w->n; r++) {
        int64_t own = own_count(w, r);
        for (int g = 0; g < w->groups; g++) {
            int j = r * w->groups + g;
            float sum = w->sums[j / LANES][j % LANES];
            for (int64_t t = 0; t < own; t++) {
                sum = sum + w->tail[at + t][g];
                load_row(w->rows, v, h, w->own[at + t], dv);
                add_values_any(dv, w->acc + j * dv, (const float *)(w->tail + at + t) + g, 0,
                               w->rows, 1);
            }
            sum = sum > 0.0f ? sum : 1.0f; /* a row that sees no key (padding) gets zeros */
            int64_t offset = ((int64_t)r * heads + h * w->groups + g) * w->d;
            for (int c = 0; c < w->d; c++) {
                float x = w->acc[j * dv + c / LANES][c % LANES] / sum;
                if (out_bf16)
                    ((uint16_t *)out)[offset + c] = to_bfloat16(x);
                else
                    ((float *)out)[offset + c] = x;
            }
        }
        at += own;
    }
}

/* One key head: its G query heads over the n rows. Returns 0, or 1 when out of memory. */
static int attend_head(Tensor q, float scale, Tensor k, Tensor v, int n, int heads, int h,
                       int groups, int d, const int64_t *prefix, const int64_t *start,
                       const int64_t *extras, void *out, int out_bf16) {
    Work w = {.n = n, .groups = groups, .d = d, .dv = d / LANES, .nq = n * groups,
              .prefix = prefix, .start = start, .extras = extras};
    w.packs = (w.nq + LANES - 1) / LANES;
    w.pmin = prefix[0];
    for (int r = 0; r < n; r++) w.pmin = prefix[r] < w.pmin ? prefix[r] : w.pmin;
    for (int r = 0; r < n; r++) w.tails += own_count(&w, r);
    w.qt = aligned_alloc(64, sizeof(vf) * (size_t)(w.packs + n) * d);
    w.shared = aligned_alloc(64, sizeof(vf) * ((size_t)w.pmin * w.packs + 1));
    w.tail = aligned_alloc(64, sizeof(vf) * ((size_t)w.tails + 1));
    w.own = malloc(sizeof(int64_t) * ((size_t)w.tails + 1));
    w.rows = aligned_alloc(64, sizeof(vf) * KEYS * (size_t)w.dv);
    w.values = aligned_alloc(64, sizeof(vf) * VALUES * (size_t)w.dv);
    w.acc = aligned_alloc(64, sizeof(vf) * (size_t)w.nq * w.dv);
    w.maxes = malloc(sizeof(float) * (size_t)(w.packs + n) * LANES);
    w.sums = aligned_alloc(64, sizeof(vf) * (size_t)w.packs);
    int failed = !w.qt || !w.shared || !w.tail || !w.own || !w.rows || !w.values || !w.acc
                 || !w.maxes || !w.sums;
    if (!failed) {
        pack_queries(&w, q, scale, h);
        score(&w, k, h);
        exponentiate(&w);
        sum_values(&w, v, h, heads, out, out_bf16);
    }
    free(w.qt), free(w.shared), free(w.tail), free(w.own), free(w.rows), free(w.values);
    free(w.acc), free(w.maxes), free(w.sums);
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
