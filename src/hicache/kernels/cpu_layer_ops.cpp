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
//
// Those roundings, done in integer arithmetic, made the bfloat16 ops 3-4x slower than the
// float32 ones (a dozen instructions a rounding). On CPUs with AVX512-BF16 each is one
// VCVTNEPS2BF16 instead (namespace bf16x16), which rounds as round_bf16 does except that
// it reads a subnormal input as zero: a row (or head) where any rounded value was
// subnormal is done again the integer way, so the bits are the same on every CPU.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HICACHE_BF16X16 1
#endif

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

#if HICACHE_BF16X16
// Sixteen lanes at a time with AVX512-BF16. Every arithmetic step is the scalar code's
// (the same IEEE operations in the same order), so a lane's result is the scalar one's.
namespace bf16x16 {

constexpr int kLanes = 16;

inline __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 load(const uint16_t* p) {
  return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// x rounded to bfloat16; lanes whose x was subnormal (rounded here to zero, where
// round_bf16 keeps a subnormal) are added to `subnormal`.
inline __m256i narrow(__m512 x, __mmask16& subnormal) {
  subnormal |= _mm512_fpclass_ps_mask(x, 0x20);
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
}

inline void store(uint16_t* p, __m512 x, __mmask16& subnormal) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(x, subnormal));
}

// to_bf16_precision.
inline __m512 bf16_precision(__m512 x, __mmask16& subnormal) {
  return widen(narrow(x, subnormal));
}

// exp_below_88, the same operations.
inline __m512 exp_below_88(__m512 x) {
  // (std::max(a, b) is b < a ? ... : the operand order below keeps its NaN.)
  const __m512 clamped = _mm512_max_ps(_mm512_set1_ps(-87.f), x);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_add_ps(_mm512_mul_ps(clamped, _mm512_set1_ps(1.44269504088896341f)),
                    _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), clamped);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 result = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  const __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(result, below, _mm512_setzero_ps());
}

// silu, the same operations.
inline __m512 silu(__m512 x) {
  const __m512 negated = _mm512_xor_ps(x, _mm512_set1_ps(-0.f));
  const __m512 e = exp_below_88(_mm512_min_ps(_mm512_set1_ps(87.f), negated));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

}  // namespace bf16x16
#endif

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

int hicache_layer_ops_abi_version() { return 4; }

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
    int64_t done = 0;
#if HICACHE_BF16X16
    __mmask16 subnormal = 0;
    const __m512 inv16 = _mm512_set1_ps(inv);
    for (; done + bf16x16::kLanes <= dim; done += bf16x16::kLanes) {
      const __m512 normed =
          bf16x16::bf16_precision(_mm512_mul_ps(bf16x16::load(row + done), inv16), subnormal);
      bf16x16::store(dst + done, _mm512_mul_ps(bf16x16::load(weight + done), normed), subnormal);
    }
    if (subnormal) done = 0;
#endif
#pragma omp simd
    for (int64_t i = done; i < dim; ++i) {
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
      int64_t done = 0;
#if HICACHE_BF16X16
      __mmask16 subnormal = 0;
      for (; done + bf16x16::kLanes <= half; done += bf16x16::kLanes) {
        using namespace bf16x16;
        const __m512 a1 = load(x1 + done), a2 = load(x2 + done);
        const __m512 ci = load(c + done), si = load(s + done);
        const __m512 a = bf16_precision(_mm512_mul_ps(a1, ci), subnormal);
        const __m512 b = bf16_precision(_mm512_mul_ps(a2, si), subnormal);
        const __m512 d = bf16_precision(_mm512_mul_ps(a2, ci), subnormal);
        const __m512 e = bf16_precision(_mm512_mul_ps(a1, si), subnormal);
        bf16x16::store(o1 + done, _mm512_sub_ps(a, b), subnormal);
        bf16x16::store(o2 + done, _mm512_add_ps(d, e), subnormal);
      }
      if (subnormal) done = 0;
#endif
#pragma omp simd
      for (int64_t i = done; i < half; ++i) {
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
  const auto op = [](uint16_t gate, uint16_t up) {
    return round_bf16(to_bf16_precision(silu(widen(gate))) * widen(up));
  };
#if HICACHE_BF16X16
  if (width >= bf16x16::kLanes) {
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const uint16_t* gate = gate_up + r * stride;
      const uint16_t* up = gate + width;
      uint16_t* dst = out + r * width;
      __mmask16 subnormal = 0;
      int64_t done = 0;
      for (; done + bf16x16::kLanes <= width; done += bf16x16::kLanes) {
        using namespace bf16x16;
        const __m512 gated = bf16_precision(silu(load(gate + done)), subnormal);
        bf16x16::store(dst + done, _mm512_mul_ps(gated, load(up + done)), subnormal);
      }
      if (subnormal) done = 0;
      for (int64_t i = done; i < width; ++i) dst[i] = op(gate[i], up[i]);
    }
    return;
  }
#endif
  swiglu_rows(gate_up, stride, out, rows, width, threads, op);
}

// 1 where the bfloat16 ops round with AVX512-BF16 (namespace bf16x16), else 0.
int hicache_layer_ops_bf16x16() {
#if HICACHE_BF16X16
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
