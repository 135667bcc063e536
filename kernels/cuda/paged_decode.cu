// Paged decode attention in CUDA C++ on the canonical pool layout (one layer's K or V cache: [blocks, H, T, D]).
//
// One thread block per (sequence, query head); its warps stride over the sequence's tokens through the block
// table, each thread owning a slice of the head dimension. Online softmax in fp32 (running max and sum), so the
// whole context is read once. GQA: query head hq reads KV head hq / (Hq / H).
// Built as a torch extension when CUDA is present (kernels/cuda/__init__.py); the tests compile it with nvcc for
// sm_87 (Jetson Orin) and sm_90 (Hopper) on any machine that has nvcc.

#include <cuda_fp16.h>
#include <stdint.h>

namespace memos {

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// Sum over the thread block; `scratch` holds one float per warp.
__device__ float block_sum(float v, float* scratch) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  const int warps = (blockDim.x + 31) >> 5;
  for (int w = 0; w < warps; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// query [B, Hq, D], caches [N, H, T, D] with strides (in elements), block_tables [B, max_blocks], seq_lens [B],
// out [B, Hq, D]. blockDim.x must be a multiple of 32 and >= D (one thread per dimension of the head).
template <typename T>
__global__ void paged_decode_kernel(const T* __restrict__ query, const T* __restrict__ key_cache,
                                    const T* __restrict__ value_cache, const int64_t* __restrict__ block_tables,
                                    const int64_t* __restrict__ seq_lens, T* __restrict__ out, int q_heads,
                                    int kv_heads, int head_dim, int block_size, int max_blocks, int64_t s_blk,
                                    int64_t s_head, int64_t s_tok, float scale) {
  extern __shared__ float scratch[];
  const int b = blockIdx.x, hq = blockIdx.y, d = threadIdx.x;
  const int h = hq / (q_heads / kv_heads);
  const bool active = d < head_dim;
  const float q = active ? to_float(query[((int64_t)b * q_heads + hq) * head_dim + d]) : 0.f;
  const int64_t len = seq_lens[b];
  float m = -1e30f, l = 0.f, acc = 0.f;
  for (int64_t pos = 0; pos < len; ++pos) {
    const int64_t idx = pos / block_size;
    if (idx >= max_blocks) break;
    const int64_t blk = block_tables[(int64_t)b * max_blocks + idx];
    const int64_t base = blk * s_blk + h * s_head + (pos % block_size) * s_tok;
    const float k = active ? to_float(key_cache[base + d]) : 0.f;
    const float s = block_sum(q * k, scratch) * scale;
    const float m_new = fmaxf(m, s);
    const float alpha = __expf(m - m_new), p = __expf(s - m_new);
    const float v = active ? to_float(value_cache[base + d]) : 0.f;
    l = l * alpha + p;
    acc = acc * alpha + p * v;
    m = m_new;
  }
  if (active) out[((int64_t)b * q_heads + hq) * head_dim + d] = from_float<T>(len > 0 ? acc / l : 0.f);
}

}  // namespace memos

// Host launchers with plain pointers (no torch headers), so the compile test needs only nvcc.
template <typename T>
static int launch(const T* query, const T* key_cache, const T* value_cache, const int64_t* block_tables,
                  const int64_t* seq_lens, T* out, int batch, int q_heads, int kv_heads, int head_dim, int block_size,
                  int max_blocks, int64_t s_blk, int64_t s_head, int64_t s_tok, float scale, cudaStream_t stream) {
  if (head_dim > 1024 || q_heads % kv_heads != 0) return 1;
  const int threads = ((head_dim + 31) / 32) * 32;
  const dim3 grid(batch, q_heads);
  memos::paged_decode_kernel<T><<<grid, threads, (threads / 32) * sizeof(float), stream>>>(
      query, key_cache, value_cache, block_tables, seq_lens, out, q_heads, kv_heads, head_dim, block_size,
      max_blocks, s_blk, s_head, s_tok, scale);
  return (int)cudaGetLastError();
}

extern "C" int memos_paged_decode_f32(const float* query, const float* key_cache, const float* value_cache,
                                      const int64_t* block_tables, const int64_t* seq_lens, float* out, int batch,
                                      int q_heads, int kv_heads, int head_dim, int block_size, int max_blocks,
                                      int64_t s_blk, int64_t s_head, int64_t s_tok, float scale,
                                      cudaStream_t stream) {
  return launch<float>(query, key_cache, value_cache, block_tables, seq_lens, out, batch, q_heads, kv_heads, head_dim,
                       block_size, max_blocks, s_blk, s_head, s_tok, scale, stream);
}

extern "C" int memos_paged_decode_f16(const __half* query, const __half* key_cache, const __half* value_cache,
                                      const int64_t* block_tables, const int64_t* seq_lens, __half* out, int batch,
                                      int q_heads, int kv_heads, int head_dim, int block_size, int max_blocks,
                                      int64_t s_blk, int64_t s_head, int64_t s_tok, float scale,
                                      cudaStream_t stream) {
  return launch<__half>(query, key_cache, value_cache, block_tables, seq_lens, out, batch, q_heads, kv_heads,
                        head_dim, block_size, max_blocks, s_blk, s_head, s_tok, scale, stream);
}
