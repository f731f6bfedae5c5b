// depthwise_planes: 3x3 depthwise convolutions of padding 1 and dilation 1 on small square planes (7x7 at stride 1,
// 14x14 and 28x28 at stride 2: MobileNetV2's last stages), a thread per image plane (or band of its output rows),
// every input code read from the table once.
//
// depthwise_rows (depthwise_rows.cu) reads a code once per kernel row, three products an 8-byte entry, and on these
// planes its lanes' windows lie on many lines: `ncu` puts it at L1's data pipe, 84-94 % busy. Here an entry holds
// every product a code feeds, so a code costs one read:
// - stride 1: taps 0-7 in a 16-byte entry (a quarter warp's random codes: about 2.5 wavefronts), tap 8 in an int16 one;
// - stride 2: a code's row and column parities fix the taps it feeds: 4 (an 8-byte entry), 2 (4 bytes) or 1 (int16).
// A thread's plane is compile-time (H, W, S), so which taps a code feeds, and which outputs they go to, are constants:
// no masks, no window arithmetic. A warp's 32 planes (32 images of the block's channel) come into a warp-private
// stage in shared memory as the input's words (coalesced), each lane then reads its own plane's words (the stage's
// lane pitch odd: no bank conflicts) and realigns them; the sums go out the same way, plane by plane, so the stores
// are whole runs of a plane (a store's lanes run on across planes instead: 0.90-0.97x on 960 at 7x7 and 576 at 14x14,
// s2 on an H200). The tables (4.5 KiB a channel, from Et16) are prepared with the weights (tables.cu); a
// block copies its own. 37 % fewer L1 wavefronts than depthwise_rows' best on 960 at 7x7; at batch 64 a block per
// channel leaves 9-15 warps an SM, and the time goes in the planes' loads and the sums' stores more than in the reads.
// One NVIDIA H200 against auto's pick without it: 960 at 7x7 1.62 -> 2.13-2.17 T MAC/s at batch 64, 2.33-2.37 ->
// 3.03-3.04 at 256; 576 at 14x14, s2 1.22 -> 1.49-1.51 at 64, 1.70 -> 2.11-2.16 at 256; 192 at 28x28, s2 1.38 ->
// 1.63-1.64 at 64 (benchmarks/imagenet.md, "Depthwise convs: a thread a plane", "... the planes' words loaded once"
// and "... bands of a 28x28 plane").
//
// The entries hold int16 products: other tables run depthwise_rows (launch_depthwise_planes).
#include "depthwise_stores.cuh"
#include "launch.cuh"

namespace approx_cuda {
namespace {

constexpr int kDpTabBytes = 4608;  // stride 1: 256 x 16 + 256 x 2; stride 2: 256 x (8 + 4 + 4 + 2)

// acc plus the int16 in the low (HI false) or high half of w, sign-extended: one IDP.2A
template <bool HI>
__device__ __forceinline__ uint32_t dp_add_half(uint32_t acc, uint32_t w) {
  return static_cast<uint32_t>(__dp2a_lo(static_cast<int>(w), HI ? 0x100 : 1, static_cast<int>(acc)));
}

// Where tap k (ky * 3 + kx) lies: table at byte `base`, in word `word` of its entry, high half or low; s16: the
// int16 table (base 4096). Stride 2: a code on an odd row (padding 1) feeds kernel rows 0 and 2, on an even one row 1;
// the same for columns: A (base 0, 8 bytes: taps 00, 02 | 20, 22), B (2048: taps 01, 21), C (3072: 10, 12), D (11).
struct DpLoc {
  int base, word, hi, s16;
};
template <int S>
__host__ __device__ constexpr DpLoc dp_loc(int k) {
  const int ky = k / 3, kx = k % 3;
  if (S == 1) return k < 8 ? DpLoc{0, k / 2, k & 1, 0} : DpLoc{4096, 0, 0, 1};
  const bool r2 = ky != 1, c2 = kx != 1;
  if (r2 && c2) return DpLoc{0, ky == 2, kx == 2, 0};
  if (r2) return DpLoc{2048, 0, ky == 2, 0};
  if (c2) return DpLoc{3072, 0, kx == 2, 0};
  return DpLoc{4096, 0, 0, 1};
}

// a code's byte offset in a table of 2^SH-byte entries, from its word (at bit `bit`): one shift and one AND
template <int SH>
__device__ __forceinline__ uint32_t dp_off(uint32_t w, int bit) {
  return (bit >= SH ? w >> (bit - SH) : w << (SH - bit)) & (255u << SH);
}

// Output rows OY0..OY1 - 1 of an H x W plane at stride S: the input rows they read, as words of the plane
template <int S, int H, int W, int OY0, int OY1>
struct DpBand {
  static constexpr int Wo = (W - 1) / S + 1, NR = OY1 - OY0, NO = NR * Wo;
  static constexpr int IY0 = OY0 * S - 1 < 0 ? 0 : OY0 * S - 1;
  static constexpr int IY1 = (OY1 - 1) * S + 1 > H - 1 ? H - 1 : (OY1 - 1) * S + 1;
  static constexpr int W0 = (IY0 * W) >> 2, NW = ((IY1 * W + W - 1) >> 2) - W0 + 1;
  // the input's words a lane's band lies in: one more where a plane may start off a word (H W odd: 7x7) and the
  // band's last byte is not a word's first
  static constexpr int NWR = NW + ((H * W) % 4 != 0 && ((IY1 * W + W - 1) & 3) != 0);
  static constexpr int SW = NWR | 1, OS = NO | 1;  // a lane's pitch in the stage, odd: conflict-free reads
};

template <int S, int H, int W, int NB>
struct DpShape {
  static constexpr int Ho = (H - 1) / S + 1, Wo = (W - 1) / S + 1, HW = H * W;
  static constexpr int RB = (Ho + NB - 1) / NB;  // output rows a band
  // Many bands (large planes): every band but the first (the padding row above) and the last runs band 1's code on
  // rows shifted by whole words (a plane starts on a word, an output row's S input rows are whole words), so the
  // code is built three times, not NB
  static constexpr bool kUniform = NB >= 4 && (S * W) % 4 == 0 && HW % 4 == 0 && (NB - 1) * RB < Ho;
  // a warp's stage: its 32 planes' band words, later its 32 bands' sums (the larger of the two, over the bands)
  static constexpr int stage_words() {
    int most = 1;
    for (int bi = 0; bi < NB; ++bi) {
      const int oy0 = bi * RB, oy1 = (bi + 1) * RB < Ho ? (bi + 1) * RB : Ho;
      if (oy0 >= oy1) continue;
      const int iy0 = oy0 * S - 1 < 0 ? 0 : oy0 * S - 1, iy1 = (oy1 - 1) * S + 1 > H - 1 ? H - 1 : (oy1 - 1) * S + 1;
      const int nw = (((iy1 * W + W - 1) >> 2) - ((iy0 * W) >> 2) + 1 + (HW % 4 != 0 && ((iy1 * W + W - 1) & 3))) | 1;
      const int os = ((oy1 - oy0) * Wo) | 1;
      most = nw > most ? nw : most;
      most = os > most ? os : most;
    }
    return 32 * most;
  }
};

// A lane's band: wd its plane's words W0.. (registers), acc its sums, padding's products (code 0's) added up front.
template <int S, int H, int W, int OY0, int OY1>
__device__ __forceinline__ void dp_sums(const uint32_t* wd, const uint8_t* tab, uint32_t* acc) {
  using BD = DpBand<S, H, W, OY0, OY1>;
  constexpr int Wo = BD::Wo;
  uint32_t pad[9];
#pragma unroll
  for (int k = 0; k < 9; ++k) {
    const DpLoc L = dp_loc<S>(k);
    if (L.s16) {
      pad[k] = static_cast<uint32_t>(static_cast<int32_t>(*reinterpret_cast<const int16_t*>(tab + L.base)));
    } else {
      const uint32_t v = *reinterpret_cast<const uint32_t*>(tab + L.base + 4 * L.word);
      pad[k] = L.hi ? static_cast<uint32_t>(static_cast<int32_t>(v) >> 16)
                    : static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(v)));
    }
  }
#pragma unroll
  for (int o = 0; o < BD::NO; ++o) {
    const int oy = OY0 + o / Wo, ox = o % Wo;
    uint32_t s = 0;  // wraps like every kernel's accumulator
#pragma unroll
    for (int k = 0; k < 9; ++k) {
      const int iy = oy * S - 1 + k / 3, ix = ox * S - 1 + k % 3;
      if (iy < 0 || iy >= H || ix < 0 || ix >= W) s += pad[k];
    }
    acc[o] = s;
  }
#pragma unroll
  for (int iy = BD::IY0; iy <= BD::IY1; ++iy) {
#pragma unroll
    for (int ix = 0; ix < W; ++ix) {
      const int b = iy * W + ix, bit = 8 * (b & 3);
      const uint32_t wv = wd[(b >> 2) - BD::W0];
      // the taps this code feeds inside the band, and the entry words they lie in (constants once unrolled)
      int need = 0, words = 0;
      bool mid = false, s16 = false;
#pragma unroll
      for (int k = 0; k < 9; ++k) {
        const int ny = iy + 1 - k / 3, nx = ix + 1 - k % 3;
        if (ny >= 0 && nx >= 0 && ny % S == 0 && nx % S == 0 && ny / S >= OY0 && ny / S < OY1 && nx / S < Wo) {
          need |= 1 << k;
          const DpLoc L = dp_loc<S>(k);
          if (L.s16) s16 = true;
          else if (L.base == 0) words |= 1 << L.word;
          else mid = true;
        }
      }
      uint32_t ent[4] = {0, 0, 0, 0}, m = 0;
      int32_t e16 = 0;
      if (words) {  // the narrowest read that holds the words needed
        const uint8_t* e = tab + dp_off<S == 1 ? 4 : 3>(wv, bit);
        if (S == 1 && (words & 12) && (words & 3)) {
          const uint4 v = *reinterpret_cast<const uint4*>(e);
          ent[0] = v.x, ent[1] = v.y, ent[2] = v.z, ent[3] = v.w;
        } else if (S == 1 && (words & 12)) {
          const uint2 v = *reinterpret_cast<const uint2*>(e + 8);
          ent[2] = v.x, ent[3] = v.y;
        } else if ((words & 3) == 3) {
          const uint2 v = *reinterpret_cast<const uint2*>(e);
          ent[0] = v.x, ent[1] = v.y;
        } else if (words & 1) {
          ent[0] = *reinterpret_cast<const uint32_t*>(e);
        } else {
          ent[1] = *reinterpret_cast<const uint32_t*>(e + 4);
        }
      }
      // stride 2: an odd row's code on an even column is in B, an even row's on an odd column in C
      if (S == 2 && mid) m = *reinterpret_cast<const uint32_t*>(tab + ((iy & 1) ? 2048 : 3072) + dp_off<2>(wv, bit));
      if (s16) e16 = *reinterpret_cast<const int16_t*>(tab + 4096 + dp_off<1>(wv, bit));
#pragma unroll
      for (int k = 0; k < 9; ++k) {
        if (!(need >> k & 1)) continue;
        const DpLoc L = dp_loc<S>(k);
        const int o = ((iy + 1 - k / 3) / S - OY0) * Wo + (ix + 1 - k % 3) / S;
        if (L.s16) {
          acc[o] += static_cast<uint32_t>(e16);
        } else {
          const uint32_t v = L.base == 0 ? ent[L.word] : m;
          acc[o] = L.hi ? dp_add_half<true>(acc[o], v) : dp_add_half<false>(acc[o], v);
        }
      }
    }
  }
}

struct DpWarp {
  int ch, n0, nimg, lane;  // the warp's channel, first image and images (<= 32)
  uint32_t* stage;         // its stage in shared memory
};

// Phase 0: the input's words the warp's planes' bands lie in, as loaded, into its stage (lane pitch SW). Phase 1: a
// lane's words, realigned to its plane (which starts on any byte where H W is odd), its sums, and their stores.
// Realigned while loading, each word took a second load of the next one, dependent on the plane's offset: on 960 at
// 7x7 at batch 64 the loads and the stage alone took 3.7 us a call, 1.5 without that load (an H200,
// benchmarks/imagenet.md, "Depthwise convs: the planes' words loaded once").
// dy: output rows the band lies below rows OY0..OY1 - 1 (DpShape::kUniform's shifted bands; 0 for the rest).
template <int S, int H, int W, int OY0, int OY1, int EPI>
__device__ __forceinline__ void dp_band(const Params& p, const DpWarp& wp, const uint8_t* tab, int phase, int dy) {
  using BD = DpBand<S, H, W, OY0, OY1>;
  constexpr int HW = H * W, HoWo = ((H - 1) / S + 1) * BD::Wo, NWR = BD::NWR;
  const unsigned img_in = static_cast<unsigned>(p.C) * HW;
  if (phase == 0) {
    const unsigned in_words = static_cast<unsigned>(p.M / HoWo * img_in / 4);  // dp_inputs_ok: whole words
    const uint32_t* a32 = reinterpret_cast<const uint32_t*>(p.a);
    uint32_t v[NWR];
#pragma unroll
    for (int i = 0; i < NWR; ++i) {  // word f % NWR of plane f / NWR, f = lane + 32 i: a warp's loads contiguous
      const int f = wp.lane + 32 * i, pp = f / NWR, j = f - pp * NWR;
      const unsigned pos = static_cast<unsigned>(wp.n0 + pp) * img_in + static_cast<unsigned>(wp.ch) * HW;
      const unsigned w = (pos >> 2) + BD::W0 + static_cast<unsigned>(dy) * (S * W / 4) + j;
      // only a word past the band's own bytes (NWR > NW) can lie past the input
      v[i] = pp < wp.nimg && (NWR == BD::NW || w < in_words) ? __ldg(a32 + w) : 0u;
    }
#pragma unroll
    for (int i = 0; i < NWR; ++i) {
      const int f = wp.lane + 32 * i, pp = f / NWR;
      wp.stage[pp * BD::SW + f - pp * NWR] = v[i];
    }
    return;
  }
  uint32_t raw[NWR], wd[BD::NW], acc[BD::NO];
#pragma unroll
  for (int i = 0; i < NWR; ++i) raw[i] = wp.stage[wp.lane * BD::SW + i];
  // where H W is a multiple of 4 every plane starts on a word (dp_inputs_ok: the input does)
  const unsigned sh = HW % 4 ? ((static_cast<unsigned>(wp.n0 + wp.lane) * img_in + wp.ch * HW) & 3) * 8 : 0u;
#pragma unroll
  for (int i = 0; i < BD::NW; ++i) wd[i] = __funnelshift_r(raw[i], i + 1 < NWR ? raw[i + 1] : 0u, sh);
  dp_sums<S, H, W, OY0, OY1>(wd, tab, acc);
  __syncwarp();  // every lane has its words: the stage takes the sums
#pragma unroll
  for (int o = 0; o < BD::NO; ++o) wp.stage[wp.lane * BD::OS + o] = acc[o];
  __syncwarp();
  const DrEnd dend = dr_end<EPI>(p.epi, wp.ch);
  const long long img_out = static_cast<long long>(p.C) * HoWo;
  long long at = wp.n0 * img_out + static_cast<long long>(wp.ch) * HoWo + (OY0 + dy) * BD::Wo;
  for (int pp = 0; pp < wp.nimg; ++pp, at += img_out) {
#pragma unroll
    for (int j = wp.lane; j < BD::NO; j += 32) {
      uint32_t one[1] = {wp.stage[pp * BD::OS + j]};
      dr_store<1, EPI>(p, dend, at + j, 1, one);
    }
  }
}

template <int S, int H, int W, int NB, int EPI, int BI = 0>
__device__ __forceinline__ void dp_pick(int band, const Params& p, const DpWarp& wp, const uint8_t* tab, int phase) {
  using G = DpShape<S, H, W, NB>;
  constexpr int RB = G::RB;
  if constexpr (G::kUniform) {
    if (band == 0) dp_band<S, H, W, 0, RB, EPI>(p, wp, tab, phase, 0);
    else if (band == NB - 1) dp_band<S, H, W, (NB - 1) * RB, G::Ho, EPI>(p, wp, tab, phase, 0);
    else dp_band<S, H, W, RB, 2 * RB, EPI>(p, wp, tab, phase, (band - 1) * RB);
  } else if constexpr (BI < NB) {
    constexpr int OY0 = BI * RB, OY1 = (BI + 1) * RB < G::Ho ? (BI + 1) * RB : G::Ho;
    if (band != BI) return dp_pick<S, H, W, NB, EPI, BI + 1>(band, p, wp, tab, phase);
    if constexpr (OY0 < OY1) dp_band<S, H, W, OY0, OY1, EPI>(p, wp, tab, phase, 0);
  }
}

// A channel's nine weights, and code c's entries (from LUT row c ^ xmask) into its table at tab
__device__ __forceinline__ void dp_weights(const Params& p, int ch, int (&wk)[9]) {
  const int8_t* wch = p.w + static_cast<long long>(ch) * 9;
#pragma unroll
  for (int k = 0; k < 9; ++k) wk[k] = __ldg(wch + k);
}
template <int S>
__device__ __forceinline__ void dp_entry(const Params& p, const int (&wk)[9], int c, uint8_t* tab) {
  const int16_t* et = p.Et16 + 128 * 256 + (c ^ p.xmask);
  uint32_t q[9];
#pragma unroll
  for (int k = 0; k < 9; ++k) q[k] = static_cast<uint16_t>(__ldg(et + wk[k] * 256));
  if constexpr (S == 1) {
    reinterpret_cast<uint4*>(tab)[c] =
        make_uint4(q[0] | q[1] << 16, q[2] | q[3] << 16, q[4] | q[5] << 16, q[6] | q[7] << 16);
  } else {
    reinterpret_cast<uint2*>(tab)[c] = make_uint2(q[0] | q[2] << 16, q[6] | q[8] << 16);
    reinterpret_cast<uint32_t*>(tab + 2048)[c] = q[1] | q[7] << 16;
    reinterpret_cast<uint32_t*>(tab + 3072)[c] = q[3] | q[5] << 16;
  }
  reinterpret_cast<int16_t*>(tab + 4096)[c] = static_cast<int16_t>(q[S == 1 ? 8 : 4]);
}

// The tables of every channel, [G][kDpTabBytes], prepared with the weights (once for cached layers): a block a
// channel, a thread a code. Built in the conv's kernel instead, its blocks waited on a weight's load and then its
// products' ahead of the first read: 3.5-10 % (benchmarks/imagenet.md)
template <int S>
__global__ void __launch_bounds__(256) depthwise_planes_table_kernel(Params p, uint8_t* out) {
  int wk[9];
  dp_weights(p, blockIdx.x, wk);
  dp_entry<S>(p, wk, threadIdx.x, out + static_cast<long long>(blockIdx.x) * kDpTabBytes);
}

// A block: channel blockIdx.y, IPB images (32 a warp) x NBB of the NB bands of output rows (blockIdx.x: the images'
// group, then the bands'); warp w takes the group's band w / (IPB / 32).
template <int S, int H, int W, int NB, int NBB, int IPB, int MINB, int EPI>
__global__ void __launch_bounds__(IPB * NBB, MINB) depthwise_planes_kernel(Params p) {
  constexpr int TPB = IPB * NBB, WI = IPB / 32, BG = (NB + NBB - 1) / NBB;
  extern __shared__ __align__(16) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid >> 5, band = static_cast<int>(blockIdx.x % BG) * NBB + warp / WI;
  DpWarp wp;
  wp.ch = blockIdx.y;
  wp.lane = tid & 31;
  wp.n0 = static_cast<int>(blockIdx.x / BG) * IPB + (warp % WI) * 32;
  wp.nimg = min(32, static_cast<int>(p.M / ((H - 1) / S + 1) / ((W - 1) / S + 1)) - wp.n0);
  wp.stage = reinterpret_cast<uint32_t*>(smem + kDpTabBytes) + warp * DpShape<S, H, W, NB>::stage_words();
  // the channel's table as prepared with the weights (tables.cu: a weight's two round trips, its load and then its
  // products', off the critical path): its loads, then the planes' (phase 0 waits on both at once), then its stores
  constexpr int N4 = kDpTabBytes / 16, PER = (N4 + TPB - 1) / TPB;
  const uint4* src = reinterpret_cast<const uint4*>(p.Tdw + static_cast<long long>(wp.ch) * kDpTabBytes);
  uint4 tv[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i)
    if (tid + i * TPB < N4) tv[i] = __ldg(src + tid + i * TPB);
  const bool work = wp.nimg > 0 && band < NB;
  if (work) dp_pick<S, H, W, NB, EPI>(band, p, wp, smem, 0);
#pragma unroll
  for (int i = 0; i < PER; ++i)
    if (tid + i * TPB < N4) reinterpret_cast<uint4*>(smem)[tid + i * TPB] = tv[i];
  __syncthreads();  // the table and every warp's stage
  if (work) dp_pick<S, H, W, NB, EPI>(band, p, wp, smem, 1);
}

// The planes built in: (stride, plane side) and the (bands, images a block, bands a block; 0: all) auto times, the
// first the default. MINB: blocks an SM the registers are capped for. At 14x14, s2, one band: 95 registers without
// spills, where the uncapped 122 left 8 blocks an SM; a call's blocks last about as long as each other, so waves
// count: at batch 256 2,304 blocks in 1.75 waves of 10 an SM, not 2.2 of 8 (an H200: 1.85-1.88 -> 1.97-1.99 T MAC/s;
// 12 an SM, 80 registers: 1.84). 28x28, s2: 7 bands of 2 output rows (DpShape::kUniform) a block of 224 threads,
// capped at 72 registers (4 blocks an SM): 192 at 28x28, s2 at 1.63 T MAC/s at batch 64 where depthwise_rows' best
// took 1.38 (an H200). Also built: bands of 3 rows (5 bands, the last one short) at 1.49. Measured, not built: bands
// of 4 rows 1.49, of 1 row 1.31 (with stores across planes), 64 images a block 1.28; 56x56, s2 in bands of 1 or 2
// rows 1.47-1.57 (stores across planes), where depthwise_rows_split takes 1.76.
struct DpCfg {
  int S, H, NB, IPB, MINB, NBB;
};
constexpr DpCfg kDpCfgs[] = {{2, 14, 1, 64, 10, 0}, {2, 14, 2, 32, 1, 0}, {2, 14, 1, 128, 5, 0}, {1, 7, 1, 64, 1, 0},
                             {1, 7, 1, 32, 1, 0},   {2, 28, 7, 32, 4, 7}, {2, 28, 5, 32, 3, 5}};

template <int S, int H, int NB, int NBB, int IPB, int MINB, int EPI>
void dp_launch(const Params& p, cudaStream_t stream) {
  constexpr int BG = (NB + NBB - 1) / NBB;
  const size_t smem = kDpTabBytes + static_cast<size_t>(IPB / 32) * NBB * DpShape<S, H, H, NB>::stage_words() * 4;
  auto kern = depthwise_planes_kernel<S, H, H, NB, NBB, IPB, MINB, EPI>;
  set_smem(kern, smem);
  const long long B = p.M / p.HoWo;
  kern<<<dim3(static_cast<unsigned>((B + IPB - 1) / IPB * BG), p.G), IPB * NBB, smem, stream>>>(p);
}

template <int I, int EPI>
void dp_launch_cfg(const Params& p, int i, cudaStream_t stream) {
  if constexpr (I < static_cast<int>(sizeof(kDpCfgs) / sizeof(kDpCfgs[0]))) {
    if (i != I) return dp_launch_cfg<I + 1, EPI>(p, i, stream);
    constexpr DpCfg c = kDpCfgs[I];
    dp_launch<c.S, c.H, c.NB, c.NBB ? c.NBB : c.NB, c.IPB, c.MINB, EPI>(p, stream);
  }
}

// the configuration row of c (r: bands, mb: images a block, bb: bands a block; r 0: the shape's first), or -1
// a row's Config, as named (depthwise_planes_config_name) and listed (depthwise_planes_candidates)
Config dp_config(const DpCfg& d) {
  Config c;
  c.r = d.NB;
  c.mb = d.IPB;
  c.bb = d.NBB;
  return c;
}

int dp_cfg_index(const Params& p, const Config& c) {
  for (int i = 0; i < static_cast<int>(sizeof(kDpCfgs) / sizeof(kDpCfgs[0])); ++i) {
    const DpCfg& d = kDpCfgs[i];
    if (d.S == p.sh && d.H == p.H && (c.r == 0 || (c.r == d.NB && c.mb == d.IPB && c.bb == d.NBB))) return i;
  }
  return -1;
}

// the planes built in, as "7x7 at stride 1, 14x14 or 28x28 at stride 2"
std::string dp_planes_built() {
  std::string out;
  for (int s = 1; s <= 2; ++s) {
    std::string sides;
    int n = 0;
    for (const DpCfg& d : kDpCfgs) {
      const std::string side = std::to_string(d.H) + "x" + std::to_string(d.H);
      if (d.S == s && sides.find(side) == std::string::npos) sides += (n++ ? ", " : "") + side;
    }
    const size_t last = sides.rfind(", ");
    if (last != std::string::npos) sides.replace(last, 2, " or ");
    if (n) out += (out.empty() ? "" : ", ") + sides + " at stride " + std::to_string(s);
  }
  return out;
}

long long dp_in_bytes(const Params& p) { return p.M / p.HoWo * p.C * p.H * p.W; }

// inputs the kernel reads as aligned words: on 4 bytes, a whole number of words
bool dp_inputs_ok(const Params& p) { return reinterpret_cast<uintptr_t>(p.a) % 4 == 0 && dp_in_bytes(p) % 4 == 0; }

}  // namespace

std::string depthwise_planes_why_not(const Params& p, const ConvGeo& cg) {
  if (!p.conv || p.N != 1 || p.Cg != 1)
    return "needs a depthwise conv (one input and one output channel per group)";
  if (cg.kh != 3 || cg.kw != 3 || cg.dh != 1 || cg.dw != 1 || p.ph != 1 || p.pw != 1 || p.sh != p.sw)
    return "needs a 3x3 kernel of dilation 1, padding 1 and one stride along both axes";
  if (p.H != p.W || dp_cfg_index(p, Config{}) < 0) return "needs a square plane of those built: " + dp_planes_built();
  if (dp_in_bytes(p) >= (1ll << 31) || p.G > 65535)
    return "needs inputs under 2^31 bytes and at most 65535 channels";
  return "";
}

bool depthwise_planes_applies_end(const Params& p, int fmt) { return fmt == 1 && dp_inputs_ok(p); }

int64_t depthwise_planes_table_bytes(const Params& p, const ConvGeo& cg) {
  return depthwise_planes_why_not(p, cg).empty() ? static_cast<int64_t>(p.G) * kDpTabBytes : 0;
}

void build_depthwise_planes_tables(const Params& p, uint8_t* out, cudaStream_t stream) {
  if (p.sh == 1) depthwise_planes_table_kernel<1><<<p.G, 256, 0, stream>>>(p, out);
  else depthwise_planes_table_kernel<2><<<p.G, 256, 0, stream>>>(p, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::vector<Config> depthwise_planes_candidates(const Params& p, int fmt) {
  std::vector<Config> out;
  if (fmt == 2) return out;  // int32 products: depthwise_rows' table runs them
  for (const DpCfg& d : kDpCfgs)
    if (d.S == p.sh && d.H == p.H) out.push_back(dp_config(d));
  return out;
}

std::string depthwise_planes_config_name(const Config& c) {
  if (!c.r) return "depthwise_planes";
  return "depthwise_planes_b" + std::to_string(c.r) + "_i" + std::to_string(c.mb) +
         (c.bb ? "_bb" + std::to_string(c.bb) : "");
}

// depthwise_planes_b<NB>_i<IPB>[_bb<NBB>], each count as suffix_count spells it
std::string parse_depthwise_planes_config(const std::string& name, Config& c) {
  const std::string pre = "depthwise_planes_b";
  int nb = -1, ipb = -1, bb = 0;
  const size_t i = name.rfind(pre, 0) == 0 ? name.find("_i", pre.size()) : std::string::npos;
  if (i != std::string::npos) {
    const size_t k = name.find("_bb", i + 2);
    nb = suffix_count(name.substr(pre.size(), i - pre.size()), 1, 1024);
    ipb = suffix_count(name.substr(i + 2, k == std::string::npos ? k : k - i - 2), 1, 1024);
    if (k != std::string::npos) bb = suffix_count(name.substr(k + 3), 1, 1024);
  }
  for (const DpCfg& d : kDpCfgs)
    if (d.NB == nb && d.IPB == ipb && d.NBB == bb) {
      c.r = nb;
      c.mb = ipb;
      c.bb = bb;
      return "";
    }
  std::string valid;
  for (const DpCfg& d : kDpCfgs) {
    const std::string v = depthwise_planes_config_name(dp_config(d));
    if ((", " + valid + ", ").find(", " + v + ", ") == std::string::npos) valid += (valid.empty() ? "" : ", ") + v;
  }
  return "bad algo '" + name + "': depthwise_planes_b<bands>_i<images a block>[_bb<bands a block>], one of " + valid;
}

void launch_depthwise_planes(const Params& p, const ConvGeo& cg, int fmt, const Config& c, cudaStream_t stream) {
  const int i = dp_cfg_index(p, c);
  TORCH_CHECK(i >= 0, "depthwise_planes: no configuration ", depthwise_planes_config_name(c), " for this shape");
  // int16 entries only, and inputs read as aligned words: the rest (a table whose products need int32, an input
  // view off a word) runs depthwise_rows' single table, which takes both
  TORCH_CHECK(p.Tdw, "depthwise_planes: its channels' tables were not prepared (tables.cu)");
  if (fmt != 1 || !dp_inputs_ok(p)) {
    TORCH_CHECK(p.epi.kind == 0, "depthwise_planes: no end in the stores here (depthwise_planes_applies_end)");
    return launch_depthwise_rows(p, cg, fmt, kDrSingle, 0, stream);
  }
  if (p.epi.kind == 1) dp_launch_cfg<0, 1>(p, i, stream);
  else if (p.epi.kind == 2) dp_launch_cfg<0, 2>(p, i, stream);
  else dp_launch_cfg<0, 0>(p, i, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace approx_cuda
