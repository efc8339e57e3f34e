// Products of a few rows by a float32 weight, y = x @ W^T (+ bias), for the CPU: the rows
// of a decode step.
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
// results differ from its in the last bits.
//
// Built at run time by hicache/kernels/few_rows.py through hicache/kernels/cpu_build.py
// (g++ -O3 -march=native -fopenmp) and called through ctypes. GCC's vector extension is
// lowered to whatever the machine has (one AVX-512 register, two AVX2 ones, ...). OpenMP
// resolves to the runtime torch already loaded (same soname): one thread pool.

#include <cstdint>
#include <cstring>

namespace {

constexpr int kBlock = 16;  // output features per block: one 64-byte vector
// Rows a block is read for at once: their accumulators stay in registers (8 of AVX-512's
// 32; with 16-register AVX2 a vector takes two, so 4 rows fill half of them).
#ifdef __AVX512F__
constexpr int kRows = 8;
#else
constexpr int kRows = 4;
#endif
// How far ahead of the loads the next lines are asked for, in floats (1 KiB: 16 lines).
constexpr int64_t kPrefetch = 256;

typedef float vec __attribute__((vector_size(kBlock * sizeof(float))));

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(vec));
  return v;
}

// R rows of x times one block of the weight (w: [K, 16]) into y[r, 0 : valid] (valid <= 16:
// the last block of a weight whose N is not a multiple of 16 is padded with zeros).
template <int R>
inline void block_rows(const float* __restrict x, int64_t x_stride, const float* __restrict w,
                       int64_t K, const float* __restrict bias, float* __restrict y,
                       int64_t y_stride, int valid) {
  vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = vec{};
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(w + (k * kBlock) + kPrefetch, 0, 0);
    const vec wk = load(w + k * kBlock);
    for (int r = 0; r < R; ++r) acc[r] += x[r * x_stride + k] * wk;
  }
  for (int r = 0; r < R; ++r) {
    vec out = acc[r];
    if (valid == kBlock) {
      if (bias != nullptr) out += load(bias);
      std::memcpy(y + r * y_stride, &out, sizeof(vec));
    } else {
      for (int i = 0; i < valid; ++i) y[r * y_stride + i] = bias ? out[i] + bias[i] : out[i];
    }
  }
}

void block(const float* x, int64_t x_stride, int64_t M, const float* w, int64_t K,
           const float* bias, float* y, int64_t y_stride, int valid) {
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

}  // namespace

extern "C" {

int hicache_few_rows_abi_version() { return 1; }

int hicache_few_rows_block() { return kBlock; }

// y[M, N] (row stride y_stride) = x[M, K] (row stride x_stride) @ W^T + bias, with W
// [N, K] given blocked as w[ceil(N / 16), K, 16] (zeros past N) and bias [N] or null.
// The blocks are shared out among `threads` OpenMP threads in contiguous runs.
void hicache_few_rows_linear(const float* x, int64_t x_stride, int64_t M, const float* w,
                             int64_t K, int64_t N, const float* bias, float* y,
                             int64_t y_stride, int threads) {
  const int64_t blocks = (N + kBlock - 1) / kBlock;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int valid = static_cast<int>(N - b * kBlock < kBlock ? N - b * kBlock : kBlock);
    block(x, x_stride, M, w + b * K * kBlock, K, bias == nullptr ? nullptr : bias + b * kBlock,
          y + b * kBlock, y_stride, valid);
  }
}

}  // extern "C"
