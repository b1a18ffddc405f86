// apply_token_bitmask_: a grammar's allowed-token mask on a batch's logits (structured outputs).
// A word at a time: all-ones words (the tokens inside a free JSON string) cost one compare, all-zero
// words (most of the vocabulary inside JSON structure) one run of 32 stores, and only mixed words
// are read bit by bit. xgrammar's own CPU apply takes ~0.7 ms per nearly-closed 151936-token row
// (bench/RESULTS.md), a cost every row of the step shares; this loop is bound by the stores.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace minipaged {
namespace {

template <typename scalar_t>
void mask_row(scalar_t* row, const int32_t* words, int64_t num_words, int64_t vocab) {
  const scalar_t neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t covered = std::min(vocab, num_words * 32);
  for (int64_t w = 0; w * 32 < covered; ++w) {
    const uint32_t word = static_cast<uint32_t>(words[w]);
    if (word == 0xFFFFFFFFu) continue;
    const int64_t first = w * 32, count = std::min<int64_t>(32, covered - first);
    if (word == 0) {
      std::fill(row + first, row + first + count, neg_inf);
    } else if (count == 32) {  // branch-free, so that random bits cost no mispredictions
      scalar_t* out = row + first;
      for (int b = 0; b < 32; ++b) out[b] = ((word >> b) & 1u) ? out[b] : neg_inf;
    } else {
      for (int64_t b = 0; b < count; ++b)
        if (!((word >> b) & 1u)) row[first + b] = neg_inf;
    }
  }
  std::fill(row + covered, row + vocab, neg_inf);  // tokens past the bitmask: never allowed
}

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& indices) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_floating_point() && logits.stride(1) == 1,
              "apply_token_bitmask_: logits must be 2-D floating point [rows, vocab] with contiguous rows, got ",
              logits.sizes(), " ", logits.scalar_type(), " strides ", logits.strides());
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.size(0) == logits.size(0),
              "apply_token_bitmask_: bitmask must be int32 [", logits.size(0), ", ceil(vocab / 32)], got ",
              bitmask.sizes(), " ", bitmask.scalar_type());
  TORCH_CHECK(indices.dim() == 1 && indices.scalar_type() == at::kLong,
              "apply_token_bitmask_: indices must be a 1-D int64 tensor of rows, got ", indices.sizes(), " ",
              indices.scalar_type());
  TORCH_CHECK(bitmask.device().is_cpu() && indices.device().is_cpu(),
              "apply_token_bitmask_: bitmask and indices must be on the CPU like logits");
  const at::Tensor words = bitmask.contiguous();
  const at::Tensor rows = indices.contiguous();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int64_t num_rows = logits.size(0), vocab = logits.size(1), num_words = words.size(1);
  for (int64_t i = 0; i < rows.numel(); ++i)  // all checked before any row is written
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < num_rows, "apply_token_bitmask_: indices[", i, "] = ", row_ids[i],
                " is outside the ", num_rows, " rows of logits");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "apply_token_bitmask_", [&] {
    scalar_t* base = logits.data_ptr<scalar_t>();
    const int32_t* mask = words.data_ptr<int32_t>();
    at::parallel_for(0, rows.numel(), 1, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i)
        mask_row(base + row_ids[i] * logits.stride(0), mask + row_ids[i] * num_words, num_words, vocab);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(minipaged, CPU, m) { m.impl("apply_token_bitmask_", &apply_token_bitmask_); }

}  // namespace minipaged
