// depthwise: convolutions with one input and one output channel per group (MobileNet's depthwise
// 3x3, any kernel size up to 7x7, stride, padding and dilation).
//
// A depthwise layer does only kh * kw MACs per output, so it is bound by moving its codes and
// accumulators, not by lookups; the implicit-GEMM kernels, built for long reductions over many
// output channels, ran it at 0.25-0.76 T MAC/s (8 channels per table row, 7 of them empty). Here a
// block owns one channel: it gathers that channel's kh * kw columns of the effective product table
// E (one 256-entry row of products per tap, 1 KiB each) into shared memory once, and each thread then
// computes whole outputs, one lookup per tap, reading its codes straight from global memory (a warp
// reads neighbouring pixels of one row: coalesced) and writing its int32 accumulator once. No
// weight-expanded table T is built (table = false in algos.cpp), so training calls, whose weights
// change every step, pay nothing extra either.
#include <algorithm>

#include "launch.cuh"

namespace approx_cuda {
namespace {

constexpr int kDwThreads = 256;
constexpr int kDwMaxTaps = 49;
// Blocks aimed at per SM: enough to hide the global loads; more blocks per channel would only
// gather the same table columns again.
constexpr int kDwBlocksPerSM = 8;

struct DwGeo {
  int kh, kw, dh, dw;
  int bpc;  // blocks per channel (grid.x); block j takes outputs j, j + bpc * 256 threads, ...
};

// KH, KW > 0: the kernel size at compile time (3x3: every tap's load issued at once, unrolled);
// 0: read from g (any size up to kDwMaxTaps).
template <int KH, int KW>
__global__ void __launch_bounds__(kDwThreads) depthwise_kernel(Params p, DwGeo g) {
  extern __shared__ __align__(16) int32_t Ts[];  // [tap][LUT row of the code]
  const int kh = KH ? KH : g.kh, kw = KW ? KW : g.kw;
  const int ch = blockIdx.y, taps = kh * kw, tid = threadIdx.x;
  const int8_t* wch = p.w + (long long)ch * p.K;
  for (int e = tid; e < taps * 256; e += kDwThreads) {
    const int k = e >> 8, row = e & 255;
    Ts[e] = __ldg(p.E32 + row * 256 + (static_cast<int>(wch[k]) + 128));
  }
  __syncthreads();
  const uint8_t* plane = p.a + (long long)ch * p.H * p.W;  // image b's plane: + b * C * H * W
  const long long img = (long long)p.C * p.H * p.W, oimg = (long long)p.Ntot * p.HoWo;
  const unsigned pad_row = p.xmask;  // padding reads code 0, whose LUT row is 0 ^ xmask
  const unsigned stride = static_cast<unsigned>(g.bpc) * kDwThreads;
  for (unsigned t = blockIdx.x * kDwThreads + tid; t < static_cast<unsigned>(p.M); t += stride) {
    const unsigned b = fdiv(t, p.fHoWo), pix = t - b * static_cast<unsigned>(p.HoWo);
    const int oy = static_cast<int>(fdiv(pix, p.fWo)), ox = static_cast<int>(pix) - oy * p.Wo;
    const uint8_t* src = plane + b * img;
    const int y0 = oy * p.sh - p.ph, x0 = ox * p.sw - p.pw;
    unsigned rows[KH && KW ? KH * KW : 1];
    uint32_t acc = 0;  // wraps like every kernel's accumulator (the checks bound the real sums)
    if constexpr (KH > 0 && KW > 0) {
      // all loads first, then all lookups: the loads overlap instead of waiting one by one
#pragma unroll
      for (int ky = 0; ky < KH; ++ky) {
        const int iy = y0 + ky * g.dh;
        const bool rowok = iy >= 0 && iy < p.H;
#pragma unroll
        for (int kx = 0; kx < KW; ++kx) {
          const int ix = x0 + kx * g.dw;
          rows[ky * KW + kx] =
              rowok && ix >= 0 && ix < p.W ? (__ldg(src + iy * p.W + ix) ^ p.xmask) : pad_row;
        }
      }
#pragma unroll
      for (int k = 0; k < KH * KW; ++k) acc += static_cast<uint32_t>(Ts[k * 256 + rows[k]]);
    } else {
      for (int ky = 0; ky < kh; ++ky) {
        const int iy = y0 + ky * g.dh;
        const bool rowok = iy >= 0 && iy < p.H;
        const int32_t* trow = Ts + ky * kw * 256;
        for (int kx = 0; kx < kw; ++kx) {
          const int ix = x0 + kx * g.dw;
          const unsigned row =
              rowok && ix >= 0 && ix < p.W ? (__ldg(src + iy * p.W + ix) ^ p.xmask) : pad_row;
          acc += static_cast<uint32_t>(trow[kx * 256 + row]);
        }
      }
    }
    p.out[b * oimg + (long long)ch * p.HoWo + pix] = static_cast<int32_t>(acc);
  }
}

}  // namespace

std::string depthwise_why_not(const Params& p, const ConvGeo& cg) {
  if (!p.conv || p.N != 1 || p.Cg != 1)
    return "needs a depthwise conv (one input and one output channel per group)";
  if (cg.kh * cg.kw > kDwMaxTaps) return "needs a kernel of at most 49 taps (7x7)";
  if (p.M >= (1ll << 31)) return "needs fewer than 2^31 output pixels per channel";
  return "";
}

void launch_depthwise(const Params& p, const ConvGeo& cg, cudaStream_t stream) {
  const long long per_block = kDwThreads;
  const long long want = (long long)kDwBlocksPerSM * sm_count() / p.G + 1;
  const long long most = (p.M + per_block - 1) / per_block;
  DwGeo g{cg.kh, cg.kw, cg.dh, cg.dw, static_cast<int>(std::max(1ll, std::min(want, most)))};
  const size_t smem = (size_t)cg.kh * cg.kw * 256 * sizeof(int32_t);
  const dim3 grid(g.bpc, p.G);
  if (cg.kh == 3 && cg.kw == 3) {
    set_smem(depthwise_kernel<3, 3>, smem);
    depthwise_kernel<3, 3><<<grid, kDwThreads, smem, stream>>>(p, g);
  } else {
    set_smem(depthwise_kernel<0, 0>, smem);
    depthwise_kernel<0, 0><<<grid, kDwThreads, smem, stream>>>(p, g);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace approx_cuda
