// A decoder layer's elementwise work for the CPU in float32 and bfloat16, each in one pass:
// RMSNorm, the rotary embedding and SwiGLU's silu(gate) * up.
//
// torch runs each of these as several ops (RMSNorm: square, mean, rsqrt, two products;
// RoPE: seven), each a pass over the rows and a few microseconds of dispatch; in a decode
// step of a small model that is several percent of the step. Here every row is read once
// and written once. Built at run time by hicache/kernels/cpu_layer_ops.py through
// hicache/kernels/cpu_build.py (g++ -O3 -march=native) and called through ctypes.
//
// Rounding follows the reference models' order of operations (products and sums are not
// contracted into fused multiply-adds: -ffp-contract=off); only the mean of squares is
// summed in another order than torch's; silu's exp is Cephes' polynomial (within 2 ulp of
// std::exp) where torch's is Sleef's.
//
// Rows are split over `threads` OpenMP threads (the caller passes 1 for a few rows, where
// waking a team costs more than the pass): for a 1,024-token prompt torch's silu and product
// took 1.8 ms a layer in the model (two passes, two threads) and these ops single-threaded
// as much again in bf16 (docs/benchmarks.md).
//
// bfloat16 values are widened to float32 and every result the model's torch code rounds
// to bfloat16 is rounded here too (to nearest even), at the same points: torch computes a
// bfloat16 op in float32 and rounds its result, so the rotary embedding gives torch's bits;
// RMSNorm normalizes in float32 (the reference models do), rounds, then multiplies by the
// weight and rounds again, as ``weight * normed.to(bfloat16)`` does.

#include <algorithm>
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

// x rounded to bfloat16 and widened back, in 32-bit lanes throughout: what
// widen(round_bf16(x)) gives, without narrowing to 16 bits and back between ops.
inline float to_bf16_precision(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t nearest = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const uint32_t quiet = (bits & 0xffff0000u) | 0x400000u;
  const uint32_t rounded = (bits & 0x7fffffffu) > 0x7f800000u ? quiet : nearest;
  float y;
  std::memcpy(&y, &rounded, sizeof(y));
  return y;
}

inline uint16_t round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t nearest = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;  // to nearest even
  const uint32_t quiet = (bits >> 16) | 0x40u;  // a NaN stays a NaN, made quiet
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet : nearest);
}

// exp(x) for x <= 87 in arithmetic the compiler vectorizes (std::exp is a scalar call):
// Cephes' expf, x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 polynomial, 2^n
// written into the exponent bits, in fused multiply-adds (explicit: the file is built
// without contraction); within 2 ulp of std::exp. Below -87 it is 0.
inline float exp_below_88(float x) {
  const float clamped = std::max(x, -87.f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  float r = std::fma(n, -0.693359375f, clamped);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r) + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? 0.f : p * scale;
}

// silu(x) = x / (1 + exp(-x)). For x < -87 exp(-x) stops at exp(87): the result, below
// 1e-36 in magnitude, is not torch's (which is as small, or -0 below -88.7).
inline float silu(float x) { return x / (1.f + exp_below_88(std::min(-x, 87.f))); }

// The rows of hicache_silu_mul, `op(gate, up)` an element's result in T.
template <typename T, typename Op>
inline void swiglu_rows(const T* gate_up, int64_t stride, T* out, int64_t rows, int64_t width,
                        int threads, Op op) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * stride;
    const T* up = gate + width;
    T* dst = out + r * width;
#pragma omp simd
    for (int64_t i = 0; i < width; ++i) dst[i] = op(gate[i], up[i]);
  }
}

}  // namespace

extern "C" {

int hicache_layer_ops_abi_version() { return 3; }

// out[r, :] = weight * (x[r, :] * 1 / sqrt(mean(x[r, :]^2) + eps)) for rows r < rows.
void hicache_rms_norm(const float* x, int64_t x_stride, const float* weight, float* out,
                      int64_t out_stride, int64_t rows, int64_t dim, float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
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
                    int64_t heads, int64_t half, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
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
                           float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = x + r * x_stride;
    uint16_t* dst = out + r * out_stride;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < dim; ++i) sum += widen(row[i]) * widen(row[i]);
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) {
      const float normed = to_bf16_precision(widen(row[i]) * inv);
      dst[i] = round_bf16(widen(weight[i]) * normed);
    }
  }
}

// hicache_rotary for bfloat16 x, cos and sin: each product, difference and sum rounded.
void hicache_rotary_bf16(const uint16_t* x, int64_t x_tok, int64_t x_head, const uint16_t* cos_,
                         const uint16_t* sin_, int64_t cs_stride, uint16_t* out, int64_t tokens,
                         int64_t heads, int64_t half, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
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
        const float a = to_bf16_precision(widen(x1[i]) * widen(c[i]));
        const float b = to_bf16_precision(widen(x2[i]) * widen(s[i]));
        const float d = to_bf16_precision(widen(x2[i]) * widen(c[i]));
        const float e = to_bf16_precision(widen(x1[i]) * widen(s[i]));
        o1[i] = round_bf16(a - b);
        o2[i] = round_bf16(d + e);
      }
    }
  }
}

// out[r, :] = silu(gate_up[r, :width]) * gate_up[r, width:2 width] for rows r < rows (the
// gate and up projections side by side in one row, as one GEMM writes them); out: [rows,
// width], contiguous.
void hicache_silu_mul(const float* gate_up, int64_t stride, float* out, int64_t rows,
                      int64_t width, int threads) {
  swiglu_rows(gate_up, stride, out, rows, width, threads,
              [](float gate, float up) { return silu(gate) * up; });
}

// hicache_silu_mul for bfloat16: silu rounded, then the product rounded (torch's two ops).
void hicache_silu_mul_bf16(const uint16_t* gate_up, int64_t stride, uint16_t* out, int64_t rows,
                           int64_t width, int threads) {
  swiglu_rows(gate_up, stride, out, rows, width, threads, [](uint16_t gate, uint16_t up) {
    return round_bf16(to_bf16_precision(silu(widen(gate))) * widen(up));
  });
}

}  // extern "C"
