// A conv's codes in auto's GEMM layout (lut_ops.cpp's gemm_layout): the conv as a 1x1 conv of stride 1 over its
// taps, tap k = (c, ky, kx) of output pixel (b, oy, ox) at out[b][k][oy][ox], or folded at out[k][b][oy][ox] (one
// image whose plane is the batch's planes end to end). A tap in the padding is code 0, as every kernel reads it.
// A linear layer's codes [M, K] are the folded copy of M images of 1x1 pixels: [K, M], transposed.
// One pass over the output, 4 bytes a thread, about 0.8 TB/s on an H200 (bound by the per-byte index arithmetic, not
// by memory); PyTorch's strided copy (as_strided, then contiguous) wrote the same bytes at 0.3. A KxK conv's taps
// unfolded go by planes instead (gemm_layout_planes_kernel): at 0.8 TB/s the copy had cost ResNet-50's 3x3 convs
// on 28x28 outputs 7 % of their time at batch 64 and 10 % at 256.
#include <algorithm>

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
  // planes kernel: the windows' span, Hp rows of Wq bytes (a multiple of 4), the input's columns from byte L (a
  // multiple of 4) of its rows ph .. ph + rows - 1
  unsigned Hp, Wq, L, rows;
  FastDiv fRow;     // a row's loads: W / 4 words where words, else W bytes
  bool words;       // the rows 4-byte aligned
};

// The span's bytes in shared memory: its n, 16-byte aligned, and a word's three reads past its last byte (any byte)
__host__ __device__ constexpr unsigned span_area(unsigned n) { return ((n + 15) & ~15u) + 16; }

// Unfolded taps, a block an input plane (image b, channel c): the plane's rows straight into their windows' span in
// shared memory (zeroed first: the padding; 4-byte loads and stores where the rows are 4-byte aligned, several in
// flight a thread), then the plane's KK x P output bytes, which lie together (out[b][c KK + rk][P], K = C KK), as
// words, their 4 bytes read from shared memory without bounds tests, at stride 1 or 2 as two or three words shifted
// together (from two rows where the word crosses one). The span's rows are Wq bytes (a multiple of 4) with the
// input's columns from byte L = pw rounded up to 4, so a row's words land whole: building the span byte by byte from
// a copy of the plane (a division and a bounds test a byte) had cost as many instructions as the output words.
__global__ void gemm_layout_planes_kernel(const uint8_t* __restrict__ a, uint32_t* __restrict__ out, LayoutGeo g) {
  extern __shared__ uint8_t span[];  // [Hp][Wq]: row y, column x is input (y - ph, x - L)
  constexpr int kIn = 4;             // loads in flight a thread
  const long long plane = blockIdx.x;  // b C + c
  const uint8_t* src = a + plane * g.HW;
  const unsigned th = blockDim.x, Wq = g.Wq;
  uint32_t* span4 = reinterpret_cast<uint32_t*>(span);
  for (unsigned i = threadIdx.x; i < g.Hp * Wq / 4; i += th) span4[i] = 0;
  __syncthreads();
  if (g.words) {  // W % 4 == 0, a 4-byte aligned: a row's words to whole words of its span row
    const unsigned W4 = g.W / 4, n = g.rows * W4;
    const uint32_t* s4 = reinterpret_cast<const uint32_t*>(src);
    for (unsigned i0 = threadIdx.x; i0 < n; i0 += kIn * th) {
      uint32_t v[kIn];
#pragma unroll
      for (int u = 0; u < kIn; ++u) v[u] = i0 + u * th < n ? __ldg(s4 + i0 + u * th) : 0u;
#pragma unroll
      for (int u = 0; u < kIn; ++u) {
        const unsigned i = i0 + u * th, iy = fdiv(i, g.fRow);
        if (i < n) span4[((iy + g.ph) * Wq + g.L) / 4 + i - iy * W4] = v[u];
      }
    }
  } else {
    const unsigned n = g.rows * g.W;
    for (unsigned i0 = threadIdx.x; i0 < n; i0 += kIn * th) {
      uint8_t v[kIn];
#pragma unroll
      for (int u = 0; u < kIn; ++u) v[u] = i0 + u * th < n ? __ldg(src + i0 + u * th) : 0;
#pragma unroll
      for (int u = 0; u < kIn; ++u) {
        const unsigned i = i0 + u * th, iy = fdiv(i, g.fRow);
        if (i < n) span[(iy + g.ph) * Wq + g.L + i - iy * g.W] = v[u];
      }
    }
  }
  __syncthreads();
  const unsigned words = g.KK * g.P / 4;  // P % 4 == 0: a word's bytes share their tap
  uint32_t* dst = out + plane * words;
  // a word's bytes at stride 1 or 2 from span byte s: 4 or 7 bytes out of three aligned words
  auto take = [&](unsigned s) {
    const uint32_t* w4 = reinterpret_cast<const uint32_t*>(span) + (s >> 2);
    const unsigned sh = 8 * (s & 3);
    const uint32_t lo = __funnelshift_r(w4[0], w4[1], sh);
    return g.sw == 1 ? lo : __byte_perm(lo, __funnelshift_r(w4[1], w4[2], sh), 0x6420);
  };
  if (g.sw <= 2 && g.Wo % 4 == 0) {
    // rows of whole words: a thread takes one word column (tap rk, word xw of a row) every R-th row from r0, its span
    // byte and output word stepped by constants (a word's divisions had left the copy bound by instructions: at its
    // rate, up to about 120 a word)
    const unsigned W4 = g.Wo / 4, cols = g.KK * W4, R = max(1u, th / cols);
    for (unsigned item = threadIdx.x; item < cols * R; item += th) {
      const unsigned r0 = item / cols, c = item - r0 * cols, rk = c / W4, xw = c - rk * W4;
      const unsigned ky = rk / g.kw, kx = rk - ky * g.kw;
      unsigned s = (r0 * g.sh + ky * g.dh) * Wq + kx * g.dw + g.L - g.pw + 4 * xw * g.sw;
      uint32_t* d = dst + rk * (g.P / 4) + r0 * W4 + xw;
      const unsigned ds = R * g.sh * Wq, dd = R * W4;
#pragma unroll 4
      for (unsigned oy = r0; oy < g.Ho; oy += R, s += ds, d += dd) *d = take(s);
    }
    return;
  }
  for (unsigned wi = threadIdx.x; wi < words; wi += th) {
    const unsigned j0 = 4 * wi, rk = fdiv(j0, g.fP), j = j0 - rk * g.P;
    const unsigned oy = fdiv(j, g.fWo), ky = fdiv(rk, g.fkw), kx = rk - ky * g.kw;
    unsigned ox = j - oy * g.Wo;
    const unsigned at = (oy * g.sh + ky * g.dh) * Wq + kx * g.dw + g.L - g.pw;  // the span index of column 0's byte
    uint32_t word = 0;
    if (g.sw <= 2 && g.Wo >= 4) {
      word = take(at + ox * g.sw);
      // a word across two output rows (Wo % 4 != 0, e.g. 14x14 outputs): its first k bytes from this row, the rest
      // from the next row's first columns (taking them byte by byte had split a warp between two paths)
      const unsigned k = g.Wo - ox;
      if (k < 4) word = (word & ((1u << (8 * k)) - 1)) | (take(at + g.sh * Wq) << (8 * k));
    } else {
      const uint8_t* row = span + at;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        word |= static_cast<uint32_t>(row[ox * g.sw]) << (8 * i);
        if (++ox == g.Wo) ox = 0, row += g.sh * Wq;
      }
    }
    dst[wi] = word;
  }
}

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
  g.Hp = static_cast<unsigned>((s.Ho - 1) * s.sh + (s.kh - 1) * s.dh + 1);
  g.L = static_cast<unsigned>(round_up(s.pw, 4));
  const int64_t span_w = (s.Wo - 1) * s.sw + (s.kw - 1) * s.dw - s.pw + 1 + g.L;  // past the last window's byte
  g.Wq = static_cast<unsigned>(round_up(std::max(span_w, g.L + s.W), 4));
  g.rows = static_cast<unsigned>(std::max<int64_t>(0, std::min<int64_t>(s.H, g.Hp - s.ph)));
  // by planes: KxK taps unfolded, where a plane's span fits the default 48 KiB of shared memory (a 1x1 conv's
  // samples are 1 / stride^2 of its input: the planes' span would read it all to write that)
  const long long span_bytes = span_area(g.Hp * g.Wq);
  if (!folded && g.KK > 1 && span_bytes <= 48 * 1024) {
    g.words = s.W % 4 == 0 && reinterpret_cast<uintptr_t>(a.data_ptr()) % 4 == 0;
    g.fRow = make_fastdiv(static_cast<unsigned>(g.words ? s.W / 4 : s.W));
    // a block's threads by its output words, 7-14 a thread: on an H200 at batch 64, 441 words (ResNet-50's 14x14
    // outputs) took 0.69-0.73 of 256 threads' time at 64, 1,764 (28x28) 0.81-0.86 of 128's and 0.74-0.78 of 512's at
    // 256, 7,056 (56x56) 0.86 of 256's at 512 (benchmarks/imagenet.md, "The taps' rows straight into their span")
    const unsigned words = g.KK * g.P / 4, threads = words <= 512 ? 64 : words <= 4096 ? 256 : 512;
    gemm_layout_planes_kernel<<<static_cast<unsigned>(s.B * s.C), threads, span_bytes, stream>>>(
        reinterpret_cast<const uint8_t*>(a.data_ptr()), reinterpret_cast<uint32_t*>(out.data_ptr()), g);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const long long blocks = (total / 4 + kThreads - 1) / kThreads;
  gemm_layout_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      reinterpret_cast<const uint8_t*>(a.data_ptr()), reinterpret_cast<uint32_t*>(out.data_ptr()), g);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace approx_cuda
