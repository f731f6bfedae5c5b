// Host helpers of the kernel launchers (nvcc-compiled .cu files only).
#pragma once
#include <c10/cuda/CUDAException.h>

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "../checks.h"
#include "gather.cuh"
#include "kernels.h"

namespace approx_cuda {

using approx_checks::I;

template <typename Kern>
inline void set_smem(Kern k, size_t bytes) {
  // Once per (device, kernel) and size is enough: the attribute belongs to the function in the
  // current device's context (a process that moves to another GPU must set it again, or the
  // launch fails with "invalid argument"), and a larger size wins.
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, size_t> done;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  size_t& cur = done[{dev, reinterpret_cast<const void*>(k)}];
  if (bytes > cur) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(bytes)));
    cur = bytes;
  }
}

// Blocks of `threads` that fit one SM with `smem` dynamic bytes (registers, shared memory and
// threads counted), once per (device, kernel, size).
template <typename Kern>
inline int blocks_per_sm(Kern k, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, size_t>, int> known;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto [it, fresh] = known.try_emplace({dev, reinterpret_cast<const void*>(k), smem}, 0);
  if (fresh) C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&it->second, k, threads, smem));
  return std::max(1, it->second);
}

inline int64_t rowinfo_bytes(const Params& p, int Mb) {
  return p.conv ? (int64_t)Mb * kRowInfoBytes : 0;
}

// Stages the block's codes in shared memory when they fit `budget` bytes (see stage_codes).
inline void choose_stage(Params& p, int Mb, int64_t budget) {
  int64_t bytes = 0;
  if (p.conv) {
    const int64_t imgs = (Mb - 1) / p.HoWo + 2;  // most images Mb consecutive rows can touch
    bytes = imgs * p.Cg * (int64_t)p.H * p.W;
    p.stage = 1;
  } else {
    bytes = (int64_t)Mb * p.Kpad;
    p.stage = 2;
  }
  if (bytes > budget) {
    p.stage = 0;
    bytes = 0;
  }
  p.stage_bytes = static_cast<int>(round_up(bytes, 16));
}

inline dim3 grid_for(const Params& p, int Mb) {
  const int64_t bx = (p.M + Mb - 1) / Mb;
  TORCH_CHECK(bx <= 0x7fffffff, "approx CUDA kernels: too many rows (", I(p.M), ")");
  return dim3(static_cast<unsigned>(bx), p.G, (p.NG + p.NGB - 1) / p.NGB);
}

}  // namespace approx_cuda
