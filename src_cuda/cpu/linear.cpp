// linear_widened: input @ weight.T (+ bias) in float32 arithmetic for a float32, bfloat16,
// float16 or int8 weight (int8 with a scale per output row, weight-only quantization), the weight
// staying in its format in memory. Two paths:
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
// leaving room for the rows of the input it meets.
constexpr int64_t kBlockBytes = 256 * 1024;
constexpr int64_t kMinBlockRows = 8;
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

// out[:, n0:n0+nc] = x @ w[n0:n0+nc].T for every block of nc rows; each thread its own blocks.
// widened_t: float (the float32 GEMM of the build: MKL, OpenBLAS) or, for an int8 weight on a CPU
// with bfloat16 dot products, c10::BFloat16 (oneDNN's bfloat16 GEMM, twice float32's rate there;
// the inputs are then rounded to bfloat16, as torch's own bfloat16 linear rounds them).
template <typename widened_t, typename scalar_t>
void widened_gemm(const at::Tensor& x_float, const scalar_t* w, at::Tensor& out) {
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
      widen(w + n0 * k, widened, nc * k);
      // one thread here: this loop is the parallel one
      at::Tensor out_block = out.narrow(1, n0, nc);
      if constexpr (std::is_same_v<widened_t, float>) at::mm_out(out_block, x, buffer.narrow(0, 0, nc).t());
      else out_block.copy_(at::mm(x, buffer.narrow(0, 0, nc).t()));
    }
  });
}

#if defined(MINIPAGED_LANES)
// out[r + m * ldo] = dot(x[m], w[r]) for the M (<= kRowGroup) input rows at x (row stride k) and
// R (1 or 2) weight rows at w: each input vector loaded once serves R weight rows, each weight
// vector M input rows (on AVX2, 2 x 4 accumulators leave registers for the loads). U steps of
// kLanes at a time: R * M * U independent FMA chains (at least 4, covering the FMA latency so
// that even a lone decode row runs at memory speed).
template <int M, int R, typename scalar_t>
inline void dot_tile(const float* x, const scalar_t* w, int64_t k, float* out, int64_t ldo) {
  constexpr int U = R * M >= 4 ? 1 : 4 / (R * M);
  Lanes acc[U][R][M];
#pragma GCC unroll 4
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 2
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) acc[u][r][m] = lanes_zero();
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
      Lanes total = acc[0][r][m];
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) total = lanes_add(total, acc[u][r][m]);
      float sum = lanes_hsum(total);
      for (int64_t j = i; j < k; ++j) sum += static_cast<float>(w[r * k + j]) * x[m * k + j];
      out[r + m * ldo] = sum;
    }
  }
}

template <int R, typename scalar_t>
inline void dot_group(int64_t group, const float* x, const scalar_t* w, int64_t k, float* out, int64_t ldo) {
  switch (group) {
    case 1: dot_tile<1, R>(x, w, k, out, ldo); break;
    case 2: dot_tile<2, R>(x, w, k, out, ldo); break;
    case 3: dot_tile<3, R>(x, w, k, out, ldo); break;
    default: dot_tile<4, R>(x, w, k, out, ldo); break;
  }
}

// out = x @ w.T for rows <= kStreamRows: each weight row read from memory once, two at a time,
// meeting the input rows a group of kRowGroup at a time (a later group finds the rows in L1).
template <typename scalar_t>
void streamed_gemm(const at::Tensor& x, const scalar_t* w, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), n = out.size(1);
  const float* xs = x.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, (n + 1) / 2, kStreamTaskRows / 2, [&](int64_t first, int64_t last) {
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t j = 2 * pair;
      for (int64_t m0 = 0; m0 < rows; m0 += kRowGroup) {
        const int64_t group = std::min<int64_t>(kRowGroup, rows - m0);
        if (j + 1 < n) dot_group<2>(group, xs + m0 * k, w + j * k, k, os + m0 * n + j, n);
        else dot_group<1>(group, xs + m0 * k, w + j * k, k, os + m0 * n + j, n);
      }
    }
  });
}

#endif  // MINIPAGED_LANES

at::Tensor linear_widened(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& weight_scale) {
  TORCH_CHECK(weight.dim() == 2, "linear_widened: weight must be 2-D [out_features, in_features], got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16 ||
                  weight.scalar_type() == at::kHalf || weight.scalar_type() == at::kChar,
              "linear_widened: weight must be float32, bfloat16, float16 or int8, got ", weight.scalar_type());
  const bool int8 = weight.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == weight_scale.has_value(), "linear_widened: weight_scale (a scale per output row) goes with an "
              "int8 weight and only with it; weight is ", weight.scalar_type(), ", weight_scale ",
              weight_scale.has_value() ? "given" : "not given");
  if (int8)
    TORCH_CHECK(weight_scale->dim() == 1 && weight_scale->size(0) == weight.size(0) && weight_scale->is_floating_point(),
                "linear_widened: weight_scale must be a floating-point [", weight.size(0), "], got ",
                weight_scale->scalar_type(), " ", weight_scale->sizes());
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == weight.size(1), "linear_widened: input's last dimension (",
              input.dim() ? input.size(-1) : 0, ") must equal weight's in_features (", weight.size(1), ")");
  TORCH_CHECK(input.is_floating_point(), "linear_widened: input must be floating point, got ", input.scalar_type());
  const int64_t k = weight.size(1), n = weight.size(0);
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear_widened: bias must be [", n, "], got ",
                bias->sizes());
  const at::Tensor w = weight.contiguous();
  int64_t rows = 1;  // not reshape({-1, k}): k may be 0
  for (int64_t d = 0; d + 1 < input.dim(); ++d) rows *= input.size(d);
  const at::Tensor x = input.reshape({rows, k}).to(at::kFloat).contiguous();
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows > 0 && n > 0) {
    if (k == 0) {
      out.zero_();
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
#if defined(__AVX512BF16__)
      widened_gemm<c10::BFloat16>(x, w.data_ptr<int8_t>(), out);
#else
      widened_gemm<float>(x, w.data_ptr<int8_t>(), out);
#endif
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
