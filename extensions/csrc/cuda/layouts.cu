// A conv's codes in auto's GEMM layout (lut_ops.cpp's gemm_layout): the conv as a 1x1 conv of stride 1 over its
// taps, tap k = (c, ky, kx) of output pixel (b, oy, ox) at out[b][k][oy][ox], or folded at out[k][b][oy][ox] (one
// image whose plane is the batch's planes end to end). A tap in the padding is code 0, as every kernel reads it.
// A linear layer's codes [M, K] are the folded copy of M images of 1x1 pixels: [K, M], transposed.
// One pass over the output, 4 bytes a thread, about 0.8 TB/s on an H200 (bound by the per-byte index arithmetic, not
// by memory); PyTorch's strided copy (as_strided, then contiguous) wrote the same bytes at 0.3.
#include "launch.cuh"

namespace approx_cuda {
namespace {

struct LayoutGeo {
  unsigned total;                 // output bytes (< 2^31, a multiple of 4)
  unsigned K, P, BP, KK, kw, Wo, Ho;
  FastDiv fK, fP, fBP, fKK, fkw, fWo;
  int H, W, sh, sw, ph, pw, dh, dw;
  long long CHW, HW;
  bool folded;
};

__global__ void gemm_layout_kernel(const uint8_t* __restrict__ a, uint32_t* __restrict__ out, LayoutGeo g) {
  const unsigned o = 4u * (blockIdx.x * blockDim.x + threadIdx.x);
  if (o >= g.total) return;
  // the word's first byte: tap k and image b; j its pixel within the run of pixels that share k (and b unfolded),
  // whose length is a multiple of 4, so that the word's 4 bytes share k
  unsigned k, b, j;
  if (g.folded) {
    k = fdiv(o, g.fBP);
    j = o - k * g.BP;
    b = fdiv(j, g.fP);
    j -= b * g.P;
  } else {
    const unsigned r = fdiv(o, g.fP);
    j = o - r * g.P;
    b = fdiv(r, g.fK);
    k = r - b * g.K;
  }
  unsigned oy = fdiv(j, g.fWo), ox = j - oy * g.Wo;
  const unsigned c = fdiv(k, g.fKK), rk = k - c * g.KK, ky = fdiv(rk, g.fkw), kx = rk - ky * g.kw;
  const int dy = static_cast<int>(ky) * g.dh - g.ph, dx = static_cast<int>(kx) * g.dw - g.pw;
  const uint8_t* plane = a + b * g.CHW + c * g.HW;
  uint32_t word = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int iy = static_cast<int>(oy) * g.sh + dy, ix = static_cast<int>(ox) * g.sw + dx;
    if ((unsigned)iy < (unsigned)g.H && (unsigned)ix < (unsigned)g.W)
      word |= static_cast<uint32_t>(__ldg(plane + iy * g.W + ix)) << (8 * i);
    if (++ox == g.Wo) {  // folded: the next pixel may be the next image's
      ox = 0;
      if (++oy == g.Ho) oy = 0, plane += g.CHW;
    }
  }
  out[o / 4] = word;
}

}  // namespace

void launch_gemm_layout(const at::Tensor& a, at::Tensor& out, const approx_checks::ConvShape& s, bool folded,
                        cudaStream_t stream) {
  const long long total = out.numel(), plane = s.Ho * s.Wo;
  TORCH_CHECK(total == s.B * s.K * plane && total < (1ll << 31) && total % 4 == 0 && s.groups == 1 &&
                  (folded ? s.B * plane : plane) % 4 == 0,
              "approx CUDA: bad GEMM layout of a conv's codes");
  if (total == 0) return;
  LayoutGeo g{};
  g.total = static_cast<unsigned>(total);
  g.K = static_cast<unsigned>(s.K);
  g.P = static_cast<unsigned>(plane);
  g.BP = static_cast<unsigned>(s.B * plane);
  g.KK = static_cast<unsigned>(s.kh * s.kw);
  g.kw = static_cast<unsigned>(s.kw);
  g.Wo = static_cast<unsigned>(s.Wo);
  g.Ho = static_cast<unsigned>(s.Ho);
  g.fK = make_fastdiv(g.K);
  g.fP = make_fastdiv(g.P);
  g.fBP = make_fastdiv(g.BP);
  g.fKK = make_fastdiv(g.KK);
  g.fkw = make_fastdiv(g.kw);
  g.fWo = make_fastdiv(g.Wo);
  g.H = static_cast<int>(s.H);
  g.W = static_cast<int>(s.W);
  g.sh = static_cast<int>(s.sh);
  g.sw = static_cast<int>(s.sw);
  g.ph = static_cast<int>(s.ph);
  g.pw = static_cast<int>(s.pw);
  g.dh = static_cast<int>(s.dh);
  g.dw = static_cast<int>(s.dw);
  g.HW = s.H * s.W;
  g.CHW = s.C * g.HW;
  g.folded = folded;
  constexpr int kThreads = 256;
  const long long blocks = (total / 4 + kThreads - 1) / kThreads;
  gemm_layout_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const uint8_t*>(a.data_ptr()), reinterpret_cast<uint32_t*>(out.data_ptr()), g);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace approx_cuda
