// linear_widened: input @ weight.T (+ bias) in float32 arithmetic for a float32, bfloat16,
// float16, int8 or int4 weight (weight-only quantization: int8 with a scale per output row, int4
// with a scale and zero point per group of input columns), the weight staying in its format in
// memory. Two paths:
// - few input rows (decode, a speculative verify: at most kStreamRows): the weight is streamed
//   once, each weight row meeting every input row while it is in registers. The float32 GEMM of
//   the build (MKL) takes about as long per row at 2-8 rows as at one on AMD Zen 3 (4-5 G FMA/s on
//   one core, bench/RESULTS.md), so a 5-token verify cost five decodes; streamed, the step reads
//   the weight once whatever the rows, at memory speed.
// - more rows: for CPUs without 16-bit dot products (no AVX512-BF16 / AMX), where torch's own
//   bfloat16 matmul runs several times slower than float32, each thread widens a block of weight
//   rows into a float32 buffer that stays in its L2 and hands it to the float32 GEMM (at::mm), so
//   the arithmetic runs at float32 speed while memory carries half the bytes. A float32 weight
//   goes to at::mm as it is.
// The loads are compiled per instruction set (isa.h, lanes.h): F16C turns float16 into float32
// eight at a time, bfloat16 is a shift. The streamed path needs lanes.h's vectors (AVX2 + FMA, or
// AVX-512); the scalar variant (aarch64 today) takes the GEMM path at every row count.
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu/isa.h"
#include "cpu/lanes.h"

namespace minipaged::MINIPAGED_CPU_ISA {
namespace {

// A block's float32 copy fills about half of a 512 KiB L2 (Zen 3, most Intel cores have more),
// leaving room for the rows of the input it meets; but never fewer than kMinBlockRows rows: a GEMM
// with a narrow weight block packs the whole input again for few outputs (K = 3072 gave 21-row
// blocks: bfloat16 at 256 rows ran at 84 GFLOP/s against 185 with 128-row blocks, AVX2 on an
// Intel Xeon; int8/int4 into oneDNN's bfloat16 GEMM 1.3-1.9x faster at 32-256 rows; bench/RESULTS.md).
constexpr int64_t kBlockBytes = 256 * 1024;
constexpr int64_t kMinBlockRows = 128;
// Up to this many input rows take the streamed path: on AMD Zen 3 (2 threads, bench/linear_cpu.py
// --rows) it beats MKL's GEMM at every shape of Qwen3-0.6B up to 24 rows, and loses at 32 with K = 3072.
constexpr int64_t kStreamRows = 24;
// Input rows that share one pass over a weight row (their accumulators fill the vector registers).
constexpr int kRowGroup = 4;
// Weight rows per parallel task: enough work to amortize a task, many tasks for the threads.
constexpr int64_t kStreamTaskRows = 64;

inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {  // vectorized by the compiler: bfloat16 is float32's upper half
    const uint32_t word = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(dst + i, &word, sizeof(float));
  }
}

inline void widen(const int8_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);  // the scale: once per output, after
}

// int8 into bfloat16, exactly (8 significant bits hold every int8): float32's upper half.
inline void widen(const int8_t* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    const float value = src[i];
    uint32_t word;
    std::memcpy(&word, &value, sizeof(float));
    bits[i] = static_cast<uint16_t>(word >> 16);
  }
}

inline void widen(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);  // vcvtph2ps with F16C
}

// An int4 weight: n rows of k / 2 bytes, each 32 weights in 16 bytes (byte i holds weight i in its
// low nibble and weight 16 + i in its high one: two shifts give 16 weights in order, llama.cpp's
// Q4_0 order), and per row k / group scales and zero points: w = (q - zero) * scale, the
// convention of HQQ and torchao. scale_t: float or c10::BFloat16.
template <typename scale_t>
struct Int4Weight {
  const uint8_t* q;
  const scale_t* scale;
  const scale_t* zero;
  int64_t k, group, groups;  // groups = k / group, not divided again in the loops
  // q * scale + shift = (q - zero) * scale for group g of row r
  float scale_of(int64_t r, int64_t g) const { return static_cast<float>(scale[r * groups + g]); }
  float shift_of(int64_t r, int64_t g) const { return -static_cast<float>(zero[r * groups + g]) * scale_of(r, g); }
#if defined(MINIPAGED_LANES)
  // scale_of and shift_of for groups [g0, g0 + count) of row r, count <= kLanes: one vector at a time
  // where count is kLanes (a decode step would otherwise spend as long on them as on the weights).
  void params(int64_t r, int64_t g0, int64_t count, float* scales, float* shifts) const {
    if (count == kLanes) {
      const Lanes s = lanes_loadu(scale + r * groups + g0), z = lanes_loadu(zero + r * groups + g0);
      lanes_storeu(scales, s), lanes_storeu(shifts, lanes_sub(lanes_zero(), lanes_mul(z, s)));
      return;
    }
    for (int64_t i = 0; i < count; ++i) scales[i] = scale_of(r, g0 + i), shifts[i] = shift_of(r, g0 + i);
  }
#endif
};

// The 32 weights of one int4 chunk, dequantized: in vectors where the widened type has a vector
// store here (float32; bfloat16 on CPUs with AVX512-BF16's rounding conversion), else one by one.
template <typename widened_t>
inline void widen_int4_chunk(const uint8_t* bytes, float scale, float shift, widened_t* out) {
#if defined(MINIPAGED_LANES)
  if constexpr (std::is_same_v<widened_t, float>) {
    const Int4Table table = lanes_int4_table(scale, shift);
#pragma GCC unroll 4
    for (int v = 0; v < 32 / kLanes; ++v) lanes_storeu(out + v * kLanes, lanes_int4_lookup(bytes, v, table));
    return;
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<widened_t, c10::BFloat16>) {
    const Int4Table table = lanes_int4_table(scale, shift);
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {  // rounded to nearest even, as c10::BFloat16(float)
      const __m256bh rounded = _mm512_cvtneps_pbh(lanes_int4_lookup(bytes, v, table));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + v * 16), reinterpret_cast<const __m256i&>(rounded));
    }
    return;
  }
#endif
#endif
  for (int i = 0; i < 16; ++i) {
    out[i] = static_cast<widened_t>(static_cast<float>(bytes[i] & 0xF) * scale + shift);
    out[16 + i] = static_cast<widened_t>(static_cast<float>(bytes[i] >> 4) * scale + shift);
  }
}

// Rows [n0, n0 + nc) of an int4 weight, dequantized (into float32, or rounded to bfloat16): a
// prompt's GEMM at a few dozen rows waits mostly on this.
template <typename widened_t, typename scale_t>
void widen_int4(const Int4Weight<scale_t>& w, int64_t n0, int64_t nc, widened_t* dst) {
  for (int64_t r = n0; r < n0 + nc; ++r)
    for (int64_t g = 0; g < w.groups; ++g) {
      const float scale = w.scale_of(r, g), shift = w.shift_of(r, g);
      for (int64_t c = g * w.group; c < (g + 1) * w.group; c += 32)
        widen_int4_chunk(w.q + r * (w.k / 2) + c / 2, scale, shift, dst + (r - n0) * w.k + c);
    }
}

// out[:, n0:n0+nc] = x @ w[n0:n0+nc].T for every block of nc rows; each thread its own blocks.
// widened_t: float (the float32 GEMM of the build: MKL, OpenBLAS) or, for an int8 or int4 weight on
// a CPU with bfloat16 dot products (quantized_widened_t), c10::BFloat16 (oneDNN's bfloat16 GEMM, twice float32's rate there;
// the inputs are then rounded to bfloat16, as torch's own bfloat16 linear rounds them).
// widen_rows(n0, nc, buffer) writes weight rows [n0, n0 + nc) widened into the buffer.
template <typename widened_t, typename WidenRows>
void widened_gemm_by(const at::Tensor& x_float, const WidenRows& widen_rows, at::Tensor& out) {
  const at::Tensor x = x_float.to(c10::CppTypeToScalarType<widened_t>::value);
  const int64_t k = x.size(1), n = out.size(1);
  const int64_t block = std::max<int64_t>(kMinBlockRows, kBlockBytes / (k * int64_t(sizeof(float))));
  const int64_t num_blocks = (n + block - 1) / block;
  const at::ThreadLocalState caller;  // inference mode and the like, for the ATen calls on the pool's threads
  at::parallel_for(0, num_blocks, 1, [&](int64_t first, int64_t last) {
    const at::ThreadLocalStateGuard as_caller(caller);
    at::Tensor buffer = at::empty({std::min(block, n), k}, x.options());
    widened_t* widened = buffer.data_ptr<widened_t>();
    for (int64_t b = first; b < last; ++b) {
      const int64_t n0 = b * block, nc = std::min(block, n - n0);
      widen_rows(n0, nc, widened);
      // one thread here: this loop is the parallel one
      at::Tensor out_block = out.narrow(1, n0, nc);
      if constexpr (std::is_same_v<widened_t, float>) at::mm_out(out_block, x, buffer.narrow(0, 0, nc).t());
      else out_block.copy_(at::mm(x, buffer.narrow(0, 0, nc).t()));
    }
  });
}

template <typename widened_t, typename scalar_t>
void widened_gemm(const at::Tensor& x, const scalar_t* w, at::Tensor& out) {
  const int64_t k = x.size(1);
  widened_gemm_by<widened_t>(x, [w, k](int64_t n0, int64_t nc, widened_t* dst) { widen(w + n0 * k, dst, nc * k); }, out);
}

#if defined(MINIPAGED_LANES)
template <int U, int R, int M>
inline void zero_accumulators(Lanes (&acc)[U][R][M]) {
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) acc[u][r][m] = lanes_zero();
}

// The sum of acc[.][r][m]'s lanes.
template <int U, int R, int M>
inline float accumulated(const Lanes (&acc)[U][R][M], int r, int m) {
  Lanes total = acc[0][r][m];
#pragma GCC unroll 4
  for (int u = 1; u < U; ++u) total = lanes_add(total, acc[u][r][m]);
  return lanes_hsum(total);
}

// out[r + m * ldo] = dot(x[m], w[r]) for the M (<= kRowGroup) input rows at x (row stride k) and
// R (1 or 2) weight rows at w: each input vector loaded once serves R weight rows, each weight
// vector M input rows (on AVX2, 2 x 4 accumulators leave registers for the loads). U steps of
// kLanes at a time: R * M * U independent FMA chains (at least 4, covering the FMA latency so
// that even a lone decode row runs at memory speed).
template <int M, int R, typename scalar_t>
inline void dot_tile(const float* x, const scalar_t* w, int64_t k, float* out, int64_t ldo) {
  constexpr int U = R * M >= 4 ? 1 : 4 / (R * M);
  Lanes acc[U][R][M];
  zero_accumulators(acc);
  int64_t i = 0;
  for (; i + U * kLanes <= k; i += U * kLanes) {
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) {
      Lanes wv[R];
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) wv[r] = lanes_loadu(w + r * k + i + u * kLanes);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const Lanes xv = lanes_loadu(x + m * k + i + u * kLanes);
#pragma GCC unroll 2
        for (int r = 0; r < R; ++r) acc[u][r][m] = lanes_fmadd(wv[r], xv, acc[u][r][m]);
      }
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      float sum = accumulated(acc, r, m);
      for (int64_t j = i; j < k; ++j) sum += static_cast<float>(w[r * k + j]) * x[m * k + j];
      out[r + m * ldo] = sum;
    }
  }
}

// dot_tile for R rows of an int4 weight from row r0: each 32-weight chunk dequantized in registers
// through its group's Int4Table (lanes.h: a lookup on AVX-512, a conversion and an FMA on AVX2),
// each dequantized vector shared by the M input rows.
template <int M, int R, typename scale_t>
inline void dot_tile_int4(const float* x, const Int4Weight<scale_t>& w, int64_t r0, float* out, int64_t ldo) {
  constexpr int V = 32 / kLanes;  // vectors per chunk
  constexpr int U = R * M >= 4 ? 1 : 4 / (R * M);
  const int64_t k = w.k;
  Lanes acc[U][R][M];
  zero_accumulators(acc);
  alignas(64) float scales[R][kLanes], shifts[R][kLanes];
  for (int64_t g0 = 0; g0 < w.groups; g0 += kLanes) {
    const int64_t count = std::min<int64_t>(kLanes, w.groups - g0);
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r) w.params(r0 + r, g0, count, scales[r], shifts[r]);
    for (int64_t i = 0; i < count; ++i) {
      Int4Table table[R];
#pragma GCC unroll 2
      for (int r = 0; r < R; ++r) table[r] = lanes_int4_table(scales[r][i], shifts[r][i]);
      for (int64_t c = (g0 + i) * w.group; c < (g0 + i + 1) * w.group; c += 32) {
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) {
          Lanes wv[R];
#pragma GCC unroll 2
          for (int r = 0; r < R; ++r)
            wv[r] = lanes_int4_lookup(w.q + (r0 + r) * (k / 2) + c / 2, v, table[r]);
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            const Lanes xv = lanes_loadu(x + m * k + c + v * kLanes);
#pragma GCC unroll 2
            for (int r = 0; r < R; ++r) acc[v % U][r][m] = lanes_fmadd(wv[r], xv, acc[v % U][r][m]);
          }
        }
      }
    }
  }
#pragma GCC unroll 2
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      out[r + m * ldo] = accumulated(acc, r, m);
    }
  }
}

// tile(std::integral_constant<int, M>) for M = group, the input rows a tile takes (1 to kRowGroup).
template <typename Tile>
inline void with_row_group(int64_t group, const Tile& tile) {
  switch (group) {
    case 1: tile(std::integral_constant<int, 1>{}); break;
    case 2: tile(std::integral_constant<int, 2>{}); break;
    case 3: tile(std::integral_constant<int, 3>{}); break;
    default: tile(std::integral_constant<int, 4>{}); break;
  }
}

// out = x @ w.T for rows <= kStreamRows: each weight row read from memory once, two at a time,
// meeting the input rows a group of kRowGroup at a time (a later group finds the rows in L1).
// weight_t: a pointer to the weight's rows, or an Int4Weight.
template <typename weight_t>
void streamed_gemm(const at::Tensor& x, const weight_t& w, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), n = out.size(1);
  const float* xs = x.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, (n + 1) / 2, kStreamTaskRows / 2, [&](int64_t first, int64_t last) {
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t j = 2 * pair;
      for (int64_t m0 = 0; m0 < rows; m0 += kRowGroup) {
        const float* x_rows = xs + m0 * k;
        float* out_rows = os + m0 * n + j;
        with_row_group(std::min<int64_t>(kRowGroup, rows - m0), [&](auto group) {
          constexpr int M = decltype(group)::value;
          if constexpr (std::is_pointer_v<weight_t>) {
            if (j + 1 < n) dot_tile<M, 2>(x_rows, w + j * k, k, out_rows, n);
            else dot_tile<M, 1>(x_rows, w + j * k, k, out_rows, n);
          } else {
            if (j + 1 < n) dot_tile_int4<M, 2>(x_rows, w, j, out_rows, n);
            else dot_tile_int4<M, 1>(x_rows, w, j, out_rows, n);
          }
        });
      }
    }
  });
}

#endif  // MINIPAGED_LANES

// The argument checks; returns in_features (twice weight's columns for int4).
int64_t check_linear_arguments(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& weight_scale,
                               const std::optional<at::Tensor>& weight_zero) {
  TORCH_CHECK(weight.dim() == 2, "linear_widened: weight must be 2-D [out_features, in_features], got ",
              weight.sizes());
  const at::ScalarType wtype = weight.scalar_type();
  TORCH_CHECK(wtype == at::kFloat || wtype == at::kBFloat16 || wtype == at::kHalf || wtype == at::kChar ||
                  wtype == at::kByte,
              "linear_widened: weight must be float32, bfloat16, float16, int8 or uint8 (int4, two a byte), got ", wtype);
  const bool int8 = wtype == at::kChar, int4 = wtype == at::kByte;
  const int64_t n = weight.size(0), k = int4 ? 2 * weight.size(1) : weight.size(1);
  TORCH_CHECK((int8 || int4) == weight_scale.has_value(), "linear_widened: weight_scale goes with an int8 or int4 "
              "(uint8) weight and only with it; weight is ", wtype, ", weight_scale ",
              weight_scale.has_value() ? "given" : "not given");
  TORCH_CHECK(int4 == weight_zero.has_value(), "linear_widened: weight_zero goes with an int4 (uint8) weight and only "
              "with it; weight is ", wtype, ", weight_zero ", weight_zero.has_value() ? "given" : "not given");
  if (int8)
    TORCH_CHECK(weight_scale->dim() == 1 && weight_scale->size(0) == n && weight_scale->is_floating_point(),
                "linear_widened: weight_scale must be a floating-point [", n, "] for an int8 weight, got ",
                weight_scale->scalar_type(), " ", weight_scale->sizes());
  if (int4) {
    for (const at::Tensor& t : {*weight_scale, *weight_zero})
      TORCH_CHECK(t.dim() == 2 && t.size(0) == n && t.size(1) >= 1 &&
                      (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                      t.scalar_type() == weight_scale->scalar_type() && t.sizes() == weight_scale->sizes(),
                  "linear_widened: an int4 weight's weight_scale and weight_zero must both be float32 or both "
                  "bfloat16, [", n, ", groups]; got ", weight_scale->scalar_type(), " ", weight_scale->sizes(), " and ",
                  weight_zero->scalar_type(), " ", weight_zero->sizes());
    const int64_t groups = weight_scale->size(1);
    TORCH_CHECK(k % groups == 0 && (k / groups) % 32 == 0, "linear_widened: an int4 weight's groups must be whole "
                "multiples of 32 input columns; ", k, " columns (2 x ", weight.size(1), " bytes) in ", groups, " groups");
  }
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == k, "linear_widened: input's last dimension (",
              input.dim() ? input.size(-1) : 0, ") must equal weight's in_features (", k, int4 ? ": two a byte" : "",
              ")");
  TORCH_CHECK(input.is_floating_point(), "linear_widened: input must be floating point, got ", input.scalar_type());
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear_widened: bias must be [", n, "], got ", bias->sizes());
  return k;
}

// What an int8 or int4 weight widens into for a prompt's GEMM (widened_gemm_by says why).
#if defined(__AVX512BF16__)
using quantized_widened_t = c10::BFloat16;
#else
using quantized_widened_t = float;
#endif

// out = x @ dequantized(w).T for an int4 weight, on either path.
template <typename scale_t>
void int4_gemm(const at::Tensor& x, const Int4Weight<scale_t>& w, at::Tensor& out) {
#if defined(MINIPAGED_LANES)
  if (x.size(0) <= kStreamRows) return streamed_gemm(x, w, out);
#endif
  widened_gemm_by<quantized_widened_t>(
      x, [&w](int64_t n0, int64_t nc, quantized_widened_t* dst) { widen_int4(w, n0, nc, dst); }, out);
}

template <typename scale_t>
Int4Weight<scale_t> int4_weight(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& zero, int64_t k) {
  const int64_t groups = scale.size(1);
  return {q.data_ptr<uint8_t>(), scale.data_ptr<scale_t>(), zero.data_ptr<scale_t>(), k, k / groups, groups};
}

at::Tensor linear_widened(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& weight_scale, const std::optional<at::Tensor>& weight_zero) {
  const int64_t k = check_linear_arguments(input, weight, bias, weight_scale, weight_zero);
  const int64_t n = weight.size(0);
  const bool int8 = weight.scalar_type() == at::kChar, int4 = weight.scalar_type() == at::kByte;
  const at::Tensor w = weight.contiguous();
  int64_t rows = 1;  // not reshape({-1, k}): k may be 0
  for (int64_t d = 0; d + 1 < input.dim(); ++d) rows *= input.size(d);
  const at::Tensor x = input.reshape({rows, k}).to(at::kFloat).contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows > 0 && n > 0) {
    if (k == 0) {
      out.zero_();
    } else if (int4) {
      const at::Tensor scale = weight_scale->contiguous(), zero = weight_zero->contiguous();
      if (scale.scalar_type() == at::kFloat) int4_gemm(x, int4_weight<float>(w, scale, zero, k), out);
      else int4_gemm(x, int4_weight<c10::BFloat16>(w, scale, zero, k), out);
#if defined(MINIPAGED_LANES)
    } else if (rows <= kStreamRows) {
      if (w.scalar_type() == at::kFloat) streamed_gemm(x, w.data_ptr<float>(), out);
      else if (w.scalar_type() == at::kBFloat16) streamed_gemm(x, w.data_ptr<c10::BFloat16>(), out);
      else if (int8) streamed_gemm(x, w.data_ptr<int8_t>(), out);
      else streamed_gemm(x, w.data_ptr<c10::Half>(), out);
#endif
    } else if (w.scalar_type() == at::kFloat) {
      at::mm_out(out, x, w.t());
    } else if (w.scalar_type() == at::kBFloat16) {
      widened_gemm<float>(x, w.data_ptr<c10::BFloat16>(), out);
    } else if (int8) {
      widened_gemm<quantized_widened_t>(x, w.data_ptr<int8_t>(), out);
    } else {
      widened_gemm<float>(x, w.data_ptr<c10::Half>(), out);
    }
  }
  if (int8) out.mul_(weight_scale->to(at::kFloat));
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  std::vector<int64_t> shape(input.sizes().begin(), input.sizes().end());
  shape.back() = n;
  return out.to(input.scalar_type()).reshape(shape);
}

}  // namespace

MINIPAGED_CPU_IMPL(m) { m.impl("linear_widened", &linear_widened); }

}  // namespace minipaged::MINIPAGED_CPU_ISA
