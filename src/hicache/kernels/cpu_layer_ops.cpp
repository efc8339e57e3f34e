// A decoder layer's elementwise work for the CPU in float32 and bfloat16, each in one pass:
// RMSNorm and the rotary embedding.
//
// torch runs each of these as several ops (RMSNorm: square, mean, rsqrt, two products;
// RoPE: seven), each a pass over the rows and a few microseconds of dispatch; in a decode
// step of a small model that is several percent of the step. Here every row is read once
// and written once. Built at run time by hicache/kernels/cpu_layer_ops.py through
// hicache/kernels/cpu_build.py (g++ -O3 -march=native) and called through ctypes.
//
// Rounding follows the reference models' order of operations (products and sums are not
// contracted into fused multiply-adds: -ffp-contract=off); only the mean of squares is
// summed in another order than torch's. (SwiGLU's silu(gate) * up measured no faster
// this way than torch's two vectorized ops, so it stays torch's.)
//
// bfloat16 values are widened to float32 and every result the model's torch code rounds
// to bfloat16 is rounded here too (to nearest even), at the same points: torch computes a
// bfloat16 op in float32 and rounds its result, so the rotary embedding gives torch's bits;
// RMSNorm normalizes in float32 (the reference models do), rounds, then multiplies by the
// weight and rounds again, as ``weight * normed.to(bfloat16)`` does.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float widen(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline uint16_t round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

extern "C" {

int hicache_layer_ops_abi_version() { return 2; }

// out[r, :] = weight * (x[r, :] * 1 / sqrt(mean(x[r, :]^2) + eps)) for rows r < rows.
void hicache_rms_norm(const float* x, int64_t x_stride, const float* weight, float* out,
                      int64_t out_stride, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * x_stride;
    float* dst = out + r * out_stride;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; ++i) sum += row[i] * row[i];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) dst[i] = weight[i] * (row[i] * inv);
  }
}

// Rotate the first `heads` heads of each token of x (head_dim = 2 * half) by the token's
// angles: out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]. cos, sin: [tokens, half]
// (row stride cs_stride); out: [tokens, heads, 2 * half], contiguous.
void hicache_rotary(const float* x, int64_t x_tok, int64_t x_head, const float* cos_,
                    const float* sin_, int64_t cs_stride, float* out, int64_t tokens,
                    int64_t heads, int64_t half) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float* c = cos_ + t * cs_stride;
    const float* s = sin_ + t * cs_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const float* x1 = x + t * x_tok + h * x_head;
      const float* x2 = x1 + half;
      float* o1 = out + (t * heads + h) * 2 * half;
      float* o2 = o1 + half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i] * c[i];
        const float b = x2[i] * s[i];
        const float d = x2[i] * c[i];
        const float e = x1[i] * s[i];
        o1[i] = a - b;
        o2[i] = d + e;
      }
    }
  }
}

// hicache_rms_norm for bfloat16 rows and weight (raw bits).
void hicache_rms_norm_bf16(const uint16_t* x, int64_t x_stride, const uint16_t* weight,
                           uint16_t* out, int64_t out_stride, int64_t rows, int64_t dim,
                           float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = x + r * x_stride;
    uint16_t* dst = out + r * out_stride;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; ++i) sum += widen(row[i]) * widen(row[i]);
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) {
      const float normed = widen(round_bf16(widen(row[i]) * inv));
      dst[i] = round_bf16(widen(weight[i]) * normed);
    }
  }
}

// hicache_rotary for bfloat16 x, cos and sin: each product, difference and sum rounded.
void hicache_rotary_bf16(const uint16_t* x, int64_t x_tok, int64_t x_head, const uint16_t* cos_,
                         const uint16_t* sin_, int64_t cs_stride, uint16_t* out, int64_t tokens,
                         int64_t heads, int64_t half) {
  for (int64_t t = 0; t < tokens; ++t) {
    const uint16_t* c = cos_ + t * cs_stride;
    const uint16_t* s = sin_ + t * cs_stride;
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* x1 = x + t * x_tok + h * x_head;
      const uint16_t* x2 = x1 + half;
      uint16_t* o1 = out + (t * heads + h) * 2 * half;
      uint16_t* o2 = o1 + half;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float a = widen(round_bf16(widen(x1[i]) * widen(c[i])));
        const float b = widen(round_bf16(widen(x2[i]) * widen(s[i])));
        const float d = widen(round_bf16(widen(x2[i]) * widen(c[i])));
        const float e = widen(round_bf16(widen(x1[i]) * widen(s[i])));
        o1[i] = round_bf16(a - b);
        o2[i] = round_bf16(d + e);
      }
    }
  }
}

}  // extern "C"
