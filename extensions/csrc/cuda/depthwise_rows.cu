// depthwise_rows: 3x3 depthwise convolutions of dilation 1 at stride 1 or 2 (MobileNetV2's), with
// input rows staged in shared memory and one table read per input code and kernel row.
//
// `depthwise` (depthwise.cu) pays, per output, 9 byte loads from global memory and 9 int32 lookups:
// 0.23-0.65 T MAC/s on an H100. Here a block owns one channel and builds, per kernel row ky and LUT
// row r, one entry holding the products of that row's three taps, E[r][w(ky, 0..2)]: as int16
// (8 bytes, 6 KiB a channel) where every product of the table fits int16, else as int32 (16 bytes,
// 12 KiB; auto does not time it then, see algos.cpp). A thread computes R consecutive outputs of
// one output row, reading each of its input codes once per kernel row: one shared-memory read then
// gives up to 3 products (stride 1: each feeds 3 outputs; stride 2: 1 or 2 of them), so a 3x3
// output costs about 3 (R + 2) / R reads instead of 9.
//
// Work is cut into tasks (image, output row, segment of R outputs), numbered row-major over the
// whole batch; a tile is kDrThreads consecutive tasks, one a thread, so a tile may start and end
// mid-row and span several small images (7x7 planes: 36 images a tile). The tile's input rows
// (every image it touches: the rows of its output rows plus halo) are staged whole, already turned
// into LUT rows (code ^ xmask) with padding as the pad row, in "slots" one image each.
#include <algorithm>

#include "launch.cuh"

namespace approx_cuda {
namespace {

constexpr int kDrThreads = 256;
// Blocks aimed at per SM; a block walks the channel's tiles with stride gridDim.x, so the table is
// built once per block, not per tile.
constexpr int kDrBlocksPerSM = 8;
constexpr int kDrSlackWords = 4;  // after the staged rows: the unaligned reads' last word

struct DrGeo {
  int Ho, segs;    // output rows per image, R-output segments per output row
  int Hn;          // staged rows of a slot holding a whole image: (Ho - 1) * S + 3
  int nw;          // staged words per row (the row pitch / 4)
  int table_bytes; // offset of the staged rows in shared memory
  unsigned total;  // tasks of one channel: B * Ho * segs (< 2^31: depthwise_rows_why_not)
  unsigned tiles;
  FastDiv fsegs, fHo, fnw, fHn;
};

// Products of one kernel row as int16, sign-extended on use into the wrapping accumulator.
struct Tab16 {
  using E = uint2;
  __device__ static E pack(int a, int b, int c) {
    return make_uint2((static_cast<uint32_t>(a) & 0xffffu) | (static_cast<uint32_t>(b) << 16),
                      static_cast<uint32_t>(c) & 0xffffu);
  }
  template <int KX>
  __device__ static uint32_t get(E e) {
    if constexpr (KX == 0) return static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(e.x)));
    if constexpr (KX == 1) return static_cast<uint32_t>(static_cast<int32_t>(e.x) >> 16);
    return static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(e.y)));
  }
};

struct Tab32 {
  using E = uint4;
  __device__ static E pack(int a, int b, int c) {
    return make_uint4(static_cast<uint32_t>(a), static_cast<uint32_t>(b), static_cast<uint32_t>(c), 0u);
  }
  template <int KX>
  __device__ static uint32_t get(E e) {
    return KX == 0 ? e.x : KX == 1 ? e.y : e.z;
  }
};

// Adds input code i's products (e) to the outputs it feeds: input column i of the thread's window
// feeds output j through tap kx where i = j * S + kx.
template <int S, int R, class Tab, int KX>
__device__ __forceinline__ void feed(uint32_t (&acc)[R], typename Tab::E e, int i) {
  const int d = i - KX;
  if (d >= 0 && d % S == 0 && d / S < R) acc[d / S] += Tab::template get<KX>(e);
}

template <int S, int R, class Tab>
__device__ __forceinline__ void dr_body(const Params& p, const DrGeo& g, uint8_t* smem) {
  using E = typename Tab::E;
  constexpr int NC = (R - 1) * S + 3;  // input columns a thread reads per input row
  constexpr int NWA = (NC + 3) / 4;    // as whole words
  E* tab = reinterpret_cast<E*>(smem);  // [ky][LUT row]
  uint32_t* st = reinterpret_cast<uint32_t*>(smem + g.table_bytes);
  const int ch = blockIdx.y, tid = threadIdx.x;
  {
    const int8_t* wch = p.w + (long long)ch * 9;
    for (int e = tid; e < 3 * 256; e += kDrThreads) {
      const int ky = e >> 8;
      const int32_t* er = p.E32 + (e & 255) * 256 + 128;
      tab[e] = Tab::pack(__ldg(er + __ldg(wch + ky * 3)), __ldg(er + __ldg(wch + ky * 3 + 1)),
                         __ldg(er + __ldg(wch + ky * 3 + 2)));
    }
  }
  const uint32_t pad4 = p.xmask * 0x01010101u;  // four padding codes' LUT rows (0 ^ xmask)
  const long long plane = (long long)p.H * p.W, img_in = (long long)p.C * plane;
  const long long img_out = (long long)p.C * p.HoWo;
  const uint8_t* a_ch = p.a + (long long)ch * plane;
  int32_t* out_ch = p.out + (long long)ch * p.HoWo;
  const int Ho = g.Ho;
  for (unsigned tile = blockIdx.x; tile < g.tiles; tile += gridDim.x) {
    const unsigned t0 = tile * kDrThreads, t1 = min(t0 + kDrThreads, g.total);
    // output rows (row-major over the batch) gA..gB; images bA..bB
    const unsigned gA = fdiv(t0, g.fsegs), gB = fdiv(t1 - 1, g.fsegs);
    const unsigned bA = fdiv(gA, g.fHo), bB = fdiv(gB, g.fHo);
    const int oyA = static_cast<int>(gA - bA * Ho), oyB = static_cast<int>(gB - bB * Ho);
    // slot 0: image bA from output row oyA (its local row 0 is input row oyA * S - ph); slots
    // 1, 2, ...: later images from output row 0 (local row 0 = input row -ph), whole but the last
    const int n0 = ((bA == bB ? oyB : Ho - 1) - oyA) * S + 3;
    const int nimg = static_cast<int>(bB - bA) + 1;
    const int Q = nimg == 1 ? n0 : n0 + (nimg - 2) * g.Hn + oyB * S + 3;
    __syncthreads();  // the previous tile's reads of the staged rows are done
    for (unsigned w = tid; w < static_cast<unsigned>(Q * g.nw); w += kDrThreads) {
      const unsigned q = fdiv(w, g.fnw);
      const int j = static_cast<int>(w - q * g.nw);
      unsigned k = 0;
      int iy = oyA * S - p.ph + static_cast<int>(q);
      if (static_cast<int>(q) >= n0) {
        const unsigned u = q - n0, kk = fdiv(u, g.fHn);
        k = kk + 1;
        iy = static_cast<int>(u - kk * g.Hn) - p.ph;
      }
      uint32_t v = pad4;
      if (iy >= 0 && iy < p.H) {
        const uint8_t* row = a_ch + (bA + k) * img_in + (long long)iy * p.W;
        const int gc = 4 * j - p.pw;  // staged column 0 is input column -pw
        // Aligned 4-byte loads realigned in registers (rows of odd widths start anywhere), where
        // every byte they touch lies inside the row; bytes at the row's ends and in the padding.
        const uintptr_t r0 = reinterpret_cast<uintptr_t>(row);
        const uintptr_t at = r0 + static_cast<intptr_t>(gc), al = at & ~uintptr_t(3);
        const unsigned sh = static_cast<unsigned>(at & 3) * 8;
        if (gc >= 0 && al >= r0 && al + (sh ? 8 : 4) <= r0 + static_cast<unsigned>(p.W)) {
          const uint32_t* wp = reinterpret_cast<const uint32_t*>(al);
          const uint32_t lo = __ldg(wp);
          v = (sh ? __funnelshift_r(lo, __ldg(wp + 1), sh) : lo) ^ pad4;
        } else {
          v = 0;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int c = gc + i;
            const uint32_t r = c >= 0 && c < p.W ? (__ldg(row + c) ^ p.xmask) : p.xmask;
            v |= r << (8 * i);
          }
        }
      }
      st[w] = v;
    }
    if (tid < kDrSlackWords) st[Q * g.nw + tid] = pad4;
    __syncthreads();
    const unsigned t = t0 + tid;
    if (t >= t1) continue;
    const unsigned gr = fdiv(t, g.fsegs);
    const int seg = static_cast<int>(t - gr * g.segs);
    const unsigned b = fdiv(gr, g.fHo);
    const int oy = static_cast<int>(gr - b * Ho);
    const unsigned k = b - bA;
    const int q0 = k == 0 ? (oy - oyA) * S : n0 + static_cast<int>(k - 1) * g.Hn + oy * S;
    uint32_t acc[R];
#pragma unroll
    for (int j = 0; j < R; ++j) acc[j] = 0;  // wraps like every kernel's accumulator
#pragma unroll
    for (int ky = 0; ky < 3; ++ky) {
      // the thread's window: staged columns seg * R * S .. + NC - 1 of local row q0 + ky
      const int start = (q0 + ky) * g.nw * 4 + seg * R * S;
      uint32_t wv[NWA];
      if constexpr ((R * S) % 4 == 0) {  // every window starts on a word
#pragma unroll
        for (int i = 0; i < NWA; ++i) wv[i] = st[(start >> 2) + i];
      } else {
        uint32_t raw[NWA + 1];
#pragma unroll
        for (int i = 0; i <= NWA; ++i) raw[i] = st[(start >> 2) + i];
        const unsigned sh = static_cast<unsigned>(start & 3) * 8;
#pragma unroll
        for (int i = 0; i < NWA; ++i) wv[i] = __funnelshift_r(raw[i], raw[i + 1], sh);
      }
      const E* tk = tab + ky * 256;
#pragma unroll
      for (int i = 0; i < NC; ++i) {
        const E e = tk[(wv[i >> 2] >> (8 * (i & 3))) & 255u];
        feed<S, R, Tab, 0>(acc, e, i);
        feed<S, R, Tab, 1>(acc, e, i);
        feed<S, R, Tab, 2>(acc, e, i);
      }
    }
    const int ox0 = seg * R;
    int32_t* o = out_ch + b * img_out + (long long)oy * p.Wo + ox0;
    if constexpr (R == 8) {
      if (ox0 + R <= p.Wo && (reinterpret_cast<uintptr_t>(o) & 15) == 0) {
        reinterpret_cast<uint4*>(o)[0] = make_uint4(acc[0], acc[1], acc[2], acc[3]);
        reinterpret_cast<uint4*>(o)[1] = make_uint4(acc[4], acc[5], acc[6], acc[7]);
        continue;
      }
    }
#pragma unroll
    for (int j = 0; j < R; ++j)
      if (ox0 + j < p.Wo) o[j] = static_cast<int32_t>(acc[j]);
  }
}

// MODE 1: int16 entries, 2: int32 entries, 0: the fit flags decide on the device.
template <int S, int R, int MODE>
__global__ void __launch_bounds__(kDrThreads) depthwise_rows_kernel(Params p, DrGeo g) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (MODE == 1 || (MODE == 0 && read_fits16(p.flags)))
    dr_body<S, R, Tab16>(p, g, smem);
  else
    dr_body<S, R, Tab32>(p, g, smem);
}

// Outputs a thread: 7 where rows are a multiple of 7 wide but not of 8 (MobileNetV2's 7, 14, 28),
// so no lane computes outputs past the row's end.
int dr_r(const Params& p) { return p.Wo % 8 != 0 && p.Wo % 7 == 0 ? 7 : 8; }

// fmt 1: int16 entries; else int32-sized (fmt 0 reads the flags on the device).
DrGeo dr_geo(const Params& p, int fmt, size_t& smem) {
  const int S = p.sh, R = dr_r(p);
  DrGeo g{};
  g.Ho = static_cast<int>(p.HoWo / p.Wo);
  g.segs = (p.Wo + R - 1) / R;
  g.Hn = (g.Ho - 1) * S + 3;
  g.nw = ((g.segs * R - 1) * S + 3 + 3) / 4;  // staged columns: every window's, the last overhanging
  g.table_bytes = 3 * 256 * (fmt == 1 ? 8 : 16);
  const long long B = p.M / p.HoWo, total = B * g.Ho * g.segs;
  g.total = static_cast<unsigned>(total);
  g.tiles = static_cast<unsigned>((total + kDrThreads - 1) / kDrThreads);
  g.fsegs = make_fastdiv(g.segs);
  g.fHo = make_fastdiv(g.Ho);
  g.fnw = make_fastdiv(g.nw);
  g.fHn = make_fastdiv(g.Hn);
  // Most staged rows a tile can need: kDrThreads consecutive tasks touch at most rt output rows
  // and imgs images; an image with r of them stages (r - 1) * S + 3 rows.
  const long long rt = std::min<long long>((kDrThreads - 1) / g.segs + 2, B * g.Ho);
  const long long imgs = std::min<long long>({rt, (rt - 1) / g.Ho + 2, B});
  const long long rows = S * rt + (3 - S) * imgs;
  smem = g.table_bytes + (size_t)(rows * g.nw + kDrSlackWords) * 4;
  return g;
}

template <int S, int R>
void launch_dr_sr(const Params& p, int fmt, const DrGeo& g, size_t smem, dim3 grid, cudaStream_t stream) {
  auto kern = fmt == 1 ? depthwise_rows_kernel<S, R, 1>
                       : fmt == 2 ? depthwise_rows_kernel<S, R, 2> : depthwise_rows_kernel<S, R, 0>;
  set_smem(kern, smem);
  kern<<<grid, kDrThreads, smem, stream>>>(p, g);
}

}  // namespace

std::string depthwise_rows_why_not(const Params& p, const ConvGeo& cg) {
  if (!p.conv || p.N != 1 || p.Cg != 1)
    return "needs a depthwise conv (one input and one output channel per group)";
  if (cg.kh != 3 || cg.kw != 3 || cg.dh != 1 || cg.dw != 1) return "needs a 3x3 kernel of dilation 1";
  if (p.sh != p.sw || (p.sh != 1 && p.sh != 2)) return "needs stride 1 or 2, the same along both axes";
  if (p.ph > 1 || p.pw > 1) return "needs padding of at most 1";
  if (p.M >= (1ll << 31)) return "needs fewer than 2^31 output pixels per channel";
  size_t smem = 0;
  dr_geo(p, 2, smem);
  if ((long long)smem > max_smem_optin())
    return "needs a tile's input rows (" + std::to_string(smem) + " bytes) to fit shared memory";
  return "";
}

void launch_depthwise_rows(const Params& p, const ConvGeo&, int fmt, cudaStream_t stream) {
  size_t smem = 0;
  const DrGeo g = dr_geo(p, fmt, smem);
  const long long want = ((long long)kDrBlocksPerSM * sm_count() + p.G - 1) / p.G;
  const dim3 grid(static_cast<unsigned>(std::max(1ll, std::min<long long>(want, g.tiles))), p.G);
  const bool r7 = dr_r(p) == 7;
  if (p.sh == 1) {
    if (r7) launch_dr_sr<1, 7>(p, fmt, g, smem, grid, stream);
    else launch_dr_sr<1, 8>(p, fmt, g, smem, grid, stream);
  } else {
    if (r7) launch_dr_sr<2, 7>(p, fmt, g, smem, grid, stream);
    else launch_dr_sr<2, 8>(p, fmt, g, smem, grid, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace approx_cuda
