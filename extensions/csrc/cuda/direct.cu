// direct: the effective product table E in shared memory (int16, 128 KiB; int32 tables are
// read through L1/L2), one lookup per MAC. No per-weight table, so it suits small batches and
// training (weights that change every step).
#include "launch.cuh"

namespace approx_cuda {
namespace {

// Direct: thread (rs, ng) sums R rows x 8 channels, one E lookup per MAC.
constexpr int kDirectR = 4;
constexpr int kDirectKC = 8;
constexpr int kEStride = 258;  // int16 entries per row of the shared-memory E

template <bool E16S>
__device__ __forceinline__ void direct_body(const Params& p, uint8_t* smem) {
  constexpr int R = kDirectR, KC = kDirectKC;
  const RowSets b(p.NGB, R);
  const int NGB = b.NGB, rowsets = b.rowsets, Mb = b.Mb, grp = b.grp, ngz = b.ngz, ng = b.ng;
  const int tid = threadIdx.x, rs = b.rs;
  const long long m0 = b.m0;

  // Shared memory: [E16, rows padded to 258 entries][staged codes][act Mb*KC]
  //                [weights KC x NGB*8][row info (conv)]
  // The padding puts row a's column c in bank (a + c/2) % 32: a warp's rows differ, its column
  // is often the same, and an unpadded 512-byte row would send all 32 lookups to one bank.
  uint8_t* sp = smem;
  int16_t* Es = reinterpret_cast<int16_t*>(sp);
  sp += kEStride * 256 * 2;
  uint8_t* st = sp;
  sp += p.stage_bytes;
  uint8_t* act = sp;
  sp += ((Mb * KC + 15) / 16) * 16;
  uint8_t* wt = sp;
  sp += ((KC * NGB * 8 + 15) / 16) * 16;
  RowInfo ri{reinterpret_cast<long long*>(sp), reinterpret_cast<int*>(sp + Mb * 8)};
  if (E16S) {
    const int4* src = reinterpret_cast<const int4*>(p.E16);
    uint32_t* dst = reinterpret_cast<uint32_t*>(Es);
#pragma unroll 8
    for (int q = tid; q < 256 * 256 * 2 / 16; q += kThreads) {
      const int4 v = __ldg(src + q);
      const int row = q >> 5, w0 = (q & 31) * 4 + row * (kEStride / 2);
      dst[w0] = v.x; dst[w0 + 1] = v.y; dst[w0 + 2] = v.z; dst[w0 + 3] = v.w;
    }
  }
  if (p.conv) fill_rowinfo(p, grp, m0, Mb, ri);
  stage_codes(p, grp, m0, Mb, st);
  const int cstride = p.stage == 2 ? p.Kpad : KC;

  uint32_t acc[R][8];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0;

  __syncthreads();  // row info
  const int nb = NGB * 8;
  for (int k0 = 0; k0 < p.K; k0 += KC) {
    if (p.stage != 2) gather_tile<KC>(p, grp, m0, Mb, k0, act, ri, st);
    for (int e = tid; e < KC * nb; e += kThreads) {
      const int kk = e / nb, n = ngz * 8 + (e - kk * nb), k = k0 + kk;
      int v = 128;
      if (k < p.K && n < p.N) v = (int)p.w[((long long)grp * p.N + n) * p.K + k] + 128;
      wt[e] = static_cast<uint8_t>(v);
    }
    __syncthreads();
    if (rs < rowsets) {
      const uint8_t* cbase = p.stage == 2 ? st + k0 : act;
      uint64_t codes[R];
#pragma unroll
      for (int i = 0; i < R; ++i) codes[i] = load_word<KC>(cbase + (rs + rowsets * i) * cstride);
      const int kmax = min(KC, p.K - k0);
#pragma unroll
      for (int kk = 0; kk < KC; ++kk) {
        if (kk < kmax) {
          const uint2 wv = *reinterpret_cast<const uint2*>(wt + kk * nb + ng * 8);
          const uint64_t w8 = (uint64_t)wv.x | ((uint64_t)wv.y << 32);
#pragma unroll
          for (int i = 0; i < R; ++i) {
            const int row = static_cast<int>((codes[i] >> (8 * kk)) & 255) * (E16S ? kEStride : 256);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              const int col = static_cast<int>((w8 >> (8 * j)) & 255);
              if (E16S) acc[i][j] += (uint32_t)(int32_t)Es[row + col];
              else acc[i][j] += (uint32_t)__ldg(p.E32 + row + col);
            }
          }
        }
      }
    }
    __syncthreads();
  }
  if (rs >= rowsets) return;
  store_rows<R>(p, b, [&](int i, uint32_t (&v)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = acc[i][j];
  });
}

__global__ void __launch_bounds__(kThreads) direct_kernel(Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (read_fits16(p.flags))
    direct_body<true>(p, smem);
  else
    direct_body<false>(p, smem);
}


}  // namespace

void launch_direct(const Params& p0, cudaStream_t stream) {
  Params p = p0;
  p.NGB = std::min(p.NG, kMaxNGB);
  const int Mb = (kThreads / p.NGB) * kDirectR;
  choose_stage(p, Mb, 48 << 10);
  const size_t smem = kEStride * 256 * 2 + p.stage_bytes + round_up((int64_t)Mb * kDirectKC, 16) +
                      round_up((int64_t)kDirectKC * p.NGB * 8, 16) + rowinfo_bytes(p, Mb);
  TORCH_CHECK((int)smem <= max_smem_optin(), "approx direct kernel: needs ", I(smem),
              " bytes of shared memory, the device allows ", I(max_smem_optin()));
  set_smem(direct_kernel, smem);
  direct_kernel<<<grid_for(p, Mb), kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace approx_cuda
