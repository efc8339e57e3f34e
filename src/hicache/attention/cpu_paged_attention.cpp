// Paged attention for the CPU, keys and values read where they lie in the paged KV pool,
// through each sequence's page table: decode (one new query token per sequence; below) and
// prefill (a prompt's new tokens, causal; hicache_paged_prefill, further down).
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
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#endif

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

#if defined(__AVX512F__)
constexpr int VW = 16;  // floats per vector register
#elif defined(__AVX__)
constexpr int VW = 8;
#else
constexpr int VW = 4;  // SSE, NEON
#endif
typedef float vf __attribute__((vector_size(VW * sizeof(float))));

inline vf load(const float* p) {
  vf x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
inline void store(float* p, vf x) { std::memcpy(p, &x, sizeof(x)); }

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

// The R rows' scores (each L long, in w.scores) become their softmax weights, unnormalized
// (divided by the sum, w.denom, at the end).
inline void softmax_rows(Scratch& w, int R, int L) {
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
}

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
  softmax_rows(w, R, L);
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

#if defined(__AVX512F__)
// A vector's VW elements of a K or V row, as float.
inline vf load_row(const float* p) { return load(p); }
inline vf load_row(const BF16* p) {
  const __m512i wide = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<vf>(_mm512_castsi512_ps(wide));
}
inline vf load_row(const _Float16* p) {
  return reinterpret_cast<vf>(
      _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
inline float hsum(vf x) { return _mm512_reduce_add_ps(reinterpret_cast<__m512>(x)); }

// ``attend`` for a head size of NV vectors and G query heads a KV head, both known to the
// compiler: the loops over a row's vectors and over the G heads unroll, and each key or
// value row is loaded and widened once for its G heads (the general code above converts
// it once a head, its reductions sized at run time). Slots are read in address order, all
// of the task's KV heads of a slot together, as above. Twice the general code's speed
// with the KV in cache (bf16 and float32, SmolLM2's heads, 8 rows over 512 tokens); from
// memory, float32 is bound by the reads either way. A row's arithmetic depends on nothing
// but its own query, keys and values, so its output is the same whichever task or batch
// it is in.
template <typename T, int NV, int G>
void attend_shaped(const Step<T>& a, int b, int kh0, int kh1, Scratch& w) {
  constexpr int D = NV * VW;
  const int L = a.lens[b], P = a.page_size;
  const int R = (kh1 - kh0) * G;
  w.acc.assign(static_cast<size_t>(R) * D, 0.f);
  w.scores.resize(static_cast<size_t>(R) * L);
  w.denom.resize(R);
  const int32_t* pages = a.table + b * a.table_stride;
  const int num_pages = (L + P - 1) / P;
  const int64_t part_at = kh0 * a.kv_head;
  const int64_t part_bytes = ((kh1 - kh0 - 1) * a.kv_head + D) * static_cast<int64_t>(sizeof(T));
  // Pass 1: every score, slot by slot in address order (all of the task's KV heads of a
  // slot together; a KV head at a time, page by page, measured 3-8% slower a float32
  // decode step at 512 tokens, read from memory), the queries from the scratch (in L1).
  w.qf.resize(static_cast<size_t>(R) * D);
  for (int r = 0; r < R; ++r) {
    const T* row = a.q + b * a.q_tok + static_cast<int64_t>(kh0 * G + r) * a.q_head;
    for (int v = 0; v < NV; ++v) {
      store(w.qf.data() + r * D + v * VW, load_row(row + v * VW) * a.scale);
    }
  }
  for (int p = 0; p < num_pages; ++p) {
    const int start = p * P, n = std::min(P, L - start);
    const int64_t base = static_cast<int64_t>(pages[p]) * P;
    const int64_t next = p + 1 < num_pages ? static_cast<int64_t>(pages[p + 1]) * P : -1;
    for (int i = 0; i < n; ++i) {
      if (next >= 0) prefetch(a.k + (next + i) * a.kv_slot + part_at, part_bytes);
      const T* slot = a.k + (base + i) * a.kv_slot;
      for (int kh = kh0; kh < kh1; ++kh) {
        const T* key = slot + kh * a.kv_head;
        vf k[NV];
        for (int v = 0; v < NV; ++v) k[v] = load_row(key + v * VW);
        const float* q = w.qf.data() + static_cast<size_t>((kh - kh0) * G) * D;
        float* sc = w.scores.data() + static_cast<size_t>((kh - kh0) * G) * L + start + i;
        for (int g = 0; g < G; ++g) {
          vf prod = load(q + g * D) * k[0];
          for (int v = 1; v < NV; ++v) prod += load(q + g * D + v * VW) * k[v];
          sc[static_cast<size_t>(g) * L] = hsum(prod);
        }
      }
    }
  }
  softmax_rows(w, R, L);
  // Pass 2: the weighted sum of values, slot by slot as pass 1 (the sums in the scratch:
  // a page at a time with them in registers, KV head by KV head, was 1.4x faster with the
  // values in cache but 4% slower a float32 decode step at 512 tokens, from memory).
  for (int p = 0; p < num_pages; ++p) {
    const int start = p * P, n = std::min(P, L - start);
    const int64_t base = static_cast<int64_t>(pages[p]) * P;
    const int64_t next = p + 1 < num_pages ? static_cast<int64_t>(pages[p + 1]) * P : -1;
    for (int i = 0; i < n; ++i) {
      if (next >= 0) prefetch(a.v + (next + i) * a.kv_slot + part_at, part_bytes);
      const T* slot = a.v + (base + i) * a.kv_slot;
      for (int kh = kh0; kh < kh1; ++kh) {
        const T* val = slot + kh * a.kv_head;
        vf x[NV];
        for (int v = 0; v < NV; ++v) x[v] = load_row(val + v * VW);
        float* acc = w.acc.data() + static_cast<size_t>((kh - kh0) * G) * D;
        const float* sc = w.scores.data() + static_cast<size_t>((kh - kh0) * G) * L + start + i;
        for (int g = 0; g < G; ++g) {
          const float wt = sc[static_cast<size_t>(g) * L];
          for (int v = 0; v < NV; ++v) {
            float* at = acc + g * D + v * VW;
            store(at, load(at) + wt * x[v]);
          }
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

template <typename T, int NV>
using AttendFn = void (*)(const Step<T>&, int, int, int, Scratch&);

template <typename T, int NV>
AttendFn<T, NV> shaped_for_group(int G) {
  switch (G) {
    case 1: return attend_shaped<T, NV, 1>;
    case 2: return attend_shaped<T, NV, 2>;
    case 3: return attend_shaped<T, NV, 3>;
    case 4: return attend_shaped<T, NV, 4>;
    default: return nullptr;
  }
}
#endif  // __AVX512F__

// The task function for these heads: ``attend_shaped`` where it is compiled for them (head
// sizes of 32, 64 or 128 and up to 4 query heads a KV head), else the general ``attend``.
template <typename T>
void (*attend_for(int H, int KVH, int D))(const Step<T>&, int, int, int, Scratch&) {
#if defined(__AVX512F__)
  const int G = H / KVH;
  void (*fn)(const Step<T>&, int, int, int, Scratch&) = nullptr;
  if (D == 2 * VW) fn = shaped_for_group<T, 2>(G);
  if (D == 4 * VW) fn = shaped_for_group<T, 4>(G);
  if (D == 8 * VW) fn = shaped_for_group<T, 8>(G);
  if (fn != nullptr) return fn;
#endif
  (void)H, (void)KVH, (void)D;
  return attend<T>;
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
  const auto task = attend_for<T>(H, KVH, D);
#pragma omp parallel num_threads(threads)
  {
    Scratch w;
    if (per_sequence) {
#pragma omp for schedule(dynamic, 1)
      for (int b = 0; b < B; ++b) task(a, b, 0, KVH, w);
    } else {
#pragma omp for collapse(2) schedule(dynamic, 1)
      for (int b = 0; b < B; ++b) {
        for (int kh = 0; kh < KVH; ++kh) task(a, b, kh, kh + 1, w);
      }
    }
  }
}


// ------------------------------------------------------------------------------ prefill
// Causal attention of a prompt's new tokens (positions [total - extend, total)) over its
// whole context (positions [0, total)), keys and values read where they lie in the pool.
//
// The work is laid out as two small matrix products per block, with the query rows (the G
// query heads that share a KV head, times a block of positions) along the vector lanes and
// the keys' and values' elements broadcast from memory:
//   scores^T [keys][rows]  = K [keys][D] . Q^T [D][rows]   (Q^T packed once per task)
//   out^T    [D][rows]    += V^T [D][keys] . P^T [keys][rows]
// so that V rows are read in place (float32, whatever the pages) and K rows once per block
// and task, into the score tiles' layout; every K/V element loaded serves all G heads' rows
// at once; and the online softmax's running maximum and sum are per lane: no horizontal
// reductions.
//
// Key blocks start at absolute positions 0, kBk, 2 kBk, ... and every row's arithmetic is
// the same whichever tile, task or chunk it falls in, so a query's output does not depend
// on how its prompt was chunked (a masked or absent key adds an exact 0).
//
// Other dtypes convert each block's keys and values to float32 for these tiles, except bf16
// on a CPU with AVX512-BF16, which multiplies in bf16 (prefill_task_bf16, further down).

// Block sizes, timed as variants on this project's CPU machine (Zen 4, SmolLM2-135M's heads:
// G = 3, D = 64; L = 256-2048, 1 and 2 threads; see attention/cpu.py's docstring).
constexpr int kBk = 128;        // keys per block (64: 1-4% slower)
constexpr int kRv = 1;          // row vectors per tile (2: 2-6% slower; likely its
                                // larger diagonal tiles)
constexpr int kRG = kRv * VW;   // rows per tile: positions of one query head (16 with AVX-512)
constexpr int kJk = 8;          // keys per score tile (4: 13% slower)
constexpr int kDd = 8;          // value dimensions per output tile (4, 12, 16: 10-15% slower)
constexpr int kBqUnit = 32;     // a task's query positions are a multiple of this
constexpr int kBqMax = 128;     // and at most this (see prefill)
static_assert(kBqUnit % kRG == 0, "a tile's rows must be positions of one query head");
static_assert(kBk % kJk == 0, "score tiles must divide a key block");

// scores^T[j][lanes] for kJk keys x kRG rows: the sum over d of key j's [d] * qt[d][lanes],
// stored to s; with ``mask``, keys at positions after a lane's position (key0 + j >
// pos[lane]) score -inf; top[v] becomes the lane-wise maximum of itself and the scores.
// keys: the tile's keys packed [D][kJk], so that the kJk broadcasts of each d are at fixed
// offsets from one pointer (the rows through eight pointers ran out of registers).
inline void score_tile(const float* qt, int64_t R, const float* keys, int D, float* s,
                       bool mask, float key0, const vf* pos, vf* top) {
  vf acc[kJk][kRv] = {};
  for (int d = 0; d < D; ++d) {
    vf q[kRv];
#pragma GCC unroll 4
    for (int v = 0; v < kRv; ++v) q[v] = load(qt + d * R + v * VW);
#pragma GCC unroll 8
    for (int j = 0; j < kJk; ++j) {
      const float x = keys[d * kJk + j];
#pragma GCC unroll 4
      for (int v = 0; v < kRv; ++v) acc[j][v] += x * q[v];
    }
  }
  if (mask) {
    const vf minus_inf = vf{} - INFINITY;
#pragma GCC unroll 8
    for (int j = 0; j < kJk; ++j) {
      const vf key = vf{} + (key0 + static_cast<float>(j));
#pragma GCC unroll 4
      for (int v = 0; v < kRv; ++v) acc[j][v] = key > pos[v] ? minus_inf : acc[j][v];
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < kJk; ++j) {
#pragma GCC unroll 4
    for (int v = 0; v < kRv; ++v) {
      top[v] = acc[j][v] > top[v] ? acc[j][v] : top[v];
      store(s + j * kRG + v * VW, acc[j][v]);
    }
  }
}

// One key block's step of the online softmax, per lane (a query row), for both pool
// dtypes: given the block's scores s[j][lanes] (j < n) and the new running maxima
// ``tops``, the old sums' rescale factor ``alpha``, the block's weights in place of its
// scores (unnormalized: divided by their running sum at the end), and the running sums
// ``l`` and maxima ``m`` updated.
inline void online_softmax_block(const float* tops, float* s, int n, float* m, float* l,
                                 float* alpha) {
  alignas(64) float sum[kRG];
#pragma omp simd
  for (int e = 0; e < kRG; ++e) {
    alpha[e] = exp_nonpositive(m[e] - tops[e]);
    sum[e] = 0.f;
  }
  for (int j = 0; j < n; ++j) {
    float* sj = s + j * kRG;
#pragma omp simd
    for (int e = 0; e < kRG; ++e) {
      sj[e] = exp_nonpositive(sj[e] - tops[e]);
      sum[e] += sj[e];
    }
  }
#pragma omp simd
  for (int e = 0; e < kRG; ++e) {
    l[e] = l[e] * alpha[e] + sum[e];
    m[e] = tops[e];
  }
}

// out^T[d0 + e][lanes] = alpha * out^T[d0 + e][lanes] + sum over j < n of
// value[j][d0 + e] * p[j][lanes], for e < E (E dimensions, at most kDd).
template <int E>
inline void value_tile(float* ot, int64_t R, const float* p, const float* const* values, int n,
                       int d0, const vf* alpha) {
  vf acc[E][kRv];
#pragma GCC unroll 8
  for (int e = 0; e < E; ++e) {
#pragma GCC unroll 4
    for (int v = 0; v < kRv; ++v) acc[e][v] = load(ot + (d0 + e) * R + v * VW) * alpha[v];
  }
  for (int j = 0; j < n; ++j) {
    vf w[kRv];
#pragma GCC unroll 4
    for (int v = 0; v < kRv; ++v) w[v] = load(p + j * kRG + v * VW);
    const float* row = values[j] + d0;
#pragma GCC unroll 8
    for (int e = 0; e < E; ++e) {
      const float x = row[e];
#pragma GCC unroll 4
      for (int v = 0; v < kRv; ++v) acc[e][v] += x * w[v];
    }
  }
#pragma GCC unroll 8
  for (int e = 0; e < E; ++e) {
#pragma GCC unroll 4
    for (int v = 0; v < kRv; ++v) store(ot + (d0 + e) * R + v * VW, acc[e][v]);
  }
}

template <int E>
void value_tiles(float* ot, int64_t R, const float* p, const float* const* values, int n,
                 int D, const vf* alpha) {
  int d0 = 0;
  for (; d0 + E <= D; d0 += E) value_tile<E>(ot, R, p, values, n, d0, alpha);
  switch (D - d0) {  // the last few dimensions of a head size not a multiple of kDd
    case 0: break;
    case 1: value_tile<1>(ot, R, p, values, n, d0, alpha); break;
    case 2: value_tile<2>(ot, R, p, values, n, d0, alpha); break;
    case 3: value_tile<3>(ot, R, p, values, n, d0, alpha); break;
    case 4: value_tile<4>(ot, R, p, values, n, d0, alpha); break;
    case 5: value_tile<5>(ot, R, p, values, n, d0, alpha); break;
    case 6: value_tile<6>(ot, R, p, values, n, d0, alpha); break;
    default: value_tile<7>(ot, R, p, values, n, d0, alpha); break;
  }
}

// Packs kJk key rows (float32, D each) into the score tile's layout [D][kJk]. (An AVX-512
// version, 8 x 16 transposes in shuffles, measured no faster: with a key block packed once
// for 128 positions' rows, packing is a few percent of the time, most of it the rows' loads.)
inline void pack_keys(const float* const* rows, int D, float* kt) {
  for (int d = 0; d < D; ++d) {
#pragma GCC unroll 8
    for (int j = 0; j < kJk; ++j) kt[d * kJk + j] = rows[j][d];
  }
}

// A float buffer aligned to a cache line, grown on demand.
struct Buffer {
  float* data = nullptr;
  size_t size = 0;
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { std::free(data); }
  float* get(size_t n) {
    if (n > size) {
      std::free(data);
      size = (n + 15) / 16 * 16;
      data = static_cast<float*>(std::aligned_alloc(64, size * sizeof(float)));
    }
    return data;
  }
};

template <typename T>
struct Prefill {
  const T* q;
  int64_t q_tok, q_head;
  const T* k;
  const T* v;
  int64_t kv_slot, kv_head;
  const int32_t* table;
  int64_t table_stride;
  const int32_t* starts;   // [P] the prompt's first row in q and out
  const int32_t* extends;  // [P] its new tokens
  const int32_t* totals;   // [P] its context length, the new tokens included
  T* out;
  int64_t out_tok, out_head;
  int H, KVH, D, page_size;
  float scale;
};

struct PrefillScratch {
  Buffer qt, ot, s, m, l, pos, keys, values, zeros, weights;
  std::vector<const float*> value_rows;
};

// Positions [qb bq, (qb + 1) bq) of prompt b (those of them that are new), for the G query
// heads of KV head kh: rows r = g bq + i (head kh G + g, position qb bq + i), in tiles of
// kRG rows, each one head's consecutive positions.
#if defined(__AVX512BF16__)
void prefill_task_bf16(const Prefill<BF16>& a, int b, int kh, int qb, int bq,
                       PrefillScratch& w);
#endif

// (Not inlined: inlined into prefill's loop, as GCC chose once the bf16 task was added, the
// float32 tasks measured 4-5% slower.)
template <typename T>
__attribute__((noinline)) void prefill_task(const Prefill<T>& a, int b, int kh, int qb, int bq,
                                            PrefillScratch& w) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<T, BF16>::value) {
    prefill_task_bf16(a, b, kh, qb, bq, w);
    return;
  }
#endif
  const int G = a.H / a.KVH, D = a.D, P = a.page_size;
  const int total = a.totals[b], first = total - a.extends[b];
  const int lo = std::max(qb * bq, first), hi = std::min((qb + 1) * bq, total);  // [lo, hi)
  const int64_t R = static_cast<int64_t>(bq) * G;
  float* qt = w.qt.get(static_cast<size_t>(R) * D);
  float* ot = w.ot.get(static_cast<size_t>(R) * D);
  float* s = w.s.get(static_cast<size_t>(kBk) * kRG);
  float* m = w.m.get(R);
  float* l = w.l.get(R);
  float* pos = w.pos.get(R);  // each row's position, as a float: compared with keys' in lanes
  // Rows at positions outside [lo, hi) compute on zeros and are never written out: their
  // position is that of their tile's last live row, so that they see a key, stay finite,
  // and widen no tile's range of keys.
  std::memset(qt, 0, sizeof(float) * R * D);
  std::memset(ot, 0, sizeof(float) * R * D);
  for (int64_t r = 0; r < R; ++r) {
    const int i = static_cast<int>(r % bq), p = qb * bq + i;
    const int tile_last = std::min(qb * bq + (i / kRG + 1) * kRG, hi) - 1;
    const bool live = p >= lo && p < hi;
    pos[r] = static_cast<float>(live ? p : tile_last);
    m[r] = -INFINITY;
    l[r] = 0.f;
    if (!live) continue;
    const int h = kh * G + static_cast<int>(r / bq);
    const T* row = a.q + (a.starts[b] + p - first) * a.q_tok + h * a.q_head;
    for (int d = 0; d < D; ++d) qt[d * R + r] = to_float(row[d]) * a.scale;
  }
  const int32_t* pages = a.table + b * a.table_stride;
  constexpr bool kInPlace = std::is_same<T, float>::value;
  float* kbuf = w.keys.get(static_cast<size_t>(kBk) * D);
  // Other dtypes: the block's keys and values in float32, rows [2 kBk][D].
  float* vbuf = kInPlace ? nullptr : w.values.get(static_cast<size_t>(2 * kBk) * D);
  float* zeros = w.zeros.get(D);
  std::memset(zeros, 0, sizeof(float) * D);
  w.value_rows.resize(kBk);
  const float** vrows = w.value_rows.data();
  for (int j0 = 0; j0 < hi; j0 += kBk) {
    // Keys [j0, j0 + n): up to the task's last query, in whole score tiles (keys past it
    // are masked; past the context, zeros). Keys packed in tiles [n / kJk][D][kJk] (see
    // score_tile); values read in place (float32) or converted into rows [n][D].
    const int n = std::min(kBk, (hi - j0 + kJk - 1) / kJk * kJk);
    const float* krows[kBk];
    for (int j = 0; j < n; ++j) {
      const int p = j0 + j;
      if (p >= total) {
        krows[j] = vrows[j] = zeros;
        continue;
      }
      const int64_t slot = static_cast<int64_t>(pages[p / P]) * P + p % P;
      const T* kr = a.k + slot * a.kv_slot + kh * a.kv_head;
      const T* vr = a.v + slot * a.kv_slot + kh * a.kv_head;
      if constexpr (kInPlace) {
        krows[j] = reinterpret_cast<const float*>(kr);
        vrows[j] = reinterpret_cast<const float*>(vr);
      } else {
        for (int d = 0; d < D; ++d) {
          vbuf[j * D + d] = to_float(kr[d]);
          vbuf[(kBk + j) * D + d] = to_float(vr[d]);
        }
        krows[j] = vbuf + j * D;
        vrows[j] = vbuf + (kBk + j) * D;
      }
    }
    for (int j = 0; j < n; j += kJk) pack_keys(krows + j, D, kbuf + j * D);
    for (int64_t r0 = 0; r0 < R; r0 += kRG) {
      // This tile's live positions [tlo, thi] and keys [j0, j0 + tn): each tile goes only
      // as far as its own last query (a tile with none live, or wholly before the block,
      // is skipped: as a block of masked keys would, it keeps its sums unchanged).
      const int i0 = static_cast<int>(r0 % bq);
      const int tlo = std::max(qb * bq + i0, lo), thi = std::min(qb * bq + i0 + kRG, hi) - 1;
      if (tlo > thi || thi < j0) continue;
      const int tn = std::min(n, (thi - j0 + kJk) / kJk * kJk);
      const bool diagonal = j0 + tn - 1 > tlo;  // some key here lies after some query
      vf pv[kRv], top[kRv];
      float* mr = m + r0;
      float* lr = l + r0;
      for (int v = 0; v < kRv; ++v) {
        pv[v] = load(pos + r0 + v * VW);
        top[v] = load(mr + v * VW);
      }
      for (int j = 0; j < tn; j += kJk) {
        score_tile(qt + r0, R, kbuf + j * D, D, s + j * kRG, diagonal,
                   static_cast<float>(j0 + j), pv, top);
      }
      alignas(64) float tops[kRG], alpha[kRG];
      for (int v = 0; v < kRv; ++v) store(tops + v * VW, top[v]);
      online_softmax_block(tops, s, tn, mr, lr, alpha);
      vf av[kRv];
      for (int v = 0; v < kRv; ++v) av[v] = load(alpha + v * VW);
      value_tiles<kDd>(ot + r0, R, s, vrows, tn, D, av);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int p = qb * bq + static_cast<int>(r % bq);
    if (p < lo || p >= hi) continue;
    const int h = kh * G + static_cast<int>(r / bq);
    T* dst = a.out + (a.starts[b] + p - first) * a.out_tok + h * a.out_head;
    const float inv = 1.f / l[r];
    for (int d = 0; d < D; ++d) dst[d] = from_float<T>(ot[d * R + r] * inv);
  }
}

#if defined(__AVX512BF16__)
// ------------------------------------------------------------- prefill, bf16 pools
// With AVX512-BF16 a bf16 prompt multiplies in bf16 (VDPBF16PS: a pair of bf16 products
// added to a float32 lane) instead of converting each key and value block to float32 and
// running the float32 tiles: the same tiles and online softmax, each instruction twice the
// products.
//   scores: Q^T packed once per task as pairs of dimensions [D / 2][rows] (unscaled: bf16
//     products are exact in float32, and the scale multiplies the tile's sums), keys copied
//     per block as rows of pairs [keys][D / 2], a pair broadcast against 16 rows' pairs.
//   values: the weights rounded to bf16 as pairs of keys [keys / 2][rows], the values
//     packed per block as pairs of keys [keys / 2][D]; the softmax sums stay those of the
//     float32 weights (as torch's flash SDPA in bf16 does).
// Key pairs lie within the blocks at absolute positions, so a row's arithmetic is still
// the same whichever task, tile or chunk holds it (a masked or absent key: an exact 0).
// Measured on this project's CPU machine (2 Zen 4 cores; SmolLM2-135M's heads, page 16,
// 2 threads; against converting the blocks to float32): L=256 0.50 -> 0.32 ms, L=1024
// 6.5-6.8 -> 3.9-4.2 ms (1.61-1.68x), L=2048 25.3-26.0 -> 15.0-15.7 ms, 256 new tokens
// after 768 cached 2.78 -> 1.63 ms; the products in bf16 for the scores alone gave 1.2x.
// The keys are copied as rows [kJk][D / 2] and broadcast through one pointer per key (2-5%
// faster than packing them [D / 2][kJk] as the float32 tiles do); 16 keys per score tile or
// 16 dimensions per value tile measured no faster. (The conversion to float32 it replaces
// was already vectorized by the compiler.)
static_assert(VW == 16 && kRv == 1, "the bf16 tiles are one AVX-512 vector of rows");
static_assert(kJk % 2 == 0, "keys come in pairs");

inline uint32_t bf16_pair(const BF16* row, int d, int D) {  // row[d], row[d + 1] (0 past D)
  const uint32_t hi = d + 1 < D ? row[d + 1].bits : 0u;
  return static_cast<uint32_t>(row[d].bits) | hi << 16;
}

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// As score_tile: qt pairs [Dp][R] from this tile's rows, keys rows of pairs [kJk][Dp]
// (through one pointer each: no register runs out here, unlike the float32 tile's).
inline void score_tile_bf16(const uint32_t* qt, int64_t R, const uint32_t* keys, int Dp,
                            float* s, bool mask, float key0, __m512 pos, __m512 scale,
                            __m512* top) {
  __m512 acc[kJk];
#pragma GCC unroll 8
  for (int j = 0; j < kJk; ++j) acc[j] = _mm512_setzero_ps();
  for (int p = 0; p < Dp; ++p) {
    const __m512bh q = as_bh(_mm512_loadu_si512(qt + p * R));
#pragma GCC unroll 8
    for (int j = 0; j < kJk; ++j) {
      acc[j] = _mm512_dpbf16_ps(acc[j], as_bh(_mm512_set1_epi32(static_cast<int>(
                                            keys[j * Dp + p]))), q);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < kJk; ++j) {
    acc[j] = _mm512_mul_ps(acc[j], scale);
    if (mask) {
      const __mmask16 after = _mm512_cmp_ps_mask(
          _mm512_set1_ps(key0 + static_cast<float>(j)), pos, _CMP_GT_OQ);
      acc[j] = _mm512_mask_mov_ps(acc[j], after, _mm512_set1_ps(-INFINITY));
    }
    *top = _mm512_max_ps(*top, acc[j]);
    _mm512_storeu_ps(s + j * kRG, acc[j]);
  }
}

// As value_tile: weights pairs pw [n / 2][kRG], values pairs vp [n / 2][D].
template <int E>
inline void value_tile_bf16(float* ot, int64_t R, const uint32_t* pw, const uint32_t* vp,
                            int pairs, int D, int d0, __m512 alpha) {
  __m512 acc[E];
#pragma GCC unroll 8
  for (int e = 0; e < E; ++e) acc[e] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + e) * R), alpha);
  for (int jp = 0; jp < pairs; ++jp) {
    const __m512bh wt = as_bh(_mm512_loadu_si512(pw + jp * kRG));
    const uint32_t* row = vp + static_cast<int64_t>(jp) * D + d0;
#pragma GCC unroll 8
    for (int e = 0; e < E; ++e) {
      acc[e] = _mm512_dpbf16_ps(acc[e], as_bh(_mm512_set1_epi32(static_cast<int>(row[e]))), wt);
    }
  }
#pragma GCC unroll 8
  for (int e = 0; e < E; ++e) _mm512_storeu_ps(ot + (d0 + e) * R, acc[e]);
}

void value_tiles_bf16(float* ot, int64_t R, const uint32_t* pw, const uint32_t* vp, int pairs,
                      int D, __m512 alpha) {
  int d0 = 0;
  for (; d0 + kDd <= D; d0 += kDd) value_tile_bf16<kDd>(ot, R, pw, vp, pairs, D, d0, alpha);
  switch (D - d0) {
    case 0: break;
    case 1: value_tile_bf16<1>(ot, R, pw, vp, pairs, D, d0, alpha); break;
    case 2: value_tile_bf16<2>(ot, R, pw, vp, pairs, D, d0, alpha); break;
    case 3: value_tile_bf16<3>(ot, R, pw, vp, pairs, D, d0, alpha); break;
    case 4: value_tile_bf16<4>(ot, R, pw, vp, pairs, D, d0, alpha); break;
    case 5: value_tile_bf16<5>(ot, R, pw, vp, pairs, D, d0, alpha); break;
    case 6: value_tile_bf16<6>(ot, R, pw, vp, pairs, D, d0, alpha); break;
    default: value_tile_bf16<7>(ot, R, pw, vp, pairs, D, d0, alpha); break;
  }
}

// The bf16 paths' query rows of one task, as prefill_task lays out its float32 ones: pairs
// of dimensions transposed into qt [pairs][R] (qt zeroed by the caller), and each row's
// position (a dead row's: its tile's last live one) and softmax state.
void bf16_query_rows(const Prefill<BF16>& a, int b, int kh, int qb, int bq, int lo, int hi,
                     uint32_t* qt, float* m, float* l, float* pos) {
  const int G = a.H / a.KVH, D = a.D;
  const int first = a.totals[b] - a.extends[b];
  const int64_t R = static_cast<int64_t>(bq) * G;
  for (int64_t r = 0; r < R; ++r) {
    const int i = static_cast<int>(r % bq), p = qb * bq + i;
    const int tile_last = std::min(qb * bq + (i / kRG + 1) * kRG, hi) - 1;
    const bool live = p >= lo && p < hi;
    pos[r] = static_cast<float>(live ? p : tile_last);
    m[r] = -INFINITY;
    l[r] = 0.f;
    if (!live) continue;
    const int h = kh * G + static_cast<int>(r / bq);
    const BF16* row = a.q + (a.starts[b] + p - first) * a.q_tok + h * a.q_head;
    for (int d = 0; d < D; d += 2) qt[(d / 2) * R + r] = bf16_pair(row, d, D);
  }
}

// prefill_task for bf16 (same rows, blocks, tiles and skipping; see there).
void prefill_task_bf16(const Prefill<BF16>& a, int b, int kh, int qb, int bq,
                       PrefillScratch& w) {
  const int G = a.H / a.KVH, D = a.D, P = a.page_size, Dp = (D + 1) / 2;
  const int total = a.totals[b], first = total - a.extends[b];
  const int lo = std::max(qb * bq, first), hi = std::min((qb + 1) * bq, total);
  const int64_t R = static_cast<int64_t>(bq) * G;
  uint32_t* qt = reinterpret_cast<uint32_t*>(w.qt.get(static_cast<size_t>(R) * Dp));
  float* ot = w.ot.get(static_cast<size_t>(R) * D);
  float* s = w.s.get(static_cast<size_t>(kBk) * kRG);
  uint32_t* pw = reinterpret_cast<uint32_t*>(w.weights.get(static_cast<size_t>(kBk / 2) * kRG));
  float* m = w.m.get(R);
  float* l = w.l.get(R);
  float* pos = w.pos.get(R);
  std::memset(qt, 0, sizeof(uint32_t) * R * Dp);
  std::memset(ot, 0, sizeof(float) * R * D);
  bf16_query_rows(a, b, kh, qb, bq, lo, hi, qt, m, l, pos);
  const int32_t* pages = a.table + b * a.table_stride;
  // Keys as rows of pairs [n][Dp] (an odd D's last pair padded with 0); values as pairs of
  // rows [n / 2][D].
  uint32_t* kbuf = reinterpret_cast<uint32_t*>(w.keys.get(static_cast<size_t>(kBk) * Dp));
  uint32_t* vp = reinterpret_cast<uint32_t*>(w.values.get(static_cast<size_t>(kBk / 2) * D));
  const std::vector<BF16> zeros(D, BF16{0});
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int j0 = 0; j0 < hi; j0 += kBk) {
    const int n = std::min(kBk, (hi - j0 + kJk - 1) / kJk * kJk);
    const BF16* krows[kBk];
    const BF16* vrows[kBk];
    for (int j = 0; j < n; ++j) {
      const int p = j0 + j;
      if (p >= total) {
        krows[j] = vrows[j] = zeros.data();
        continue;
      }
      const int64_t slot = static_cast<int64_t>(pages[p / P]) * P + p % P;
      krows[j] = a.k + slot * a.kv_slot + kh * a.kv_head;
      vrows[j] = a.v + slot * a.kv_slot + kh * a.kv_head;
    }
    for (int j = 0; j < n; ++j) {
      uint32_t* kt = kbuf + static_cast<int64_t>(j) * Dp;
      kt[Dp - 1] = 0;
      std::memcpy(kt, krows[j], sizeof(BF16) * D);
    }
    for (int j = 0; j < n; j += 2) {
      const BF16* even = vrows[j];
      const BF16* odd = vrows[j + 1];
      uint32_t* dst = vp + static_cast<int64_t>(j / 2) * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) {
        dst[d] = static_cast<uint32_t>(even[d].bits) | static_cast<uint32_t>(odd[d].bits) << 16;
      }
    }
    for (int64_t r0 = 0; r0 < R; r0 += kRG) {
      const int i0 = static_cast<int>(r0 % bq);
      const int tlo = std::max(qb * bq + i0, lo), thi = std::min(qb * bq + i0 + kRG, hi) - 1;
      if (tlo > thi || thi < j0) continue;
      const int tn = std::min(n, (thi - j0 + kJk) / kJk * kJk);
      const bool diagonal = j0 + tn - 1 > tlo;
      float* mr = m + r0;
      float* lr = l + r0;
      const __m512 pv = _mm512_loadu_ps(pos + r0);
      __m512 top = _mm512_loadu_ps(mr);
      for (int j = 0; j < tn; j += kJk) {
        score_tile_bf16(qt + r0, R, kbuf + static_cast<int64_t>(j) * Dp, Dp, s + j * kRG,
                        diagonal, static_cast<float>(j0 + j), pv, scale, &top);
      }
      alignas(64) float tops[kRG], alpha[kRG];
      _mm512_store_ps(tops, top);
      online_softmax_block(tops, s, tn, mr, lr, alpha);
      // The weights of keys j, j + 1 as a pair in each lane: key j's in the low half.
      const __m512i interleave = _mm512_set_epi16(
          31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
          23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      for (int j = 0; j < tn; j += 2) {
        const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + (j + 1) * kRG),
                                                  _mm512_loadu_ps(s + j * kRG));
        const __m512i packed = _mm512_permutexvar_epi16(
            interleave, reinterpret_cast<const __m512i&>(both));
        _mm512_storeu_si512(pw + (j / 2) * kRG, packed);
      }
      value_tiles_bf16(ot + r0, R, pw, vp, tn / 2, D, _mm512_load_ps(alpha));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int p = qb * bq + static_cast<int>(r % bq);
    if (p < lo || p >= hi) continue;
    const int h = kh * G + static_cast<int>(r / bq);
    BF16* dst = a.out + (a.starts[b] + p - first) * a.out_tok + h * a.out_head;
    const float inv = 1.f / l[r];
    for (int d = 0; d < D; ++d) dst[d] = from_float<BF16>(ot[d * R + r] * inv);
  }
}
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ------------------------------------------------------------- prefill, bf16 on AMX
// On a CPU with AMX (Intel Sapphire Rapids and later) both products of a block run on the
// tile unit, in the layouts the AVX512-BF16 tiles above already use, transposed so that a
// row still lies along a vector's lanes between them and the online softmax is the same:
//   scores^T [16 keys][16 rows] = K [16 keys][32 dims] . Q^T pairs [16 dim pairs][16 rows]
//     (A: the block's keys as rows of pairs, kbuf; B: Q^T pairs, qt, as packed per task)
//   out^T [16 dims][16 rows]   += V^T [16 dims][32 keys] . P^T pairs [16 key pairs][16 rows]
//     (A: the block's values transposed, vt; B: the rounded weights, pw; C: out^T in ot,
//     rescaled by the softmax's alpha in memory before it is loaded)
// TDPBF16PS multiplies a pair of bf16 and adds to a float32 lane as VDPBF16PS does (both
// flush subnormal inputs); a row's arithmetic depends on nothing but its own query and the
// keys and values of blocks at absolute positions, so a chunked or cached prompt still
// equals the cold one bit for bit. Head sizes up to 128 (4 tiles of Q^T); keys come in
// 32s (a tile of key pairs), the ones past a row's position masked to an exact 0 weight.
// The tile unit then leaves the exp and the softmax's bookkeeping as most of the time.
constexpr int kAmxKeys = 32;  // keys per P.V tile (16 pairs)
static_assert(kBk % kAmxKeys == 0, "key blocks hold whole P.V tiles");

// All eight tiles 16 rows x 64 bytes (palette 1); the rest of the 64-byte config zero.
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void configure_tiles() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

// Linux hands the tile registers' state only to a process that asked for it
// (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); torch's oneDNN asks too, asking twice is fine.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

std::atomic<bool> amx_enabled{true};

// Whether a bf16 prompt of head size D runs on the tiles (else on AVX512-BF16).
bool amx_usable(int D) { return D <= 128 && amx_enabled.load() && amx_permitted(); }

void prefill_task_amx(const Prefill<BF16>& a, int b, int kh, int qb, int bq,
                      PrefillScratch& w) {
  const int G = a.H / a.KVH, D = a.D, P = a.page_size, Dp = (D + 1) / 2;
  const int Dq = (Dp + 15) / 16 * 16;  // pairs, in whole tiles (zeros past Dp)
  const int Dv = (D + 15) / 16 * 16;   // output dimensions, in whole tiles
  const int chunks = Dq / 16;
  const int total = a.totals[b], first = total - a.extends[b];
  const int lo = std::max(qb * bq, first), hi = std::min((qb + 1) * bq, total);
  const int64_t R = static_cast<int64_t>(bq) * G;
  uint32_t* qt = reinterpret_cast<uint32_t*>(w.qt.get(static_cast<size_t>(R) * Dq));
  float* ot = w.ot.get(static_cast<size_t>(R) * Dv);
  float* s = w.s.get(static_cast<size_t>(kBk) * kRG);
  uint32_t* pw = reinterpret_cast<uint32_t*>(w.weights.get(static_cast<size_t>(kBk / 2) * kRG));
  float* m = w.m.get(R);
  float* l = w.l.get(R);
  float* pos = w.pos.get(R);
  std::memset(qt, 0, sizeof(uint32_t) * R * Dq);
  std::memset(ot, 0, sizeof(float) * R * Dv);
  bf16_query_rows(a, b, kh, qb, bq, lo, hi, qt, m, l, pos);
  const int32_t* pages = a.table + b * a.table_stride;
  // Keys as rows of pairs [kBk][Dq]; values transposed, bf16 [Dv][kBk] (zeros past D).
  uint32_t* kbuf = reinterpret_cast<uint32_t*>(w.keys.get(static_cast<size_t>(kBk) * Dq));
  uint16_t* vt = reinterpret_cast<uint16_t*>(w.values.get(static_cast<size_t>(kBk / 2) * Dv));
  std::memset(kbuf, 0, sizeof(uint32_t) * kBk * Dq);
  std::memset(vt, 0, sizeof(uint16_t) * kBk * Dv);
  const __m512 scale = _mm512_set1_ps(a.scale);
  const __m512i interleave = _mm512_set_epi16(
      31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
      23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int j0 = 0; j0 < hi; j0 += kBk) {
    const int n = std::min(kBk, (hi - j0 + kAmxKeys - 1) / kAmxKeys * kAmxKeys);
    for (int j = 0; j < n; ++j) {
      const int p = j0 + j;
      uint32_t* kt = kbuf + static_cast<int64_t>(j) * Dq;
      if (p >= total) {  // past the context: zeros (masked, as every key after a query)
        std::memset(kt, 0, sizeof(uint32_t) * Dp);
        for (int d = 0; d < D; ++d) vt[d * kBk + j] = 0;
        continue;
      }
      const int64_t slot = static_cast<int64_t>(pages[p / P]) * P + p % P;
      const BF16* kr = a.k + slot * a.kv_slot + kh * a.kv_head;
      const BF16* vr = a.v + slot * a.kv_slot + kh * a.kv_head;
      kt[Dp - 1] = 0;
      std::memcpy(kt, kr, sizeof(BF16) * D);
      for (int d = 0; d < D; ++d) vt[d * kBk + j] = vr[d].bits;
    }
    for (int64_t r0 = 0; r0 < R; r0 += kRG) {
      const int i0 = static_cast<int>(r0 % bq);
      const int tlo = std::max(qb * bq + i0, lo), thi = std::min(qb * bq + i0 + kRG, hi) - 1;
      if (tlo > thi || thi < j0) continue;
      const int tn = std::min(n, (thi - j0 + kAmxKeys) / kAmxKeys * kAmxKeys);
      const bool diagonal = j0 + tn - 1 > tlo;
      float* mr = m + r0;
      float* lr = l + r0;
      // Scores: Q^T's pairs in tiles 2.. (one per 32 dimensions), each key tile in 0.
      const int64_t qstride = R * static_cast<int64_t>(sizeof(uint32_t));
      _tile_loadd(2, qt + r0, qstride);
      if (chunks > 1) _tile_loadd(3, qt + 16 * R + r0, qstride);
      if (chunks > 2) _tile_loadd(4, qt + 32 * R + r0, qstride);
      if (chunks > 3) _tile_loadd(5, qt + 48 * R + r0, qstride);
      const int64_t kstride = static_cast<int64_t>(Dq) * sizeof(uint32_t);
      for (int j = 0; j < tn; j += 16) {
        const uint32_t* keys = kbuf + static_cast<int64_t>(j) * Dq;
        _tile_zero(0);
        _tile_loadd(1, keys, kstride);
        _tile_dpbf16ps(0, 1, 2);
        if (chunks > 1) {
          _tile_loadd(1, keys + 16, kstride);
          _tile_dpbf16ps(0, 1, 3);
        }
        if (chunks > 2) {
          _tile_loadd(1, keys + 32, kstride);
          _tile_dpbf16ps(0, 1, 4);
        }
        if (chunks > 3) {
          _tile_loadd(1, keys + 48, kstride);
          _tile_dpbf16ps(0, 1, 5);
        }
        _tile_stored(0, s + j * kRG, kRG * sizeof(float));
      }
      const __m512 pv = _mm512_loadu_ps(pos + r0);
      __m512 top = _mm512_loadu_ps(mr);
      for (int j = 0; j < tn; ++j) {
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j * kRG), scale);
        if (diagonal) {
          const __mmask16 after = _mm512_cmp_ps_mask(
              _mm512_set1_ps(static_cast<float>(j0 + j)), pv, _CMP_GT_OQ);
          x = _mm512_mask_mov_ps(x, after, _mm512_set1_ps(-INFINITY));
        }
        top = _mm512_max_ps(top, x);
        _mm512_storeu_ps(s + j * kRG, x);
      }
      alignas(64) float tops[kRG], alpha[kRG];
      _mm512_store_ps(tops, top);
      online_softmax_block(tops, s, tn, mr, lr, alpha);
      for (int j = 0; j < tn; j += 2) {
        const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + (j + 1) * kRG),
                                                  _mm512_loadu_ps(s + j * kRG));
        const __m512i packed = _mm512_permutexvar_epi16(
            interleave, reinterpret_cast<const __m512i&>(both));
        _mm512_storeu_si512(pw + (j / 2) * kRG, packed);
      }
      // Values: out^T rescaled in memory, then four tiles of it (64 dimensions) at a time
      // in 2..5, each weight tile (32 keys) in 1 against the values' tiles in 0.
      const __m512 av = _mm512_load_ps(alpha);
      for (int d = 0; d < Dv; ++d) {
        float* o = ot + d * R + r0;
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), av));
      }
      const int64_t vstride = kBk * static_cast<int64_t>(sizeof(uint16_t));
      for (int d0 = 0; d0 < Dv; d0 += 64) {
        const int tiles = std::min(4, (Dv - d0) / 16);
        float* o = ot + d0 * R + r0;
        const int64_t ostride = qstride;
        _tile_loadd(2, o, ostride);
        if (tiles > 1) _tile_loadd(3, o + 16 * R, ostride);
        if (tiles > 2) _tile_loadd(4, o + 32 * R, ostride);
        if (tiles > 3) _tile_loadd(5, o + 48 * R, ostride);
        for (int j = 0; j < tn; j += kAmxKeys) {
          _tile_loadd(1, pw + (j / 2) * kRG, kRG * sizeof(uint32_t));
          const uint16_t* values = vt + static_cast<int64_t>(d0) * kBk + j;
          _tile_loadd(0, values, vstride);
          _tile_dpbf16ps(2, 0, 1);
          if (tiles > 1) {
            _tile_loadd(0, values + 16 * kBk, vstride);
            _tile_dpbf16ps(3, 0, 1);
          }
          if (tiles > 2) {
            _tile_loadd(0, values + 32 * kBk, vstride);
            _tile_dpbf16ps(4, 0, 1);
          }
          if (tiles > 3) {
            _tile_loadd(0, values + 48 * kBk, vstride);
            _tile_dpbf16ps(5, 0, 1);
          }
        }
        _tile_stored(2, o, ostride);
        if (tiles > 1) _tile_stored(3, o + 16 * R, ostride);
        if (tiles > 2) _tile_stored(4, o + 32 * R, ostride);
        if (tiles > 3) _tile_stored(5, o + 48 * R, ostride);
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int p = qb * bq + static_cast<int>(r % bq);
    if (p < lo || p >= hi) continue;
    const int h = kh * G + static_cast<int>(r / bq);
    BF16* dst = a.out + (a.starts[b] + p - first) * a.out_tok + h * a.out_head;
    const float inv = 1.f / l[r];
    for (int d = 0; d < D; ++d) dst[d] = from_float<BF16>(ot[d * R + r] * inv);
  }
}
#define HICACHE_AMX 1
#endif  // __AMX_TILE__ && __AMX_BF16__
#endif  // __AVX512BF16__

template <typename T>
void prefill(const Prefill<T>& a, int num_prompts, int threads) {
  // Query positions per task: as many (up to kBqMax) as leave every thread about four
  // tasks. A larger task packs and reads each key block once for more rows (32 positions
  // measured 1-2% slower than 64-256 at L = 1024-2048, 2 threads); more tasks balance
  // better on more threads. A row's arithmetic is the same whatever the task size.
  int64_t units = 0;
  for (int b = 0; b < num_prompts; ++b) {
    const int total = a.totals[b], first = total - a.extends[b];
    units += (total + kBqUnit - 1) / kBqUnit - first / kBqUnit;
  }
  // And no larger than keeps a task's Q^T and out^T within 256 KB (for larger heads than
  // SmolLM2's, where it was not measured: so that they stay in a 1 MB L2 beside the key
  // and value blocks).
  const int G = a.H / a.KVH;
  int bq = kBqMax;
  while (bq > kBqUnit && units * kBqUnit / bq * a.KVH < 4 * threads) bq /= 2;
  while (bq > kBqUnit && static_cast<int64_t>(bq) * G * a.D > 32768) bq /= 2;
  // A task per (prompt, KV head, block of bq positions), the longest first (a block's work
  // grows with its last position), taken by whichever thread is free.
  struct Task {
    int b, kh, qb, keys;
  };
  std::vector<Task> tasks;
  for (int b = 0; b < num_prompts; ++b) {
    const int total = a.totals[b], first = total - a.extends[b];
    for (int qb = first / bq; qb * bq < total; ++qb) {
      const int keys = std::min((qb + 1) * bq, total);
      for (int kh = 0; kh < a.KVH; ++kh) tasks.push_back({b, kh, qb, keys});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& x, const Task& y) { return x.keys > y.keys; });
  const int n = static_cast<int>(tasks.size());
  [[maybe_unused]] bool amx = false;  // read only where the CPU has AMX
#if defined(HICACHE_AMX)
  if constexpr (std::is_same<T, BF16>::value) amx = amx_usable(a.D);
#endif
#pragma omp parallel num_threads(threads)
  {
    PrefillScratch w;
#if defined(HICACHE_AMX)
    // Tile configuration is per thread; oneDNN's kernels set their own and release it.
    if (amx) configure_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int t = 0; t < n; ++t) {
#if defined(HICACHE_AMX)
      if constexpr (std::is_same<T, BF16>::value) {
        if (amx) {
          prefill_task_amx(a, tasks[t].b, tasks[t].kh, tasks[t].qb, bq, w);
          continue;
        }
      }
#endif
      prefill_task(a, tasks[t].b, tasks[t].kh, tasks[t].qb, bq, w);
    }
#if defined(HICACHE_AMX)
    if (amx) _tile_release();
#endif
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

// Causal prefill of P prompts (see Prefill): prompt b's new rows are q/out rows
// [starts[b], starts[b] + extends[b]), at positions [totals[b] - extends[b], totals[b]),
// its pages row b of table. dtype as above. Returns 0, or -1 for an unknown dtype.
int hicache_paged_prefill(int dtype, const void* q, int64_t q_tok, int64_t q_head, const void* k,
                          const void* v, int64_t kv_slot, int64_t kv_head, const int32_t* table,
                          int64_t table_stride, const int32_t* starts, const int32_t* extends,
                          const int32_t* totals, void* out, int64_t out_tok, int64_t out_head,
                          int P, int H, int KVH, int D, int page_size, float scale,
                          int threads) {
  switch (dtype) {
    case 0:
      prefill(Prefill<float>{static_cast<const float*>(q), q_tok, q_head,
                             static_cast<const float*>(k), static_cast<const float*>(v),
                             kv_slot, kv_head, table, table_stride, starts, extends, totals,
                             static_cast<float*>(out), out_tok, out_head, H, KVH, D,
                             page_size, scale},
              P, threads);
      return 0;
    case 1:
      prefill(Prefill<BF16>{static_cast<const BF16*>(q), q_tok, q_head,
                            static_cast<const BF16*>(k), static_cast<const BF16*>(v), kv_slot,
                            kv_head, table, table_stride, starts, extends, totals,
                            static_cast<BF16*>(out), out_tok, out_head, H, KVH, D, page_size,
                            scale},
              P, threads);
      return 0;
    case 2:
      prefill(Prefill<_Float16>{static_cast<const _Float16*>(q), q_tok, q_head,
                                static_cast<const _Float16*>(k),
                                static_cast<const _Float16*>(v), kv_slot, kv_head, table,
                                table_stride, starts, extends, totals,
                                static_cast<_Float16*>(out), out_tok, out_head, H, KVH, D,
                                page_size, scale},
              P, threads);
      return 0;
    default:
      return -1;
  }
}

// How a bf16 prompt of head size 64 multiplies: 2 on AMX tiles, 1 with AVX512-BF16, 0 in
// float32 (its blocks converted).
int hicache_prefill_bf16_path(void) {
#if defined(HICACHE_AMX)
  if (amx_usable(64)) return 2;
#endif
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

// AMX on (1) or off (0) for the prompts that follow (where the CPU has it); returns the
// previous setting (0 where it has none).
int hicache_set_prefill_amx(int enabled) {
#if defined(HICACHE_AMX)
  return amx_enabled.exchange(enabled != 0) ? 1 : 0;
#else
  (void)enabled;
  return 0;
#endif
}

int hicache_kernel_abi_version(void) { return 3; }
}
