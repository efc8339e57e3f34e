// Products of a few rows by a float32 or bfloat16 weight, y = x @ W^T (+ bias), for the
// CPU: the rows of a decode step.
//
// A decode step multiplies a handful of rows by every weight of the model once, so it is
// bound by reading the weights from memory. oneDNN's packed GEMM read SmolLM2-135M's
// weights at 18-22 GB/s for 1-8 rows where this machine streams ~30 GB/s on two threads.
// Here the weight is stored in blocks of 16 output features ([N / 16, K, 16]: each block is
// one contiguous run the hardware prefetcher follows, a 64-byte line per k), and each
// block is read once per 8 rows: for each k, its 16 weights are one vector load, and every
// row adds x[r, k] times that vector into its own 16 accumulators (a fused multiply-add
// with the scalar broadcast from memory).
//
// Each output is summed over k in order, in one float32 lane, whatever the number of rows:
// a row's result does not depend on which other rows share its step (a request decodes
// the same tokens alone or batched). The sums run in another order than oneDNN's, so
// results differ from its in the last bits. bfloat16 weights are widened to float32 as
// they are read (half the bytes of a float32 weight), products and sums are float32, and
// each output is rounded to bfloat16 once, as oneDNN's bfloat16 GEMM does.
//
// Built at run time by hicache/kernels/few_rows.py through hicache/kernels/cpu_build.py
// (g++ -O3 -march=native -fopenmp) and called through ctypes. GCC's vector extension is
// lowered to whatever the machine has (one AVX-512 register, two AVX2 ones, ...). OpenMP
// resolves to the runtime torch already loaded (same soname): one thread pool.

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX512BF16__
#include <immintrin.h>
#endif

namespace {

constexpr int kBlock = 16;  // output features per block: one 64-byte vector of floats
// Rows a block is read for at once: their accumulators stay in registers (8 of AVX-512's
// 32; with 16-register AVX2 a vector takes two, so 4 rows fill half of them).
#ifdef __AVX512F__
constexpr int kRows = 8;
#else
constexpr int kRows = 4;
#endif
// How far ahead of the loads the next lines are asked for, in bytes (16 lines).
constexpr int64_t kPrefetchBytes = 1024;

typedef float vec __attribute__((vector_size(kBlock * sizeof(float))));
typedef uint32_t bits __attribute__((vector_size(kBlock * sizeof(uint32_t))));
typedef uint16_t halves __attribute__((vector_size(kBlock * sizeof(uint16_t))));

// bfloat16 travels as its 16 bits: the high half of a float32's.
struct bf16 {
  uint16_t raw;
};

inline float to_float(float x) { return x; }

inline float to_float(bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.raw) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}

inline vec load(const bf16* p) {
  halves h;
  std::memcpy(&h, p, sizeof(halves));
  const bits u = __builtin_convertvector(h, bits) << 16;
  vec v;
  std::memcpy(&v, &u, sizeof(vec));
  return v;
}

// float32 -> bfloat16, rounded to nearest even as torch rounds it (NaN stays a NaN).
inline halves round_to_bf16(vec v) {
  bits u;
  std::memcpy(&u, &v, sizeof(bits));
  const bits nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  bits r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  r = (r & ~nan) | (nan & 0x7FC0u);
  return __builtin_convertvector(r, halves);
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof(vec)); }

inline void store(bf16* p, vec v) {
  const halves h = round_to_bf16(v);
  std::memcpy(p, &h, sizeof(halves));
}

inline void store_lane(float* p, float x) { *p = x; }

inline void store_lane(bf16* p, float x) {
  vec v = vec{} + x;
  p->raw = round_to_bf16(v)[0];
}

// R rows' sums (plus the bias) into y[r, 0 : valid] (valid <= 16: the last block of a
// weight whose N is not a multiple of 16 is padded).
template <int R, typename T>
inline void store_rows(const vec* acc, const T* __restrict bias, T* __restrict y,
                       int64_t y_stride, int valid) {
  for (int r = 0; r < R; ++r) {
    vec out = acc[r];
    if (valid == kBlock) {
      if (bias != nullptr) out += load(bias);
      store(y + r * y_stride, out);
    } else {
      for (int i = 0; i < valid; ++i) {
        store_lane(y + r * y_stride + i, bias ? out[i] + to_float(bias[i]) : out[i]);
      }
    }
  }
}

// R rows of x (float32) times one block of the weight (w: [K, 16]) into y[r, 0 : valid]
// (valid <= 16: the last block of a weight whose N is not a multiple of 16 is padded).
template <int R, typename T>
inline void block_rows(const float* __restrict x, int64_t x_stride, const T* __restrict w,
                       int64_t K, const T* __restrict bias, T* __restrict y, int64_t y_stride,
                       int valid) {
  constexpr int64_t ahead = kPrefetchBytes / sizeof(T);
  vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vec{};
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(w + k * kBlock + ahead, 0, 0);
    const vec wk = load(w + k * kBlock);
    for (int r = 0; r < R; ++r) acc[r] += x[r * x_stride + k] * wk;
  }
  store_rows<R>(acc, bias, y, y_stride, valid);
}

template <typename T>
void block(const float* x, int64_t x_stride, int64_t M, const T* w, int64_t K, const T* bias,
           T* y, int64_t y_stride, int valid) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) {
    block_rows<kRows>(x + m * x_stride, x_stride, w, K, bias, y + m * y_stride, y_stride,
                      valid);
  }
  x += m * x_stride;
  y += m * y_stride;
  switch (M - m) {
    case 7: if constexpr (kRows > 7) block_rows<7>(x, x_stride, w, K, bias, y, y_stride, valid); break;
    case 6: if constexpr (kRows > 6) block_rows<6>(x, x_stride, w, K, bias, y, y_stride, valid); break;
    case 5: if constexpr (kRows > 5) block_rows<5>(x, x_stride, w, K, bias, y, y_stride, valid); break;
    case 4: if constexpr (kRows > 4) block_rows<4>(x, x_stride, w, K, bias, y, y_stride, valid); break;
    case 3: block_rows<3>(x, x_stride, w, K, bias, y, y_stride, valid); break;
    case 2: block_rows<2>(x, x_stride, w, K, bias, y, y_stride, valid); break;
    case 1: block_rows<1>(x, x_stride, w, K, bias, y, y_stride, valid); break;
    default: break;
  }
}

// bfloat16: the weight is blocked in pairs of k ([ceil(N / 16), ceil(K / 2), 16, 2]: one
// 64-byte vector holds 16 outputs' weights for k and k + 1), the layout of AVX-512 BF16's
// pairwise dot product (VDPBF16PS: two bfloat16 products added into a float32 lane, twice
// the products of a float32 FMA). `pairs` holds each row's (x[2j], x[2j + 1]) as one 32-bit
// word (row stride `pair_stride`, zero-padded), and the widened rows the same values as
// float32 (row stride 2 * pair_stride) for CPUs without it, which add the two products
// of a pair in the instruction's order (k + 1, then k), each product exact in float32.
template <int R>
inline void pair_rows(const uint32_t* __restrict pairs, const float* __restrict widened,
                      int64_t pair_stride, const bf16* __restrict w, int64_t K2,
                      const bf16* __restrict bias, bf16* __restrict y, int64_t y_stride,
                      int valid) {
  constexpr int64_t ahead = kPrefetchBytes / sizeof(bf16);
  vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vec{};
  for (int64_t j = 0; j < K2; ++j) {
    const bf16* wj = w + j * 2 * kBlock;
    __builtin_prefetch(wj + ahead, 0, 0);
#ifdef __AVX512BF16__
    const __m512bh wk = (__m512bh)_mm512_loadu_si512(wj);
    for (int r = 0; r < R; ++r) {
      const __m512bh xk = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r * pair_stride + j]));
      acc[r] = (vec)_mm512_dpbf16_ps((__m512)acc[r], xk, wk);
    }
    (void)widened;
#else
    bits u;
    std::memcpy(&u, wj, sizeof(bits));
    const bits low = u << 16, high = u & 0xFFFF0000u;
    vec w0, w1;
    std::memcpy(&w0, &low, sizeof(vec));
    std::memcpy(&w1, &high, sizeof(vec));
    for (int r = 0; r < R; ++r) {
      const float* xr = widened + r * 2 * pair_stride + 2 * j;
      acc[r] += xr[1] * w1;
      acc[r] += xr[0] * w0;
    }
    (void)pairs;
#endif
  }
  store_rows<R>(acc, bias, y, y_stride, valid);
}

void pair_block(const uint32_t* pairs, const float* widened, int64_t pair_stride, int64_t M,
                const bf16* w, int64_t K2, const bf16* bias, bf16* y, int64_t y_stride,
                int valid) {
  int64_t m = 0;
  for (; m + kRows <= M; m += kRows) {
    pair_rows<kRows>(pairs + m * pair_stride, widened + m * 2 * pair_stride, pair_stride, w,
                     K2, bias, y + m * y_stride, y_stride, valid);
  }
  pairs += m * pair_stride;
  widened += m * 2 * pair_stride;
  y += m * y_stride;
  switch (M - m) {
    case 7: if constexpr (kRows > 7) pair_rows<7>(pairs, widened, pair_stride, w, K2, bias, y, y_stride, valid); break;
    case 6: if constexpr (kRows > 6) pair_rows<6>(pairs, widened, pair_stride, w, K2, bias, y, y_stride, valid); break;
    case 5: if constexpr (kRows > 5) pair_rows<5>(pairs, widened, pair_stride, w, K2, bias, y, y_stride, valid); break;
    case 4: if constexpr (kRows > 4) pair_rows<4>(pairs, widened, pair_stride, w, K2, bias, y, y_stride, valid); break;
    case 3: pair_rows<3>(pairs, widened, pair_stride, w, K2, bias, y, y_stride, valid); break;
    case 2: pair_rows<2>(pairs, widened, pair_stride, w, K2, bias, y, y_stride, valid); break;
    case 1: pair_rows<1>(pairs, widened, pair_stride, w, K2, bias, y, y_stride, valid); break;
    default: break;
  }
}

// The blocks are shared out among `threads` OpenMP threads in contiguous runs.
void few_rows_linear(const float* x, int64_t x_stride, int64_t M, const float* w, int64_t K,
                     int64_t N, const float* bias, float* y, int64_t y_stride, int threads) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int valid = static_cast<int>(N - b * kBlock < kBlock ? N - b * kBlock : kBlock);
    block(x, x_stride, M, w + b * K * kBlock, K, bias == nullptr ? nullptr : bias + b * kBlock,
          y + b * kBlock, y_stride, valid);
  }
}

// bfloat16: each thread first copies the rows into its pairs and widened buffers (a few
// rows: a few KiB), then takes its run of blocks.
void few_rows_linear_bf16(const bf16* x, int64_t x_stride, int64_t M, const bf16* w, int64_t K,
                          int64_t N, const bf16* bias, bf16* y, int64_t y_stride, int threads) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  const int64_t K2 = (K + 1) / 2;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<uint32_t> pairs(static_cast<size_t>(M * K2), 0);
    std::vector<float> widened(static_cast<size_t>(M * 2 * K2), 0.0f);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) {
        const bf16 v = x[m * x_stride + k];
        pairs[m * K2 + k / 2] |= static_cast<uint32_t>(v.raw) << (16 * (k % 2));
        widened[m * 2 * K2 + k] = to_float(v);
      }
    }
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int valid = static_cast<int>(N - b * kBlock < kBlock ? N - b * kBlock : kBlock);
      pair_block(pairs.data(), widened.data(), K2, M, w + b * K2 * 2 * kBlock, K2,
                 bias == nullptr ? nullptr : bias + b * kBlock, y + b * kBlock, y_stride,
                 valid);
    }
  }
}

}  // namespace

extern "C" {

int hicache_few_rows_abi_version() { return 3; }

int hicache_few_rows_block() { return kBlock; }

// y[M, N] (row stride y_stride) = x[M, K] (row stride x_stride) @ W^T + bias, with W
// [N, K] given blocked as w[ceil(N / 16), K, 16] (zeros past N) and bias [N] or null;
// float32 (below: bfloat16, w[ceil(N / 16), ceil(K / 2), 16, 2], summed in float32 and
// rounded once at the end).
void hicache_few_rows_linear(const float* x, int64_t x_stride, int64_t M, const float* w,
                             int64_t K, int64_t N, const float* bias, float* y,
                             int64_t y_stride, int threads) {
  few_rows_linear(x, x_stride, M, w, K, N, bias, y, y_stride, threads);
}

void hicache_few_rows_linear_bf16(const bf16* x, int64_t x_stride, int64_t M, const bf16* w,
                                  int64_t K, int64_t N, const bf16* bias, bf16* y,
                                  int64_t y_stride, int threads) {
  few_rows_linear_bf16(x, x_stride, M, w, K, N, bias, y, y_stride, threads);
}

}  // extern "C"
