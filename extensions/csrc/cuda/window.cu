// expanded_window: convolutions of stride 1, dilation 1 and a 3- or 5-wide kernel (see below).
#include "launch.cuh"
#include "ptx.cuh"

namespace approx_cuda {
namespace {

// expanded_window (conv, stride 1, dilation 1): a thread computes kWinRX neighbouring outputs of
// one output row for one 8-channel group. The block's input planes sit in shared memory, padded
// (padding = code 0's LUT row) and as LUT rows, so the codes of one kernel row for all kWinRX
// outputs are a few aligned 4-byte loads, and each code is one byte_perm away from its lookup.
// The table streams through shared memory one kernel row (KW taps) at a time.
constexpr int kWinThreads = 256;
constexpr int kWinRX = 8;

template <typename TT, int KW>
__device__ __forceinline__ void window_body(const Params& p, uint8_t* smem) {
  constexpr int VPR = sizeof(TT) == 2 ? 1 : 2;
  constexpr int RX = kWinRX, NW = (RX + KW - 1 + 3) / 4, CQ = KW * 256 * VPR;
  const int tid = threadIdx.x, grp = blockIdx.y, ng = blockIdx.z;
  const long long tpi = (long long)p.win.Ho * p.win.seg;  // tasks per image
  const long long t0 = (long long)blockIdx.x * kWinThreads, task = t0 + tid;
  const long long b0 = t0 / tpi;
  const bool live = task < p.win.tasks;
  const long long b = task / tpi;
  const int r = static_cast<int>(task - b * tpi), oy = r / p.win.seg, ox0 = (r - oy * p.win.seg) * RX;
  const int4* Tg = static_cast<const int4*>(p.T) + ((long long)grp * p.NG + ng) * p.Kpad * 256 * VPR;
  int4* buf = reinterpret_cast<int4*>(smem);
  uint8_t* st = smem + 2 * CQ * 16;
  const int plane = p.win.Hp * p.win.Wp, img_bytes = p.Cg * plane;
  const int nchunks = p.Cg * p.win.kh;
  auto copy_chunk = [&](int q) {
    const int4* src = Tg + (long long)q * CQ;
    int4* dst = buf + (q & 1) * CQ;
#pragma unroll 4
    for (int e = tid; e < CQ; e += kWinThreads) cp_async16(dst + e, src + e);
    cp_async_commit();
  };
  copy_chunk(0);
  {
    // Staging: one padded row per step; rows past the images or the padding get code 0.
    const uint32_t xm = 0x01010101u * p.xmask;
    const int rows = p.win.imgs * p.Cg * p.win.Hp, wpr = p.win.Wp >> 2;
    for (int e = tid; e < rows; e += kWinThreads) {
      const int j = e / (p.Cg * p.win.Hp), rem = e - j * (p.Cg * p.win.Hp);
      const int c = rem / p.win.Hp, iy = rem - c * p.win.Hp - p.ph;
      const long long bb = b0 + j;
      const bool rowok = bb * tpi < p.win.tasks && iy >= 0 && iy < p.H;
      const uint8_t* src = p.a + ((bb * p.C + (long long)grp * p.Cg + c) * p.H + (rowok ? iy : 0)) * p.W;
      uint32_t* dst = reinterpret_cast<uint32_t*>(st + (long long)e * p.win.Wp);
      for (int x = 0; x < wpr; ++x) {
        uint32_t word = 0;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int ix = 4 * x + t - p.pw;
          if (rowok && ix >= 0 && ix < p.W) word |= (uint32_t)__ldg(src + ix) << (8 * t);
        }
        dst[x] = word ^ xm;
      }
    }
  }
  const uint8_t* my = st + (live ? (b - b0) * img_bytes + oy * p.win.Wp + ox0 : 0);
  uint32_t s[RX][4], h[RX][4];
#pragma unroll
  for (int i = 0; i < RX; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) s[i][j] = h[i][j] = 0;
  int c = 0, i = 0;  // input channel and kernel row of chunk q
  for (int q = 0; q < nchunks; ++q) {
    cp_async_wait<0>();
    __syncthreads();  // chunk q (and, at q = 0, the staged planes) in; chunk q - 1 done
    if (q + 1 < nchunks) copy_chunk(q + 1);
    const uint32_t* row = reinterpret_cast<const uint32_t*>(my + c * plane + i * p.win.Wp);
    uint32_t w[NW];
#pragma unroll
    for (int t = 0; t < NW; ++t) w[t] = row[t];
    const int4* tb = buf + (q & 1) * CQ;
#pragma unroll
    for (int j = 0; j < KW; ++j)
#pragma unroll
      for (int x = 0; x < RX; ++x) {
        const int pos = x + j;
        const int idx = static_cast<int>(__byte_perm(w[pos >> 2], 0, 0x4440 | (pos & 3)));
        add_row<TT>(tb + (j * 256 + idx) * VPR, s[x], h[x]);
      }
    if (++i == p.win.kh) {
      i = 0;
      ++c;
    }
  }
  if (!live) return;
  const int n0 = ng * 8;
  const long long howo = (long long)p.win.Ho * p.Wo;
  int32_t* o = p.out + ((b * p.Ntot + (long long)grp * p.N + n0) * p.win.Ho + oy) * (long long)p.Wo + ox0;
  uint32_t v[RX][8];
#pragma unroll
  for (int x = 0; x < RX; ++x) finish_row<TT>(s[x], h[x], static_cast<uint32_t>(p.K), v[x]);
  if ((p.Wo & 3) == 0 && ox0 + RX <= p.Wo) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (n0 + j >= p.N) break;
      int4* oj = reinterpret_cast<int4*>(o + j * howo);
      oj[0] = make_int4(v[0][j], v[1][j], v[2][j], v[3][j]);
      oj[1] = make_int4(v[4][j], v[5][j], v[6][j], v[7][j]);
    }
  } else {
#pragma unroll
    for (int x = 0; x < RX; ++x)
      if (ox0 + x < p.Wo)
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (n0 + j < p.N) o[j * howo + x] = static_cast<int32_t>(v[x][j]);
  }
}

template <int KW, int MODE>
__global__ void __launch_bounds__(kWinThreads, 2) window_kernel(Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (MODE == 1 || (MODE == 0 && read_fits16(p.flags)))
    window_body<int16_t, KW>(p, smem);
  else
    window_body<int32_t, KW>(p, smem);
}

}  // namespace

// expanded_window: shared memory of the table chunks (int32 size unless the format is known to be
// int16) plus the staged planes; 0 when the shape is not one it runs.
int64_t window_smem(const Params& p, const ConvGeo& cg, int fmt) {
  if (!p.conv || p.sh != 1 || p.sw != 1 || cg.dh != 1 || cg.dw != 1 || (cg.kw != 3 && cg.kw != 5) ||
      p.NG > 65535)
    return 0;
  const int64_t tbuf = 2 * (int64_t)cg.kw * 256 * 16 * (fmt == 1 ? 1 : 2);
  const int64_t bytes = tbuf + (int64_t)p.win.imgs * p.Cg * p.win.Hp * p.win.Wp;
  return bytes <= max_smem_optin() ? bytes : 0;
}

void set_window_geometry(Params& p, const ConvGeo& cg) {
  p.win.kh = cg.kh;
  p.win.Ho = static_cast<int>(p.HoWo / p.Wo);
  p.win.B = p.M / p.HoWo;
  p.win.seg = (p.Wo + kWinRX - 1) / kWinRX;
  p.win.Hp = p.H + 2 * p.ph;
  const int nw = (kWinRX + cg.kw - 1 + 3) / 4;
  p.win.Wp = static_cast<int>(round_up(std::max(p.W + 2 * p.pw, (p.win.seg - 1) * kWinRX + 4 * nw), 4));
  const int64_t tpi = (int64_t)p.win.Ho * p.win.seg;
  p.win.tasks = p.win.B * tpi;
  p.win.imgs = static_cast<int>(std::min<int64_t>((kWinThreads - 1) / tpi + 2, 1 << 20));
}

template <int KW, int MODE>
void launch_window_t(const Params& p, size_t smem, cudaStream_t stream) {
  auto kern = window_kernel<KW, MODE>;
  set_smem(kern, smem);
  const int64_t bx = (p.win.tasks + kWinThreads - 1) / kWinThreads;
  TORCH_CHECK(bx <= 0x7fffffff, "approx CUDA kernels: too many rows (", I(p.M), ")");
  kern<<<dim3(static_cast<unsigned>(bx), p.G, p.NG), kWinThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int MODE>
void launch_window_m(const Params& p, const ConvGeo& cg, cudaStream_t stream) {
  const size_t smem = window_smem(p, cg, MODE);
  if (cg.kw == 3) launch_window_t<3, MODE>(p, smem, stream);
  else launch_window_t<5, MODE>(p, smem, stream);
}

void launch_window(const Params& p, const ConvGeo& cg, int fmt, cudaStream_t stream) {
  if (fmt == 1) launch_window_m<1>(p, cg, stream);
  else if (fmt == 2) launch_window_m<2>(p, cg, stream);
  else launch_window_m<0>(p, cg, stream);
}
}  // namespace approx_cuda
