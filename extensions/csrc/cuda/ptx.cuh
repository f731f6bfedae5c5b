// PTX wrappers: cp.async copies, mbarriers, and the copy-warp slot pipeline built from them.
#pragma once
#include <cstdint>
#include <utility>

namespace approx_cuda {

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// Word base[I] where (unsigned)(first + I) < lim, else 0, read through the non-coherent path. The run's words sit at
// immediate offsets from one address; a predicated load written in C++ rebuilt its 64-bit address a word.
template <int I>
__device__ __forceinline__ uint32_t ldg_word_if(const uint32_t* base, int first, unsigned lim) {
  uint32_t v;
  asm("{\n .reg .pred p;\n .reg .u32 t;\n add.u32 t, %2, %3;\n setp.lt.u32 p, t, %4;\n mov.b32 %0, 0;\n"
      " @p ld.global.nc.b32 %0, [%1+%5];\n}\n"
      : "=r"(v)
      : "l"(base), "r"(first), "n"(I), "r"(lim), "n"(4 * I));
  return v;
}
template <int N>
__device__ __forceinline__ void ldg_words_if(uint32_t (&w)[N], const uint32_t* base, int first, unsigned lim) {
  [&]<int... I>(std::integer_sequence<int, I...>) {
    ((w[I] = ldg_word_if<I>(base, first, lim)), ...);
  }(std::make_integer_sequence<int, N>{});
}
// ldg_word_if's 16-byte form: quad base[I] where (unsigned)(first + I) < lim, else zeros.
template <int I>
__device__ __forceinline__ uint4 ldg_quad_if(const uint4* base, int first, unsigned lim) {
  uint32_t x, y, z, w;
  asm("{\n .reg .pred p;\n .reg .u32 t;\n add.u32 t, %5, %6;\n setp.lt.u32 p, t, %7;\n mov.b32 %0, 0;\n"
      " mov.b32 %1, 0;\n mov.b32 %2, 0;\n mov.b32 %3, 0;\n @p ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4+%8];\n}\n"
      : "=r"(x), "=r"(y), "=r"(z), "=r"(w)
      : "l"(base), "r"(first), "n"(I), "r"(lim), "n"(16 * I));
  return make_uint4(x, y, z, w);
}
// ldg_words_if's words first .. first + N - 1 of the word array at base (on 16 bytes), a word at or past lim (a
// multiple of 4) or before 0 reading 0, from the aligned 16-byte quads that hold them: then each lane's run is
// selected by its first word's place in a quad, in two rounds of selects. A warp's run of N words a lane is
// (N + 2) / 4 + 1 load requests where ldg_words_if makes N, each costing L1 about as many wavefronts (the lines
// the lanes touch).
template <int N>
__device__ __forceinline__ void ldg_words_by_quads(uint32_t (&w)[N], const void* base, int first, unsigned lim) {
  constexpr int NQ = (N + 2) / 4 + 1;  // quads holding N words from a quad's last word
  uint32_t q[4 * NQ];
  const int k0 = first >> 2;  // floor, so word -1 lies in quad -1, which reads 0
  [&]<int... J>(std::integer_sequence<int, J...>) {
    (([&] {
       const uint4 v = ldg_quad_if<J>(static_cast<const uint4*>(base) + k0, k0, lim / 4);
       q[4 * J] = v.x, q[4 * J + 1] = v.y, q[4 * J + 2] = v.z, q[4 * J + 3] = v.w;
     }()),
     ...);
  }(std::make_integer_sequence<int, NQ>{});
#pragma unroll
  for (int b = 1; b < 4; b <<= 1) {
    const bool on = first & b;
#pragma unroll
    for (int j = 0; j + b < 4 * NQ; ++j) q[j] = on ? q[j + b] : q[j];
  }
#pragma unroll
  for (int i = 0; i < N; ++i) w[i] = q[i];
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// mbarriers (sm_80+) for pipelines without block-wide barriers.
__device__ __forceinline__ void mbar_init(uint64_t* b, unsigned count) {
  asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared.b64 st, [%0];\n}\n" ::"r"(smem_u32(b))
               : "memory");
}
// Arrives on b once every cp.async this thread issued so far has landed.
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* b) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n"
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      " mbarrier.try_wait.parity.shared.b64 done, [%0], %1;\n"
#else
      " mbarrier.test_wait.parity.shared.b64 done, [%0], %1;\n"
#endif
      " @!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(b)),
      "r"(parity)
      : "memory");
}

// Warp-specialised pipeline of S shared-memory slots: one copy warp fills chunk i into slot i % S
// (cp.async) once the summing warps released what the slot held before; a slot's `full` barrier
// completes when its copies land, its `empty` barrier when each of the `consumers` summing warps
// is done with it. With no block-wide barrier per chunk, warps drift apart by up to S chunks
// instead of all waiting for the slowest at every chunk (fc2: 37.8 -> 30.2 us on the H100).
template <int S>
struct SlotPipe {
  uint64_t* full;   // S barriers, then S `empty` ones (16 * S bytes of shared memory)
  uint64_t* empty;

  // Every thread of the block calls it; a __syncthreads() must follow before first use.
  __device__ __forceinline__ SlotPipe(uint64_t* bars, int consumers) : full(bars), empty(bars + S) {
    if (threadIdx.x == 0)
      for (int j = 0; j < S; ++j) {
        mbar_init(full + j, 32);
        mbar_init(empty + j, consumers);
      }
  }
  // Copy warp: chunk i (N16 16-byte words from src) into its slot at dst.
  template <int N16>
  __device__ __forceinline__ void fill(int i, int4* dst, const int4* src, int lane) {
    const int slot = i % S;
    if (i >= S) mbar_wait(empty + slot, ((i / S) - 1) & 1);
#pragma unroll 8
    for (int q = lane; q < N16; q += 32) cp_async16(dst + q, src + q);
    cp_async_mbar_arrive(full + slot);
  }
  // Summing warps: wait for chunk i, and hand its slot back when done with it.
  __device__ __forceinline__ void wait_full(int i) { mbar_wait(full + i % S, (i / S) & 1); }
  __device__ __forceinline__ void release(int i, int lane) {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty + i % S);
  }
};

}  // namespace approx_cuda
