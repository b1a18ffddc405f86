// The paged KV cache layout, in one place for the CPU and CUDA kernels.
//
// Per layer, key_cache and value_cache are [num_blocks, num_kv_heads, block_size, head_dim],
// contiguous. Token `pos` of a sequence lives in block block_table[pos / block_size] at offset
// pos % block_size; its linear slot is block * block_size + offset. All offsets are 64-bit:
// a large pool (e.g. 100k blocks x 8 heads x 16 x 256) overflows 32 bits.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define MINIPAGED_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MINIPAGED_HOST_DEVICE inline
#endif

namespace minipaged {

struct CacheLayout {
  int64_t num_blocks;
  int64_t num_kv_heads;
  int64_t block_size;
  int64_t head_dim;

  MINIPAGED_HOST_DEVICE int64_t num_slots() const { return num_blocks * block_size; }
  // Element offset of (block, kv_head, offset-in-block, 0).
  MINIPAGED_HOST_DEVICE int64_t row(int64_t block, int64_t kv_head, int64_t offset) const {
    return ((block * num_kv_heads + kv_head) * block_size + offset) * head_dim;
  }
  // Element offset of (slot, kv_head, 0).
  MINIPAGED_HOST_DEVICE int64_t slot_row(int64_t slot, int64_t kv_head) const {
    return row(slot / block_size, kv_head, slot % block_size);
  }
  MINIPAGED_HOST_DEVICE int64_t block_elems() const { return num_kv_heads * block_size * head_dim; }
  MINIPAGED_HOST_DEVICE bool valid_block(int64_t block) const { return block >= 0 && block < num_blocks; }
  MINIPAGED_HOST_DEVICE bool valid_slot(int64_t slot) const { return slot >= 0 && slot < num_slots(); }
};

}  // namespace minipaged
