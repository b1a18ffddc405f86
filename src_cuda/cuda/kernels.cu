// CUDA kernels. No torch headers here (see launch.h); the bindings validate and launch.
//
// Decode: one thread block per (sequence, kv head, tile of its query heads, partition of the
// context). The block reads each K/V row of its partition once for all query heads of the tile
// (GQA), with 16-byte loads spread over the lanes of a warp. The partition is walked in chunks
// with an online softmax (running max and sum, float32), so shared memory does not grow with
// the partition. Several partitions per sequence (split-K) keep the GPU busy when the batch is
// small; a second kernel merges their partial results.
//
// Out-of-range data never touches memory outside the cache: seq_lens are clamped to what the
// block table can address, and tokens in an out-of-range block are masked (score -inf, V not read).
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
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 256;   // tokens whose scores sit in shared memory at once
constexpr int kUnroll = 2;    // tokens per lane in flight in each pass

// ---- 16-byte vectors of T as floats
template <typename T> struct Vec;
template <> struct Vec<float> {
  static constexpr int kSize = 4;
  __device__ static void to_float(const uint4& raw, float* out) {
    const float* f = reinterpret_cast<const float*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = f[i];
  }
  __device__ static float load1(const float* p) { return *p; }
  __device__ static float store1(float x) { return x; }
};
template <> struct Vec<__half> {
  static constexpr int kSize = 8;
  __device__ static void to_float(const uint4& raw, float* out) {
    const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 f = __half22float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  __device__ static float load1(const __half* p) { return __half2float(*p); }
  __device__ static __half store1(float x) { return __float2half(x); }
};
template <> struct Vec<__nv_bfloat16> {
  static constexpr int kSize = 8;
  __device__ static void to_float(const uint4& raw, float* out) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 f = __bfloat1622float2(h[i]);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  __device__ static float load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  __device__ static __nv_bfloat16 store1(float x) { return __float2bfloat16(x); }
};
// 8-bit caches (quant.h): 16 elements per 16 bytes, converted before their scale is applied (fp8
// as float16 bits: e5m2 its top byte, e4m3 its value x 2^-8, folded into raw_scale).
__device__ __forceinline__ float half_bits_to_float(uint16_t bits) {
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}
template <> struct Vec<int8_t> {
  static constexpr int kSize = 16;
  __device__ static void to_float(const uint4& raw, float* out) {
    const int8_t* b = reinterpret_cast<const int8_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 16; ++i) out[i] = static_cast<float>(b[i]);
  }
};
template <> struct Vec<fp8_e5m2> {
  static constexpr int kSize = 16;
  __device__ static void to_float(const uint4& raw, float* out) {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 16; ++i) out[i] = half_bits_to_float(e5m2_half_bits(b[i]));
  }
};
template <> struct Vec<fp8_e4m3> {
  static constexpr int kSize = 16;
  __device__ static void to_float(const uint4& raw, float* out) {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(&raw);
#pragma unroll
    for (int i = 0; i < 16; ++i) out[i] = half_bits_to_float(e4m3_half_bits(b[i]));
  }
};

// How one K/V row of HEAD_DIM elements is spread over the lanes of a warp.
template <typename T, int HEAD_DIM>
struct RowSplit {
  static constexpr int kVec = Vec<T>::kSize;
  static constexpr int kVecsPerRow = HEAD_DIM / kVec;
  static constexpr int kLanesPerToken = kVecsPerRow < 32 ? kVecsPerRow : 32;
  static constexpr int kVecsPerLane = kVecsPerRow / kLanesPerToken;
  static constexpr int kTokensPerWarp = 32 / kLanesPerToken;
  static constexpr int kTokensPerPass = kTokensPerWarp * kWarps;
  static constexpr int kElemsPerLane = kVecsPerLane * kVec;
  static_assert(HEAD_DIM % kVec == 0 && kVecsPerRow % kLanesPerToken == 0, "unsupported head_dim");
  // Element offset within the row of this lane's v-th vector: lanes of a token read adjacent
  // 16-byte pieces, so a token's row is one coalesced read.
  __device__ static int elem(int v, int lane_in_token) { return (v * kLanesPerToken + lane_in_token) * kVec; }
};

template <int WIDTH>
__device__ __forceinline__ float sum_over_lanes(float x) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// Reduces `x` (one value per thread, for each of G heads) over the block: max or sum.
template <int G, bool kMax>
__device__ void block_reduce(float (&x)[G], float* scratch /* [kWarps][G] */) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      float other = __shfl_xor_sync(0xffffffffu, x[g], off);
      x[g] = kMax ? fmaxf(x[g], other) : x[g] + other;
    }
    if (lane == 0) scratch[warp * G + g] = x[g];
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float r = scratch[g];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) r = kMax ? fmaxf(r, scratch[w * G + g]) : r + scratch[w * G + g];
    x[g] = r;
  }
  __syncthreads();
}

__device__ __forceinline__ int clamped_seq_len(const DecodeArgs& a, int seq) {
  const int64_t len = a.seq_lens[seq] > 0 ? a.seq_lens[seq] : 0;
  return static_cast<int>(len < a.seq_len_bound ? len : a.seq_len_bound);
}

// Q: the query's (and output's) type; T: the cache's, Q itself or an 8-bit format (then Q is
// float: the bindings convert). fp8's layer scales are read from the device: K's is folded into
// the query, V's into the result; int8's per-token scales multiply each score and probability.
template <typename Q, typename T, int HEAD_DIM, int G>
__global__ void __launch_bounds__(kThreads)
decode_kernel(const DecodeArgs a) {
  using R = RowSplit<T, HEAD_DIM>;
  constexpr bool kPerTokenScales = std::is_same_v<T, int8_t>;
  constexpr bool kLayerScales = std::is_same_v<T, fp8_e4m3> || std::is_same_v<T, fp8_e5m2>;
  extern __shared__ float smem[];
  float* scores = smem;                    // [G][kChunk]
  float* out_acc = scores + G * kChunk;    // [G][HEAD_DIM]
  float* red = out_acc + G * HEAD_DIM;     // [kWarps][G]

  const int group = a.num_heads / static_cast<int>(a.layout.num_kv_heads);
  const int tiles = (group + G - 1) / G;
  const int kv_head = blockIdx.y / tiles;
  const int head0 = kv_head * group + (blockIdx.y % tiles) * G;
  const int heads = min(G, kv_head * group + group - head0);  // live heads in this tile
  const int seq = blockIdx.x, part = blockIdx.z;  // sequences on x: up to 2^31 - 1 of them
  const int seq_len = clamped_seq_len(a, seq);
  const int begin = part * a.partition_tokens;
  const int end = min(seq_len, begin + a.partition_tokens);
  if (begin >= end && part > 0) return;  // the merge reads only partitions that hold tokens

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int token_in_warp = lane / R::kLanesPerToken, lane_in_token = lane % R::kLanesPerToken;
  const Q* query = static_cast<const Q*>(a.query);
  const T* key_cache = static_cast<const T*>(a.key_cache);
  const T* value_cache = static_cast<const T*>(a.value_cache);
  const int32_t* block_table = a.block_tables + seq * a.max_blocks_per_seq;
  const int64_t B = a.layout.block_size;

  float q_scale = a.scale;
  if constexpr (kLayerScales) q_scale *= raw_scale(a.format, *a.key_scale);
  float q[G][R::kElemsPerLane];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int v = 0; v < R::kVecsPerLane; ++v)
#pragma unroll
      for (int i = 0; i < R::kVec; ++i) {
        const Q* qp = query + seq * a.query_seq_stride + min(head0 + g, head0 + heads - 1) * a.query_head_stride;
        q[g][v * R::kVec + i] = Vec<Q>::load1(qp + R::elem(v, lane_in_token) + i) * q_scale;
      }

  float acc[G][R::kElemsPerLane] = {};
  float run_max[G], run_sum[G];
#pragma unroll
  for (int g = 0; g < G; ++g) run_max[g] = -FLT_MAX, run_sum[g] = 0.f;

  // Row offset of token `t` of this sequence, or -1 when its block id is out of range.
  auto row_of = [&](int t) -> int64_t {
    const int64_t block = block_table[t / B];
    return a.layout.valid_block(block) ? a.layout.row(block, kv_head, t % B) : -1;
  };

  // This lane's 16-byte pieces of the rows of kUnroll tokens, all loads issued before any use;
  // live[u] is false (and the data zero) past the chunk or for an out-of-range block. scale[u]:
  // the token's int8 scale in `scales` (1 otherwise, or when not live).
  auto load_rows = [&](const T* cache, int base, int chunk_end, uint4(&raw)[kUnroll][R::kVecsPerLane],
                       bool(&live)[kUnroll], const float* scales, float(&scale)[kUnroll]) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = base + u * R::kTokensPerPass + token_in_warp;
      const int64_t row = t < chunk_end ? row_of(t) : -1;
      live[u] = row >= 0;
      scale[u] = 1.f;
      if constexpr (kPerTokenScales) if (live[u]) scale[u] = scales[row / HEAD_DIM];
#pragma unroll
      for (int v = 0; v < R::kVecsPerLane; ++v)
        raw[u][v] = live[u] ? *reinterpret_cast<const uint4*>(cache + row + R::elem(v, lane_in_token))
                            : make_uint4(0, 0, 0, 0);
    }
  };

  for (int chunk = begin; chunk < end; chunk += kChunk) {
    const int chunk_end = min(end, chunk + kChunk);
    // Pass 1: scores of the chunk's tokens for every head of the tile.
    for (int base = chunk + warp * R::kTokensPerWarp; base < chunk_end; base += R::kTokensPerPass * kUnroll) {
      uint4 raw[kUnroll][R::kVecsPerLane];
      bool live[kUnroll];
      float scale[kUnroll];
      load_rows(key_cache, base, chunk_end, raw, live, a.key_scale, scale);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float k[R::kElemsPerLane];
#pragma unroll
        for (int v = 0; v < R::kVecsPerLane; ++v) Vec<T>::to_float(raw[u][v], k + v * R::kVec);
        const int t = base + u * R::kTokensPerPass + token_in_warp;
#pragma unroll
        for (int g = 0; g < G; ++g) {
          float s = 0.f;
#pragma unroll
          for (int i = 0; i < R::kElemsPerLane; ++i) s += q[g][i] * k[i];
          s = sum_over_lanes<R::kLanesPerToken>(s) * scale[u];
          if (lane_in_token == 0 && t < chunk_end) scores[g * kChunk + (t - chunk)] = live[u] ? s : -INFINITY;
        }
      }
    }
    __syncthreads();

    // Online softmax update: new running max, rescale what was accumulated, exponentiate.
    float m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      m[g] = -FLT_MAX;
      for (int i = threadIdx.x; i < chunk_end - chunk; i += kThreads) m[g] = fmaxf(m[g], scores[g * kChunk + i]);
    }
    block_reduce<G, true>(m, red);
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float new_max = fmaxf(run_max[g], m[g]);
      const float rescale = __expf(run_max[g] - new_max);
      run_max[g] = new_max;
      run_sum[g] *= rescale;
#pragma unroll
      for (int i = 0; i < R::kElemsPerLane; ++i) acc[g][i] *= rescale;
      l[g] = 0.f;
      for (int i = threadIdx.x; i < chunk_end - chunk; i += kThreads) {
        const float p = __expf(scores[g * kChunk + i] - new_max);  // masked tokens give 0
        scores[g * kChunk + i] = p;
        l[g] += p;
      }
    }
    block_reduce<G, false>(l, red);  // also orders the writes to `scores` before pass 2
#pragma unroll
    for (int g = 0; g < G; ++g) run_sum[g] += l[g];

    // Pass 2: accumulate probability-weighted V rows.
    for (int base = chunk + warp * R::kTokensPerWarp; base < chunk_end; base += R::kTokensPerPass * kUnroll) {
      uint4 raw[kUnroll][R::kVecsPerLane];
      bool live[kUnroll];
      float scale[kUnroll];
      load_rows(value_cache, base, chunk_end, raw, live, a.value_scale, scale);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (!live[u]) continue;
        const int t = base + u * R::kTokensPerPass + token_in_warp;
        float val[R::kElemsPerLane];
#pragma unroll
        for (int v = 0; v < R::kVecsPerLane; ++v) Vec<T>::to_float(raw[u][v], val + v * R::kVec);
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float p = scores[g * kChunk + (t - chunk)] * scale[u];
#pragma unroll
          for (int i = 0; i < R::kElemsPerLane; ++i) acc[g][i] += p * val[i];
        }
      }
    }
    __syncthreads();  // `scores` is rewritten by the next chunk
  }

  if constexpr (kLayerScales) {
    const float v_scale = raw_scale(a.format, *a.value_scale);
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
      for (int i = 0; i < R::kElemsPerLane; ++i) acc[g][i] *= v_scale;
  }
  // Sum the accumulators of the tokens a warp held side by side, then across warps.
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int i = 0; i < R::kElemsPerLane; ++i) {
      float x = acc[g][i];
#pragma unroll
      for (int off = R::kLanesPerToken; off < 32; off *= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
      acc[g][i] = x;
    }
  // Warps add into out_acc one after another, in a fixed order, so the output is bitwise the same
  // run to run (shared-memory atomics would add in arrival order). Warp 0 stores: no zeroing.
  for (int w = 0; w < kWarps; ++w) {
    if (warp == w && token_in_warp == 0) {
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int v = 0; v < R::kVecsPerLane; ++v)
#pragma unroll
          for (int i = 0; i < R::kVec; ++i) {
            float& sum = out_acc[g * HEAD_DIM + R::elem(v, lane_in_token) + i];
            sum = (w == 0 ? 0.f : sum) + acc[g][v * R::kVec + i];
          }
    }
    __syncthreads();
  }

  // g is a compile-time index here so run_max/run_sum stay in registers (no local memory).
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (g >= heads) break;
    const int64_t sh = static_cast<int64_t>(seq) * a.num_heads + head0 + g;
    for (int d = threadIdx.x; d < HEAD_DIM; d += kThreads) {
      const float x = out_acc[g * HEAD_DIM + d];
      if (a.num_partitions == 1) {
        const float inv = run_sum[g] > 0.f ? 1.f / run_sum[g] : 0.f;
        static_cast<Q*>(a.out)[sh * HEAD_DIM + d] = Vec<Q>::store1(x * inv);
      } else {
        const int64_t sp = sh * a.num_partitions + part;
        a.partial_out[sp * HEAD_DIM + d] = x;
        if (d == 0) a.partial_max[sp] = run_max[g], a.partial_sum[sp] = run_sum[g];
      }
    }
  }
}

// Merges the partitions of one (sequence, head): rescale each to the global max, normalise.
template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kThreads)
merge_partitions_kernel(const DecodeArgs a) {
  const int seq = blockIdx.x, head = blockIdx.y;
  const int parts = (clamped_seq_len(a, seq) + a.partition_tokens - 1) / a.partition_tokens;
  const int64_t sh = static_cast<int64_t>(seq) * a.num_heads + head;
  const float* pmax = a.partial_max + sh * a.num_partitions;
  const float* psum = a.partial_sum + sh * a.num_partitions;
  float global_max = -FLT_MAX;
  for (int p = 0; p < parts; ++p) global_max = fmaxf(global_max, pmax[p]);
  float total = 0.f;
  for (int p = 0; p < parts; ++p) total += psum[p] * __expf(pmax[p] - global_max);
  const float inv = total > 0.f ? 1.f / total : 0.f;
  for (int d = threadIdx.x; d < HEAD_DIM; d += kThreads) {
    float x = 0.f;
    for (int p = 0; p < parts; ++p)
      x += a.partial_out[(sh * a.num_partitions + p) * HEAD_DIM + d] * __expf(pmax[p] - global_max);
    static_cast<T*>(a.out)[sh * HEAD_DIM + d] = Vec<T>::store1(x * inv);
  }
}

template <typename Q, typename T, int HEAD_DIM, int G>
cudaError_t launch_decode_tile(const DecodeArgs& a, cudaStream_t stream) {
  const int group = a.num_heads / static_cast<int>(a.layout.num_kv_heads);
  const dim3 grid(a.num_seqs, static_cast<unsigned>(a.layout.num_kv_heads * ((group + G - 1) / G)),
                  a.num_partitions);
  const size_t smem = sizeof(float) * (G * kChunk + G * HEAD_DIM + kWarps * G);
  decode_kernel<Q, T, HEAD_DIM, G><<<grid, kThreads, smem, stream>>>(a);
  if (a.num_partitions > 1)
    merge_partitions_kernel<Q, HEAD_DIM><<<dim3(a.num_seqs, a.num_heads), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// The head tile is the GQA group rounded up to a power of two, at most 8; larger groups are
// split over several thread blocks.
template <typename Q, typename T, int HEAD_DIM>
cudaError_t launch_decode_head_dim(const DecodeArgs& a, cudaStream_t stream) {
  const int group = a.num_heads / static_cast<int>(a.layout.num_kv_heads);
  if (group <= 1) return launch_decode_tile<Q, T, HEAD_DIM, 1>(a, stream);
  if (group <= 2) return launch_decode_tile<Q, T, HEAD_DIM, 2>(a, stream);
  if (group <= 4) return launch_decode_tile<Q, T, HEAD_DIM, 4>(a, stream);
  return launch_decode_tile<Q, T, HEAD_DIM, 8>(a, stream);
}

template <typename Q, typename T = Q>
cudaError_t launch_decode_dtype(const DecodeArgs& a, cudaStream_t stream) {
  switch (a.layout.head_dim) {
    case 64: return launch_decode_head_dim<Q, T, 64>(a, stream);
    case 128: return launch_decode_head_dim<Q, T, 128>(a, stream);
    case 256: return launch_decode_head_dim<Q, T, 256>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

// ---- reshape_and_cache: one thread block per token; out-of-range and negative slots skipped.
template <typename T, typename Slot>
__global__ void reshape_and_cache_kernel(const T* key, const T* value, int64_t ks0, int64_t ks1, int64_t ks2,
                                         int64_t vs0, int64_t vs1, int64_t vs2, T* key_cache, T* value_cache,
                                         const Slot* slot_mapping, CacheLayout layout) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (!layout.valid_slot(slot)) return;
  const int64_t n = layout.num_kv_heads * layout.head_dim;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t h = i / layout.head_dim, d = i % layout.head_dim;
    const int64_t dst = layout.slot_row(slot, h) + d;
    key_cache[dst] = key[token * ks0 + h * ks1 + d * ks2];
    value_cache[dst] = value[token * vs0 + h * vs1 + d * vs2];
  }
}

template <typename T>
cudaError_t launch_reshape_typed(const void* key, const void* value, int64_t ks0, int64_t ks1, int64_t ks2,
                                 int64_t vs0, int64_t vs1, int64_t vs2, void* key_cache, void* value_cache,
                                 const void* slots, bool slots_int64, int64_t num_tokens, CacheLayout layout,
                                 cudaStream_t stream) {
  const int threads = static_cast<int>(std::min<int64_t>(256, layout.num_kv_heads * layout.head_dim));
  auto k = static_cast<const T*>(key);
  auto v = static_cast<const T*>(value);
  auto kc = static_cast<T*>(key_cache);
  auto vc = static_cast<T*>(value_cache);
  if (slots_int64)
    reshape_and_cache_kernel<T><<<num_tokens, threads, 0, stream>>>(k, v, ks0, ks1, ks2, vs0, vs1, vs2, kc, vc,
                                                                    static_cast<const int64_t*>(slots), layout);
  else
    reshape_and_cache_kernel<T><<<num_tokens, threads, 0, stream>>>(k, v, ks0, ks1, ks2, vs0, vs1, vs2, kc, vc,
                                                                    static_cast<const int32_t*>(slots), layout);
  return cudaGetLastError();
}

// ---- reshape_and_cache into an 8-bit cache: one thread block per token, one warp per (K or V,
// kv head) row at a time; int8 reduces the row's absolute maximum over the warp first.
template <typename S, typename T>
__global__ void quantize_and_cache_kernel(const QuantizeArgs a, const S* key, const S* value, T* key_cache,
                                          T* value_cache) {
  const int64_t token = blockIdx.x;
  const int64_t slot = a.slot_mapping[token];
  if (!a.layout.valid_slot(slot)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  const int64_t H = a.layout.num_kv_heads, D = a.layout.head_dim;
  for (int64_t pair = warp; pair < 2 * H; pair += warps) {  // the same for every lane of a warp
    const bool is_key = pair < H;
    const int64_t h = pair % H;
    const S* from = is_key ? key + token * a.key_strides[0] + h * a.key_strides[1]
                           : value + token * a.value_strides[0] + h * a.value_strides[1];
    const int64_t dim_stride = is_key ? a.key_strides[2] : a.value_strides[2];
    T* to = (is_key ? key_cache : value_cache) + a.layout.slot_row(slot, h);
    float inv_scale;
    if constexpr (std::is_same_v<T, int8_t>) {
      float amax = 0.f;
      for (int64_t d = lane; d < D; d += 32) amax = fmaxf(amax, fabsf(Vec<S>::load1(from + d * dim_stride)));
#pragma unroll
      for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      inv_scale = amax > 0.f ? fminf(kInt8Max / amax, FLT_MAX) : 0.f;
      if (lane == 0) (is_key ? a.key_scale : a.value_scale)[a.layout.slot_row(slot, h) / D] = amax / kInt8Max;
    } else {
      inv_scale = 1.f / *(is_key ? a.key_scale : a.value_scale);
    }
    for (int64_t d = lane; d < D; d += 32) {
      const float x = Vec<S>::load1(from + d * dim_stride);
      if constexpr (std::is_same_v<T, int8_t>) to[d] = quantize_int8(x, inv_scale);
      else if constexpr (std::is_same_v<T, fp8_e4m3>) to[d] = quantize_e4m3(x, inv_scale);
      else to[d] = quantize_e5m2(x, inv_scale);
    }
  }
}

template <typename S>
cudaError_t launch_quantize_typed(const QuantizeArgs& a, cudaStream_t stream) {
  const auto* key = static_cast<const S*>(a.key);
  const auto* value = static_cast<const S*>(a.value);
  constexpr int kQuantizeThreads = 128;
  switch (a.format) {
    case KVFormat::kInt8:
      quantize_and_cache_kernel<S, int8_t><<<a.num_tokens, kQuantizeThreads, 0, stream>>>(
          a, key, value, static_cast<int8_t*>(a.key_cache), static_cast<int8_t*>(a.value_cache));
      break;
    case KVFormat::kFp8E4M3:
      quantize_and_cache_kernel<S, fp8_e4m3><<<a.num_tokens, kQuantizeThreads, 0, stream>>>(
          a, key, value, static_cast<fp8_e4m3*>(a.key_cache), static_cast<fp8_e4m3*>(a.value_cache));
      break;
    case KVFormat::kFp8E5M2:
      quantize_and_cache_kernel<S, fp8_e5m2><<<a.num_tokens, kQuantizeThreads, 0, stream>>>(
          a, key, value, static_cast<fp8_e5m2*>(a.key_cache), static_cast<fp8_e5m2*>(a.value_cache));
      break;
    case KVFormat::kNone: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

// ---- copy_blocks: blockIdx.x picks the pair, blockIdx.y the cache (key or value).
__global__ void copy_blocks_kernel(char* key_cache, char* value_cache, const int64_t* block_mapping,
                                   int64_t block_bytes, int64_t num_blocks) {
  const int64_t src = block_mapping[2 * blockIdx.x], dst = block_mapping[2 * blockIdx.x + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;
  char* cache = blockIdx.y == 0 ? key_cache : value_cache;
  const char* from = cache + src * block_bytes;
  char* to = cache + dst * block_bytes;
  if (block_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(cache) % 16 == 0) {
    for (int64_t i = threadIdx.x; i < block_bytes / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(to)[i] = reinterpret_cast<const uint4*>(from)[i];
  } else {
    for (int64_t i = threadIdx.x; i < block_bytes; i += blockDim.x) to[i] = from[i];
  }
}

}  // namespace

bool decode_supports_head_dim(int64_t head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }

int decode_partition_tokens(int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t max_seq_len, int num_sms) {
  const int64_t tiles = (group + 7) / 8 > 1 ? (group + 7) / 8 : 1;
  const int64_t blocks = std::max<int64_t>(1, num_seqs * num_kv_heads * tiles);
  const int64_t target = 2 * static_cast<int64_t>(num_sms);  // enough blocks for two waves
  const int64_t parts = std::max<int64_t>(1, (target + blocks - 1) / blocks);
  int64_t tokens = (std::max<int64_t>(1, max_seq_len) + parts - 1) / parts;
  tokens = (tokens + kChunk - 1) / kChunk * kChunk;  // whole chunks
  return static_cast<int>(std::min<int64_t>(tokens, int64_t{1} << 30));
}

cudaError_t launch_paged_attention_decode(const DecodeArgs& args, DType dtype, cudaStream_t stream) {
  // An 8-bit cache's query and output are float (the bindings convert).
  switch (args.format) {
    case KVFormat::kInt8: return dtype == DType::kFloat ? launch_decode_dtype<float, int8_t>(args, stream) : cudaErrorInvalidValue;
    case KVFormat::kFp8E4M3: return dtype == DType::kFloat ? launch_decode_dtype<float, fp8_e4m3>(args, stream) : cudaErrorInvalidValue;
    case KVFormat::kFp8E5M2: return dtype == DType::kFloat ? launch_decode_dtype<float, fp8_e5m2>(args, stream) : cudaErrorInvalidValue;
    case KVFormat::kNone: break;
  }
  switch (dtype) {
    case DType::kFloat: return launch_decode_dtype<float>(args, stream);
    case DType::kHalf: return launch_decode_dtype<__half>(args, stream);
    case DType::kBFloat16: return launch_decode_dtype<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_reshape_and_cache(const void* key, const void* value, int64_t ks0, int64_t ks1, int64_t ks2,
                                     int64_t vs0, int64_t vs1, int64_t vs2, void* key_cache, void* value_cache,
                                     const void* slot_mapping, bool slots_int64, int64_t num_tokens,
                                     CacheLayout layout, DType dtype, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat:
      return launch_reshape_typed<float>(key, value, ks0, ks1, ks2, vs0, vs1, vs2, key_cache, value_cache,
                                         slot_mapping, slots_int64, num_tokens, layout, stream);
    case DType::kHalf:
      return launch_reshape_typed<__half>(key, value, ks0, ks1, ks2, vs0, vs1, vs2, key_cache, value_cache,
                                          slot_mapping, slots_int64, num_tokens, layout, stream);
    case DType::kBFloat16:
      return launch_reshape_typed<__nv_bfloat16>(key, value, ks0, ks1, ks2, vs0, vs1, vs2, key_cache,
                                                 value_cache, slot_mapping, slots_int64, num_tokens, layout, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_quantize_and_cache(const QuantizeArgs& args, DType input_dtype, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  switch (input_dtype) {
    case DType::kFloat: return launch_quantize_typed<float>(args, stream);
    case DType::kHalf: return launch_quantize_typed<__half>(args, stream);
    case DType::kBFloat16: return launch_quantize_typed<__nv_bfloat16>(args, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_copy_blocks(void* key_cache, void* value_cache, const int64_t* block_mapping, int64_t num_pairs,
                               int64_t block_bytes, int64_t num_blocks, cudaStream_t stream) {
  if (num_pairs == 0) return cudaSuccess;
  copy_blocks_kernel<<<dim3(static_cast<unsigned>(num_pairs), 2), 256, 0, stream>>>(
      static_cast<char*>(key_cache), static_cast<char*>(value_cache), block_mapping, block_bytes, num_blocks);
  return cudaGetLastError();
}

}  // namespace minipaged::cuda
