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

void specmtp_split_rotary(const float *qkv, int64_t n, int heads, int kv_heads, int d,
                          const float *cos, const float *sin, float *q, void *k, void *v,
                          int kv_bf16) {
    int64_t width = (int64_t)(heads + 2 * kv_heads) * d;
    for (int64_t r = 0; r < n; r++) {
        const float *row = qkv + r * width, *c = cos + r * d, *s = sin + r * d;
        for (int h = 0; h < heads; h++)
            rotate(row + (int64_t)h * d, c, s, d, q, 0, (r * heads + h) * d);
        for (int h = 0; h < kv_heads; h++) {
            int64_t offset = ((int64_t)h * n + r) * d;
            rotate(row + (int64_t)(heads + h) * d, c, s, d, k, kv_bf16, offset);
            const float *value = row + (int64_t)(heads + kv_heads + h) * d;
            for (int i = 0; i < d; i++)
                put(v, kv_bf16, offset + i, value[i]);
        }
    }
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
