// expanded_window: convolutions of dilation 1 with a 3- or 5-wide kernel at stride 1, a 1- or
// 3-wide one at stride 2, or 1x1 (see below).
#include "launch.cuh"
#include "ptx.cuh"
#include "quant_math.cuh"

namespace approx_cuda {
namespace {

// expanded_window (conv, dilation 1): a thread computes RX neighbouring outputs of one output row
// for one 8-channel group (RX = 8, or 7 or 5 where fewer outputs past the row's end are computed
// for nothing: LeNet's classic 10-wide conv2 rows, the 28- and 14-wide rows of 28x28 inputs).
// The block's input planes sit in shared memory, padded (padding = code 0's LUT row) and as LUT
// rows, so the codes of one kernel row for all RX outputs are a few 4-byte loads, and each code
// is one byte_perm away from its lookup. The table streams
// through shared memory one kernel row (KW taps) at a time. The planes are staged `cc` channels at
// a time (all of the group's channels where they fit): small planes with many channels (ResNet's
// 8x8 stage with 64 channels) put 33 images in a block, whose planes do not fit shared memory at
// once; a smaller cc also lets two blocks share an SM.
constexpr int kWinThreads = 256;

// CHUNKED: cc < Cg, so the planes are restaged inside the tap loop. A separate instantiation: the
// restaging code costs registers (28 bytes of spills in the int16 3x3 kernel), which the shapes whose
// channels fit at once (LeNet's, ResNet's first stages) do not pay.
// CP: channels a table chunk covers. 1, or 4 for 1x1 convs (Cg % 4 == 0): a chunk of one 1x1 tap gives each
// thread only RX lookups between two barriers.
// EPI: the layer's end in the stores (Params::epi; 0: the int32 sums), its own instantiation.
template <int RX, int EPI>
__device__ __forceinline__ void window_end(const Params& p, const uint32_t (&v)[RX][8], long long base, int ch0,
                                           int nch, int ox0);

// The int32 sums of outputs ox0..ox0+RX-1 (those inside the row) of channels n0..n0+7 (those below N) at o.
template <int RX>
__device__ __forceinline__ void window_sums(const Params& p, const uint32_t (&v)[RX][8], int32_t* o, long long howo,
                                            int n0, int ox0) {
  if constexpr (RX == 8) {
    if ((p.Wo & 3) == 0 && ox0 + RX <= p.Wo) {  // whole aligned 8-output rows: two 16-byte stores
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (n0 + j >= p.N) break;
        int4* oj = reinterpret_cast<int4*>(o + j * howo);
        oj[0] = make_int4(v[0][j], v[1][j], v[2][j], v[3][j]);
        oj[1] = make_int4(v[4][j], v[5][j], v[6][j], v[7][j]);
      }
      return;
    }
  }
#pragma unroll
  for (int x = 0; x < RX; ++x)
    if (ox0 + x < p.Wo)
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (n0 + j < p.N) o[j * howo + x] = static_cast<int32_t>(v[x][j]);
}

template <typename TT, int KW, int SW, int RX, bool CHUNKED, int CP, int EPI>
__device__ __forceinline__ void window_body(const Params& p, int cc, uint8_t* smem) {
  constexpr int VPR = sizeof(TT) == 2 ? 1 : 2;
  constexpr int NW = (SW * (RX - 1) + KW + 3) / 4, CQ = KW * CP * 256 * VPR;
  // a thread's first input column is 4-byte aligned when RX * SW is a multiple of 4; otherwise its
  // words are loaded from the aligned column below and funnel-shifted into place
  constexpr bool kAligned = (RX * SW) % 4 == 0;
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
  const int plane = p.win.Hp * p.win.Wp, img_bytes = cc * plane;
  const int nchunks = p.Cg * p.win.kh / CP;  // CP > 1: kh 1, Cg % CP == 0 (window_cp)
  auto copy_chunk = [&](int q) {
    const int4* src = Tg + (long long)q * CQ;
    int4* dst = buf + (q & 1) * CQ;
#pragma unroll 4
    for (int e = tid; e < CQ; e += kWinThreads) cp_async16(dst + e, src + e);
    cp_async_commit();
  };
  // Stages channels [c0, c0 + cc) of the block's images: one padded row per step; rows past the
  // images, the group's channels or the padding get code 0.
  auto stage = [&](int c0) {
    const uint32_t xm = 0x01010101u * p.xmask;
    const int rows = p.win.imgs * cc * p.win.Hp, wpr = p.win.Wp >> 2;
    for (int e = tid; e < rows; e += kWinThreads) {
      const int j = e / (cc * p.win.Hp), rem = e - j * (cc * p.win.Hp);
      const int c = rem / p.win.Hp, iy = rem - c * p.win.Hp - p.ph;
      const long long bb = b0 + j;
      const bool rowok = bb * tpi < p.win.tasks && c0 + c < p.Cg && iy >= 0 && iy < p.H;
      const uint8_t* src =
          p.a + (rowok ? ((bb * p.C + (long long)grp * p.Cg + c0 + c) * p.H + iy) * p.W : 0);
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
  };
  copy_chunk(0);
  stage(0);
  const int xoff = ox0 * SW, xal = kAligned ? xoff : (xoff & ~3);
  const unsigned xsh = kAligned ? 0u : 8u * static_cast<unsigned>(xoff & 3);
  const uint8_t* my = st + (live ? (b - b0) * img_bytes + oy * p.sh * p.win.Wp + xal : 0);
  uint32_t s[RX][4], h[RX][4];
#pragma unroll
  for (int i = 0; i < RX; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) s[i][j] = h[i][j] = 0;
  int c = 0, i = 0;  // input channel (within the staged ones) and kernel row of chunk q
  for (int q = 0; q < nchunks; ++q) {
    cp_async_wait<0>();
    __syncthreads();  // chunk q (and, at q = 0, the staged planes) in; chunk q - 1 done
    if (q + 1 < nchunks) copy_chunk(q + 1);
    if constexpr (CHUNKED) {
      if (c == cc) {  // every thread is past the staged channels (the barrier above): the next ones
        stage(q * CP / p.win.kh);
        c = 0;
        __syncthreads();
      }
    }
    const int4* tb = buf + (q & 1) * CQ;
#pragma unroll
    for (int cp = 0; cp < CP; ++cp) {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(my + (c + cp) * plane + i * p.win.Wp);
      uint32_t w[NW];
      if constexpr (kAligned) {
#pragma unroll
        for (int t = 0; t < NW; ++t) w[t] = row[t];
      } else {
        uint32_t raw[NW + 1];
#pragma unroll
        for (int t = 0; t <= NW; ++t) raw[t] = row[t];
#pragma unroll
        for (int t = 0; t < NW; ++t) w[t] = __funnelshift_r(raw[t], raw[t + 1], xsh);
      }
#pragma unroll
      for (int j = 0; j < KW; ++j)
#pragma unroll
        for (int x = 0; x < RX; ++x) {
          const int pos = SW * x + j;
          const int idx = static_cast<int>(__byte_perm(w[pos >> 2], 0, 0x4440 | (pos & 3)));
          add_row<TT>(tb + ((cp * KW + j) * 256 + idx) * VPR, s[x], h[x]);
        }
    }
    if constexpr (CP > 1) {
      c += CP;
    } else if (++i == p.win.kh) {
      i = 0;
      ++c;
    }
  }
  if (!live) return;
  const int n0 = ng * 8;
  const long long howo = (long long)p.win.Ho * p.Wo;
  const long long obase = ((b * p.Ntot + (long long)grp * p.N + n0) * p.win.Ho + oy) * (long long)p.Wo + ox0;
  int32_t* const o = p.out + obase;
  uint32_t v[RX][8];
#pragma unroll
  for (int x = 0; x < RX; ++x) finish_row<TT>(s[x], h[x], static_cast<uint32_t>(p.K), v[x]);
  if constexpr (EPI != 0) window_end<RX, EPI>(p, v, obase, grp * p.N + n0, min(8, p.N - n0), ox0);
  else window_sums<RX>(p, v, o, howo, n0, ox0);
}

// The end of outputs ox0..ox0+RX-1 (those inside the row) of channels ch0..ch0+nch-1 at base (the int32 sums'
// index of channel ch0, output ox0): approx::dequantize's or approx::requantize_codes' arithmetic per value
// (quant_math.cuh), 16-byte stores of 4 outputs where a whole aligned run of 8 is in the row (Params::epi.vec).
template <int RX, int EPI>
__device__ __forceinline__ void window_end(const Params& p, const uint32_t (&v)[RX][8], long long base, int ch0,
                                           int nch, int ox0) {
  const Epi& e = p.epi;
  const long long howo = p.HoWo;
  const bool whole = RX == 8 && e.vec && (p.Wo & 3) == 0 && ox0 + RX <= p.Wo;
  const float a = EPI == 1 ? *e.act_scale : 0.f;
  const CodesOut co{e.codes_scale, e.cqmin, e.cqmax};
  const float inv = EPI == 1 ? co.inv() : 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j >= nch) break;
    const int ch = ch0 + j;
    const long long at = base + j * howo;
    if constexpr (EPI == 1) {
      const float scale = __fmul_rn(a, e.wscale[ch]), bj = e.bias[ch];
      const bool add = e.residual != nullptr;
      float f[RX];
      if (whole) {
#pragma unroll
        for (int q = 0; q < RX; q += 4) {
          const float4 r =
              add ? *reinterpret_cast<const float4*>(e.residual + at + q) : make_float4(0.f, 0.f, 0.f, 0.f);
          f[q] = dequant_one(static_cast<int32_t>(v[q][j]), scale, bj, add, r.x, e.relu);
          f[q + 1] = dequant_one(static_cast<int32_t>(v[q + 1][j]), scale, bj, add, r.y, e.relu);
          f[q + 2] = dequant_one(static_cast<int32_t>(v[q + 2][j]), scale, bj, add, r.z, e.relu);
          f[q + 3] = dequant_one(static_cast<int32_t>(v[q + 3][j]), scale, bj, add, r.w, e.relu);
          *reinterpret_cast<float4*>(e.outf + at + q) = make_float4(f[q], f[q + 1], f[q + 2], f[q + 3]);
          if (e.codes)
            *reinterpret_cast<uint32_t*>(e.codes + at + q) =
                co.byte(f[q], inv) | co.byte(f[q + 1], inv) << 8 | co.byte(f[q + 2], inv) << 16 |
                co.byte(f[q + 3], inv) << 24;
        }
        continue;
      }
#pragma unroll
      for (int x = 0; x < RX; ++x) {
        if (ox0 + x >= p.Wo) break;
        end_one<1>(e, at + x, static_cast<int32_t>(v[x][j]), scale, bj, co, inv, 0, 0, 0);
      }
    } else {
      const int32_t qb = e.qbias[ch], m = e.mult[ch], sh = e.shift[ch];
      auto code = [&](int x) {
        return static_cast<uint32_t>(requant_code(static_cast<int32_t>(v[x][j]), qb, m, sh, e.qmin, e.qmax)) & 0xFFu;
      };
      if (whole) {
#pragma unroll
        for (int q = 0; q < RX; q += 4)
          *reinterpret_cast<uint32_t*>(e.codes + at + q) =
              code(q) | code(q + 1) << 8 | code(q + 2) << 16 | code(q + 3) << 24;
        continue;
      }
#pragma unroll
      for (int x = 0; x < RX; ++x) {
        if (ox0 + x >= p.Wo) break;
        end_one<2>(e, at + x, static_cast<int32_t>(v[x][j]), 0.f, 0.f, co, inv, qb, m, sh);
      }
    }
  }
}

template <int KW, int SW, int RX, int MODE, bool CHUNKED, int CP, int EPI>
__global__ void __launch_bounds__(kWinThreads, 2) window_kernel(Params p, int cc) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (MODE == 1 || (MODE == 0 && read_fits16(p.flags)))
    window_body<int16_t, KW, SW, RX, CHUNKED, CP, EPI>(p, cc, smem);
  else
    window_body<int32_t, KW, SW, RX, CHUNKED, CP, EPI>(p, cc, smem);
}

// The kernel width the table row of a chunk holds (K = Cg * kh * kw).
int window_kw(const Params& p) { return p.K / (p.Cg * p.win.kh); }

bool window_shape(const Params& p, const ConvGeo& cg) {
  if (!p.conv || cg.dh != 1 || cg.dw != 1 || (p.sh != 1 && p.sh != 2) || p.NG > 65535) return false;
  if (p.sw == 1) return cg.kw == 1 || cg.kw == 3 || cg.kw == 5;
  return p.sw == 2 && (cg.kw == 1 || cg.kw == 3);
}

// Shared memory of the table chunks (int32 size unless the format is known to be int16) plus cc
// staged channels of the block's images.
int window_cp(const Params& p, int kw) { return kw == 1 && p.win.kh == 1 && p.Cg % 4 == 0 ? 4 : 1; }

int64_t window_bytes(const Params& p, int kw, int fmt, int cc) {
  const int64_t tbuf = 2 * (int64_t)kw * window_cp(p, kw) * 256 * 16 * (fmt == 1 ? 1 : 2);
  return tbuf + (int64_t)p.win.imgs * cc * p.win.Hp * p.win.Wp;
}

// The most channels (<= Cg) staged at once within `budget` bytes; 0 if not even one fits.
int window_cc(const Params& p, int kw, int fmt, int64_t budget) {
  const int64_t per = (int64_t)p.win.imgs * p.win.Hp * p.win.Wp, room = budget - window_bytes(p, kw, fmt, 0);
  const int cp = window_cp(p, kw);
  if (room < per * cp) return 0;
  const int64_t cc = std::min<int64_t>(p.Cg, room / per);
  return static_cast<int>(cc == p.Cg ? cc : cc / cp * cp);  // whole chunks of channels
}

}  // namespace

int64_t window_smem(const Params& p, const ConvGeo& cg, int fmt) {
  if (!window_shape(p, cg)) return 0;
  const int cc = window_cc(p, cg.kw, fmt, max_smem_optin());
  return cc ? window_bytes(p, cg.kw, fmt, cc) : 0;
}

namespace {

// p.win for rx outputs a thread (p.win.kh set)
void window_geometry(Params& p, int kw, int rx) {
  p.win.rx = rx;
  p.win.seg = (p.Wo + rx - 1) / rx;
  p.win.Hp = p.H + 2 * p.ph;
  const int nw = (p.sw * (rx - 1) + kw + 3) / 4;  // words of a thread's kernel row
  const int extra = (rx * p.sw) % 4 ? 4 : 0;      // the word loaded below an unaligned start
  p.win.Wp = static_cast<int>(
      round_up(std::max(p.W + 2 * p.pw, (p.win.seg - 1) * rx * p.sw + 4 * nw + extra), 4));
  const int64_t tpi = (int64_t)p.win.Ho * p.win.seg;
  p.win.tasks = p.win.B * tpi;
  p.win.imgs = static_cast<int>(std::min<int64_t>((kWinThreads - 1) / tpi + 2, 1 << 20));
}

// 7 or 5 outputs a thread where that computes fewer past the row's end than 8 (3- and 5-wide
// kernels at stride 1); 0 where 8 is best or the only choice. Not always faster: their stores are
// not 16-byte vectors, which costs where few taps make each output (a 28-wide LeNet conv1 row ran
// at 2.4 T MAC/s with 7, 3.3 with 8), so auto times both.
int window_alt_rx(const Params& p, int kw) {
  if (p.sw != 1 || (kw != 3 && kw != 5)) return 0;
  auto padded = [&](int rx) { return (p.Wo + rx - 1) / rx * rx; };
  int rx = 8;
  for (int r : {7, 5})
    if (padded(r) < padded(rx)) rx = r;
  return rx == 8 ? 0 : rx;
}

}  // namespace

std::vector<Config> window_candidates(const Params& p, int fmt) {
  // Per outputs a thread (8, and 7 or 5 where they compute less): as many channels staged at once
  // as fit (one block an SM where that takes over half of shared memory), and as many as leave
  // room for two blocks an SM. auto's trial decides.
  const int kw = window_kw(p), optin = max_smem_optin(), alt = window_alt_rx(p, kw);
  std::vector<Config> out;
  for (int rx : {8, alt}) {
    if (rx == 0) continue;
    Params q = p;
    if (rx != q.win.rx) window_geometry(q, kw, rx);
    const int all = window_cc(q, kw, fmt, optin), two = window_cc(q, kw, fmt, optin / 2 - 1024);
    Config c;
    c.rx = rx == 8 ? 0 : rx;
    if (all > 0) out.push_back(c);  // cc 0: as many as fit
    if (two > 0 && two < all) {
      c.cc = two;
      out.push_back(c);
    }
  }
  return out;
}

void set_window_geometry(Params& p, const ConvGeo& cg) {
  p.win.kh = cg.kh;
  p.win.Ho = static_cast<int>(p.HoWo / p.Wo);
  p.win.B = p.M / p.HoWo;
  window_geometry(p, cg.kw, 8);  // the default; launch_window redoes it for a configuration's rx
}

template <int KW, int SW, int RX, int MODE, int CP, int EPI>
void launch_window_e(const Params& p, int cc, cudaStream_t stream) {
  auto kern = cc < p.Cg ? window_kernel<KW, SW, RX, MODE, true, CP, EPI>
                        : window_kernel<KW, SW, RX, MODE, false, CP, EPI>;
  const size_t smem = window_bytes(p, KW, MODE, cc);
  set_smem(kern, smem);
  const int64_t bx = (p.win.tasks + kWinThreads - 1) / kWinThreads;
  TORCH_CHECK(bx <= 0x7fffffff, "approx CUDA kernels: too many rows (", I(p.M), ")");
  kern<<<dim3(static_cast<unsigned>(bx), p.G, p.NG), kWinThreads, smem, stream>>>(p, cc);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int KW, int SW, int RX, int MODE, int CP = 1>
void launch_window_t(const Params& p, int cc, cudaStream_t stream) {
  if (p.epi.kind == 1) launch_window_e<KW, SW, RX, MODE, CP, 1>(p, cc, stream);
  else if (p.epi.kind == 2) launch_window_e<KW, SW, RX, MODE, CP, 2>(p, cc, stream);
  else launch_window_e<KW, SW, RX, MODE, CP, 0>(p, cc, stream);
}

template <int MODE>
void launch_window_m(const Params& p, const ConvGeo& cg, int cc, cudaStream_t stream) {
  const int rx = p.win.rx;
  if (p.sw == 2) {
    if (cg.kw == 1 && window_cp(p, 1) == 4) launch_window_t<1, 2, 8, MODE, 4>(p, cc, stream);
    else if (cg.kw == 1) launch_window_t<1, 2, 8, MODE>(p, cc, stream);
    else launch_window_t<3, 2, 8, MODE>(p, cc, stream);
  } else if (cg.kw == 1) {
    if (window_cp(p, 1) == 4) launch_window_t<1, 1, 8, MODE, 4>(p, cc, stream);
    else launch_window_t<1, 1, 8, MODE>(p, cc, stream);
  } else if (cg.kw == 3) {
    if (rx == 7) launch_window_t<3, 1, 7, MODE>(p, cc, stream);
    else if (rx == 5) launch_window_t<3, 1, 5, MODE>(p, cc, stream);
    else launch_window_t<3, 1, 8, MODE>(p, cc, stream);
  } else {
    if (rx == 7) launch_window_t<5, 1, 7, MODE>(p, cc, stream);
    else if (rx == 5) launch_window_t<5, 1, 5, MODE>(p, cc, stream);
    else launch_window_t<5, 1, 8, MODE>(p, cc, stream);
  }
}

void launch_window(const Params& p0, const ConvGeo& cg, int fmt, const Config& c, cudaStream_t stream) {
  // rx 0, or 7 or 5 for a shape that has no such kernel (only 3- and 5-wide at stride 1 do): 8
  Params p = p0;
  if (c.rx && c.rx != p.win.rx && p.sw == 1 && (cg.kw == 3 || cg.kw == 5)) window_geometry(p, cg.kw, c.rx);
  // cc 0 (algo='expanded_window', or a pick made for another format): as many channels as fit
  const int fit = window_cc(p, cg.kw, fmt, max_smem_optin()), cp = window_cp(p, cg.kw);
  int cc = c.cc > 0 && c.cc <= fit ? c.cc : fit;
  if (cc < p.Cg) cc = std::max(cp, cc / cp * cp);  // whole chunks of channels (fit is one where fit < Cg)
  TORCH_CHECK(cc > 0, "approx expanded_window: the staged planes do not fit shared memory");
  if (fmt == 1) launch_window_m<1>(p, cg, cc, stream);
  else if (fmt == 2) launch_window_m<2>(p, cg, cc, stream);
  else launch_window_m<0>(p, cg, cc, stream);
}
}  // namespace approx_cuda
