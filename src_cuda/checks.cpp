#include "checks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <unordered_set>
#include <vector>

namespace minipaged {
namespace {

// The names users write (torch.int8, torch.float8_e4m3fn), not c10's (Char, Float8_e4m3fn).
const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kChar: return "int8";
    case at::kFloat8_e4m3fn: return "float8_e4m3fn";
    case at::kFloat8_e5m2: return "float8_e5m2";
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    default: return c10::toString(t);
  }
}

bool is_float_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

bool is_cache_dtype(at::ScalarType t) {
  return is_float_dtype(t) || t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2;
}

// What a tensor that meets the cache (query, key, value) must be: the cache's dtype, or for an
// 8-bit cache any of the float dtypes.
void check_input_dtype(const at::Tensor& t, const char* name, const at::Tensor& key_cache) {
  if (is_float_dtype(key_cache.scalar_type())) {
    TORCH_CHECK(t.scalar_type() == key_cache.scalar_type(), name, ": expected dtype ", key_cache.scalar_type(),
                " (that of key_cache), got ", t.scalar_type());
  } else {
    TORCH_CHECK_VALUE(is_float_dtype(t.scalar_type()), name, ": expected dtype float32, float16 or bfloat16 (an ",
                      "8-bit key_cache is quantized from and to them), got ", t.scalar_type());
  }
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), name, ": expected a tensor on ", ref.device(),
              " (the device of key_cache), got ", t.device());
}

void check_index_dtype(const at::Tensor& t, const char* name, bool allow_int64) {
  bool ok = t.scalar_type() == at::kInt || (allow_int64 && t.scalar_type() == at::kLong);
  TORCH_CHECK(ok, name, ": expected dtype ", allow_int64 ? "int64 or int32" : "int32", ", got ",
              t.scalar_type());
}

}  // namespace

HostInts::HostInts(const at::Tensor& t) : host_(t.is_cpu() ? t : t.to(at::kCPU)) {
  TORCH_INTERNAL_ASSERT((host_.scalar_type() == at::kInt || host_.scalar_type() == at::kLong) && host_.dim() <= 2);
  data_ = host_.const_data_ptr();
  wide_ = host_.scalar_type() == at::kLong;
  stride0_ = host_.dim() > 0 ? host_.stride(0) : 0;
  stride1_ = host_.dim() > 1 ? host_.stride(1) : 0;
}

CacheLayout check_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK_VALUE(key_cache.dim() == 4,
                    "key_cache: expected 4-D [num_blocks, num_kv_heads, block_size, head_dim], got shape ",
                    key_cache.sizes());
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), "value_cache: expected shape ",
                    key_cache.sizes(), " (that of key_cache), got ", value_cache.sizes());
  TORCH_CHECK(is_cache_dtype(key_cache.scalar_type()),
              "key_cache: expected dtype float32, float16 or bfloat16 (or int8, float8_e4m3fn, float8_e5m2 for an "
              "8-bit cache), got ", key_cache.scalar_type());
  TORCH_CHECK_VALUE(value_cache.scalar_type() == key_cache.scalar_type(), "value_cache: expected dtype ",
                    dtype_name(key_cache.scalar_type()), " (that of key_cache), got ", dtype_name(value_cache.scalar_type()));
  check_same_device(value_cache, "value_cache", key_cache);
  TORCH_CHECK_VALUE(key_cache.is_contiguous(), "key_cache: expected a contiguous tensor");
  TORCH_CHECK_VALUE(value_cache.is_contiguous(), "value_cache: expected a contiguous tensor");
  TORCH_CHECK_VALUE(key_cache.size(1) > 0 && key_cache.size(2) > 0 && key_cache.size(3) > 0,
                    "key_cache: num_kv_heads, block_size and head_dim must be positive, got shape ",
                    key_cache.sizes());
  return CacheLayout{key_cache.size(0), key_cache.size(1), key_cache.size(2), key_cache.size(3)};
}

CacheLayout check_reshape_and_cache(const at::Tensor& key, const at::Tensor& value,
                                    const at::Tensor& key_cache, const at::Tensor& value_cache,
                                    const at::Tensor& slot_mapping) {
  CacheLayout layout = check_cache_pair(key_cache, value_cache);
  TORCH_CHECK_VALUE(key.dim() == 3 && key.size(1) == layout.num_kv_heads && key.size(2) == layout.head_dim,
                    "key: expected shape [num_tokens, ", layout.num_kv_heads, ", ", layout.head_dim,
                    "] (num_kv_heads and head_dim of key_cache), got ", key.sizes());
  TORCH_CHECK_VALUE(value.sizes() == key.sizes(), "value: expected shape ", key.sizes(),
                    " (that of key), got ", value.sizes());
  check_input_dtype(key, "key", key_cache);
  TORCH_CHECK_VALUE(value.scalar_type() == key.scalar_type(), "value: expected dtype ", dtype_name(key.scalar_type()),
                    " (that of key), got ", dtype_name(value.scalar_type()));
  check_same_device(key, "key", key_cache);
  check_same_device(value, "value", key_cache);
  check_same_device(slot_mapping, "slot_mapping", key_cache);
  check_index_dtype(slot_mapping, "slot_mapping", /*allow_int64=*/true);
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
                    "slot_mapping: expected shape [", key.size(0), "] (one slot per token of key), got ",
                    slot_mapping.sizes());
  return layout;
}

void check_slot_range(const at::Tensor& slot_mapping, const CacheLayout& layout) {
  const HostInts slot(slot_mapping);
  const int64_t num_slots = slot_mapping.size(0);
  // Tokens are written in parallel on both backends, so two tokens for one slot have no defined
  // winner: that input is rejected (the CUDA path checks it under MINIPAGED_VALIDATE=1 only).
  // Sorted copy rather than a hash set: this runs on every cache write, and a sort of a few
  // thousand slots costs less than as many hash-node allocations.
  std::vector<int64_t> sorted;
  sorted.reserve(num_slots);
  for (int64_t i = 0; i < num_slots; ++i) {
    const int64_t s = slot(i);
    TORCH_CHECK_VALUE(s < layout.num_slots(), "slot_mapping: slot ", s, " at index ", i,
                      " is out of range: the cache holds ", layout.num_slots(), " slots (",
                      layout.num_blocks, " blocks x ", layout.block_size,
                      "); use a negative slot to skip a token");
    if (s >= 0) sorted.push_back(s);
  }
  std::sort(sorted.begin(), sorted.end());
  const auto repeated = std::adjacent_find(sorted.begin(), sorted.end());
  if (repeated == sorted.end()) return;
  std::vector<int64_t> indices;  // the first two holding the repeated slot
  for (int64_t i = 0; i < num_slots && indices.size() < 2; ++i)
    if (slot(i) == *repeated) indices.push_back(i);
  TORCH_CHECK_VALUE(false, "slot_mapping: slot ", *repeated, " appears at indices ", indices[0], " and ", indices[1],
                    "; each slot takes at most one token per call");
}

// The query of an attention op against its caches: [rows, num_heads, head_dim], heads a multiple
// of the kv heads, the caches' dtype and device. `rows` names the first dimension in messages.
static CacheLayout check_attention_query(const at::Tensor& query, const at::Tensor& key_cache,
                                         const at::Tensor& value_cache, const char* rows) {
  CacheLayout layout = check_cache_pair(key_cache, value_cache);
  TORCH_CHECK_VALUE(query.dim() == 3 && query.size(2) == layout.head_dim,
                    "query: expected shape [", rows, ", num_heads, ", layout.head_dim,
                    "] (head_dim of key_cache), got ", query.sizes());
  TORCH_CHECK_VALUE(query.size(1) > 0 && query.size(1) % layout.num_kv_heads == 0,
                    "query: num_heads (", query.size(1), ") must be a positive multiple of num_kv_heads (",
                    layout.num_kv_heads, ")");
  check_input_dtype(query, "query", key_cache);
  check_same_device(query, "query", key_cache);
  return layout;
}

CacheLayout check_paged_attention_decode(const at::Tensor& query, const at::Tensor& key_cache,
                                         const at::Tensor& value_cache,
                                         const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  const CacheLayout layout = check_attention_query(query, key_cache, value_cache, "num_seqs");
  check_same_device(block_tables, "block_tables", key_cache);
  check_same_device(seq_lens, "seq_lens", key_cache);
  check_index_dtype(block_tables, "block_tables", /*allow_int64=*/false);
  check_index_dtype(seq_lens, "seq_lens", /*allow_int64=*/false);
  const int64_t num_seqs = query.size(0);
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
                    "block_tables: expected shape [", num_seqs, ", max_blocks_per_seq], got ",
                    block_tables.sizes());
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs, "seq_lens: expected shape [",
                    num_seqs, "], got ", seq_lens.sizes());
  return layout;
}

void check_decode_ranges(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const CacheLayout& layout) {
  const HostInts lens(seq_lens), table(block_tables);
  const int64_t width = block_tables.size(1);
  for (int64_t s = 0; s < seq_lens.size(0); ++s) {
    const int64_t len = lens(s);
    TORCH_CHECK_VALUE(len >= 0 && len <= width * layout.block_size, "seq_lens: seq_lens[", s, "] = ",
                      len, " is out of range: expected 0 <= seq_len <= max_blocks_per_seq * block_size = ",
                      width * layout.block_size);
    const int64_t used = (len + layout.block_size - 1) / layout.block_size;
    for (int64_t b = 0; b < used; ++b) {
      const int64_t block = table(s, b);
      TORCH_CHECK_VALUE(layout.valid_block(block), "block_tables: block_tables[", s, "][", b, "] = ",
                        block, " is out of range: expected a block id in [0, ", layout.num_blocks, ")");
    }
  }
}

CacheLayout check_paged_attention_prefill(const at::Tensor& query, const at::Tensor& key_cache,
                                          const at::Tensor& value_cache, const at::Tensor& block_tables,
                                          const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens) {
  const CacheLayout layout = check_attention_query(query, key_cache, value_cache, "total_q");
  check_same_device(block_tables, "block_tables", key_cache);
  check_same_device(cu_seqlens_q, "cu_seqlens_q", key_cache);
  check_same_device(seq_lens, "seq_lens", key_cache);
  check_index_dtype(block_tables, "block_tables", /*allow_int64=*/false);
  check_index_dtype(cu_seqlens_q, "cu_seqlens_q", /*allow_int64=*/false);
  check_index_dtype(seq_lens, "seq_lens", /*allow_int64=*/false);
  TORCH_CHECK_VALUE(seq_lens.dim() == 1, "seq_lens: expected shape [num_seqs], got ", seq_lens.sizes());
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == num_seqs,
                    "block_tables: expected shape [", num_seqs, ", max_blocks_per_seq] (one row per entry of "
                    "seq_lens), got ", block_tables.sizes());
  TORCH_CHECK_VALUE(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) == num_seqs + 1, "cu_seqlens_q: expected shape [",
                    num_seqs + 1, "] (num_seqs + 1 offsets into query), got ", cu_seqlens_q.sizes());
  return layout;
}

int64_t check_prefill_ranges(const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& seq_lens, int64_t total_q, const CacheLayout& layout) {
  check_decode_ranges(block_tables, seq_lens, layout);
  const HostInts c(cu_seqlens_q), l(seq_lens);
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK_VALUE(c(0) == 0, "cu_seqlens_q: expected cu_seqlens_q[0] = 0, got ", c(0));
  int64_t longest = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q = c(i + 1) - c(i);
    TORCH_CHECK_VALUE(q >= 0, "cu_seqlens_q: must not decrease, but cu_seqlens_q[", i + 1, "] = ", c(i + 1),
                      " < cu_seqlens_q[", i, "] = ", c(i));
    TORCH_CHECK_VALUE(q <= l(i), "cu_seqlens_q: sequence ", i, " has ", q, " new tokens but seq_lens[", i, "] = ",
                      l(i), "; seq_lens counts the new tokens too, so q_i <= seq_lens[i]");
    longest = std::max(longest, q);
  }
  TORCH_CHECK_VALUE(c(num_seqs) == total_q, "cu_seqlens_q: expected cu_seqlens_q[-1] = ", total_q,
                    " (total_q, the rows of query), got ", c(num_seqs));
  return longest;
}

void check_max_seq_len(const at::Tensor& seq_lens, std::optional<int64_t> max_seq_len) {
  if (!max_seq_len.has_value() || seq_lens.numel() == 0) return;
  const HostInts lens(seq_lens);
  int64_t longest = 0;
  for (int64_t s = 0; s < seq_lens.size(0); ++s) longest = std::max(longest, lens(s));
  TORCH_CHECK_VALUE(longest <= *max_seq_len, "max_seq_len: ", *max_seq_len,
                    " is smaller than the longest sequence in seq_lens (", longest, ")");
}

CacheLayout check_copy_blocks(const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const at::Tensor& block_mapping) {
  CacheLayout layout = check_cache_pair(key_cache, value_cache);
  check_same_device(block_mapping, "block_mapping", key_cache);
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong,
              "block_mapping: expected dtype int64, got ", block_mapping.scalar_type());
  TORCH_CHECK_VALUE(block_mapping.dim() == 2 && block_mapping.size(1) == 2,
                    "block_mapping: expected shape [num_pairs, 2] of (src, dst) block ids, got ",
                    block_mapping.sizes());
  return layout;
}

void check_copy_ranges(const at::Tensor& block_mapping, const CacheLayout& layout) {
  const HostInts pair(block_mapping);
  const int64_t n = block_mapping.size(0);
  // Copies run in parallel, so a destination must be written once and never read as a source.
  std::unordered_set<int64_t> sources, destinations;
  for (int64_t i = 0; i < n; ++i) sources.insert(pair(i, 0));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t src = pair(i, 0), dst = pair(i, 1);
    TORCH_CHECK_VALUE(layout.valid_block(src) && layout.valid_block(dst), "block_mapping: row ", i,
                      " = (", src, ", ", dst, ") is out of range: expected block ids in [0, ",
                      layout.num_blocks, ")");
    TORCH_CHECK_VALUE(destinations.insert(dst).second, "block_mapping: destination block ", dst,
                      " appears more than once");
    TORCH_CHECK_VALUE(!sources.count(dst), "block_mapping: destination block ", dst,
                      " is also a source in the same call");
  }
}

KVFormat kv_format_of(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kChar: return KVFormat::kInt8;
    case at::kFloat8_e4m3fn: return KVFormat::kFp8E4M3;
    case at::kFloat8_e5m2: return KVFormat::kFp8E5M2;
    default: return KVFormat::kNone;
  }
}

static void check_one_scale(const std::optional<at::Tensor>& scale, const char* name, const at::Tensor& key_cache,
                            const CacheLayout& layout, KVFormat format) {
  if (format == KVFormat::kNone) {
    TORCH_CHECK_VALUE(!scale.has_value(), name, ": scales are for 8-bit caches (int8, float8_e4m3fn, "
                      "float8_e5m2), but key_cache is ", dtype_name(key_cache.scalar_type()));
    return;
  }
  const bool per_token = format == KVFormat::kInt8;
  TORCH_CHECK_VALUE(scale.has_value(), name, ": a ", dtype_name(key_cache.scalar_type()), " key_cache needs its scales: ",
                    per_token ? "float32 [num_blocks, num_kv_heads, block_size], one per token and kv head"
                              : "a float32 tensor of one element, the layer's scale");
  const at::Tensor& s = *scale;
  TORCH_CHECK_VALUE(s.scalar_type() == at::kFloat, name, ": expected dtype float32, got ", s.scalar_type());
  check_same_device(s, name, key_cache);
  if (per_token) {
    TORCH_CHECK_VALUE(s.dim() == 3 && s.size(0) == layout.num_blocks && s.size(1) == layout.num_kv_heads &&
                          s.size(2) == layout.block_size,
                      name, ": an int8 cache keeps one scale per token and kv head: expected shape [",
                      layout.num_blocks, ", ", layout.num_kv_heads, ", ", layout.block_size,
                      "] ([num_blocks, num_kv_heads, block_size] of key_cache), got ", s.sizes());
    TORCH_CHECK_VALUE(s.is_contiguous(), name, ": expected a contiguous tensor");
  } else {
    TORCH_CHECK_VALUE(s.numel() == 1, name, ": a ", dtype_name(key_cache.scalar_type()),
                      " cache has one scale per layer: expected a tensor of one element, got shape ", s.sizes());
  }
}

KVFormat check_kv_scales(const at::Tensor& key_cache, const CacheLayout& layout,
                         const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_scale) {
  const KVFormat format = kv_format_of(key_cache);
  check_one_scale(key_scale, "key_scale", key_cache, layout, format);
  check_one_scale(value_scale, "value_scale", key_cache, layout, format);
  return format;
}

LayerScales check_layer_scale_values(KVFormat format, const std::optional<at::Tensor>& key_scale,
                                     const std::optional<at::Tensor>& value_scale) {
  LayerScales out;
  if (format != KVFormat::kFp8E4M3 && format != KVFormat::kFp8E5M2) return out;
  auto read = [](const at::Tensor& t, const char* name) {
    // On the CPU the element is read in place (no dispatcher call, see HostInts).
    const float v = t.is_cpu() ? *t.const_data_ptr<float>() : t.to(at::kCPU).reshape({}).item<float>();
    TORCH_CHECK_VALUE(std::isfinite(v) && v > 0.f, name, ": expected a finite scale > 0, got ", v);
    return v;
  };
  out.key = read(*key_scale, "key_scale");
  out.value = read(*value_scale, "value_scale");
  return out;
}

bool validate_device_data() {
  // Read on every call (a few nanoseconds) so a process can switch it on and off.
  const char* v = std::getenv("MINIPAGED_VALIDATE");
  return v != nullptr && std::strcmp(v, "0") != 0 && std::strcmp(v, "") != 0;
}

}  // namespace minipaged
