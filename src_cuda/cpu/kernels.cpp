// CPU kernels. Decode attention is memory-bound, so the plan is to read every K/V byte once:
// work items are (sequence, kv head, partition of the context), all query heads of a GQA group
// are handled together, and a softmax that is online across blocks keeps one pass over K/V.
// Partitions let a single long sequence use every core; their partial results are merged
// afterwards with the usual (max, sum) rescaling.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cache_layout.h"
#include "checks.h"

namespace minipaged {
namespace {

constexpr int64_t kPartitionTokens = 512;  // tokens per work item along the context

// Rows of K/V are converted to float before the arithmetic: one cheap, vectorisable pass.
template <typename T>
inline const float* as_float(const T* src, int64_t n, float* buf) {
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}
template <>
inline const float* as_float<float>(const float* src, int64_t, float*) {
  return src;
}

inline float dot(const float* a, const float* b, int64_t n) {
  // Independent partial sums so the compiler vectorises without reassociating a reduction.
  constexpr int kLanes = 16;
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) part[j] += a[i + j] * b[i + j];
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += part[j];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Running softmax state of one work item: per query head of the group, the max score seen,
// the sum of exp(score - max), and the exp-weighted sum of V rows.
struct Partial {
  float* max_score;  // [group]
  float* exp_sum;    // [group]
  float* acc;        // [group, head_dim]
};

template <typename T>
void decode_work_item(const float* q,  // [group, head_dim], already scaled
                      const T* key_cache, const T* value_cache, const CacheLayout& layout,
                      const int32_t* block_table, int64_t kv_head, int64_t begin, int64_t end,
                      int64_t group, Partial out, std::vector<float>& scratch) {
  const int64_t D = layout.head_dim, B = layout.block_size;
  scratch.resize(2 * B * D + group * B);
  float* kbuf = scratch.data();
  float* vbuf = kbuf + B * D;
  float* scores = vbuf + B * D;  // [group, B]
  std::fill(out.max_score, out.max_score + group, -std::numeric_limits<float>::infinity());
  std::fill(out.exp_sum, out.exp_sum + group, 0.f);
  std::fill(out.acc, out.acc + group * D, 0.f);

  for (int64_t pos = begin; pos < end;) {
    const int64_t block = block_table[pos / B];
    const int64_t first = pos % B;
    const int64_t n = std::min(B - first, end - pos);
    const int64_t row = layout.row(block, kv_head, first);
    const float* k = as_float(key_cache + row, n * D, kbuf);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t t = 0; t < n; ++t) scores[g * B + t] = dot(q + g * D, k + t * D, D);

    const float* v = as_float(value_cache + row, n * D, vbuf);
    for (int64_t g = 0; g < group; ++g) {
      float* s = scores + g * B;
      const float block_max = *std::max_element(s, s + n);
      const float new_max = std::max(out.max_score[g], block_max);
      const float rescale = std::exp(out.max_score[g] - new_max);  // 0 on the first block
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) sum += (s[t] = std::exp(s[t] - new_max));
      out.exp_sum[g] = out.exp_sum[g] * rescale + sum;
      out.max_score[g] = new_max;
      float* acc = out.acc + g * D;
      if (rescale != 1.f)
        for (int64_t d = 0; d < D; ++d) acc[d] *= rescale;
      for (int64_t t = 0; t < n; ++t) axpy(s[t], v + t * D, acc, D);
    }
    pos += n;
  }
}

at::Tensor paged_attention_decode_cpu(const at::Tensor& query, const at::Tensor& key_cache,
                                      const at::Tensor& value_cache, const at::Tensor& block_tables,
                                      const at::Tensor& seq_lens, double scale,
                                      std::optional<int64_t> max_seq_len) {
  const CacheLayout layout = check_paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens);
  check_decode_ranges(block_tables, seq_lens, layout);
  const at::Tensor lens = seq_lens.contiguous();
  const int32_t* lens_ptr = lens.data_ptr<int32_t>();
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), D = layout.head_dim;
  const int64_t group = num_heads / layout.num_kv_heads;
  int64_t longest = 0;
  for (int64_t s = 0; s < num_seqs; ++s) longest = std::max<int64_t>(longest, lens_ptr[s]);
  if (max_seq_len.has_value())
    TORCH_CHECK_VALUE(longest <= *max_seq_len, "max_seq_len: ", *max_seq_len,
                      " is smaller than the longest sequence in seq_lens (", longest, ")");

  // Partitions are whole blocks so a work item never splits a block.
  const int64_t part = std::max<int64_t>(1, kPartitionTokens / layout.block_size) * layout.block_size;
  const int64_t num_parts = std::max<int64_t>(1, (longest + part - 1) / part);
  const at::Tensor q = (query.to(at::kFloat) * scale).contiguous();
  const at::Tensor tables = block_tables.contiguous();
  at::Tensor max_score = at::empty({num_seqs, num_heads, num_parts}, query.options().dtype(at::kFloat));
  at::Tensor exp_sum = at::zeros_like(max_score);
  at::Tensor acc = at::empty({num_seqs, num_heads, num_parts, D}, max_score.options());
  at::Tensor out = at::empty({num_seqs, num_heads, D}, query.options());

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, query.scalar_type(), "paged_attention_decode_cpu", [&] {
    const scalar_t* kc = key_cache.const_data_ptr<scalar_t>();
    const scalar_t* vc = value_cache.const_data_ptr<scalar_t>();
    const float* qp = q.const_data_ptr<float>();
    float* mp = max_score.data_ptr<float>();
    float* ep = exp_sum.data_ptr<float>();
    float* ap = acc.data_ptr<float>();
    const int64_t items = num_seqs * layout.num_kv_heads * num_parts;
    at::parallel_for(0, items, 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> scratch, m(group), l(group), a(group * D);
      for (int64_t item = lo; item < hi; ++item) {
        const int64_t p = item % num_parts;
        const int64_t kv_head = (item / num_parts) % layout.num_kv_heads;
        const int64_t s = item / (num_parts * layout.num_kv_heads);
        const int64_t begin = p * part, end = std::min<int64_t>(lens_ptr[s], begin + part);
        const int64_t h0 = kv_head * group;
        if (begin < end)
          decode_work_item<scalar_t>(qp + (s * num_heads + h0) * D, kc, vc, layout,
                                     tables.const_data_ptr<int32_t>() + s * tables.size(1), kv_head,
                                     begin, end, group, Partial{m.data(), l.data(), a.data()}, scratch);
        for (int64_t g = 0; g < group; ++g) {
          const int64_t idx = (s * num_heads + h0 + g) * num_parts + p;
          mp[idx] = begin < end ? m[g] : -std::numeric_limits<float>::infinity();
          ep[idx] = begin < end ? l[g] : 0.f;
          if (begin < end) std::memcpy(ap + idx * D, a.data() + g * D, D * sizeof(float));
        }
      }
    });
    // Merge partitions: rescale each partial to the global max, then normalise.
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_seqs * num_heads, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> row(D);
      for (int64_t sh = lo; sh < hi; ++sh) {
        const float* m = mp + sh * num_parts;
        const float* l = ep + sh * num_parts;
        const float global_max = *std::max_element(m, m + num_parts);
        std::fill(row.begin(), row.end(), 0.f);
        float total = 0.f;
        for (int64_t p = 0; p < num_parts; ++p) {
          if (l[p] == 0.f) continue;
          const float w = std::exp(m[p] - global_max);
          total += w * l[p];
          axpy(w, ap + (sh * num_parts + p) * D, row.data(), D);
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t d = 0; d < D; ++d) op[sh * D + d] = static_cast<scalar_t>(row[d] * inv);
      }
    });
  });
  return out;
}

void reshape_and_cache_cpu(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                           at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const CacheLayout layout = check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  check_slot_range(slot_mapping, layout);
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  const int64_t D = layout.head_dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.scalar_type(), "reshape_and_cache_cpu", [&] {
    auto write = [&](const at::Tensor& src, scalar_t* dst_base, int64_t i) {
      const scalar_t* s = src.const_data_ptr<scalar_t>();
      for (int64_t h = 0; h < layout.num_kv_heads; ++h) {
        const scalar_t* from = s + i * src.stride(0) + h * src.stride(1);
        scalar_t* to = dst_base + layout.slot_row(sp[i], h);
        if (src.stride(2) == 1) {
          std::memcpy(to, from, D * sizeof(scalar_t));
        } else {
          for (int64_t d = 0; d < D; ++d) to[d] = from[d * src.stride(2)];
        }
      }
    };
    scalar_t* kc = key_cache.data_ptr<scalar_t>();
    scalar_t* vc = value_cache.data_ptr<scalar_t>();
    at::parallel_for(0, key.size(0), 64, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        if (sp[i] < 0) continue;
        write(key, kc, i);
        write(value, vc, i);
      }
    });
  });
}

void copy_blocks_cpu(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& block_mapping) {
  const CacheLayout layout = check_copy_blocks(key_cache, value_cache, block_mapping);
  check_copy_ranges(block_mapping, layout);
  const at::Tensor pairs = block_mapping.contiguous();
  const int64_t* p = pairs.const_data_ptr<int64_t>();
  const int64_t bytes = layout.block_elems() * key_cache.element_size();
  auto* kc = static_cast<char*>(key_cache.data_ptr());
  auto* vc = static_cast<char*>(value_cache.data_ptr());
  at::parallel_for(0, pairs.size(0), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      std::memcpy(kc + p[2 * i + 1] * bytes, kc + p[2 * i] * bytes, bytes);
      std::memcpy(vc + p[2 * i + 1] * bytes, vc + p[2 * i] * bytes, bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(minipaged, CPU, m) {
  m.impl("reshape_and_cache", &reshape_and_cache_cpu);
  m.impl("paged_attention_decode", &paged_attention_decode_cpu);
  m.impl("copy_blocks", &copy_blocks_cpu);
}

}  // namespace minipaged
