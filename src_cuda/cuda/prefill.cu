// CUDA prefill attention: causal attention for packed new tokens over their sequences' paged
// history. No torch headers here (see launch.h).
//
// One thread block per (sequence, tile of kRows query rows, kv head x history split). A row is
// one (new token, query head of the kv head's GQA group) pair, token-major, so each K/V row
// loaded serves every head of the group. The query tile sits in shared memory (float, scaled);
// K and then V stream through shared memory kKeys tokens at a time with an online softmax
// (float32), each thread owning a slice of one row's accumulator. Long histories are split
// over several blocks (split-K) and merged by a second kernel, as decode does.
//
// The grid is sized from bounds, never from device data, so out-of-range data is clamped:
// cu_seqlens_q to [0, total_q], seq_lens to what the block table addresses, q_i to seq_len;
// keys in an out-of-range block are masked (score -inf, V not read).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>

#include <type_traits>

#include "cuda/launch.h"
#include "quant.h"

namespace minipaged::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kRows = 16;                          // query rows per block
constexpr int kKeys = 16;                          // keys per shared-memory chunk
constexpr int kThreadsPerRow = kThreads / kRows;   // threads sharing one row's accumulator
constexpr int kMinSplitTokens = 512;               // shortest history piece worth its own block

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
// 8-bit caches (quant.h), before the scale; fp8 as float16 bits (e4m3: value x 2^-8, in raw_scale).
__device__ __forceinline__ float to_float(int8_t x) { return static_cast<float>(x); }
__device__ __forceinline__ float half_bits_to_float(uint16_t bits) {
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
__device__ __forceinline__ float to_float(fp8_e5m2 x) { return half_bits_to_float(e5m2_half_bits(x.bits)); }
__device__ __forceinline__ float to_float(fp8_e4m3 x) { return half_bits_to_float(e4m3_half_bits(x.bits)); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// Where a sequence's new tokens are, clamped so that bad data cannot reach outside any tensor.
struct SeqSpan {
  int64_t q_begin;  // first row of query
  int q_len;        // new tokens
  int context;      // tokens before the first new one
};

__device__ SeqSpan seq_span(const PrefillArgs& a, int seq) {
  auto clamp = [](int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); };
  const int64_t begin = clamp(a.cu_seqlens_q[seq], 0, a.total_q);
  const int64_t end = clamp(a.cu_seqlens_q[seq + 1], begin, a.total_q);
  const int64_t seq_len = clamp(a.seq_lens[seq], 0, a.max_blocks_per_seq * a.layout.block_size);
  const int64_t q_len = end - begin < seq_len ? end - begin : seq_len;
  return SeqSpan{begin, static_cast<int>(q_len), static_cast<int>(seq_len - q_len)};
}

// Copies keys [chunk, chunk + kKeys) of one kv head into `rows` ([kKeys][HEAD_DIM + 1] floats,
// padded against bank conflicts) with 16-byte loads; `live[k]` is false for keys at or past
// `end` or in an out-of-range block (their row is zero). An 8-bit cache's rows are dequantized:
// times the token's int8 scale (`scales`) or the fp8 layer's (raw_scale of *scales).
template <typename T, int HEAD_DIM>
__device__ void load_chunk(const T* cache, const int32_t* block_table, const CacheLayout& layout, int kv_head,
                           int chunk, int end, float* rows, bool* live, KVFormat format, const float* scales) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kVecsPerRow = HEAD_DIM / kVec;
  const int64_t B = layout.block_size;
  for (int i = threadIdx.x; i < kKeys * kVecsPerRow; i += kThreads) {
    const int k = i / kVecsPerRow, v = i % kVecsPerRow, t = chunk + k;
    const int64_t block = t < end ? block_table[t / B] : -1;
    const bool ok = t < end && layout.valid_block(block);
    if (v == 0) live[k] = ok;
    uint4 raw = make_uint4(0, 0, 0, 0);
    const int64_t row = ok ? layout.row(block, kv_head, t % B) : 0;
    if (ok) raw = *reinterpret_cast<const uint4*>(cache + row + v * kVec);
    const T* elems = reinterpret_cast<const T*>(&raw);
    float scale = 1.f;
    if constexpr (std::is_same_v<T, int8_t>) scale = ok ? scales[row / HEAD_DIM] : 0.f;
    if constexpr (std::is_same_v<T, fp8_e4m3> || std::is_same_v<T, fp8_e5m2>) scale = raw_scale(format, *scales);
#pragma unroll
    for (int e = 0; e < kVec; ++e) rows[k * (HEAD_DIM + 1) + v * kVec + e] = to_float(elems[e]) * scale;
  }
}

// One (sequence, query tile, kv head x split) of the grid; false when the tile has no rows (nor
// then has any later tile of the sequence).
// Q: the query's (and output's) type; T: the cache's (Q, or an 8-bit format with Q float).
template <typename Q, typename T, int HEAD_DIM>
__device__ bool prefill_tile(const PrefillArgs& a, int seq, int tile, float* smem) {
  constexpr int kSlice = HEAD_DIM / kThreadsPerRow;  // accumulator elements per thread
  constexpr int kStride = HEAD_DIM + 1;
  float* q_tile = smem;                        // [kRows][kStride], scaled
  float* kv_rows = q_tile + kRows * kStride;   // [kKeys][kStride]: K, then V, of one chunk
  float* scores = kv_rows + kKeys * kStride;   // [kRows][kKeys]
  bool* live = reinterpret_cast<bool*>(scores + kRows * kKeys);  // [kKeys]

  const int group = a.num_heads / static_cast<int>(a.layout.num_kv_heads);
  const int kv_head = blockIdx.z / a.num_splits, split = blockIdx.z % a.num_splits;
  const SeqSpan span = seq_span(a, seq);
  const int row0 = tile * kRows;  // rows of this sequence and kv head: token * group + g
  const int rows = min(kRows, span.q_len * group - row0);
  if (rows <= 0) return false;

  // Load the query tile. Row r: token row0 / group + ..., query head kv_head * group + (r % group).
  const Q* query = static_cast<const Q*>(a.query);
  for (int i = threadIdx.x; i < kRows * HEAD_DIM; i += kThreads) {
    const int r = i / HEAD_DIM, d = i % HEAD_DIM;
    float x = 0.f;
    if (r < rows) {
      const int64_t token = span.q_begin + (row0 + r) / group;
      const int head = kv_head * group + (row0 + r) % group;
      x = to_float(query[token * a.query_token_stride + head * a.query_head_stride + d]) * a.scale;
    }
    q_tile[r * kStride + d] = x;
  }

  // This thread's row and accumulator slice (columns lane, lane + kThreadsPerRow, ...).
  const int my_row = threadIdx.x / kThreadsPerRow, lane = threadIdx.x % kThreadsPerRow;
  float acc[kSlice] = {};
  float run_max = -FLT_MAX, run_sum = 0.f;

  // Keys this block reads: its split of the history, up to the tile's last position.
  const int last_pos = span.context + (row0 + rows - 1) / group;
  const int key_begin = split * a.split_tokens;
  const int key_end = min(last_pos + 1, key_begin + a.split_tokens);
  const int32_t* block_table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  const T* key_cache = static_cast<const T*>(a.key_cache);
  const T* value_cache = static_cast<const T*>(a.value_cache);

  for (int chunk = key_begin; chunk < key_end; chunk += kKeys) {
    __syncthreads();  // the previous chunk's V and scores are no longer read
    load_chunk<T, HEAD_DIM>(key_cache, block_table, a.layout, kv_head, chunk, key_end, kv_rows, live, a.format,
                            a.key_scale);
    __syncthreads();
    for (int i = threadIdx.x; i < kRows * kKeys; i += kThreads) {
      const int r = i / kKeys, k = i % kKeys;
      const int pos = span.context + (row0 + r) / group;
      float s = -INFINITY;
      if (r < rows && live[k] && chunk + k <= pos) {
        s = 0.f;
#pragma unroll 8
        for (int d = 0; d < HEAD_DIM; ++d) s += q_tile[r * kStride + d] * kv_rows[k * kStride + d];
      }
      scores[r * kKeys + k] = s;
    }
    __syncthreads();
    load_chunk<T, HEAD_DIM>(value_cache, block_table, a.layout, kv_head, chunk, key_end, kv_rows, live, a.format,
                            a.value_scale);
    __syncthreads();
    // Online softmax of this thread's row; every thread of the row computes the same state.
    float chunk_max = -FLT_MAX;
#pragma unroll
    for (int k = 0; k < kKeys; ++k) chunk_max = fmaxf(chunk_max, scores[my_row * kKeys + k]);
    const float new_max = fmaxf(run_max, chunk_max);
    const float rescale = __expf(run_max - new_max);
    run_max = new_max;
    run_sum *= rescale;
#pragma unroll
    for (int j = 0; j < kSlice; ++j) acc[j] *= rescale;
#pragma unroll
    for (int k = 0; k < kKeys; ++k) {
      const float p = __expf(scores[my_row * kKeys + k] - new_max);  // masked keys give 0
      run_sum += p;
      if (p > 0.f) {
#pragma unroll
        for (int j = 0; j < kSlice; ++j) acc[j] += p * kv_rows[k * kStride + lane + j * kThreadsPerRow];
      }
    }
  }

  if (my_row >= rows) return true;
  const int64_t token = span.q_begin + (row0 + my_row) / group;
  const int head = kv_head * group + (row0 + my_row) % group;
  const int64_t th = token * a.num_heads + head;
  if (a.num_splits == 1) {
    const float inv = run_sum > 0.f ? 1.f / run_sum : 0.f;
#pragma unroll
    for (int j = 0; j < kSlice; ++j)
      static_cast<Q*>(a.out)[th * HEAD_DIM + lane + j * kThreadsPerRow] = from_float<Q>(acc[j] * inv);
  } else {
    const int64_t ts = th * a.num_splits + split;
#pragma unroll
    for (int j = 0; j < kSlice; ++j) a.partial_out[ts * HEAD_DIM + lane + j * kThreadsPerRow] = acc[j];
    if (lane == 0) a.partial_max[ts] = run_max, a.partial_sum[ts] = run_sum;
  }
  return true;
}

template <typename Q, typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads)
prefill_kernel(const PrefillArgs a) {
  extern __shared__ float smem[];
  // Sequences on grid.x (up to 2^31 - 1 of them); query tiles on grid.y, which stops at 65,535,
  // so a block takes tiles blockIdx.y, + gridDim.y, ... (a very long chunk with a large group).
  for (int tile = blockIdx.y; tile < a.query_tiles; tile += gridDim.y) {
    if (tile != static_cast<int>(blockIdx.y)) __syncthreads();  // the last tile's shared-memory reads are done
    if (!prefill_tile<Q, T, HEAD_DIM>(a, blockIdx.x, tile, smem)) return;
  }
}

// Merges the history splits of one (query row, head); splits that saw no key have sum 0 (the
// caller zeroes partial_sum, so rows no block wrote come out as zero too).
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads)
merge_splits_kernel(const PrefillArgs a) {
  const int64_t th = static_cast<int64_t>(blockIdx.x) * a.num_heads + blockIdx.y;
  const float* pmax = a.partial_max + th * a.num_splits;
  const float* psum = a.partial_sum + th * a.num_splits;
  float global_max = -FLT_MAX;
  for (int p = 0; p < a.num_splits; ++p)
    if (psum[p] > 0.f) global_max = fmaxf(global_max, pmax[p]);
  float total = 0.f;
  for (int p = 0; p < a.num_splits; ++p)
    if (psum[p] > 0.f) total += psum[p] * __expf(pmax[p] - global_max);
  const float inv = total > 0.f ? 1.f / total : 0.f;
  for (int d = threadIdx.x; d < HEAD_DIM; d += kThreads) {
    float x = 0.f;
    for (int p = 0; p < a.num_splits; ++p)
      if (psum[p] > 0.f) x += a.partial_out[(th * a.num_splits + p) * HEAD_DIM + d] * __expf(pmax[p] - global_max);
    static_cast<T*>(a.out)[th * HEAD_DIM + d] = from_float<T>(x * inv);
  }
}

template <typename Q, typename T, int HEAD_DIM>
cudaError_t launch_prefill_head_dim(const PrefillArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(a.num_seqs), static_cast<unsigned>(std::min(a.query_tiles, 65535)),
                  static_cast<unsigned>(a.layout.num_kv_heads * a.num_splits));
  const size_t smem = sizeof(float) * ((kRows + kKeys) * (HEAD_DIM + 1) + kRows * kKeys) + kKeys;
  prefill_kernel<Q, T, HEAD_DIM><<<grid, kThreads, smem, stream>>>(a);
  if (a.num_splits > 1)
    merge_splits_kernel<Q, HEAD_DIM><<<dim3(static_cast<unsigned>(a.total_q), a.num_heads), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename Q, typename T = Q>
cudaError_t launch_prefill_dtype(const PrefillArgs& a, cudaStream_t stream) {
  switch (a.layout.head_dim) {
    case 64: return launch_prefill_head_dim<Q, T, 64>(a, stream);
    case 128: return launch_prefill_head_dim<Q, T, 128>(a, stream);
    case 256: return launch_prefill_head_dim<Q, T, 256>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

PrefillPlan prefill_plan(int64_t max_query_len, int64_t group, int64_t num_seqs, int64_t num_kv_heads,
                         int64_t max_keys, int num_sms) {
  PrefillPlan plan{};
  plan.query_tiles = static_cast<int>(std::max<int64_t>(1, (max_query_len * group + kRows - 1) / kRows));
  const int64_t blocks = std::max<int64_t>(1, plan.query_tiles * num_seqs * num_kv_heads);
  const int64_t wanted = (2 * static_cast<int64_t>(num_sms) + blocks - 1) / blocks;  // two waves
  const int64_t most = std::max<int64_t>(1, max_keys / kMinSplitTokens);
  const int64_t splits = std::clamp<int64_t>(wanted, 1, most);
  int64_t tokens = (std::max<int64_t>(1, max_keys) + splits - 1) / splits;
  tokens = (tokens + kKeys - 1) / kKeys * kKeys;
  plan.split_tokens = static_cast<int>(std::min<int64_t>(tokens, int64_t{1} << 30));
  plan.num_splits = static_cast<int>((std::max<int64_t>(1, max_keys) + tokens - 1) / tokens);
  return plan;
}

cudaError_t launch_paged_attention_prefill(const PrefillArgs& args, DType dtype, cudaStream_t stream) {
  if (args.total_q == 0 || args.num_seqs == 0) return cudaSuccess;
  // An 8-bit cache's query and output are float (the bindings convert).
  if (args.format != KVFormat::kNone && dtype != DType::kFloat) return cudaErrorInvalidValue;
  switch (args.format) {
    case KVFormat::kInt8: return launch_prefill_dtype<float, int8_t>(args, stream);
    case KVFormat::kFp8E4M3: return launch_prefill_dtype<float, fp8_e4m3>(args, stream);
    case KVFormat::kFp8E5M2: return launch_prefill_dtype<float, fp8_e5m2>(args, stream);
    case KVFormat::kNone: break;
  }
  switch (dtype) {
    case DType::kFloat: return launch_prefill_dtype<float>(args, stream);
    case DType::kHalf: return launch_prefill_dtype<__half>(args, stream);
    case DType::kBFloat16: return launch_prefill_dtype<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace minipaged::cuda
