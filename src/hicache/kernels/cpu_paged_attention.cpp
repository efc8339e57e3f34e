// Paged decode attention for the CPU: one new query token per sequence, its keys and
// values read where they lie in the paged KV pool, through the sequence's page table.
//
// Built at run time by hicache/kernels/cpu_attention.py (g++ -O3 -march=native -fopenmp)
// and called through ctypes. OpenMP resolves to the runtime torch already loaded (same
// soname), so this kernel and torch's own ops share one thread pool.
//
// Layouts (element strides given by the caller; the last dimension is contiguous):
//   q      [B, H, D]            (token stride q_tok, head stride q_head)
//   k, v   [slots, KVH, D]      (slot stride kv_slot, head stride kv_head)
//   table  [B, max_pages] int32 (row stride table_stride): pages of each context in order
//   lens   [B] int32            context length of each sequence (its new token included)
//   out    [B, H, D]            contiguous
// Query head h reads KV head h / (H / KVH). Scores and the softmax are in float32.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct BF16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(BF16 x) {
  uint32_t wide = static_cast<uint32_t>(x.bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}
inline float to_float(_Float16 x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline _Float16 from_float<_Float16>(float x) { return static_cast<_Float16>(x); }
template <>
inline BF16 from_float<BF16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return BF16{static_cast<uint16_t>((bits >> 16) | 0x40)};
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
  return BF16{static_cast<uint16_t>(bits >> 16)};
}

template <typename T>
void decode(const T* q, int64_t q_tok, int64_t q_head, const T* k, const T* v, int64_t kv_slot,
            int64_t kv_head, const int32_t* table, int64_t table_stride, const int32_t* lens,
            T* out, int B, int H, int KVH, int D, int page_size, float scale, int threads) {
  const int G = H / KVH;
#pragma omp parallel num_threads(threads)
  {
    // Per thread: the G query rows of one KV head (scaled, in float), their scores over
    // the whole context, and their outputs. Reused across the tasks this thread takes.
    std::vector<float> qf(static_cast<size_t>(G) * D);
    std::vector<float> acc(static_cast<size_t>(G) * D);
    std::vector<float> scores;
    std::vector<float> denom(G);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int b = 0; b < B; ++b) {
      for (int kh = 0; kh < KVH; ++kh) {
        const int L = lens[b];
        scores.resize(static_cast<size_t>(G) * L);
        for (int g = 0; g < G; ++g) {
          const T* row = q + b * q_tok + static_cast<int64_t>(kh * G + g) * q_head;
          for (int d = 0; d < D; ++d) qf[g * D + d] = to_float(row[d]) * scale;
        }
        const int32_t* pages = table + b * table_stride;
        // Pass 1: every score, page by page (each key row read once for all G heads).
        for (int start = 0, p = 0; start < L; start += page_size, ++p) {
          const int n = std::min(page_size, L - start);
          const int64_t base = static_cast<int64_t>(pages[p]) * page_size;
          for (int i = 0; i < n; ++i) {
            const T* key = k + (base + i) * kv_slot + kh * kv_head;
            for (int g = 0; g < G; ++g) {
              const float* qg = qf.data() + g * D;
              float s = 0.f;
#pragma omp simd reduction(+ : s)
              for (int d = 0; d < D; ++d) s += qg[d] * to_float(key[d]);
              scores[static_cast<size_t>(g) * L + start + i] = s;
            }
          }
        }
        // Softmax weights, unnormalized (divided by the sum at the end).
        for (int g = 0; g < G; ++g) {
          float* sg = scores.data() + static_cast<size_t>(g) * L;
          float top = -INFINITY;
          for (int j = 0; j < L; ++j) top = std::max(top, sg[j]);
          float sum = 0.f;
          for (int j = 0; j < L; ++j) {
            sg[j] = std::exp(sg[j] - top);
            sum += sg[j];
          }
          denom[g] = sum;
        }
        // Pass 2: the weighted sum of values (each value row read once).
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int start = 0, p = 0; start < L; start += page_size, ++p) {
          const int n = std::min(page_size, L - start);
          const int64_t base = static_cast<int64_t>(pages[p]) * page_size;
          for (int i = 0; i < n; ++i) {
            const T* val = v + (base + i) * kv_slot + kh * kv_head;
            for (int g = 0; g < G; ++g) {
              const float w = scores[static_cast<size_t>(g) * L + start + i];
              float* ag = acc.data() + g * D;
#pragma omp simd
              for (int d = 0; d < D; ++d) ag[d] += w * to_float(val[d]);
            }
          }
        }
        for (int g = 0; g < G; ++g) {
          T* dst = out + (static_cast<int64_t>(b) * H + kh * G + g) * D;
          const float inv = 1.f / denom[g];
          for (int d = 0; d < D; ++d) dst[d] = from_float<T>(acc[g * D + d] * inv);
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16, 2 float16. Returns 0, or -1 for an unknown dtype.
int hicache_paged_decode(int dtype, const void* q, int64_t q_tok, int64_t q_head, const void* k,
                         const void* v, int64_t kv_slot, int64_t kv_head, const int32_t* table,
                         int64_t table_stride, const int32_t* lens, void* out, int B, int H,
                         int KVH, int D, int page_size, float scale, int threads) {
  switch (dtype) {
    case 0:
      decode(static_cast<const float*>(q), q_tok, q_head, static_cast<const float*>(k),
             static_cast<const float*>(v), kv_slot, kv_head, table, table_stride, lens,
             static_cast<float*>(out), B, H, KVH, D, page_size, scale, threads);
      return 0;
    case 1:
      decode(static_cast<const BF16*>(q), q_tok, q_head, static_cast<const BF16*>(k),
             static_cast<const BF16*>(v), kv_slot, kv_head, table, table_stride, lens,
             static_cast<BF16*>(out), B, H, KVH, D, page_size, scale, threads);
      return 0;
    case 2:
      decode(static_cast<const _Float16*>(q), q_tok, q_head, static_cast<const _Float16*>(k),
             static_cast<const _Float16*>(v), kv_slot, kv_head, table, table_stride, lens,
             static_cast<_Float16*>(out), B, H, KVH, D, page_size, scale, threads);
      return 0;
    default:
      return -1;
  }
}

int hicache_kernel_abi_version(void) { return 1; }
}
