// Paged decode attention for the CPU: one new query token per sequence, its keys and
// values read where they lie in the paged KV pool, through the sequence's page table.
//
// Built at run time by hicache/attention/cpu.py (g++ -O3 -march=native -fopenmp)
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

// exp(x) for the softmax's arguments (scores minus their maximum, so x <= 0), in
// arithmetic the compiler vectorizes: std::exp stays one scalar call per score (it may set
// errno), which took a fifth of this kernel's time. Cephes' expf: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by its degree-6 polynomial, 2^n written into the exponent bits;
// within 2 ulp of std::exp. Below -87 (where 2^n would leave the normal floats) it is 0,
// as far below 1 as a softmax weight can matter.
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.f);
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? 0.f : p * scale;
}

// Asks for the ``bytes`` from ``start`` ahead of their use, a cache line at a time.
inline void prefetch(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at);
}

template <typename T>
struct Step {
  const T* q;
  int64_t q_tok, q_head;
  const T* k;
  const T* v;
  int64_t kv_slot, kv_head;
  const int32_t* table;
  int64_t table_stride;
  const int32_t* lens;
  T* out;
  int H, KVH, D, page_size;
  float scale;
};

// Per thread: the task's query rows (scaled, in float), their scores over the whole
// context, their outputs and softmax sums. Reused across the tasks the thread takes.
struct Scratch {
  std::vector<float> qf, acc, scores, denom;
};

// The query heads of KV heads [kh0, kh1) of sequence b. Every key and value row is read
// once for all of them; with all of a sequence's KV heads in one task a page's slots are
// read whole and in address order, which the hardware prefetchers stream (one KV head
// alone reads a strided third of each slot: measured 2-3x slower from memory).
template <typename T>
void attend(const Step<T>& a, int b, int kh0, int kh1, Scratch& w) {
  const int G = a.H / a.KVH, D = a.D, L = a.lens[b], P = a.page_size;
  const int R = (kh1 - kh0) * G;
  w.qf.resize(static_cast<size_t>(R) * D);
  w.acc.assign(static_cast<size_t>(R) * D, 0.f);
  w.scores.resize(static_cast<size_t>(R) * L);
  w.denom.resize(R);
  for (int r = 0; r < R; ++r) {
    const T* row = a.q + b * a.q_tok + static_cast<int64_t>(kh0 * G + r) * a.q_head;
    for (int d = 0; d < D; ++d) w.qf[r * D + d] = to_float(row[d]) * a.scale;
  }
  const int32_t* pages = a.table + b * a.table_stride;
  const int num_pages = (L + P - 1) / P;
  // The part of a slot this task reads (its KV heads), in elements from the slot's start.
  const int64_t part_at = kh0 * a.kv_head;
  const int64_t part_bytes = ((kh1 - kh0 - 1) * a.kv_head + D) * static_cast<int64_t>(sizeof(T));
  // Pass 1: every score, page by page.
  for (int p = 0; p < num_pages; ++p) {
    const int start = p * P, n = std::min(P, L - start);
    const int64_t base = static_cast<int64_t>(pages[p]) * P;
    // The next page may lie anywhere, where the hardware's prefetchers cannot guess it:
    // while slot i is read, slot i of the next page is asked for (the whole page, spread
    // over this one's slots; one line of it alone measured slower).
    const int64_t next = p + 1 < num_pages ? static_cast<int64_t>(pages[p + 1]) * P : -1;
    for (int i = 0; i < n; ++i) {
      if (next >= 0) prefetch(a.k + (next + i) * a.kv_slot + part_at, part_bytes);
      const T* slot = a.k + (base + i) * a.kv_slot;
      for (int kh = kh0; kh < kh1; ++kh) {
        const T* key = slot + kh * a.kv_head;
        for (int g = 0; g < G; ++g) {
          const int r = (kh - kh0) * G + g;
          const float* qr = w.qf.data() + r * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int d = 0; d < D; ++d) s += qr[d] * to_float(key[d]);
          w.scores[static_cast<size_t>(r) * L + start + i] = s;
        }
      }
    }
  }
  // Softmax weights, unnormalized (divided by the sum at the end).
  for (int r = 0; r < R; ++r) {
    float* sr = w.scores.data() + static_cast<size_t>(r) * L;
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int j = 0; j < L; ++j) top = std::max(top, sr[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < L; ++j) {
      sr[j] = exp_nonpositive(sr[j] - top);
      sum += sr[j];
    }
    w.denom[r] = sum;
  }
  // Pass 2: the weighted sum of values.
  for (int p = 0; p < num_pages; ++p) {
    const int start = p * P, n = std::min(P, L - start);
    const int64_t base = static_cast<int64_t>(pages[p]) * P;
    const int64_t next = p + 1 < num_pages ? static_cast<int64_t>(pages[p + 1]) * P : -1;
    for (int i = 0; i < n; ++i) {
      if (next >= 0) prefetch(a.v + (next + i) * a.kv_slot + part_at, part_bytes);
      const T* slot = a.v + (base + i) * a.kv_slot;
      for (int kh = kh0; kh < kh1; ++kh) {
        const T* val = slot + kh * a.kv_head;
        for (int g = 0; g < G; ++g) {
          const int r = (kh - kh0) * G + g;
          const float wt = w.scores[static_cast<size_t>(r) * L + start + i];
          float* ar = w.acc.data() + r * D;
#pragma omp simd
          for (int d = 0; d < D; ++d) ar[d] += wt * to_float(val[d]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    T* dst = a.out + (static_cast<int64_t>(b) * a.H + kh0 * G + r) * D;
    const float inv = 1.f / w.denom[r];
    for (int d = 0; d < D; ++d) dst[d] = from_float<T>(w.acc[r * D + d] * inv);
  }
}

template <typename T>
void decode(const T* q, int64_t q_tok, int64_t q_head, const T* k, const T* v, int64_t kv_slot,
            int64_t kv_head, const int32_t* table, int64_t table_stride, const int32_t* lens,
            T* out, int B, int H, int KVH, int D, int page_size, float scale, int threads) {
  const Step<T> a{q, q_tok, q_head, k, v, kv_slot, kv_head, table, table_stride, lens,
                  out, H, KVH, D, page_size, scale};
  // A task per sequence (all its KV heads) when there are enough sequences for every
  // thread; else a task per (sequence, KV head), so that few sequences still use them all.
  const bool per_sequence = B >= threads;
#pragma omp parallel num_threads(threads)
  {
    Scratch w;
    if (per_sequence) {
#pragma omp for schedule(dynamic, 1)
      for (int b = 0; b < B; ++b) attend(a, b, 0, KVH, w);
    } else {
#pragma omp for collapse(2) schedule(dynamic, 1)
      for (int b = 0; b < B; ++b) {
        for (int kh = 0; kh < KVH; ++kh) attend(a, b, kh, kh + 1, w);
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
