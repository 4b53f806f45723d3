/* Two steps of lean.py's draft forward, each one call where transformers makes many small
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
