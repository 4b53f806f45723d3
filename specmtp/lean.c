/* Three steps of lean.py's draft forward, each one call where transformers makes many small
tensor operations of a few microseconds each on a draft step's few rows.

specmtp_add_rms_norm: the residual add and the RMS norm after it. x [n, hidden] float32,
delta [n, hidden] float32 or NULL: x += delta (in place), then out[r] = x[r] / sqrt(mean(x[r]^2)
+ eps) * weight, float32 throughout.

specmtp_split_rotary: split q, k and v, rotate q and k, move the heads first, round k and v
to the cache's dtype.

qkv [n, (heads + 2 * kv_heads) * d] float32, each row q's heads, then k's, then v's;
cos, sin [n, d] float32 (the model's rotary tables at each row's position). Rotation as
transformers' rotate_half: for i < d/2, x'[i] = x[i] cos[i] - x[i + d/2] sin[i] and
x'[i + d/2] = x[i + d/2] cos[i + d/2] + x[i] sin[i + d/2].

q [n, heads, d] float32 (rotated); k, v [kv_heads, n, d] (k rotated), float32 or bfloat16
(rounded to nearest even) as kv_bf16 says.

specmtp_silu_mul: the gated MLP's activation. gate_up [n, 2 * width] float32, each row the
gate's outputs then the up projection's; out[r][i] = silu(gate[r][i]) * up[r][i] [n, width]
float32, silu(g) = g / (1 + exp(-g)).
*/
#include <math.h>
#include <stdint.h>
#include <string.h>

void specmtp_add_rms_norm(float *x, const float *delta, int64_t n, int64_t hidden,
                          const float *weight, float eps, float *out) {
    for (int64_t r = 0; r < n; r++) {
        float *row = x + r * hidden;
        double squares = 0.0;
        for (int64_t i = 0; i < hidden; i++) {
            if (delta)
                row[i] += delta[r * hidden + i];
            squares += (double)row[i] * row[i];
        }
        float inverse = (float)(1.0 / sqrt(squares / (double)hidden + (double)eps));
        for (int64_t i = 0; i < hidden; i++)
            out[r * hidden + i] = row[i] * inverse * weight[i];
    }
}

static void put(void *out, int bf16, int64_t i, float value) {
    if (!bf16) {
        ((float *)out)[i] = value;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    ((uint16_t *)out)[i] = (uint16_t)(bits >> 16);
}

/* One head's d values rotated at one row: src -> out[offset ...]. */
static void rotate(const float *src, const float *cos, const float *sin, int d, void *out,
                   int bf16, int64_t offset) {
    int half = d / 2;
    for (int i = 0; i < half; i++) {
        put(out, bf16, offset + i, src[i] * cos[i] - src[i + half] * sin[i]);
        put(out, bf16, offset + i + half, src[i + half] * cos[i + half] + src[i] * sin[i + half]);
    }
}

/* q, k and v of n rows from qkv; k and v head h's row r at (h * head_stride + start + r) * d:
a [kv_heads, n, d] tensor (head_stride n, start 0) or a cache's [kv_heads, capacity, d]
buffer past its first `start` positions (head_stride capacity). */
static void split_rotary(const float *qkv, int64_t n, int heads, int kv_heads, int d,
                         const float *cos, const float *sin, float *q, void *k, void *v,
                         int kv_bf16, int64_t head_stride, int64_t start) {
    int64_t width = (int64_t)(heads + 2 * kv_heads) * d;
    for (int64_t r = 0; r < n; r++) {
        const float *row = qkv + r * width, *c = cos + r * d, *s = sin + r * d;
        for (int h = 0; h < heads; h++)
            rotate(row + (int64_t)h * d, c, s, d, q, 0, (r * heads + h) * d);
        for (int h = 0; h < kv_heads; h++) {
            int64_t offset = ((int64_t)h * head_stride + start + r) * d;
            rotate(row + (int64_t)(heads + h) * d, c, s, d, k, kv_bf16, offset);
            const float *value = row + (int64_t)(heads + kv_heads + h) * d;
            for (int i = 0; i < d; i++)
                put(v, kv_bf16, offset + i, value[i]);
        }
    }
}

void specmtp_split_rotary(const float *qkv, int64_t n, int heads, int kv_heads, int d,
                          const float *cos, const float *sin, float *q, void *k, void *v,
                          int kv_bf16) {
    split_rotary(qkv, n, heads, kv_heads, d, cos, sin, q, k, v, kv_bf16, n, 0);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* exp(x) for 16 floats: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its Taylor polynomial
to r^7 (relative error below 1e-7 there), times 2^n; inputs below -87 give 0 or a
subnormal, above 88 infinity, as expf. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.5f)), _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln 2, ln 2 in two parts so that n * high is exact */
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

void specmtp_silu_mul(const float *gate_up, int64_t n, int64_t width, float *out) {
    for (int64_t r = 0; r < n; r++) {
        const float *gate = gate_up + r * 2 * width, *up = gate + width;
        float *row = out + r * width;
        int64_t i = 0;
#ifdef __AVX512F__
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; i + 16 <= width; i += 16) {
            __m512 g = _mm512_loadu_ps(gate + i);
            __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            _mm512_storeu_ps(row + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
        }
#endif
        for (; i < width; i++)
            row[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* Offer x[i] = v to a row's top k so far (filled of them, sorted): taken if it beats the
last (any non-NaN while not full), moved up past every smaller one. */
static inline void offer(float v, int64_t i, float *value, int64_t *index, int64_t k,
                         int64_t *filled) {
    if (*filled == k ? !(v > value[k - 1]) : v != v)
        return;
    int64_t j = *filled < k ? (*filled)++ : k - 1;
    for (; j > 0 && v > value[j - 1]; j--)
        value[j] = value[j - 1], index[j] = index[j - 1];
    value[j] = v, index[j] = i;
}

/* specmtp_top_k: each row's k largest values, largest first (equal values: the lower index
first), their indices, and the row's log-sum-exp: a drafter's likeliest tokens and their
log-probabilities (value - lse) in two vector passes over the vocabulary, where torch's
log_softmax then topk take three. x [n, V] float32; values [n, k] float32, indices [n, k]
int64, lse [n] float32 or NULL; 1 <= k <= V. A NaN is never taken. */
void specmtp_top_k(const float *x, int64_t n, int64_t V, int64_t k, float *values,
                   int64_t *indices, float *lse) {
    for (int64_t r = 0; r < n; r++) {
        const float *row = x + r * V;
        float *value = values + r * k;
        int64_t *index = indices + r * k, filled = 0, i = 0;
#ifdef __AVX512F__
        /* 16 at a time: only lanes above the current last (or all, until full) are offered */
        for (; i + 16 <= V; i += 16) {
            __m512 chunk = _mm512_loadu_ps(row + i);
            __mmask16 hits = filled == k ? _mm512_cmp_ps_mask(chunk, _mm512_set1_ps(value[k - 1]),
                                                              _CMP_GT_OQ)
                                         : 0xFFFF;
            for (; hits; hits &= hits - 1) {
                int lane = __builtin_ctz(hits);
                offer(row[i + lane], i + lane, value, index, k, &filled);
            }
        }
#endif
        for (; i < V; i++)
            offer(row[i], i, value, index, k, &filled);
        for (int64_t j = filled; j < k; j++)  /* NaNs only: none to take */
            value[j] = NAN, index[j] = -1;
        if (!lse)
            continue;
        float top = value[0];
        if (!(top > -INFINITY)) {
            lse[r] = top;
            continue;
        }
        double sum = 0.0;
        i = 0;
#ifdef __AVX512F__
        __m512 total = _mm512_setzero_ps(), shift = _mm512_set1_ps(top);
        for (; i + 16 <= V; i += 16)
            total = _mm512_add_ps(total, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), shift)));
        sum = _mm512_reduce_add_ps(total);
#endif
        for (; i < V; i++)
            sum += expf(row[i] - top);
        lse[r] = top + (float)log(sum);
    }
}

/* specmtp_lean_layers: every decoder layer of lean.py's step in one call (its layer_step,
the reference, makes a dozen calls a layer from Python, each a few microseconds that a
24-layer step pays 24 times), then the final norm. The same kernels in the same order on
the same buffers, so the two give the same bits (tests/test_lean.py).

A product is int4.c's or int8.c's specmtp_*_linear (by `bits`), a pointer lean.py takes
from their libraries, as it takes attention.c's specmtp_attention. Each layer's new keys
and values go straight into the cache's buffers [kv_heads, capacity, d] at positions past
.. past + n - 1 (lean.py's KVBuffers keeps transformers' DynamicCache a view of them). */
typedef int (*Int4Kernel)(const void *x, int bf16, int64_t m, int64_t k, const void *records,
                          int64_t n, const float *c, const float *bias, void *y, int threads);
typedef int (*Int8Kernel)(const void *x, int bf16, int64_t m, int64_t k, const void *packed,
                          int64_t n, const float *scale, const float *wsum, const float *bias,
                          void *y, int threads);
typedef int (*AttentionKernel)(const void *q, int q_bf16, int64_t q_head_stride,
                               int64_t q_row_stride, float scale, const void *k, const void *v,
                               int kv_bf16, int64_t k_head_stride, int64_t k_row_stride,
                               int64_t v_head_stride, int64_t v_row_stride, int n, int heads,
                               int kv_heads, int d, const int64_t *prefix,
                               const int64_t *extra_start, const int64_t *extras, void *out,
                               int out_bf16);

typedef struct {
    void *kernel;         /* Int4Kernel or Int8Kernel */
    int64_t bits;         /* 4 or 8 */
    int64_t in, out;      /* features */
    const void *weights;  /* int4: records; int8: packed */
    const float *first;   /* int4: C; int8: the padded scale */
    const float *second;  /* int8: wsum; int4: unused */
    const float *bias;    /* or NULL */
} Product;

typedef struct {
    const float *input_norm, *post_norm;  /* [hidden] float32 */
    Product qkv, o, gate_up, down;
    void *keys, *values;  /* the cache's buffers [kv_heads, capacity, d] */
} Layer;

typedef struct {
    int64_t n, hidden, intermediate, capacity, past, heads, kv_heads, d, kv_bf16, threads;
    const float *cos, *sin;                          /* [n, d] */
    const int64_t *prefix, *extra_start, *extras;    /* the rows' visible keys (attention.c) */
    const float *final_norm;                         /* [hidden] */
    float *qkv, *q, *attended, *o, *gate_up, *activation, *down;  /* scratch, float32 */
    float eps, scale;
} Step;

static int product(const Product *p, const float *x, int64_t m, float *y, int threads) {
    if (p->bits == 4)
        return ((Int4Kernel)p->kernel)(x, 0, m, p->in, p->weights, p->out, p->first, p->bias, y,
                                       threads);
    return ((Int8Kernel)p->kernel)(x, 0, m, p->in, p->weights, p->out, p->first, p->second,
                                   p->bias, y, threads);
}

/* x [n, hidden] the residual stream (updated in place), h [n, hidden] the final norm's
output. 0, or the first failing kernel's code (out of memory). */
int specmtp_lean_layers(const Layer *layers, int64_t count, void *attention, const Step *s,
                        float *x, float *h) {
    int64_t n = s->n, hidden = s->hidden, d = s->d;
    int heads = (int)s->heads, kv_heads = (int)s->kv_heads, threads = (int)s->threads;
    const float *delta = NULL;  /* the previous layer's MLP output */
    int failed = 0;
    for (int64_t i = 0; i < count && !failed; i++) {
        const Layer *layer = layers + i;
        specmtp_add_rms_norm(x, delta, n, hidden, layer->input_norm, s->eps, h);
        if ((failed = product(&layer->qkv, h, n, s->qkv, threads)))
            break;
        split_rotary(s->qkv, n, heads, kv_heads, (int)d, s->cos, s->sin, s->q, layer->keys,
                     layer->values, (int)s->kv_bf16, s->capacity, s->past);
        int64_t head = s->capacity * d;
        failed = ((AttentionKernel)attention)(
            s->q, 0, d, heads * d, s->scale, layer->keys, layer->values, (int)s->kv_bf16, head, d,
            head, d, (int)n, heads, kv_heads, (int)d, s->prefix, s->extra_start, s->extras,
            s->attended, 0);
        if (failed || (failed = product(&layer->o, s->attended, n, s->o, threads)))
            break;
        specmtp_add_rms_norm(x, s->o, n, hidden, layer->post_norm, s->eps, h);
        if ((failed = product(&layer->gate_up, h, n, s->gate_up, threads)))
            break;
        specmtp_silu_mul(s->gate_up, n, s->intermediate, s->activation);
        failed = product(&layer->down, s->activation, n, s->down, threads);
        delta = s->down;
    }
    if (!failed)
        specmtp_add_rms_norm(x, delta, n, hidden, s->final_norm, s->eps, h);
    return failed;
}
