// Small-M matrix products for XLA:CPU decoding, as an XLA FFI custom call (and a decode
// step's attention over its cache, `Attend`).
//
// y[M, N] = x[M, K] @ W[K, N], where W is stored as column panels of 16:
// panels[j, k, 0:16] = W[k, 16 j : 16 j + 16] (zero-padded past N), in float32,
// bfloat16 or int8 (int8 with a float32 scale per column: W = q * scale). A decode
// step multiplies 1..160 rows (the batch times the gamma + 1 tokens of a verify call)
// by each weight matrix; reading the panels in order streams the weights from memory
// once, at bandwidth, however many rows there are, and a group of panels is reused
// from cache for every block of rows.
//
// Variants (chosen per weight shape and row count by the caller, `variant`):
//   8: 8-wide vectors, up to 6 rows x 2 vectors per block (16 registers: AVX2 + FMA);
//  16: 16-wide vectors, up to 7 rows x 4 panels, 9 rows x 3 or 12 rows x 2 per block (32
//      registers: AVX-512), built only when the compiler targets AVX-512F (the host's
//      -march=native);
// each with or without its weight vectors held in registers (`InRegister`), with or
// without software prefetch of the panels ahead of the hardware prefetcher, and with rows
// in blocks as even as possible or full blocks first (`Panels`).
// With AVX512-BF16, bfloat16 weights can also run as dot products (see DotBlock16).
// bfloat16 and int8 weights are widened to float32 in registers (exactly), so a
// bfloat16 matrix gives the bits of its float32 copy at half the bytes read.
//
// Each call also takes `rows`, an int32 [1] operand: only x's first `rows` rows (clamped to
// [0, M]) are multiplied; y's other rows come back as zeros. A caller whose trailing rows
// are padding (an encoder input padded to a length bucket, a packed batch's unused slots)
// pays for its real rows only, in one compiled program for every length.
//
// Every output element accumulates x[m, k] * W[k, n] over k = 0 .. K-1 in order with
// fused multiply-adds (then times the column's scale, for int8), whatever M, the row's
// place in the call and the variant: a row's result does not depend on which other
// rows share the call (a verify call's rows equal single-token steps' bit for bit), and
// both widths give the same bits.
//
// Panels are split between the calling thread and XLA's intra-op thread pool by an
// atomic counter: a helper that starts late finds no work and returns, so the call
// never waits on a task that has not started.
//
// Also exported (plain C, for the roofline benchmark and the variant tuner):
// spec_decode_matmul (the same products on raw pointers, one thread),
// spec_decode_read_gbps (read bandwidth over a buffer), spec_decode_fma_gflops
// (peak of a register-only multiply-add loop) and spec_decode_dot_gflops (the same for
// bfloat16 dot products).

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <sched.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kPrefetchBytes = 2048;  // ahead of the hardware prefetcher, per panel
constexpr int kMaxRowBlock = 12;  // rows per block: up to 6 (16 registers), 12 (32)
constexpr int kGroup = 4;  // panels read from memory once per row sweep (at least)

typedef float f32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
#ifdef __AVX512F__
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
#endif

template <typename V>
constexpr int Lanes() { return sizeof(V) / sizeof(float); }
// Vector registers of the instruction set that has V: 16 with AVX2, 32 with AVX-512.
template <typename V>
constexpr int Registers() { return Lanes<V>() == 16 ? 32 : 16; }

template <typename V>
inline V Bits(const void* p) { V v; std::memcpy(&v, p, sizeof(v)); return v; }

// Holds v in a vector register from here on: an empty asm that reads and writes it, so the
// compiler cannot fold v's load into each multiply-add that uses it (a block of R rows
// would then load every weight vector R times, and on some CPUs the load ports, not the
// FMA units, set the pace). The 'r' variants do this with their weights.
template <typename V>
inline void InRegister(V& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__AVX__)
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

// Lanes<V>() weights of type T at p as a float vector (exact for every T).
template <typename V, typename T> struct Widen;
template <typename V> struct Widen<V, float> {
  static V Load(const float* p) { return Bits<V>(p); }
};
// bfloat16 -> float32 is the 16 bits shifted up; int8 -> float32 is a sign extension and a
// conversion. With AVX2 / AVX-512 each is one widening load and one shift or convert.
template <> struct Widen<f32x8, uint16_t> {
  static f32x8 Load(const uint16_t* p) {
#ifdef __AVX2__
    const __m256i w = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
    return Bits<f32x8>(&w);
#else
    u32x8 w = __builtin_convertvector(Bits<u16x8>(p), u32x8) << 16;
    return Bits<f32x8>(&w);
#endif
  }
};
template <> struct Widen<f32x8, int8_t> {
  static f32x8 Load(const int8_t* p) {
#ifdef __AVX2__
    const __m256 w = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    return Bits<f32x8>(&w);
#else
    return __builtin_convertvector(__builtin_convertvector(Bits<i8x8>(p), i32x8), f32x8);
#endif
  }
};
#ifdef __AVX512F__
template <> struct Widen<f32x16, uint16_t> {
  static f32x16 Load(const uint16_t* p) {
    const __m512i w = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
    return Bits<f32x16>(&w);
  }
};
template <> struct Widen<f32x16, int8_t> {
  static f32x16 Load(const int8_t* p) {
    const __m512 w = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    return Bits<f32x16>(&w);
  }
};
#endif

// Vector b of a panel row of 16 weights at `row`: columns 8 b .. 8 b + 7 (or all 16), except
// for bfloat16 weights in 8-wide vectors (`kSplit`): the row read as 8 words of two
// bfloat16 values each, vector 0 the even columns (the low halves shifted up) and vector
// 1 the odd ones (the high halves, masked), exact as `Widen`'s, for one load and two
// integer operations per 16 weights where widening each half took two loads and four (on
// an AVX2 AMD EPYC, with the weights in cache, the widening set the pace of 1-2 rows: they
// now take 0.50x and 0.78x the time, `experiments/kernel_ab.py`). The accumulators then
// hold the columns in that order; `Block` puts them back before storing.
template <typename V, typename T>
struct Row {
  static constexpr bool kSplit = false;
  static V Load(const T* row, int b) { return Widen<V, T>::Load(row + b * Lanes<V>()); }
};
template <>
struct Row<f32x8, uint16_t> {
  static constexpr bool kSplit = true;
  static f32x8 Load(const uint16_t* row, int b) {
    const u32x8 u = Bits<u32x8>(row);
    const u32x8 w = b == 0 ? u << 16 : u & 0xffff0000u;
    return Bits<f32x8>(&w);
  }
};

template <typename T>
struct Problem {
  const float* x;
  const T* panels;
  const float* scales;  // [16 P] for int8 weights, else null
  float* y;
  int64_t M, K, N;      // for `Pair` panels K counts pairs of k
  const uint32_t* xpairs = nullptr;  // for `Pair` panels: x in bfloat16, two k per word
};

// A bfloat16 dot-product panel entry: W[2 kk, n] and W[2 kk + 1, n] side by side.
struct Pair { uint16_t v[2]; };

// A block row's NV accumulator vectors (its 16 P columns in order) -> y, the first `cols`
// columns. Whole panels (every block but a matrix's last when N is not a multiple of 16) go
// out as vector stores; a partial one through a buffer. (Every row through the buffer was a
// libc memcpy of a size known only at run time, a call per row and block: 3.6% of both
// threads' time in a 5-token verify call of the big EnDe target, AVX2 AMD EPYC family 25,
// `perf record`.)
template <typename V, int NV>
inline void StoreRow(float* y, const V (&acc)[NV], int64_t cols) {
  constexpr int lanes = Lanes<V>();
  if (cols == NV * lanes) {
    for (int b = 0; b < NV; ++b) std::memcpy(y + lanes * b, &acc[b], sizeof(V));
    return;
  }
  float tmp[NV * lanes];
  for (int b = 0; b < NV; ++b) std::memcpy(tmp + lanes * b, &acc[b], sizeof(V));
  std::memcpy(y, tmp, cols * sizeof(float));
}

// R rows of x (row stride K) times P adjacent panels [K, 16] starting at panel j -> y rows
// (stride N), the first `cols` (<= 16 P) columns. Few rows take several panels at once so
// that enough independent accumulator chains cover the FMA latency; the order of the sum
// over k is the same for every P, R and vector width.
template <typename V, typename T, int R, int P, bool PF, bool PIN>
void Block(const Problem<T>& p, int64_t m, int64_t j, int64_t cols) {
  constexpr int B = kPanel / Lanes<V>();  // vectors per panel row
  const int64_t K = p.K;
  const float* x = p.x + m * K;
  const T* panels = p.panels + j * K * kPanel;
  const int64_t ahead_k = kPrefetchBytes / (kPanel * sizeof(T));
  V acc[R][P * B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < P * B; ++b) acc[r][b] = V{};
  for (int64_t k = 0; k < K; ++k) {
    const int64_t ahead = std::min(k + ahead_k, K - 1);
    if constexpr (R * P * B + P * B + 1 > Registers<V>() && R < P * B) {
      // Accumulators, weight vectors and a broadcast x would not fit the registers: the R
      // rows' x broadcast first and each weight vector used as it is widened, R + 1
      // registers beside the accumulators rather than P B + 1. On AVX2, 3 rows x 2 panels
      // held 12 accumulators + 4 weights + x = 17 registers and spilled: with bfloat16
      // weights 3 rows cost as much as 5 (AMD EPYC family 25: 1.5x the time of this form).
      V xv[R];
      for (int r = 0; r < R; ++r) xv[r] = x[r * K + k] - V{};
      for (int q = 0; q < P; ++q) {
        if constexpr (PF) __builtin_prefetch(panels + (q * K + ahead) * kPanel);
        for (int b = 0; b < B; ++b) {
          V w = Row<V, T>::Load(panels + (q * K + k) * kPanel, b);
          if constexpr (PIN) InRegister(w);
          for (int r = 0; r < R; ++r) acc[r][q * B + b] += xv[r] * w;
        }
      }
    } else {
      V w[P * B];
      for (int q = 0; q < P; ++q) {
        if constexpr (PF) __builtin_prefetch(panels + (q * K + ahead) * kPanel);
        for (int b = 0; b < B; ++b) {
          w[q * B + b] = Row<V, T>::Load(panels + (q * K + k) * kPanel, b);
          if constexpr (PIN) InRegister(w[q * B + b]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const V xv = x[r * K + k] - V{};
        for (int b = 0; b < P * B; ++b) acc[r][b] += xv * w[b];
      }
    }
  }
  if constexpr (Row<V, T>::kSplit) {  // (even, odd) columns -> (0..7, 8..15)
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < P; ++q) {
        const V even = acc[r][2 * q], odd = acc[r][2 * q + 1];
        acc[r][2 * q] = __builtin_shufflevector(even, odd, 0, 8, 1, 9, 2, 10, 3, 11);
        acc[r][2 * q + 1] = __builtin_shufflevector(even, odd, 4, 12, 5, 13, 6, 14, 7, 15);
      }
  }
  if (p.scales != nullptr) {
    for (int b = 0; b < P * B; ++b) {
      const V s = Bits<V>(p.scales + j * kPanel + b * Lanes<V>());
      for (int r = 0; r < R; ++r) acc[r][b] *= s;
    }
  }
  float* y = p.y + m * p.N + j * kPanel;
  for (int r = 0; r < R; ++r) StoreRow(y + r * p.N, acc[r], cols);
}

template <typename T>
using BlockFn = void (*)(const Problem<T>&, int64_t, int64_t, int64_t);

// Blocks by rows (1..max_rows): how many panels at once, and that block; every width also
// has single-panel blocks for a group's last panels.
template <typename V, typename T>
struct Blocks {
  int max_rows;
  int panels[kMaxRowBlock + 1];
  BlockFn<T> wide[kMaxRowBlock + 1];
  BlockFn<T> single[kMaxRowBlock + 1];
};

template <typename T, bool PF, bool PIN>
constexpr Blocks<f32x8, T> kBlocks8 = {
    6,  // 16 registers: at least 8 accumulator chains, at most 12
    {0, 4, 2, 2, 1, 1, 1},
    {nullptr, Block<f32x8, T, 1, 4, PF, PIN>, Block<f32x8, T, 2, 2, PF, PIN>,
     Block<f32x8, T, 3, 2, PF, PIN>, Block<f32x8, T, 4, 1, PF, PIN>,
     Block<f32x8, T, 5, 1, PF, PIN>, Block<f32x8, T, 6, 1, PF, PIN>},
    {nullptr, Block<f32x8, T, 1, 1, PF, PIN>, Block<f32x8, T, 2, 1, PF, PIN>,
     Block<f32x8, T, 3, 1, PF, PIN>, Block<f32x8, T, 4, 1, PF, PIN>,
     Block<f32x8, T, 5, 1, PF, PIN>, Block<f32x8, T, 6, 1, PF, PIN>}};
#ifdef __AVX512F__
template <typename T, bool PF, bool PIN>
constexpr Blocks<f32x16, T> kBlocks16 = {
    12,  // 32 registers: R rows x P panels of accumulators and P weight vectors, P (R + 1)
         // <= 32, as many panels as fit (the fewer panels a block streams at once, the
         // less of the memory's latency its loads overlap)
    {0, 4, 4, 4, 4, 4, 4, 4, 3, 3, 2, 2, 2},
    {nullptr, Block<f32x16, T, 1, 4, PF, PIN>, Block<f32x16, T, 2, 4, PF, PIN>,
     Block<f32x16, T, 3, 4, PF, PIN>, Block<f32x16, T, 4, 4, PF, PIN>,
     Block<f32x16, T, 5, 4, PF, PIN>, Block<f32x16, T, 6, 4, PF, PIN>,
     Block<f32x16, T, 7, 4, PF, PIN>, Block<f32x16, T, 8, 3, PF, PIN>,
     Block<f32x16, T, 9, 3, PF, PIN>, Block<f32x16, T, 10, 2, PF, PIN>,
     Block<f32x16, T, 11, 2, PF, PIN>, Block<f32x16, T, 12, 2, PF, PIN>},
    {nullptr, Block<f32x16, T, 1, 1, PF, PIN>, Block<f32x16, T, 2, 1, PF, PIN>,
     Block<f32x16, T, 3, 1, PF, PIN>, Block<f32x16, T, 4, 1, PF, PIN>,
     Block<f32x16, T, 5, 1, PF, PIN>, Block<f32x16, T, 6, 1, PF, PIN>,
     Block<f32x16, T, 7, 1, PF, PIN>, Block<f32x16, T, 8, 1, PF, PIN>,
     Block<f32x16, T, 9, 1, PF, PIN>, Block<f32x16, T, 10, 1, PF, PIN>,
     Block<f32x16, T, 11, 1, PF, PIN>, Block<f32x16, T, 12, 1, PF, PIN>}};
#endif

// The rows of `Panels`' row block b (of RowBlocks(M)) for M rows, m of them in the blocks
// before it.
template <typename V, typename T>
int64_t RowBlocks(const Blocks<V, T>& blocks, int64_t M) {
  return (M + blocks.max_rows - 1) / blocks.max_rows;
}
template <typename V, typename T>
int64_t BlockRows(const Blocks<V, T>& blocks, int64_t M, bool full_first, int64_t b,
                  int64_t m) {
  const int64_t row_blocks = RowBlocks(blocks, M);
  return full_first ? std::min<int64_t>(blocks.max_rows, M - m)
                    : M / row_blocks + (b < M % row_blocks ? 1 : 0);
}

// The panels the first row block takes at once: a group's size and a thread's share of the
// panels are multiples of it, so that its blocks tile them (3-panel blocks in groups of 4
// would leave every group's last panel to a single-panel block).
template <typename V, typename T>
int64_t Unit(const Blocks<V, T>& blocks, int64_t M, bool full_first) {
  return M < 1 ? 1 : blocks.panels[BlockRows(blocks, M, full_first, 0, 0)];
}

// Panels [j0, j1) for every row block; a group of kGroup or more panels (a multiple of
// `Unit`) is read from memory once and from cache for the following row blocks. Rows go
// in blocks of at most max_rows (`BlockRows`), either as even as possible (8 rows of 6:
// 4 + 4) or, with `full_first`, full blocks first and the rest last (6 + 2). A small last
// block does as many weight loads as a full one for fewer products, but it reads them from
// cache, and the first block, the one that streams them from memory, has the most rows to
// cover the wait: which is faster depends on the CPU, the weights and the row count (the
// tuner measures it, a variant option).
template <typename V, typename T>
void Panels(const Blocks<V, T>& blocks, const Problem<T>& p, int64_t j0, int64_t j1,
            bool full_first) {
  const int64_t unit = Unit(blocks, p.M, full_first);
  const int64_t group = unit * ((kGroup + unit - 1) / unit);
  for (int64_t g = j0; g < j1; g += group) {
    const int64_t g1 = std::min(j1, g + group);
    for (int64_t b = 0, m = 0, row_blocks = RowBlocks(blocks, p.M); b < row_blocks; ++b) {
      const int64_t rows = BlockRows(blocks, p.M, full_first, b, m);
      for (int64_t j = g; j < g1;) {
        const int64_t take = blocks.panels[rows] <= g1 - j ? blocks.panels[rows] : 1;
        const BlockFn<T> fn = take == 1 ? blocks.single[rows] : blocks.wide[rows];
        fn(p, m, j, std::min(kPanel * take, p.N - j * kPanel));
        j += take;
      }
      m += rows;
    }
  }
}

// A variant: the vector width (8 or 16 floats), whether rows go in full blocks first (see
// `Panels`), whether blocks hold their weight vectors in registers (`InRegister`) and
// whether they prefetch their panels ahead of the hardware prefetcher (each helps on some
// CPUs and row counts and costs on others). Every variant computes the same bits. Passed
// as one int: 8 x width + 4 x full blocks first + 2 x registers + prefetch.
struct Variant {
  int64_t width;
  bool full_first, pin, prefetch;
  static Variant Of(int64_t code) {
    return {code / 8, (code & 4) != 0, (code & 2) != 0, (code & 1) != 0};
  }
  int Index() const { return 2 * pin + prefetch; }  // into a width's 4 block tables
};

bool HaveWidth(int64_t width) {
#ifdef __AVX512F__
  if (width == 16) return true;
#endif
  return width == 8;
}

// The block table of variant v for weights of type T, passed to f (whose result it returns).
template <typename T>
struct Tables {
  template <typename F>
  static auto With(Variant v, F&& f) {
#ifdef __AVX512F__
    if (v.width == 16) {
      static const Blocks<f32x16, T>* const kWide[] = {
          &kBlocks16<T, false, false>, &kBlocks16<T, true, false>, &kBlocks16<T, false, true>,
          &kBlocks16<T, true, true>};
      return f(*kWide[v.Index()]);
    }
#endif
    static const Blocks<f32x8, T>* const kNarrow[] = {
        &kBlocks8<T, false, false>, &kBlocks8<T, true, false>, &kBlocks8<T, false, true>,
        &kBlocks8<T, true, true>};
    return f(*kNarrow[v.Index()]);
  }
};

#ifdef __AVX512BF16__
// bfloat16 dot products (AVX512-BF16): x and W both in bfloat16, each step adds
// x[2 kk] W[2 kk, n] + x[2 kk + 1] W[2 kk + 1, n] to a float32 accumulator (VDPBF16PS:
// round to nearest even, denormals flushed), kk in order: twice the multiply-adds of a
// float32 FMA per instruction, the same bits for every row count and both widths.
template <int R, int P, bool PF, bool PIN>
void DotBlock16(const Problem<Pair>& p, int64_t m, int64_t j, int64_t cols) {
  const int64_t K2 = p.K;
  const uint32_t* x = p.xpairs + m * K2;
  const Pair* panels = p.panels + j * K2 * kPanel;
  const int64_t ahead_k = kPrefetchBytes / (kPanel * sizeof(Pair));
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < K2; ++kk) {
    __m512bh w[P];
    const int64_t ahead = std::min(kk + ahead_k, K2 - 1);
    for (int q = 0; q < P; ++q) {
      if constexpr (PF) __builtin_prefetch(panels + (q * K2 + ahead) * kPanel);
      w[q] = (__m512bh)_mm512_loadu_si512(panels + (q * K2 + kk) * kPanel);
      if constexpr (PIN) InRegister(w[q]);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[r * K2 + kk]);
      for (int q = 0; q < P; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], xv, w[q]);
    }
  }
  float* y = p.y + m * p.N + j * kPanel;
  for (int r = 0; r < R; ++r) StoreRow(y + r * p.N, acc[r], cols);
}

template <int R, int P, bool PF, bool PIN>
void DotBlock8(const Problem<Pair>& p, int64_t m, int64_t j, int64_t cols) {
  const int64_t K2 = p.K;
  const uint32_t* x = p.xpairs + m * K2;
  const Pair* panels = p.panels + j * K2 * kPanel;
  const int64_t ahead_k = kPrefetchBytes / (kPanel * sizeof(Pair));
  __m256 acc[R][2 * P];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < 2 * P; ++b) acc[r][b] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < K2; ++kk) {
    __m256bh w[2 * P];
    const int64_t ahead = std::min(kk + ahead_k, K2 - 1);
    for (int q = 0; q < P; ++q) {
      if constexpr (PF) __builtin_prefetch(panels + (q * K2 + ahead) * kPanel);
      const Pair* row = panels + (q * K2 + kk) * kPanel;
      w[2 * q] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
      w[2 * q + 1] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 8));
      if constexpr (PIN) {
        InRegister(w[2 * q]);
        InRegister(w[2 * q + 1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256bh xv = (__m256bh)_mm256_set1_epi32(x[r * K2 + kk]);
      for (int b = 0; b < 2 * P; ++b) acc[r][b] = _mm256_dpbf16_ps(acc[r][b], xv, w[b]);
    }
  }
  float* y = p.y + m * p.N + j * kPanel;
  for (int r = 0; r < R; ++r) StoreRow(y + r * p.N, acc[r], cols);
}

template <bool PF, bool PIN>
const Blocks<__m512, Pair> kDotBlocks16 = {
    12,  // as kBlocks16
    {0, 4, 4, 4, 4, 4, 4, 4, 3, 3, 2, 2, 2},
    {nullptr, DotBlock16<1, 4, PF, PIN>, DotBlock16<2, 4, PF, PIN>, DotBlock16<3, 4, PF, PIN>,
     DotBlock16<4, 4, PF, PIN>, DotBlock16<5, 4, PF, PIN>, DotBlock16<6, 4, PF, PIN>,
     DotBlock16<7, 4, PF, PIN>, DotBlock16<8, 3, PF, PIN>, DotBlock16<9, 3, PF, PIN>,
     DotBlock16<10, 2, PF, PIN>, DotBlock16<11, 2, PF, PIN>, DotBlock16<12, 2, PF, PIN>},
    {nullptr, DotBlock16<1, 1, PF, PIN>, DotBlock16<2, 1, PF, PIN>, DotBlock16<3, 1, PF, PIN>,
     DotBlock16<4, 1, PF, PIN>, DotBlock16<5, 1, PF, PIN>, DotBlock16<6, 1, PF, PIN>,
     DotBlock16<7, 1, PF, PIN>, DotBlock16<8, 1, PF, PIN>, DotBlock16<9, 1, PF, PIN>,
     DotBlock16<10, 1, PF, PIN>, DotBlock16<11, 1, PF, PIN>, DotBlock16<12, 1, PF, PIN>}};
template <bool PF, bool PIN>
const Blocks<__m256, Pair> kDotBlocks8 = {
    6,
    {0, 4, 2, 2, 1, 1, 1},
    {nullptr, DotBlock8<1, 4, PF, PIN>, DotBlock8<2, 2, PF, PIN>, DotBlock8<3, 2, PF, PIN>,
     DotBlock8<4, 1, PF, PIN>, DotBlock8<5, 1, PF, PIN>, DotBlock8<6, 1, PF, PIN>},
    {nullptr, DotBlock8<1, 1, PF, PIN>, DotBlock8<2, 1, PF, PIN>, DotBlock8<3, 1, PF, PIN>,
     DotBlock8<4, 1, PF, PIN>, DotBlock8<5, 1, PF, PIN>, DotBlock8<6, 1, PF, PIN>}};

template <>
struct Tables<Pair> {
  template <typename F>
  static auto With(Variant v, F&& f) {
    if (v.width == 16) {
      static const Blocks<__m512, Pair>* const kWide[] = {
          &kDotBlocks16<false, false>, &kDotBlocks16<true, false>, &kDotBlocks16<false, true>,
          &kDotBlocks16<true, true>};
      return f(*kWide[v.Index()]);
    }
    static const Blocks<__m256, Pair>* const kNarrow[] = {
        &kDotBlocks8<false, false>, &kDotBlocks8<true, false>, &kDotBlocks8<false, true>,
        &kDotBlocks8<true, true>};
    return f(*kNarrow[v.Index()]);
  }
};

constexpr bool kHaveDot = true;
#else
constexpr bool kHaveDot = false;
#endif

// Panels [j0, j1) of p by variant v.
template <typename T>
void Range(const Problem<T>& p, Variant v, int64_t j0, int64_t j1) {
  Tables<T>::With(v, [&](const auto& blocks) { Panels(blocks, p, j0, j1, v.full_first); });
}

// The panels variant v's first row block of p takes at once (`Unit`).
template <typename T>
int64_t RangeUnit(const Problem<T>& p, Variant v) {
  return Tables<T>::With(v, [&](const auto& blocks) { return Unit(blocks, p.M, v.full_first); });
}

// float32 -> bfloat16, round to nearest even (NaN stays NaN).
inline uint16_t RoundToBf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

// At least n T's for one call, left uninitialized. Up to kScratchKeep bytes they are `kept`,
// the call site's thread_local buffer, grown as needed and kept from call to call: a vector
// made per call was zeroed before being written, and in the big CNN/DM target's set-up (320
// rows) those memsets of 0.3-0.6 MB took 4% of both threads' time (`perf record`, AMD EPYC
// family 25 model 17). Larger requests (a big batch's encoder) get a buffer of their own,
// freed with the object, so no thread holds hundreds of MB after one such call. Each call
// site keeps its own buffer, so two live scratches never share one.
constexpr int64_t kScratchKeep = int64_t{8} << 20;

template <typename T>
class Scratch {
 public:
  Scratch(std::vector<T>& kept, int64_t n) {
    if (n * int64_t{sizeof(T)} > kScratchKeep) {
      owned_.reset(new T[n]);  // default-initialized: no zeroing
      data_ = owned_.get();
      return;
    }
    if (kept.size() < static_cast<size_t>(n)) kept.resize(n);
    data_ = kept.data();
  }
  T* get() const { return data_; }

 private:
  std::unique_ptr<T[]> owned_;
  T* data_ = nullptr;
};

// x [M, 2 K2] float32 -> out [M, K2] words of two bfloat16 (k = 2 kk in the low half).
void PairRows(const float* x, int64_t M, int64_t K2, uint32_t* out) {
  for (int64_t i = 0; i < M * K2; ++i)
    out[i] = uint32_t{RoundToBf16(x[2 * i])} | uint32_t{RoundToBf16(x[2 * i + 1])} << 16;
}

// CPUs this process may run on (its affinity mask; all online CPUs where that is unknown).
int64_t UsableCpus() {
  static const int64_t n = [] {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return int64_t{CPU_COUNT(&set)};
    return std::max<int64_t>(1, std::thread::hardware_concurrency());
  }();
  return n;
}

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// How calls split their panels between the calling thread and a helper from XLA's pool,
// summed since the last `spec_decode_thread_stats` reset (a diagnostic of the split's
// overhead: a helper that starts late leaves its share to the caller).
struct SplitStats {
  std::atomic<int64_t> calls{0}, panels{0}, helpers{0}, helper_panels{0}, working{0},
      working_start_ns{0}, wait_ns{0}, call_ns{0}, same_cpu{0};
};
SplitStats g_split;

// Items [0, count) in chunks of `chunk`, taken from an atomic counter by the calling thread
// and by `helpers` tasks on XLA's pool: a helper that starts late finds no work and returns,
// so the call never waits on a task that has not started. `work` is called only while the
// caller is inside `Parallel` (a late helper touches the counter only).
struct Split {
  int64_t count, chunk, start_ns = 0;
  int cpu = -1;  // the caller's CPU when the call started
  std::function<void(int64_t, int64_t)> work;
  std::atomic<int64_t> next{0};
  std::atomic<int> active{0};
  int64_t Work() {  // -> items done by this thread
    int64_t done = 0;
    for (;;) {
      const int64_t i0 = next.fetch_add(chunk);
      if (i0 >= count) return done;
      const int64_t i1 = std::min(count, i0 + chunk);
      work(i0, i1);
      done += i1 - i0;
    }
  }
};

// work(i0, i1) over [0, count) split as `Split` says; stats (may be null) counts the split.
void Parallel(int64_t count, int64_t chunk, int64_t helpers, ffi::ThreadPool& pool,
              std::function<void(int64_t, int64_t)> work, SplitStats* stats) {
  auto shared = std::make_shared<Split>();
  shared->count = count;
  shared->chunk = std::max<int64_t>(1, chunk);
  shared->work = std::move(work);
  shared->start_ns = NowNs();
  if (stats != nullptr) shared->cpu = sched_getcpu();
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([shared, stats] {
      const int64_t start = NowNs();
      const int cpu = stats != nullptr ? sched_getcpu() : -1;  // where it started
      shared->active.fetch_add(1);
      const int64_t done = shared->Work();
      shared->active.fetch_sub(1);
      if (stats == nullptr) return;
      stats->helpers += 1;
      stats->helper_panels += done;
      if (done > 0) {  // a helper that found the work gone started after the call ended
        stats->working += 1;
        stats->working_start_ns += start - shared->start_ns;
        if (cpu >= 0 && cpu == shared->cpu) stats->same_cpu += 1;
      }
    });
  }
  shared->Work();
  const int64_t own_done = NowNs();
  while (shared->active.load() != 0) std::this_thread::yield();
  if (stats == nullptr) return;
  const int64_t end = NowNs();
  stats->calls += 1;
  stats->panels += count;
  stats->wait_ns += end - own_done;
  stats->call_ns += end - shared->start_ns;
}

// items(0, count) on the calling thread when `alone` (or with one item, or one usable CPU),
// else shared with helpers from XLA's pool (at most `threads` threads in all, one per usable
// CPU), about 4 shares per thread: the attention kernels' split over (row, head) items.
void RunItems(ffi::ThreadPool& pool, int64_t threads, int64_t count, bool alone,
              const std::function<void(int64_t, int64_t)>& items) {
  const int64_t helpers = std::min({threads, int64_t{pool.num_threads()}, UsableCpus()}) - 1;
  if (alone || count < 2 || helpers <= 0) {
    items(0, count);
    return;
  }
  Parallel(count, std::max<int64_t>(1, count / (4 * (helpers + 1))), helpers, pool, items,
           nullptr);
}

template <typename T>
void Run(const Problem<T>& problem, Variant variant, int64_t num_panels, int64_t helpers,
         ffi::ThreadPool* pool) {
  if (helpers <= 0 || num_panels < 2 || pool == nullptr) {
    Range(problem, variant, 0, num_panels);
    return;
  }
  // About 8 shares per thread, each a multiple of the blocks' panels (`Unit`).
  const int64_t unit = RangeUnit(problem, variant);
  Parallel(num_panels, unit * std::max<int64_t>(1, num_panels / (8 * unit * (helpers + 1))),
           helpers, *pool, [&](int64_t j0, int64_t j1) { Range(problem, variant, j0, j1); },
           &g_split);
}

// The bfloat16 dot-product products (x rounded to bfloat16 pairs, K even) of `panels`
// [P, K / 2, 16, 2]; false, doing nothing, where this build lacks AVX512-BF16 (the pair
// blocks exist only there, so no other build instantiates them).
bool RunPairs(const float* x, const void* panels, float* y, int64_t M, int64_t K, int64_t N,
              Variant variant, int64_t num_panels, int64_t helpers, ffi::ThreadPool* pool) {
#ifdef __AVX512BF16__
  Problem<Pair> problem{nullptr, static_cast<const Pair*>(panels), nullptr, y, M, K / 2, N};
  thread_local std::vector<uint32_t> kept;
  Scratch<uint32_t> pairs(kept, M * (K / 2));
  PairRows(x, M, K / 2, pairs.get());
  problem.xpairs = pairs.get();
  Run(problem, variant, num_panels, helpers, pool);
  return true;
#else
  return false;  // unused parameters draw no warning without -Wextra
#endif
}

// The sum of squares of row[0:K] in double, in kSumLanes partial sums (lane l sums the
// entries k = l mod kSumLanes in order) added pairwise at the end: the same bits in every
// build (each product of two floats is exact in double, so contracting it into a fused
// multiply-add changes nothing), and vectorized where the scalar chain of one sum was not
// (6 rows of 512: 0.5 us against 1.8 on an AMD EPYC of family 26).
constexpr int kSumLanes = 32;
double SumSquares(const float* row, int64_t K) {
  double part[kSumLanes] = {};
  int64_t k = 0;
  for (; k + kSumLanes <= K; k += kSumLanes)
    for (int l = 0; l < kSumLanes; ++l) part[l] += double(row[k + l]) * row[k + l];
  for (int l = 0; k < K; ++k, ++l) part[l] += double(row[k]) * row[k];
  for (int w = kSumLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) part[l] += part[l + w];
  return part[0];
}

// x's rows RMS-normalized and scaled, as T5's norm before a projection: row * rsqrt(mean(row^2)
// + eps) * scale (the sum of squares in double, `SumSquares`), so a norm and the product
// after it are one call. Each row's result depends on that row only. Into out [M, K].
void NormRows(const float* x, const float* scale, float eps, int64_t M, int64_t K, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    const float r = 1.0f / std::sqrt(float(SumSquares(row, K) / K) + eps);
    for (int64_t k = 0; k < K; ++k) out[m * K + k] = row[k] * r * scale[k];
  }
}

// ---- Decode-step attention ----
//
// out[b, t, n, :] = softmax_l(where(mask[b, t, l], q[b, t, n, :] . K[b, n, :, l] +
// bias[b, n, t, l], -1e10)) @ V[b, n, l, :] over a cache's K [B, N, H, L] and V [B, N, L, H]
// (T5: no 1 / sqrt(H)). Only the slots up to a query's last visible one are read (a cache of
// 160 slots holding 30 tokens costs 30), the loop XLA's batched dots run over every slot.
// A query with no visible slot attends to all L uniformly, as the masked softmax does.
// Every query is computed alone, its sums in an order fixed by its own mask row (masked
// slots below its last visible one add exact zeros): a verify call's rows are the same bits
// as single-token steps'.

// The attention code fixes its own rounding: every multiply-add in it is an explicit fused
// one (`Fma`), none is left for the compiler to contract. Left to contract `a * b + c`,
// gcc's tunings for AMD Zen decline to fuse some chains of them, so a query's bits differed
// between a tile of 1 query and one of 5 (an AVX2 build on a family 26 EPYC, -march=native
// -mno-avx512f: up to 7e-7), which breaks "a verify call's rows equal single steps'".
// (A `#pragma GCC optimize("fp-contract=off")` here instead stopped the small helpers
// defined above it from being inlined, and batch 8's attention took 1.8x as long.)

// a * b + c rounded once where the CPU fuses multiply-adds (AVX-512F or FMA); else (no
// fused instruction to contract to) rounded twice, the same way everywhere.
template <typename V>
inline V Fma(V a, V b, V c) {
#ifdef __AVX512F__
  if constexpr (sizeof(V) == 64) {
    const __m512 r = _mm512_fmadd_ps(Bits<__m512>(&a), Bits<__m512>(&b), Bits<__m512>(&c));
    return Bits<V>(&r);
  }
#endif
#ifdef __FMA__
  if constexpr (sizeof(V) == 32) {
    const __m256 r = _mm256_fmadd_ps(Bits<__m256>(&a), Bits<__m256>(&b), Bits<__m256>(&c));
    return Bits<V>(&r);
  }
#endif
  return a * b + c;
}

// e^x for x <= 0 in lanes (Cephes' polynomial after x = n ln 2 + r, about 1 ulp); exactly 0
// below -87 (so a masked logit's weight is 0, as exp(-1e10) is).
template <typename V>
inline V ExpNonPositive(V x) {
  typedef int32_t I __attribute__((vector_size(sizeof(V))));
  const auto tiny = x < (V{} - 87.0f);
  x = tiny ? V{} - 87.0f : x;
  const V fx = Fma(x, V{} + 1.44269504088896341f, V{} + 0.5f);
  I n = __builtin_convertvector(fx, I);  // truncates toward zero; floor below
  n = n - (__builtin_convertvector(n, V) > fx ? 1 : 0);
  const V nf = __builtin_convertvector(n, V);
  x = Fma(nf, V{} - 0.693359375f, x);
  x = Fma(nf, V{} + 2.12194440e-4f, x);
  V y = V{} + 1.9875691500e-4f;
  y = Fma(y, x, V{} + 1.3981999507e-3f);
  y = Fma(y, x, V{} + 8.3334519073e-3f);
  y = Fma(y, x, V{} + 4.1665795894e-2f);
  y = Fma(y, x, V{} + 1.6666665459e-1f);
  y = Fma(y, x, V{} + 5.0000001201e-1f);
  y = Fma(y, x * x, x) + 1.0f;
  const I bits = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(V));
  y = y * scale;
  return tiny ? V{} : y;
}

#ifdef __AVX512F__
typedef f32x16 AttV;
#else
typedef f32x8 AttV;
#endif
constexpr int64_t kAttLanes = Lanes<AttV>();

struct Attention {
  const float* q;      // query (b, t, n): q + (b * T + t) * q_row + n * H
  const float* k;      // [B, N, H, L] (decode caches; `Attend`)
  const float* v;      // [B, N, L, H] (decode caches; `Attend`)
  const float* bias;   // query (b, t, n)'s L biases: bias + b' * bias_b + n * bias_n + t * bias_t
                       // (b' = 0 when bias_batch is 1), or null
  const bool* mask;    // query (b, t)'s L flags: mask + b * mask_b + t * mask_t
  const int64_t* extent;  // [B, T]: slots read by each query
  float* out;          // [B, T, N, H]
  int64_t B, T, N, H, L, bias_batch;
  int64_t q_row, v_row, bias_b, bias_n, bias_t, mask_b, mask_t;
};

// The strides of `Attend`'s layouts: q [B, T, N, H], V [B, N, L, H], bias [Bb, N, T, L],
// mask [B, T, L].
void DecodeStrides(Attention& a) {
  a.q_row = a.N * a.H;
  a.v_row = a.H;
  a.bias_n = a.T * a.L;
  a.bias_b = a.N * a.bias_n;
  a.bias_t = a.L;
  a.mask_t = a.L;
  a.mask_b = a.T * a.L;
}

constexpr int64_t kAttTile = 8;  // queries of one head that share each K and V load

// kAttLanes mask flags at m widened to 32-bit lanes (0 or 1). gcc lowers the generic byte ->
// int conversion of a vector to a scalar extract per lane (about 25 instructions per 8
// flags, measured as a third of an encoder attention's softmax on an AVX2 AMD EPYC); one
// zero-extending load (VPMOVZXBD) does it where the instruction set has one.
typedef int32_t AttI __attribute__((vector_size(sizeof(AttV))));
typedef uint8_t AttB __attribute__((vector_size(kAttLanes)));
inline AttI MaskLanes(const bool* m) {
#ifdef __AVX512F__
  if constexpr (sizeof(AttI) == 64) {
    const __m512i r = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m)));
    return Bits<AttI>(&r);
  }
#endif
#ifdef __AVX2__
  if constexpr (sizeof(AttI) == 32) {
    const __m256i r = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)));
    return Bits<AttI>(&r);
  }
#endif
  return __builtin_convertvector(Bits<AttB>(m), AttI);
}

// The masked softmax of a tile's `count` queries over their extents (`AttendTile`): the
// logits in s (row i at s + i * stride) become weights; a query's weights past its extent
// are not written (its last chunk's rest: 0), none is read there.
template <int64_t count>
inline void SoftmaxTile(const Attention& a, int64_t b, int64_t n, int64_t t0, float* s,
                        int64_t stride, const int64_t* extent) {
  const int64_t L = a.L;
  for (int64_t i = 0; i < count; ++i) {
    float* si = s + i * stride;
    const int64_t Ei = extent[i];
    const bool* m = a.mask + b * a.mask_b + (t0 + i) * a.mask_t;
    const float* bias = a.bias == nullptr ? nullptr
        : a.bias + (a.bias_batch == 1 ? 0 : b) * a.bias_b + n * a.bias_n + (t0 + i) * a.bias_t;
    const int64_t whole = Ei / kAttLanes * kAttLanes;
    AttV top_v = AttV{} - 1e10f;
    for (int64_t l0 = 0; l0 < whole; l0 += kAttLanes) {
      AttV x = Bits<AttV>(si + l0);
      if (bias != nullptr) x = x + Bits<AttV>(bias + l0);
      const AttI visible = MaskLanes(m + l0);
      x = visible != 0 ? x : AttV{} - 1e10f;
      std::memcpy(si + l0, &x, sizeof(x));
      top_v = x > top_v ? x : top_v;
    }
    float top = -1e10f;
    for (int j = 0; j < kAttLanes; ++j) top = std::max(top, top_v[j]);
    for (int64_t l = whole; l < Ei; ++l) {
      si[l] = !m[l] ? -1e10f : bias == nullptr ? si[l] : si[l] + bias[l];
      top = std::max(top, si[l]);
    }
    const int64_t ci = (Ei + kAttLanes - 1) / kAttLanes;
    for (int64_t l = Ei; l < ci * kAttLanes; ++l) si[l] = -1e30f;  // its last chunk's rest: 0
    AttV sum{};
    for (int64_t c = 0; c < ci; ++c) {
      AttV x = ExpNonPositive(Bits<AttV>(si + c * kAttLanes) - top);
      std::memcpy(si + c * kAttLanes, &x, sizeof(x));
      sum += x;
    }
    float total = 0.0f;
    for (int j = 0; j < kAttLanes; ++j) total += sum[j];
    for (int64_t l0 = 0; l0 < whole; l0 += kAttLanes) {
      const AttV x = Bits<AttV>(si + l0) / (AttV{} + total);
      std::memcpy(si + l0, &x, sizeof(x));
    }
    for (int64_t l = whole; l < Ei; ++l) si[l] = si[l] / total;
  }
}

#ifndef SPEC_DECODE_ATT_ROWS_BYTES
#define SPEC_DECODE_ATT_ROWS_BYTES (16 << 10)
#endif
constexpr int64_t kAttRowsBytes = SPEC_DECODE_ATT_ROWS_BYTES;  // K read by rows past this

// The queries t0 .. t0 + count - 1 (count <= kAttTile) of batch row b and head n; s: scratch
// of kAttTile x `stride` floats (L rounded up to lanes). Each K and V vector is loaded once
// for the tile, and every query's sums run over the same terms in the same order as alone.
// The tile's size is a template argument, so that its accumulators stay in registers.
template <int64_t count>
void AttendTile(const Attention& a, int64_t b, int64_t n, int64_t t0, float* s, int64_t stride,
                const float* k, const float* v) {
  // Slot chunks a pass of the logits takes at once (and at least as many feature chunks for
  // the values, GV below): count x G independent accumulator chains, so that few queries
  // still cover the FMA latency.
  constexpr int64_t G = count >= 8 ? 1 : count >= 4 ? 2 : 4;
  const int64_t H = a.H, L = a.L;
  const int64_t* extent = a.extent + b * a.T + t0;
  const int64_t E = *std::max_element(extent, extent + count);
  const int64_t E_all = *std::min_element(extent, extent + count);  // slots every query reads
  const int64_t chunks = (E + kAttLanes - 1) / kAttLanes;
  const int64_t v_row = a.v_row;
  const float* q[count];
  for (int64_t i = 0; i < count; ++i) q[i] = a.q + (b * a.T + t0 + i) * a.q_row + n * H;
  // logits: over h in order, lanes over slots (a slot past a query's extent is overwritten);
  // GG chunks of slots from chunk c0; INSIDE: they lie inside the cache row (else its partial
  // last chunk is read lane by lane; a compile-time flag, so that the K vectors stay in
  // registers)
  auto logits = [&](auto gg, auto inside, int64_t c0) {
    constexpr int64_t GG = decltype(gg)::value;
    AttV acc[count][GG] = {};
    for (int64_t h = 0; h < H; ++h) {
      AttV kv[GG];
      for (int64_t g = 0; g < GG; ++g) {
        const int64_t l0 = (c0 + g) * kAttLanes;
        if constexpr (decltype(inside)::value) {
          kv[g] = Bits<AttV>(k + h * L + l0);
        } else {
          kv[g] = AttV{};
          for (int64_t j = 0; l0 + j < L && j < kAttLanes; ++j) kv[g][j] = k[h * L + l0 + j];
        }
      }
      for (int64_t i = 0; i < count; ++i) {
        const AttV qv = q[i][h] - AttV{};
        for (int64_t g = 0; g < GG; ++g) acc[i][g] = Fma(qv, kv[g], acc[i][g]);
      }
    }
    for (int64_t i = 0; i < count; ++i)
      for (int64_t g = 0; g < GG; ++g)
        std::memcpy(s + i * stride + (c0 + g) * kAttLanes, &acc[i][g], sizeof(AttV));
  };
  auto pass = [&](auto gg, int64_t c0) {
    if ((c0 + decltype(gg)::value) * kAttLanes <= L) {
      logits(gg, std::true_type{}, c0);
    } else {
      logits(gg, std::false_type{}, c0);
    }
  };
  // logits over K's rows in order, the sums in s: each (query, chunk) from zero over h in
  // order, one Fma per term, as `logits` sums them in registers. For K too long for one
  // pass of `logits`, which reads G chunks of every row, then the next G: a few lines per
  // row at the cache's stride, which the hardware prefetchers did not follow (half of the
  // tiles' time in a one-token step of the big CNN/DM target, ~300 positions of cross-
  // attention, waited on those loads: `perf annotate`, AMD EPYC family 25 model 17). Read
  // by rows, with GV's whole rows of V, its 6-token verify step took 0.75-0.82x the time
  // (`experiments.kernel_ab --placements decode --input_length 300`, and loops of 100 steps
  // in turns), its one-token step 0.92-1.0x; the EnDe steps (32 positions) did not move.
  auto logits_by_rows = [&] {
    const int64_t whole = std::min(chunks, L / kAttLanes);  // chunks inside the cache row
    for (int64_t i = 0; i < count; ++i)
      std::fill(s + i * stride, s + i * stride + chunks * kAttLanes, 0.0f);
    for (int64_t h = 0; h < H; ++h) {
      const float* kr = k + h * L;
      AttV qv[count];
      for (int64_t i = 0; i < count; ++i) qv[i] = q[i][h] - AttV{};
      for (int64_t c = 0; c < chunks; ++c) {
        AttV kv;
        if (c < whole) {
          kv = Bits<AttV>(kr + c * kAttLanes);
        } else {
          kv = AttV{};
          for (int64_t j = 0; c * kAttLanes + j < L && j < kAttLanes; ++j)
            kv[j] = kr[c * kAttLanes + j];
        }
        for (int64_t i = 0; i < count; ++i) {
          float* si = s + i * stride + c * kAttLanes;
          const AttV sum = Fma(qv[i], kv, Bits<AttV>(si));
          std::memcpy(si, &sum, sizeof(sum));
        }
      }
    }
  };
  if (chunks > G && H * E * int64_t{sizeof(float)} > kAttRowsBytes) {
    logits_by_rows();
  } else {
    int64_t c0 = 0;
    for (; c0 + G <= chunks; c0 += G) pass(std::integral_constant<int64_t, G>{}, c0);
    for (; c0 < chunks; ++c0) pass(std::integral_constant<int64_t, 1>{}, c0);
  }
  // masked softmax per query over its extent (the values pass reads no weight past it);
  // every logit -1e10 where it sees no slot at all
  SoftmaxTile<count>(a, b, n, t0, s, stride, extent);
  // weights x values: per feature chunk, over slots in order (each query's own slots only:
  // a weight that is 0 inside its extent adds an exact 0), GV chunks of features per pass
  // over V's rows: 4 (a row of 64 features in one pass) where count x 4 accumulators, the 4
  // V vectors and a weight fit the registers. (With G's 2 chunks, 4 to 6 queries read each
  // row of V in two halves, one pass each, and waited on V's loads: a third of the tiles'
  // time in the big CNN/DM target's 6-token verify, `perf annotate`, AMD EPYC family 25
  // model 17.)
  constexpr int64_t GV = count * 4 + 4 + 1 <= Registers<AttV>() ? std::max<int64_t>(G, 4) : G;
  auto values = [&](auto nv) {  // NV feature chunks per pass
    constexpr int64_t NV = decltype(nv)::value;
    for (int64_t h0 = 0; h0 < H; h0 += NV * kAttLanes) {
      int64_t width[NV];
      for (int64_t g = 0; g < NV; ++g)
        width[g] = std::clamp<int64_t>(H - h0 - g * kAttLanes, 0, kAttLanes);
      AttV acc[count][NV] = {};
      // FULL: every feature chunk of the pass is whole (a compile-time flag, as `logits`'
      // INSIDE); else each chunk whole, empty (zeros) or read lane by lane
      auto slot = [&](int64_t l, bool every, auto full) {
        AttV rv[NV];
        for (int64_t g = 0; g < NV; ++g) {
          const float* vg = v + l * v_row + h0 + g * kAttLanes;
          if constexpr (decltype(full)::value) {
            rv[g] = Bits<AttV>(vg);
          } else {
            rv[g] = AttV{};
            if (width[g] == kAttLanes) {
              rv[g] = Bits<AttV>(vg);
            } else {
              for (int64_t j = 0; j < width[g]; ++j) rv[g][j] = vg[j];
            }
          }
        }
        for (int64_t i = 0; i < count; ++i) {
          if (!every && l >= extent[i]) continue;
          const AttV w = s[i * stride + l] - AttV{};
          for (int64_t g = 0; g < NV; ++g) acc[i][g] = Fma(w, rv[g], acc[i][g]);
        }
      };
      auto slots = [&](auto full) {
        for (int64_t l = 0; l < E_all; ++l) slot(l, true, full);
        for (int64_t l = E_all; l < E; ++l) slot(l, false, full);
      };
      if (width[NV - 1] == kAttLanes) {
        slots(std::true_type{});
      } else {
        slots(std::false_type{});
      }
      for (int64_t i = 0; i < count; ++i) {
        float* o = a.out + ((b * a.T + t0 + i) * a.N + n) * H + h0;
        for (int64_t g = 0; g < NV && width[g] > 0; ++g) {
          float tmp[kAttLanes];
          std::memcpy(tmp, &acc[i][g], sizeof(tmp));
          std::memcpy(o + g * kAttLanes, tmp, width[g] * sizeof(float));
        }
      }
    }
  };
  // GV's passes where they tile the features (64 of them: one pass); else G's, as before
  // (32 features in passes of 64 would read half of each pass lane by lane: the CNN/DM
  // small draft's one-token step, 2 heads of 32, took 1.16x as long)
  if (H % (GV * kAttLanes) == 0) {
    values(std::integral_constant<int64_t, GV>{});
  } else {
    values(std::integral_constant<int64_t, G>{});
  }
}

using AttendTileFn = void (*)(const Attention&, int64_t, int64_t, int64_t, float*, int64_t,
                              const float*, const float*);
constexpr AttendTileFn kAttendTiles[kAttTile + 1] = {
    nullptr, AttendTile<1>, AttendTile<2>, AttendTile<3>, AttendTile<4>,
    AttendTile<5>, AttendTile<6>, AttendTile<7>, AttendTile<8>};

constexpr int64_t kAttSplitBytes = 32 << 10;

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                  ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> bias,
                  ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out,
                  int64_t threads, int64_t has_bias) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(),
             md = mask.dimensions(), bd = bias.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 3 || bd.size() != 4)
    return ffi::Error::InvalidArgument(
        "decode_attention: want q [B, T, N, H], k [B, N, H, L], v [B, N, L, H], bias "
        "[Bb, N, T, L], mask [B, T, L]");
  const int64_t B = qd[0], T = qd[1], N = qd[2], H = qd[3], L = kd[3];
  if (kd[0] != B || kd[1] != N || kd[2] != H || vd[0] != B || vd[1] != N || vd[2] != L ||
      vd[3] != H || md[0] != B || md[1] != T || md[2] != L ||
      (has_bias && ((bd[0] != 1 && bd[0] != B) || bd[1] != N || bd[2] != T || bd[3] != L)))
    return ffi::Error::InvalidArgument("decode_attention: shapes of q, k, v, bias and mask disagree");
  const bool* m = mask.typed_data();
  std::vector<int64_t> extent(B * T);
  int64_t work = 0, widest = 0;  // widest: the sum over rows of their widest extent
  for (int64_t b = 0; b < B; ++b) {
    int64_t row = 0;
    for (int64_t bt = b * T; bt < (b + 1) * T; ++bt) {
      int64_t e = L;
      while (e > 0 && !m[bt * L + e - 1]) --e;
      extent[bt] = e > 0 ? e : L;  // nothing visible: all slots, uniformly
      work += extent[bt];
      row = std::max(row, extent[bt]);
    }
    widest += row;
  }
  Attention a{q.typed_data(), k.typed_data(), v.typed_data(),
              has_bias ? bias.typed_data() : nullptr, m, extent.data(),
              out->typed_data(), B, T, N, H, L, has_bias ? bd[0] : 0};
  DecodeStrides(a);
  const int64_t scratch = (L + kAttLanes - 1) / kAttLanes * kAttLanes;
  auto heads = [&a, scratch](int64_t i0, int64_t i1) {  // items: (b, n) pairs
    // Each thread's scores, kept from call to call (one allocation per thread and size,
    // not one per share of every call).
    thread_local std::vector<float> s;
    if (s.size() < static_cast<size_t>(kAttTile * scratch)) s.resize(kAttTile * scratch);
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t t = 0; t < a.T; t += kAttTile)
        kAttendTiles[std::min(kAttTile, a.T - t)](a, i / a.N, i % a.N, t, s.data(), scratch,
                                                  a.k + i * a.H * a.L, a.v + i * a.L * a.H);
  };
  const int64_t kv_bytes = widest * N * H * 2 * int64_t{sizeof(float)};  // K and V read
  // A second thread pays for enough multiply-adds (2 per slot and feature), or for enough
  // bytes of K and V: in a decode step they come from memory (the layers' weights streamed
  // through the caches since the step before), where one thread reads them at a fraction of
  // the bandwidth two do. (32 KB: a batch-1 step of the big EnDe target reads ~80 KB per
  // call and the small EnDe draft's ~15 KB; split, the big target's T_p fell 4%, its
  // verify of 6 tokens 7%, batch 8's step 14%, and 25% for the CNN/DM target's one-query
  // step over ~300 article positions; the small drafts' steps, CNN/DM's with its
  // cross-attention now split, did not move: AMD EPYC family 26, in one process.)
  RunItems(pool, threads, B * N, work * N * H < (1 << 18) && kv_bytes < kAttSplitBytes, heads);
  return ffi::Error::Success();
}

#ifdef __AVX512BF16__
// 32 floats -> 16 words of two bfloat16 (x[2 j] in word j's low half, as VDPBF16PS pairs
// them), rounded to nearest even by VCVTNE2PS2BF16.
inline void PairsOf32(const float* x, uint32_t* out) {
  const __m512bh p = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + 16), _mm512_loadu_ps(x));
  _mm512_storeu_si512(out, (__m512i)p);
}

// 16 floats of each of two slots -> 16 words (lo[h] in the low half, hi[h] in the high),
// rounded to nearest even as VCVTNE2PS2BF16 rounds.
inline void PairsOf16x2(const float* lo, const float* hi, uint32_t* out) {
  const __m256bh a = _mm512_cvtneps_pbh(_mm512_loadu_ps(lo));
  const __m256bh b = hi == nullptr ? (__m256bh)_mm256_setzero_si256()
                                   : _mm512_cvtneps_pbh(_mm512_loadu_ps(hi));
  const __m512i wa = _mm512_cvtepu16_epi32((__m256i)a), wb = _mm512_cvtepu16_epi32((__m256i)b);
  _mm512_storeu_si512(out, _mm512_or_si512(wa, _mm512_slli_epi32(wb, 16)));
}

// `AttendTile` in bfloat16 dot products (AVX512-BF16): q, K, the softmax's weights and V
// rounded to bfloat16, each product of a pair summed into float32 (VDPBF16PS: twice the
// multiply-adds of an FMA per instruction), the softmax in float32. For an encoder's
// attention over its input (`SelfAttend` with `dot`), where the set-up multiplies in
// bfloat16 already; never for decode steps. kt [H / 2][stride] words: slot l's K pair
// (2 hp, 2 hp + 1) at kt[hp * stride + l]; vt [ceil(E / 2)][H] words: value feature h of the
// slot pair (2 lp, 2 lp + 1) at vt[lp * H + h] (0 past the extent). H a multiple of 32.
template <int64_t count>
void AttendTileDot(const Attention& a, int64_t b, int64_t n, int64_t t0, float* s,
                   int64_t stride, const uint32_t* kt, const uint32_t* vt) {
  constexpr int64_t G = 2;  // chunks of 16 slots (logits) or features (values) per pass
  const int64_t H = a.H, H2 = a.H / 2;
  const int64_t* extent = a.extent + b * a.T + t0;
  const int64_t E = *std::max_element(extent, extent + count);
  const int64_t chunks = (E + 15) / 16;
  alignas(64) uint32_t qp[count][64];  // the queries' pairs (H <= 128)
  for (int64_t i = 0; i < count; ++i) {
    const float* q = a.q + (b * a.T + t0 + i) * a.q_row + n * H;
    for (int64_t h = 0; h < H; h += 32) PairsOf32(q + h, qp[i] + h / 2);
  }
  for (int64_t c0 = 0; c0 < chunks; c0 += G) {
    const int64_t gg = std::min<int64_t>(G, chunks - c0);
    __m512 acc[count][G];
    for (int64_t i = 0; i < count; ++i)
      for (int64_t g = 0; g < G; ++g) acc[i][g] = _mm512_setzero_ps();
    for (int64_t hp = 0; hp < H2; ++hp) {
      __m512bh kv[G];
      for (int64_t g = 0; g < G; ++g)
        kv[g] = (__m512bh)_mm512_loadu_si512(kt + hp * stride + (c0 + std::min(g, gg - 1)) * 16);
      for (int64_t i = 0; i < count; ++i) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[i][hp]));  // NOLINT
        for (int64_t g = 0; g < G; ++g) acc[i][g] = _mm512_dpbf16_ps(acc[i][g], qv, kv[g]);
      }
    }
    for (int64_t i = 0; i < count; ++i)
      for (int64_t g = 0; g < gg; ++g) _mm512_storeu_ps(s + i * stride + (c0 + g) * 16, acc[i][g]);
  }
  SoftmaxTile<count>(a, b, n, t0, s, stride, extent);
  const int64_t pairs = (E + 1) / 2;
  // each query's weights as pairs, in place: row i's words 0 .. pairs - 1 (0 past its extent:
  // the softmax wrote zeros up to its last chunk's end, which covers 2 pairs)
  for (int64_t i = 0; i < count; ++i) {
    float* w = s + i * stride;
    uint32_t* wp = reinterpret_cast<uint32_t*>(w);
    for (int64_t l = 0; l < 2 * pairs; l += 32) {
      alignas(64) float chunk[32] = {};
      std::memcpy(chunk, w + l, std::min<int64_t>(32, stride - l) * sizeof(float));
      PairsOf32(chunk, wp + l / 2);
    }
  }
  for (int64_t h0 = 0; h0 < H; h0 += G * 16) {
    __m512 acc[count][G];
    for (int64_t i = 0; i < count; ++i)
      for (int64_t g = 0; g < G; ++g) acc[i][g] = _mm512_setzero_ps();
    for (int64_t lp = 0; lp < pairs; ++lp) {
      __m512bh vv[G];
      for (int64_t g = 0; g < G; ++g)
        vv[g] = (__m512bh)_mm512_loadu_si512(vt + lp * H + h0 + g * 16);
      for (int64_t i = 0; i < count; ++i) {
        const uint32_t* wp = reinterpret_cast<const uint32_t*>(s + i * stride) + lp;
        const __m512bh wv = (__m512bh)_mm512_set1_epi32(static_cast<int>(*wp));
        for (int64_t g = 0; g < G; ++g) acc[i][g] = _mm512_dpbf16_ps(acc[i][g], wv, vv[g]);
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      float* o = a.out + ((b * a.T + t0 + i) * a.N + n) * H + h0;
      for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(o + g * 16, acc[i][g]);
    }
  }
}

using AttendTileDotFn = void (*)(const Attention&, int64_t, int64_t, int64_t, float*, int64_t,
                                 const uint32_t*, const uint32_t*);
constexpr AttendTileDotFn kAttendTilesDot[kAttTile + 1] = {
    nullptr, AttendTileDot<1>, AttendTileDot<2>, AttendTileDot<3>, AttendTileDot<4>,
    AttendTileDot<5>, AttendTileDot<6>, AttendTileDot<7>, AttendTileDot<8>};
#endif

// ---- An encoder's self-attention in register blocks ----
//
// `AttendTile` computes a tile of up to 8 queries over one vector of slots (or features) at a
// time: per step it loads one K or V vector and 8 broadcasts for 8 multiply-adds, which is
// bound by the loads, and it reads K (transposed) and V in place with a row stride, a cache
// line per slot per pass. An encoder's attention over hundreds of positions is a pair of
// matrix products (queries x keys, then weights x values), so `SelfAttend` runs it as one
// when the head_dim is a multiple of the block's features: kAttRows queries x kAttVecs
// vectors per block (2 loads and kAttRows broadcasts for 2 kAttRows multiply-adds: 6 x 16 in
// the 16 registers of AVX2, 12 x 32 in AVX-512's 32), K and V first copied into the
// thread's scratch in the order the blocks read them. Every logit and every output element
// is still summed as in `AttendTile`: from zero, over h (logits) or over the slots (values)
// in order, each term one fused multiply-add, and the same `SoftmaxTile` between them, so
// the results are the same bits as `Attend`'s. Measured on a 2-core AVX2 AMD EPYC (family
// 25), one layer of the big CNN/DM demo target over a 283-token article: 2.4-2.6 ms -> 1.4-
// 1.8 ms (two threads); the article's whole set-up 6.4 ms less (median of 16 interleaved
// rounds), the same bits.
constexpr int kAttVecs = 2;                             // vectors of slots / features per block
constexpr int64_t kAttBlock = kAttVecs * kAttLanes;    // slots / features per block
constexpr int kAttRows = Registers<AttV>() == 32 ? 12 : 6;  // queries per block
// Rows with fewer visible positions keep the decode tiles (an EnDe sentence's ~15: no gain
// measured there, and the copies into the blocks' order cost about what they save).
constexpr int64_t kAttBlockedMinSlots = 64;

// Logits of R queries (q[i]: its H features) over the kAttBlock slots of one K block (kb:
// [H][kAttBlock], slot j of the block at kb[h * kAttBlock + j]) into s + i * stride + l0.
template <int R>
void LogitsBlock(const float* const* q, const float* kb, int64_t H, float* s, int64_t stride,
                 int64_t l0) {
  AttV acc[R][kAttVecs] = {};
  for (int64_t h = 0; h < H; ++h) {
    AttV kv[kAttVecs];
    for (int g = 0; g < kAttVecs; ++g) kv[g] = Bits<AttV>(kb + h * kAttBlock + g * kAttLanes);
    for (int i = 0; i < R; ++i) {
      const AttV qv = q[i][h] - AttV{};
      for (int g = 0; g < kAttVecs; ++g) acc[i][g] = Fma(qv, kv[g], acc[i][g]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int g = 0; g < kAttVecs; ++g)
      std::memcpy(s + i * stride + l0 + g * kAttLanes, &acc[i][g], sizeof(AttV));
}

// Outputs of R queries (weights at s + i * stride, slots 0 .. E - 1) for the kAttBlock
// features of one V block (vb: [E][kAttBlock]) into o[i].
template <int R>
void ValuesBlock(const float* s, int64_t stride, const float* vb, int64_t E, float* const* o) {
  AttV acc[R][kAttVecs] = {};
  for (int64_t l = 0; l < E; ++l) {
    AttV rv[kAttVecs];
    for (int g = 0; g < kAttVecs; ++g) rv[g] = Bits<AttV>(vb + l * kAttBlock + g * kAttLanes);
    for (int i = 0; i < R; ++i) {
      const AttV w = s[i * stride + l] - AttV{};
      for (int g = 0; g < kAttVecs; ++g) acc[i][g] = Fma(w, rv[g], acc[i][g]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int g = 0; g < kAttVecs; ++g) std::memcpy(o[i] + g * kAttLanes, &acc[i][g], sizeof(AttV));
}

// The queries t0 .. t0 + R - 1 of row b, head n: logits over the E visible slots (K blocks
// kb, one per kAttBlock slots), the masked softmax, the values (V blocks vb, one per
// kAttBlock features, each [E][kAttBlock]).
template <int R>
void SelfAttendRows(const Attention& a, int64_t b, int64_t n, int64_t t0, int64_t E,
                    const float* kb, const float* vb, float* s, int64_t stride) {
  const int64_t H = a.H;
  const float* q[R];
  float* o[R];
  for (int i = 0; i < R; ++i) {
    q[i] = a.q + (b * a.T + t0 + i) * a.q_row + n * H;
    o[i] = a.out + ((b * a.T + t0 + i) * a.N + n) * H;
  }
  for (int64_t c = 0; c * kAttBlock < E; ++c)
    LogitsBlock<R>(q, kb + c * H * kAttBlock, H, s, stride, c * kAttBlock);
  SoftmaxTile<R>(a, b, n, t0, s, stride, a.extent + b * a.T + t0);
  for (int64_t h0 = 0; h0 < H; h0 += kAttBlock) {
    ValuesBlock<R>(s, stride, vb + h0 * E, E, o);
    for (int i = 0; i < R; ++i) o[i] += kAttBlock;
  }
}

template <int... R>
constexpr auto SelfAttendRowsTable(std::integer_sequence<int, R...>) {
  using Fn = void (*)(const Attention&, int64_t, int64_t, int64_t, int64_t, const float*,
                      const float*, float*, int64_t);
  return std::array<Fn, sizeof...(R)>{SelfAttendRows<R + 1>...};
}
// kSelfAttendRows[r - 1]: a block of r queries
constexpr auto kSelfAttendRows = SelfAttendRowsTable(std::make_integer_sequence<int, kAttRows>{});

// One (row b, head n) item of `SelfAttend` in blocks (H a multiple of kAttBlock): K and V of
// its E visible slots copied from the joined product x ([B, S, C]: keys at column N H + n H,
// values at 2 N H + n H) into kb (ceil(E / kAttBlock) blocks [H][kAttBlock], zeros past E)
// and vb (H / kAttBlock blocks [E][kAttBlock]), then every query in blocks of kAttRows.
void SelfAttendBlocked(const Attention& a, const float* x, int64_t C, int64_t b, int64_t n,
                       std::vector<float>& kb, std::vector<float>& vb, std::vector<float>& s) {
  const int64_t H = a.H, S = a.L, E = a.extent[b * a.T];
  const int64_t chunks = (E + kAttBlock - 1) / kAttBlock, stride = chunks * kAttBlock;
  if (kb.size() < static_cast<size_t>(stride * H)) kb.resize(stride * H);
  if (vb.size() < static_cast<size_t>(E * H)) vb.resize(E * H);
  if (s.size() < static_cast<size_t>(kAttRows * stride)) s.resize(kAttRows * stride);
  const float* kin = x + b * S * C + a.N * H + n * H;
  const float* vin = x + b * S * C + 2 * a.N * H + n * H;
  for (int64_t c = 0; c < chunks; ++c) {
    float* block = kb.data() + c * H * kAttBlock;
    for (int64_t j = 0; j < kAttBlock; ++j) {
      const int64_t l = c * kAttBlock + j;
      for (int64_t h = 0; h < H; ++h) block[h * kAttBlock + j] = l < E ? kin[l * C + h] : 0.0f;
    }
  }
  for (int64_t h0 = 0; h0 < H; h0 += kAttBlock)
    for (int64_t l = 0; l < E; ++l)
      std::memcpy(vb.data() + h0 * E + l * kAttBlock, vin + l * C + h0, kAttBlock * sizeof(float));
  for (int64_t t = 0; t < a.T; t += kAttRows) {
    const int64_t r = std::min<int64_t>(kAttRows, a.T - t);
    kSelfAttendRows[r - 1](a, b, n, t, E, kb.data(), vb.data(), s.data(), stride);
  }
}

// ---- An encoder's self-attention, read from its joined projection ----
//
// out[b, t, n, :] = the attention of `Attend` for query q[b, t, n] over the keys and values
// of every position of row b, with q, K and V read where the joined query/key/value
// product left them: qkv [B, S, 3 N H] (query, key and value columns, heads in order). No
// transposed copy of K or V is made outside the kernel: each (row, head) item transposes its
// K into a thread's scratch (in cache) and reads V and q in place, or, for a row of
// kAttBlockedMinSlots visible positions or more, copies K and V into its scratch in blocks
// (`SelfAttendBlocked`). bias [N, 2 S - 1] (T5's relative-position bias depends on key -
// query only): query t's bias over keys l is bias[n, S - 1 - t + l]. mask [B, S]: the keys
// each query of row b sees. The same sums as `AttendTile` of decode steps, so the same bits
// as `Attend` over K, V, the full bias and the mask broadcast to every query.
ffi::Error SelfAttend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> bias,
                      ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out,
                      int64_t threads, int64_t heads, int64_t has_bias, int64_t dot) {
  const auto xd = qkv.dimensions(), bd = bias.dimensions(), md = mask.dimensions(),
             od = out->dimensions();
  if (xd.size() != 3 || bd.size() != 2 || md.size() != 2 || od.size() != 4)
    return ffi::Error::InvalidArgument(
        "self_attention: want qkv [B, S, 3 N H], bias [N, 2 S - 1], mask [B, S], out "
        "[B, S, N, H]");
  const int64_t B = xd[0], S = xd[1], C = xd[2], N = heads;
  if (N < 1 || C % (3 * N) != 0 || md[0] != B || md[1] != S || od[0] != B || od[1] != S ||
      od[2] != N || od[3] != C / (3 * N) || (has_bias && (bd[0] != N || bd[1] != 2 * S - 1)))
    return ffi::Error::InvalidArgument(
        "self_attention: shapes of qkv, bias, mask and out disagree with the heads");
  const int64_t H = C / (3 * N);
  if (dot && (!kHaveDot || H % 32 != 0 || H > 128))
    return ffi::Error::InvalidArgument(
        "self_attention: bfloat16 dot products need a CPU with AVX512-BF16 and a head_dim that "
        "is a multiple of 32 (at most 128)");
  const bool* m = mask.typed_data();
  std::vector<int64_t> extent(B * S);
  int64_t widest = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t e = S;
    while (e > 0 && !m[b * S + e - 1]) --e;
    e = e > 0 ? e : S;  // nothing visible: all keys, uniformly
    std::fill(extent.begin() + b * S, extent.begin() + (b + 1) * S, e);
    widest += e;
  }
  const float* x = qkv.typed_data();
  Attention a{x, nullptr, nullptr, has_bias ? bias.typed_data() + (S - 1) : nullptr, m,
              extent.data(), out->typed_data(), B, S, N, H, S, 1};
  a.q_row = C;
  a.v_row = C;
  a.bias_b = 0;
  a.bias_n = 2 * S - 1;
  a.bias_t = -1;
  a.mask_b = S;
  a.mask_t = 0;
  const int64_t scratch = (S + kAttLanes - 1) / kAttLanes * kAttLanes;
  auto items = [&a, x, C, scratch, dot](int64_t i0, int64_t i1) {  // items: (b, n) pairs
    thread_local std::vector<float> s, kt;
    if (s.size() < static_cast<size_t>(kAttTile * scratch)) s.resize(kAttTile * scratch);
    if (kt.size() < static_cast<size_t>(a.H * scratch)) kt.resize(a.H * scratch);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / a.N, n = i % a.N, H = a.H, S = a.L;
#ifdef __AVX512BF16__
      if (dot) {  // K and V as bfloat16 pairs in the scratch kt (K's first, V's after)
        const int64_t E = a.extent[b * S], H2 = H / 2, pairs = (E + 1) / 2;
        uint32_t* kp = reinterpret_cast<uint32_t*>(kt.data());  // [H / 2][scratch]
        uint32_t* vp = kp + H2 * scratch;                         // [pairs][H]
        const float* kin = x + b * S * C + a.N * H + n * H;
        const float* vin = x + b * S * C + 2 * a.N * H + n * H;
        const int64_t reach = (E + 15) / 16 * 16;  // the slots the logits read (<= scratch)
        for (int64_t l0 = 0; l0 < reach; l0 += 16) {  // 16 slots' pairs, then their columns
          alignas(64) uint32_t rows[16][64];
          for (int64_t l = l0; l < l0 + 16; ++l) {
            if (l < E) {
              for (int64_t h = 0; h < H; h += 32) PairsOf32(kin + l * C + h, rows[l - l0] + h / 2);
            } else {
              std::fill(rows[l - l0], rows[l - l0] + H2, 0u);
            }
          }
          for (int64_t hp = 0; hp < H2; ++hp)
            for (int64_t l = l0; l < l0 + 16; ++l) kp[hp * scratch + l] = rows[l - l0][hp];
        }
        for (int64_t lp = 0; lp < pairs; ++lp) {
          const float* r0 = vin + 2 * lp * C;
          const float* r1 = 2 * lp + 1 < E ? r0 + C : nullptr;
          for (int64_t h = 0; h < H; h += 16)
            PairsOf16x2(r0 + h, r1 == nullptr ? nullptr : r1 + h, vp + lp * H + h);
        }
        for (int64_t t = 0; t < a.T; t += kAttTile)
          kAttendTilesDot[std::min(kAttTile, a.T - t)](a, b, n, t, s.data(), scratch, kp, vp);
        continue;
      }
#endif
      if (a.H % kAttBlock == 0 && a.extent[b * S] >= kAttBlockedMinSlots) {
        thread_local std::vector<float> kb, vb;
        SelfAttendBlocked(a, x, C, b, n, kb, vb, s);
        continue;
      }
      // K of this row and head, transposed: kt[h * S + l] (the slots the logits read)
      const int64_t reach = std::min(S, (a.extent[b * S] + kAttLanes - 1) / kAttLanes * kAttLanes);
      const float* kin = x + b * S * C + a.N * H + n * H;
      for (int64_t l0 = 0; l0 < reach; l0 += 16)  // blocks of slots: contiguous writes per h
        for (int64_t h = 0; h < H; ++h)
          for (int64_t l = l0; l < std::min(reach, l0 + 16); ++l) kt[h * S + l] = kin[l * C + h];
      const float* v = x + b * S * C + 2 * a.N * H + n * H;  // V read in place
      for (int64_t t = 0; t < a.T; t += kAttTile)
        kAttendTiles[std::min(kAttTile, a.T - t)](a, b, n, t, s.data(), scratch, kt.data(), v);
    }
  };
  const int64_t kv_bytes = widest * N * H * 2 * int64_t{sizeof(float)};
  RunItems(pool, threads, B * N, widest * S * N * H < (1 << 18) && kv_bytes < kAttSplitBytes,
           items);
  return ffi::Error::Success();
}

// ---- A joined key/value product in the decode cache's layouts ----
//
// kv [B, S, 2 N H] (key columns, then value columns, heads in order) -> K [B, N, H, S] and
// V [B, N, S, H]: the copies XLA makes of a cross-attention's K and V (transposes it runs on
// one thread) done per (row, head) on the kernel's threads. Exact copies.
ffi::Error KvLayout(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> kv, ffi::ResultBuffer<ffi::F32> k,
                    ffi::ResultBuffer<ffi::F32> v, int64_t threads, int64_t heads) {
  const auto xd = kv.dimensions(), kd = k->dimensions(), vd = v->dimensions();
  if (xd.size() != 3 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument(
        "kv_layout: want kv [B, S, 2 N H], K [B, N, H, S], V [B, N, S, H]");
  const int64_t B = xd[0], S = xd[1], C = xd[2], N = heads;
  if (N < 1 || C % (2 * N) != 0)
    return ffi::Error::InvalidArgument("kv_layout: kv's columns are not 2 x heads x head_dim");
  const int64_t H = C / (2 * N);
  if (kd[0] != B || kd[1] != N || kd[2] != H || kd[3] != S || vd[0] != B || vd[1] != N ||
      vd[2] != S || vd[3] != H)
    return ffi::Error::InvalidArgument("kv_layout: shapes of kv, K and V disagree");
  const float* x = kv.typed_data();
  float* ko = k->typed_data();
  float* vo = v->typed_data();
  auto items = [=](int64_t i0, int64_t i1) {  // items: (b, n) pairs
    constexpr int64_t kBlock = 16;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / N, n = i % N;
      const float* kin = x + b * S * C + n * H;
      const float* vin = kin + N * H;
      float* kout = ko + i * H * S;
      float* vout = vo + i * S * H;
      for (int64_t l = 0; l < S; ++l)
        std::memcpy(vout + l * H, vin + l * C, H * sizeof(float));
      for (int64_t l0 = 0; l0 < S; l0 += kBlock) {  // blocks of slots: reads and writes in cache lines
        const int64_t l1 = std::min(S, l0 + kBlock);
        for (int64_t h = 0; h < H; ++h)
          for (int64_t l = l0; l < l1; ++l) kout[h * S + l] = kin[l * C + h];
      }
    }
  };
  RunItems(pool, threads, B * N, B * S * C * int64_t{sizeof(float)} < kAttSplitBytes, items);
  return ffi::Error::Success();
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x_buffer, ffi::AnyBuffer panels,
                  const float* scales, const float* norm, float eps,
                  ffi::Buffer<ffi::S32> rows_buffer, ffi::ResultBuffer<ffi::F32> y,
                  int64_t threads, int64_t variant_code) {
  const Variant variant = Variant::Of(variant_code);
  auto& x = x_buffer;
  const auto xd = x.dimensions();
  const auto pd = panels.dimensions();
  const auto yd = y->dimensions();
  const bool pairs = pd.size() == 4;  // bfloat16 dot products: [P, K / 2, 16, 2]
  if (xd.size() != 2 || yd.size() != 2 || pd.size() < 3 || pd[2] != kPanel ||
      (pairs ? pd[3] != 2 : pd.size() != 3))
    return ffi::Error::InvalidArgument(
        "small_m_matmul: want x [M, K], panels [P, K, 16] or [P, K / 2, 16, 2], y [M, N]");
  if (rows_buffer.element_count() != 1)
    return ffi::Error::InvalidArgument("small_m_matmul: want rows [1]");
  const int64_t K = xd[1], N = yd[1];
  if (pd[1] * (pairs ? 2 : 1) != K || yd[0] != xd[0] || N > pd[0] * kPanel ||
      N <= (pd[0] - 1) * kPanel)
    return ffi::Error::InvalidArgument("small_m_matmul: shapes of x, panels and y disagree");
  if (!HaveWidth(variant.width))
    return ffi::Error::InvalidArgument("small_m_matmul: vector width not built for this CPU");
  // The rows multiplied: the first `rows` (the others, padding to the caller, are zeros).
  const int64_t M = std::clamp<int64_t>(rows_buffer.typed_data()[0], 0, xd[0]);
  float* out = y->typed_data();
  std::fill(out + M * N, out + xd[0] * N, 0.0f);
  if (M == 0) return ffi::Error::Success();
  const int64_t num_panels = pd[0];
  // One thread per usable CPU at most: XLA's pool can hold more threads than there are CPUs
  // (several simulated devices), and helpers beyond the CPUs only wait for a core.
  int64_t helpers = std::min({threads, int64_t{pool.num_threads()}, UsableCpus()}) - 1;
  // Below ~256 KB of float32 weights a second thread costs more than it saves.
  if (K * N < (1 << 16)) helpers = 0;
  const auto type = panels.element_type();
  const void* w = panels.untyped_data();
  const float* xin = x.typed_data();
  thread_local std::vector<float> kept_normed;
  Scratch<float> normed(kept_normed, norm != nullptr ? M * K : 0);
  if (norm != nullptr) {
    NormRows(xin, norm, eps, M, K, normed.get());
    xin = normed.get();
  }
  if (pairs) {
    if (type != ffi::DataType::BF16 || scales != nullptr || !kHaveDot)
      return ffi::Error::InvalidArgument(
          "small_m_matmul: pair panels need bfloat16 weights and a CPU with AVX512-BF16");
    RunPairs(xin, w, out, M, K, N, variant, num_panels, helpers, &pool);
  } else if (type == ffi::DataType::F32 && scales == nullptr) {
    Run(Problem<float>{xin, static_cast<const float*>(w), nullptr, out, M, K, N},
        variant, num_panels, helpers, &pool);
  } else if (type == ffi::DataType::BF16 && scales == nullptr) {
    Run(Problem<uint16_t>{xin, static_cast<const uint16_t*>(w), nullptr, out, M, K,
                          N}, variant, num_panels, helpers, &pool);
  } else if (type == ffi::DataType::S8 && scales != nullptr) {
    Run(Problem<int8_t>{xin, static_cast<const int8_t*>(w), scales, out, M, K, N},
        variant, num_panels, helpers, &pool);
  } else {
    return ffi::Error::InvalidArgument(
        "small_m_matmul: panels must be float32 or bfloat16, or int8 with scales");
  }
  return ffi::Error::Success();
}

ffi::Error CheckScales(ffi::Buffer<ffi::F32>& scales, ffi::AnyBuffer& panels) {
  const auto sd = scales.dimensions();
  const auto pd = panels.dimensions();
  if (sd.size() != 1 || pd.size() != 3 || sd[0] != pd[0] * kPanel)
    return ffi::Error::InvalidArgument("small_m_matmul: want scales [16 P] for panels [P, K, 16]");
  return ffi::Error::Success();
}

ffi::Error CheckNorm(ffi::Buffer<ffi::F32>& norm, ffi::Buffer<ffi::F32>& x) {
  if (norm.dimensions().size() != 1 || x.dimensions().size() != 2 ||
      norm.dimensions()[0] != x.dimensions()[1])
    return ffi::Error::InvalidArgument("small_m_matmul: want a norm scale [K] for x [M, K]");
  return ffi::Error::Success();
}

ffi::Error Unscaled(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer panels,
                    ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y, int64_t threads,
                    int64_t variant) {
  return Matmul(pool, x, panels, nullptr, nullptr, 0.0f, rows, y, threads, variant);
}

ffi::Error Scaled(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer panels,
                  ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::S32> rows,
                  ffi::ResultBuffer<ffi::F32> y, int64_t threads, int64_t variant) {
  if (auto e = CheckScales(scales, panels); e.failure()) return e;
  return Matmul(pool, x, panels, scales.typed_data(), nullptr, 0.0f, rows, y, threads,
                variant);
}

ffi::Error Normed(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer panels,
                  ffi::Buffer<ffi::F32> norm, ffi::Buffer<ffi::S32> rows,
                  ffi::ResultBuffer<ffi::F32> y, int64_t threads, int64_t variant, float eps) {
  if (auto e = CheckNorm(norm, x); e.failure()) return e;
  return Matmul(pool, x, panels, nullptr, norm.typed_data(), eps, rows, y, threads, variant);
}

ffi::Error NormedScaled(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer panels,
                        ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> norm,
                        ffi::Buffer<ffi::S32> rows, ffi::ResultBuffer<ffi::F32> y,
                        int64_t threads, int64_t variant, float eps) {
  if (auto e = CheckScales(scales, panels); e.failure()) return e;
  if (auto e = CheckNorm(norm, x); e.failure()) return e;
  return Matmul(pool, x, panels, scales.typed_data(), norm.typed_data(), eps, rows, y,
                threads, variant);
}

template <typename V>
double FmaLoop(int64_t iters) {
  V acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = V{} + float(i);
  const V a = V{} + 0.999999f, b = V{} + 1e-7f;
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < 12; ++i) acc[i] = acc[i] * a + b;  // 12 independent FMA chains
  float sum = 0;
  for (int i = 0; i < 12; ++i) sum += acc[i][0];
  return sum;
}

// Seconds for `loop` (a register-only peak loop, returning a value kept from the
// optimizer) run once on each of `threads` threads at the same time.
double SecondsOnThreads(int64_t threads, const std::function<double()>& loop) {
  std::vector<double> sink(threads);
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back([&sink, &loop, t] { sink[t] = loop(); });
  sink[0] = loop();
  for (auto& th : pool) th.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile double keep = sink[0];
  (void)keep;
  return seconds;
}

#ifdef __AVX512BF16__
// 12 independent chains of VDPBF16PS on `W`-wide float32 sums (each lane adds two
// bfloat16 products per instruction): the arithmetic peak of the dot-product blocks
// (`DotBlock16`, `DotBlock8`), which on some CPUs issue as many instructions per cycle as
// FMAs and so double the multiply-adds.
template <int W>
double DotLoop(int64_t iters) {
  using Acc = std::conditional_t<W == 16, __m512, __m256>;
  using Pairs = std::conditional_t<W == 16, __m512bh, __m256bh>;
  Acc acc[12];
  Pairs a, b;
  if constexpr (W == 16) {
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(float(i));
    a = (__m512bh)_mm512_set1_epi32(0x35803f80);  // the pair (1, 2^-20): sums stay finite
    b = (__m512bh)_mm512_set1_epi32(0x35803f80);
  } else {
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(float(i));
    a = (__m256bh)_mm256_set1_epi32(0x35803f80);
    b = (__m256bh)_mm256_set1_epi32(0x35803f80);
  }
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < 12; ++i) {
      if constexpr (W == 16) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
      else acc[i] = _mm256_dpbf16_ps(acc[i], a, b);
    }
  float sum = 0;
  for (int i = 0; i < 12; ++i) sum += acc[i][0];
  return sum;
}
#endif

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecDecodeSmallMMatmul, Unscaled,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("variant"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecDecodeSmallMMatmulScaled, Scaled,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("variant"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecDecodeSmallMMatmulNormed, Normed,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("variant")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecDecodeSmallMMatmulNormedScaled, NormedScaled,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows [1]
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("variant")
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecDecodeAttention, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, T, N, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k [B, N, H, L]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v [B, N, L, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bias [Bb, N, T, L]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask [B, T, L]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // [B, T, N, H]
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("has_bias"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecDecodeSelfAttention, SelfAttend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // qkv [B, S, 3 N H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bias [N, 2 S - 1]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask [B, S]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // [B, S, N, H]
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("heads")
                                  .Attr<int64_t>("has_bias")
                                  .Attr<int64_t>("dot"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecDecodeKvLayout, KvLayout,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // kv [B, S, 2 N H]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // K [B, N, H, S]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // V [B, N, S, H]
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("heads"));

extern "C" {

// Bit w set: vector width w is built into this library (8 always; 16 with AVX-512F).
int64_t spec_decode_widths() {
  int64_t widths = 1 << 8;
#ifdef __AVX512F__
  widths |= int64_t{1} << 16;
#endif
  return widths;
}

// The kernel's products on raw pointers in the calling thread, with variant code as
// `Variant` reads it. dtype: 0 float32, 1 bfloat16, 2 int8 (scales [16 P]), 3
// bfloat16 pairs (dot products; K even). Returns 0, or -1 for a variant or dtype it lacks.
int spec_decode_matmul(const float* x, const void* panels, const float* scales, float* y,
                       int64_t M, int64_t K, int64_t N, int64_t dtype, int64_t variant_code) {
  const Variant variant = Variant::Of(variant_code);
  if (!HaveWidth(variant.width)) return -1;
  const int64_t num_panels = (N + kPanel - 1) / kPanel;
  if (dtype == 0) {
    Run(Problem<float>{x, static_cast<const float*>(panels), nullptr, y, M, K, N}, variant,
        num_panels, 0, nullptr);
  } else if (dtype == 1) {
    Run(Problem<uint16_t>{x, static_cast<const uint16_t*>(panels), nullptr, y, M, K, N},
        variant, num_panels, 0, nullptr);
  } else if (dtype == 2 && scales != nullptr) {
    Run(Problem<int8_t>{x, static_cast<const int8_t*>(panels), scales, y, M, K, N}, variant,
        num_panels, 0, nullptr);
  } else if (dtype == 3 && K % 2 == 0) {
    if (!RunPairs(x, panels, y, M, K, N, variant, num_panels, 0, nullptr)) return -1;
  } else {
    return -1;
  }
  return 0;
}

// Seconds of `spec_decode_matmul` over `copies` weight matrices laid end to end from
// `panels` (`stride` bytes apart), as a decode step streams its layers' weights: the
// tuner's measurement, without a call from Python per matrix. -1 on a refused variant.
double spec_decode_sweep(const float* x, const void* panels, const float* scales, float* y,
                         int64_t M, int64_t K, int64_t N, int64_t dtype, int64_t variant_code,
                         int64_t copies, int64_t stride) {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t c = 0; c < copies; ++c)
    if (spec_decode_matmul(x, static_cast<const char*>(panels) + c * stride, scales, y, M, K, N,
                           dtype, variant_code) != 0)
      return -1;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The split's counters (`SplitStats`) since the last reset into out[9]: calls split, their
// panels, helpers started, the helpers' panels, helpers that found work, their start delays
// (ns, summed), the callers' waits for their helpers after their own share (ns), the split
// calls' durations (ns) and the helpers that found work on the CPU their caller started
// on. reset != 0: zero them after reading.
void spec_decode_thread_stats(double* out, int64_t reset) {
  std::atomic<int64_t>* fields[] = {&g_split.calls, &g_split.panels, &g_split.helpers,
                                    &g_split.helper_panels, &g_split.working,
                                    &g_split.working_start_ns, &g_split.wait_ns, &g_split.call_ns,
                                    &g_split.same_cpu};
  for (int i = 0; i < 9; ++i) out[i] = double(reset ? fields[i]->exchange(0) : fields[i]->load());
}

// Whether the bfloat16 dot-product variant (AVX512-BF16) is built.
int spec_decode_has_bf16_dot() { return kHaveDot ? 1 : 0; }

// GB/s reading `bytes` bytes of `buffer` (64-byte aligned length) `passes` times with
// `threads` threads, each reading its own contiguous share with 32-byte loads.
double spec_decode_read_gbps(const void* buffer, int64_t bytes, int64_t passes,
                             int64_t threads) {
  threads = std::max<int64_t>(1, threads);
  const int64_t words = bytes / sizeof(f32x8);
  std::vector<float> sink(threads);
  auto read = [&](int64_t t) {
    const int64_t w0 = words * t / threads, w1 = words * (t + 1) / threads;
    const char* base = static_cast<const char*>(buffer);
    f32x8 a{}, b{}, c{}, d{};
    for (int64_t pass = 0; pass < passes; ++pass) {
      int64_t w = w0;
      for (; w + 4 <= w1; w += 4) {
        a += Bits<f32x8>(base + w * 32);
        b += Bits<f32x8>(base + w * 32 + 32);
        c += Bits<f32x8>(base + w * 32 + 64);
        d += Bits<f32x8>(base + w * 32 + 96);
      }
      for (; w < w1; ++w) a += Bits<f32x8>(base + w * 32);
    }
    const f32x8 s = a + b + c + d;
    sink[t] = s[0] + s[7];
  };
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(read, t);
  read(0);
  for (auto& th : pool) th.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile float keep = sink[0];
  (void)keep;
  return double(words) * sizeof(f32x8) * passes / seconds / 1e9;
}

// GFLOP/s (2 per multiply-add) of 12 independent multiply-add chains of `width`-wide
// vectors, `iters` steps, on each of `threads` threads. -1 for a width not built.
double spec_decode_fma_gflops(int64_t width, int64_t iters, int64_t threads) {
  if (!HaveWidth(width)) return -1;
  threads = std::max<int64_t>(1, threads);
  const double seconds = SecondsOnThreads(threads, [&] {
#ifdef __AVX512F__
    if (width == 16) return FmaLoop<f32x16>(iters);
#endif
    return FmaLoop<f32x8>(iters);
  });
  return 2.0 * 12 * width * double(iters) * threads / seconds / 1e9;
}

// GFLOP/s (4 per lane and instruction: two multiply-adds) of 12 independent VDPBF16PS
// chains of `width`-wide sums, `iters` steps, on each of `threads` threads. -1 where this
// build has no bfloat16 dot products (no AVX512-BF16) or not that width.
double spec_decode_dot_gflops(int64_t width, int64_t iters, int64_t threads) {
#ifdef __AVX512BF16__
  if (width != 8 && width != 16) return -1;
  threads = std::max<int64_t>(1, threads);
  const double seconds = SecondsOnThreads(
      threads, [&] { return width == 16 ? DotLoop<16>(iters) : DotLoop<8>(iters); });
  return 4.0 * 12 * width * double(iters) * threads / seconds / 1e9;
#else
  (void)width, (void)iters, (void)threads;
  return -1;
#endif
}

}  // extern "C"
