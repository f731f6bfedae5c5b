// The standalone probe depthwise_planes (extensions/csrc/cuda/depthwise_planes.cu) was designed on: 3x3 depthwise
// convs of padding 1, a thread per (image plane, band of output rows), each input code read once from an entry that
// holds every product it feeds. A random table and weights, every output checked against a host reference, medians
// of CUDA-event timings after a spin kernel (as runner.evaluate.device_timer times), on 576 at 14x14, s2 and 960 at
// 7x7 at batch 64 and 256. It keeps the kernel as it was before its planes' words were loaded once (each word
// realigned while loading, with a second load), so DP_MODE 8 shows what that cost. Build and run on a GPU:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -DDP_MODE=M -o dp benchmarks/dw_planes_probe.cu
//   DP_PREP=1 ./dp        # DP_PREP=1: tables prepared on the host (as tables.cu does); DP_ONLY=i: one case, 3 runs
//
// DP_MODE takes the kernel apart (the outputs are then wrong, only the time counts): 0 as is; 1 no table reads (the
// adds stay); 2 no global stores; 3 neither; 4 loads, stage and stores but no reads and no adds; 5 an empty kernel on
// the same grid; 6 the planes' loads and stage only; 7 the same without the table's copy; 8 the same with one load a
// word. Results: benchmarks/imagenet.md, "Depthwise convs timed as a graph runs them" and "Depthwise convs: the
// planes' words loaded once".
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#include <algorithm>
#include <cstring>

#ifndef DP_MODE
#define DP_MODE 0
#endif
#define CK(x)                                                        \
  do {                                                               \
    cudaError_t e_ = (x);                                            \
    if (e_ != cudaSuccess) {                                         \
      printf("CUDA %s line %d\n", cudaGetErrorString(e_), __LINE__); \
      exit(1);                                                       \
    }                                                                \
  } while (0)

struct DpArgs {
  const uint8_t* a; const int8_t* w; const int16_t* Et16; int32_t* out; const uint8_t* ptab;
  int B, C; unsigned xmask; unsigned in_words;
};

template <bool HI>
__device__ __forceinline__ uint32_t add_half(uint32_t acc, uint32_t w) {
  return (uint32_t)__dp2a_lo((int)w, HI ? 0x100 : 1, (int)acc);
}

// where tap k's product lies: table base (bytes), entry bytes, word of the entry, high half; s16: int16 table
struct Loc { int base, es, word, hi, s16; };
template <int S>
__host__ __device__ constexpr Loc tap_loc(int k) {
  const int ky = k / 3, kx = k % 3;
  if (S == 1) return k < 8 ? Loc{0, 16, k / 2, k & 1, 0} : Loc{4096, 2, 0, 0, 1};
  const bool r2 = ky != 1, c2 = kx != 1;
  if (r2 && c2) return Loc{0, 8, ky == 2, kx == 2, 0};
  if (r2) return Loc{2048, 4, 0, ky == 2, 0};
  if (c2) return Loc{3072, 4, 0, kx == 2, 0};
  return Loc{4096, 2, 0, 0, 1};
}
constexpr int kTabBytes = 4608;

template <int S, int H, int W>
struct Shp {
  static constexpr int Ho = (H - 1) / S + 1, Wo = (W - 1) / S + 1, HW = H * W, HoWo = Ho * Wo;
  static constexpr int NW = (HW + 3) / 4, SW = NW | 1, OS = HoWo | 1;
};


// a code's byte offset in a table of 2^SH-byte entries, from its window word (byte BIT/8): one shift, one AND
template <int SH>
__device__ __forceinline__ uint32_t code_off(uint32_t w, int bit) {
  return (bit >= SH ? w >> (bit - SH) : w << (SH - bit)) & (255u << SH);
}

template <int S, int H, int W, int OY0, int OY1>
struct Band {
  static constexpr int Wo = (W - 1) / S + 1, NR = OY1 - OY0;
  static constexpr int IY0 = OY0 * S - 1 < 0 ? 0 : OY0 * S - 1;
  static constexpr int IY1 = (OY1 - 1) * S + 1 > H - 1 ? H - 1 : (OY1 - 1) * S + 1;
  static constexpr int W0 = (IY0 * W) >> 2, W1 = (IY1 * W + W - 1) >> 2, NWB = W1 - W0 + 1;
};

// one lane = one plane's band: wd its words W0..W1 (registers), so: its sums, lane's slot in the warp's out stage
template <int S, int H, int W, int OY0, int OY1>
__device__ __forceinline__ void dp_band(const uint32_t (&wd)[Band<S, H, W, OY0, OY1>::NWB], const uint8_t* tab,
                                        uint32_t (&acc)[Band<S, H, W, OY0, OY1>::NR * Band<S, H, W, OY0, OY1>::Wo]) {
  using BD = Band<S, H, W, OY0, OY1>;
  constexpr int Wo = BD::Wo, W0 = BD::W0;
  uint32_t pad[9];
#pragma unroll
  for (int k = 0; k < 9; ++k) {
    const Loc L = tap_loc<S>(k);
    if (L.s16) pad[k] = (uint32_t)(int32_t)*reinterpret_cast<const int16_t*>(tab + L.base);
    else {
      const uint32_t v = *reinterpret_cast<const uint32_t*>(tab + L.base + 4 * L.word);
      pad[k] = L.hi ? (uint32_t)((int32_t)v >> 16) : (uint32_t)(int32_t)(int16_t)v;
    }
  }
#pragma unroll
  for (int r = 0; r < BD::NR; ++r)
#pragma unroll
    for (int ox = 0; ox < Wo; ++ox) {
      uint32_t s = 0;
      const int oy = OY0 + r;
#pragma unroll
      for (int k = 0; k < 9; ++k) {
        const int iy = oy * S - 1 + k / 3, ix = ox * S - 1 + k % 3;
        if (iy < 0 || iy >= H || ix < 0 || ix >= W) s += pad[k];
      }
      acc[r * Wo + ox] = s;
    }
#pragma unroll
  for (int iy = BD::IY0; iy <= BD::IY1; ++iy) {
#pragma unroll
    for (int ix = 0; ix < W; ++ix) {
      const int b = iy * W + ix;
      const uint32_t wv = wd[(b >> 2) - W0];
      int need = 0;
#pragma unroll
      for (int k = 0; k < 9; ++k) {
        const int ky = k / 3, kx = k % 3, ny = iy + 1 - ky, nx = ix + 1 - kx;
        if (ny % S == 0 && nx % S == 0 && ny / S >= OY0 && ny / S < OY1 && ny >= 0 && nx >= 0 && nx / S < Wo)
          need |= 1 << k;
      }
      uint32_t ent[4] = {0, 0, 0, 0};
      int32_t e16 = 0;
      int wmask = 0;
      bool any_mid = false, any16 = false;
#pragma unroll
      for (int k = 0; k < 9; ++k)
        if (need >> k & 1) {
          const Loc L = tap_loc<S>(k);
          if (L.s16) any16 = true;
          else if (L.base == 0) wmask |= 1 << L.word;
          else any_mid = true;
        }
      const int BIT = 8 * (b & 3);
      if (DP_MODE & 1) {
        ent[0] = wv; ent[1] = wv >> 3; ent[2] = wv >> 5; ent[3] = wv >> 7; e16 = (int32_t)wv;
      } else if (wmask) {
        constexpr int SH0 = S == 1 ? 4 : 3;
        const uint8_t* e0 = tab + code_off<SH0>(wv, BIT);
        if (SH0 == 4 && (wmask & 12) && (wmask & 3)) {
          const uint4 v = *reinterpret_cast<const uint4*>(e0);
          ent[0] = v.x; ent[1] = v.y; ent[2] = v.z; ent[3] = v.w;
        } else if (SH0 == 4 && (wmask & 12)) {
          const uint2 v = *reinterpret_cast<const uint2*>(e0 + 8);
          ent[2] = v.x; ent[3] = v.y;
        } else if ((wmask & 3) == 3) {
          const uint2 v = *reinterpret_cast<const uint2*>(e0);
          ent[0] = v.x; ent[1] = v.y;
        } else if (wmask & 1) {
          ent[0] = *reinterpret_cast<const uint32_t*>(e0);
        } else {
          ent[1] = *reinterpret_cast<const uint32_t*>(e0 + 4);
        }
      }
      uint32_t mid = 0;
      if (S == 2 && any_mid && !(DP_MODE & 1))
        mid = *reinterpret_cast<const uint32_t*>(tab + ((iy & 1) ? 2048 : 3072) + code_off<2>(wv, BIT));
      if (any16 && !(DP_MODE & 1)) e16 = *reinterpret_cast<const int16_t*>(tab + 4096 + code_off<1>(wv, BIT));
#pragma unroll
      for (int k = 0; k < 9; ++k)
        if (need >> k & 1) {
          const Loc L = tap_loc<S>(k);
          const int ky = k / 3, kx = k % 3;
          const int o = ((iy + 1 - ky) / S - OY0) * Wo + (ix + 1 - kx) / S;
          if (L.s16) acc[o] += (uint32_t)e16;
          else {
            const uint32_t v = L.base == 0 ? ent[L.word] : mid;
            acc[o] = L.hi ? add_half<true>(acc[o], v) : add_half<false>(acc[o], v);
          }
        }
    }
  }
}

// a warp: 32 planes (images n0 .. n0 + 31 of channel ch), band rows OY0..OY1; ws: the warp's stage
template <int S, int H, int W, int OY0, int OY1>
__device__ __forceinline__ void dp_warp(const DpArgs& p, int ch, int n0, const uint8_t* tab, uint32_t* ws) {
  using G = Shp<S, H, W>;
  using BD = Band<S, H, W, OY0, OY1>;
  constexpr int NWB = BD::NWB, SW = NWB | 1, Wo = G::Wo, OS = (BD::NR * Wo) | 1;
  const int lane = threadIdx.x & 31;
  const int nimg = min(32, p.B - n0);
  const unsigned img_in = (unsigned)p.C * G::HW;
  const uint32_t* a32 = reinterpret_cast<const uint32_t*>(p.a);
  // stage the band's words of the warp's planes: f = lane + 32 i -> plane f / NWB, word f % NWB
  {
    uint32_t v[NWB];
#pragma unroll
    for (int i = 0; i < NWB; ++i) {
      const int f = lane + 32 * i, pp = f / NWB, j = f - pp * NWB;
      const unsigned pos = (unsigned)(n0 + pp) * img_in + (unsigned)ch * G::HW;
      const unsigned w0 = (pos >> 2) + BD::W0 + j;
      const unsigned sh = (pos & 3) * 8;
      v[i] = 0;
      if (pp < nimg) {
        v[i] = __ldg(a32 + w0);
        if (sh && DP_MODE != 8) v[i] = __funnelshift_r(v[i], w0 + 1 < p.in_words ? __ldg(a32 + w0 + 1) : 0u, sh);
      }
    }
#pragma unroll
    for (int i = 0; i < NWB; ++i) {
      const int f = lane + 32 * i, pp = f / NWB, j = f - pp * NWB;
      ws[pp * SW + j] = v[i];
    }
  }
  __syncwarp();
  uint32_t wd[NWB];
#pragma unroll
  for (int i = 0; i < NWB; ++i) wd[i] = ws[lane * SW + i];
  uint32_t acc[BD::NR * Wo];
  __syncthreads();  // the table (built while the planes loaded)
  if (DP_MODE == 6 || DP_MODE == 7 || DP_MODE == 8) {  // an impossible store keeps the loads
    if (wd[0] == 0x12345679u && wd[NWB - 1] == 7u) p.out[lane] = 1;
    return;
  }
  if (DP_MODE == 4) {
#pragma unroll
    for (int o = 0; o < BD::NR * Wo; ++o) acc[o] = wd[o % NWB];
  } else {
    dp_band<S, H, W, OY0, OY1>(wd, tab, acc);
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < BD::NR * Wo; ++i) ws[lane * OS + i] = acc[i];
  __syncwarp();
  const unsigned img_out = (unsigned)p.C * G::HoWo;
  int32_t* o = p.out + (unsigned)n0 * img_out + (unsigned)ch * G::HoWo + OY0 * Wo;
  for (int pp = 0; pp < nimg; ++pp, o += img_out) {
#pragma unroll
    for (int j = lane; j < BD::NR * Wo; j += 32) {
      const int32_t v = (int32_t)ws[pp * OS + j];
      if (!(DP_MODE & 2) || v == 0x12345679) o[j] = v;
    }
  }
}

template <int S, int H, int W, int NB, int BI>
__device__ __forceinline__ void dp_pick(int band, const DpArgs& p, int ch, int n0, const uint8_t* tab, uint32_t* ws) {
  using G = Shp<S, H, W>;
  constexpr int RB = (G::Ho + NB - 1) / NB;
  if constexpr (BI < NB) {
    constexpr int OY0 = BI * RB, OY1 = (BI + 1) * RB < G::Ho ? (BI + 1) * RB : G::Ho;
    if (band == BI) {
      if constexpr (OY0 < OY1) dp_warp<S, H, W, OY0, OY1>(p, ch, n0, tab, ws);
      else __syncthreads();
    } else {
      dp_pick<S, H, W, NB, BI + 1>(band, p, ch, n0, tab, ws);
    }
  }
}

template <int S, int H, int W, int NB>
constexpr int dp_stage_words() {  // a warp's stage: the larger of its band's words and its sums, over the bands
  using G = Shp<S, H, W>;
  constexpr int RB = (G::Ho + NB - 1) / NB;
  int most = 1;
  for (int bi = 0; bi < NB; ++bi) {
    const int oy0 = bi * RB, oy1 = (bi + 1) * RB < G::Ho ? (bi + 1) * RB : G::Ho;
    if (oy0 >= oy1) continue;
    const int iy0 = oy0 * S - 1 < 0 ? 0 : oy0 * S - 1, iy1 = (oy1 - 1) * S + 1 > H - 1 ? H - 1 : (oy1 - 1) * S + 1;
    const int nwb = (((iy1 * W + W - 1) >> 2) - ((iy0 * W) >> 2) + 1) | 1, os = ((oy1 - oy0) * G::Wo) | 1;
    most = nwb > most ? nwb : most;
    most = os > most ? os : most;
  }
  return 32 * most;
}

// IPB images a block (32 a warp) x NB bands: warp w takes band w / (IPB / 32), images (w % (IPB / 32)) * 32 ..
template <int S, int H, int W, int NB, int IPB, int MINB>
__global__ void __launch_bounds__(IPB * NB, MINB) dp_kernel(DpArgs p) {
  constexpr int TPB = IPB * NB, WI = IPB / 32;
  extern __shared__ __align__(16) uint8_t smem[];
  if (DP_MODE == 5) return;
  uint8_t* tab = smem;
  const int ch = blockIdx.y, tid = threadIdx.x, warp = tid >> 5;
  // the table; its loads go out with the planes' (dp_warp waits on both at once)
  if (DP_MODE == 7) {
  } else if (p.ptab) {
    const uint4* src = reinterpret_cast<const uint4*>(p.ptab + (size_t)ch * kTabBytes);
    for (int i = tid; i < kTabBytes / 16; i += TPB) reinterpret_cast<uint4*>(tab)[i] = __ldg(src + i);
  } else {
    const int8_t* wch = p.w + (long long)ch * 9;
    int wk[9];
#pragma unroll
    for (int k = 0; k < 9; ++k) wk[k] = __ldg(wch + k);
#pragma unroll
    for (int c0 = 0; c0 < 256; c0 += TPB) {
      const int c = c0 + tid;
      if (TPB >= 256 || c < 256) {
        const int16_t* et = p.Et16 + 128 * 256 + (c ^ p.xmask);
        uint32_t q[9];
#pragma unroll
        for (int k = 0; k < 9; ++k) q[k] = (uint32_t)(uint16_t)__ldg(et + wk[k] * 256);
        if (S == 1) {
          reinterpret_cast<uint4*>(tab)[c] =
              make_uint4(q[0] | q[1] << 16, q[2] | q[3] << 16, q[4] | q[5] << 16, q[6] | q[7] << 16);
        } else {
          reinterpret_cast<uint2*>(tab)[c] = make_uint2(q[0] | q[2] << 16, q[6] | q[8] << 16);
          reinterpret_cast<uint32_t*>(tab + 2048)[c] = q[1] | q[7] << 16;
          reinterpret_cast<uint32_t*>(tab + 3072)[c] = q[3] | q[5] << 16;
        }
        reinterpret_cast<int16_t*>(tab + 4096)[c] = (int16_t)q[S == 1 ? 8 : 4];
      }
    }
  }
  const int band = warp / WI, n0 = blockIdx.x * IPB + (warp % WI) * 32;
  uint32_t* ws = reinterpret_cast<uint32_t*>(smem + kTabBytes) + warp * dp_stage_words<S, H, W, NB>();
  if (n0 < p.B) dp_pick<S, H, W, NB, 0>(band, p, ch, n0, tab, ws);
  else __syncthreads();
}

__global__ void spin(long long ns) {
  long long t0 = clock64();
  while (clock64() - t0 < ns) {}
}

template <int S, int H, int W>
void reference(const std::vector<uint8_t>& a, const std::vector<int8_t>& w, const std::vector<int16_t>& et, int B,
               int C, unsigned xmask, std::vector<int32_t>& out) {
  using G = Shp<S, H, W>;
  out.assign((size_t)B * C * G::HoWo, 0);
  for (int n = 0; n < B; ++n)
    for (int c = 0; c < C; ++c)
      for (int oy = 0; oy < G::Ho; ++oy)
        for (int ox = 0; ox < G::Wo; ++ox) {
          int32_t s = 0;
          for (int k = 0; k < 9; ++k) {
            const int iy = oy * S - 1 + k / 3, ix = ox * S - 1 + k % 3;
            unsigned code = 0;
            if (iy >= 0 && iy < H && ix >= 0 && ix < W) code = a[(((size_t)n * C + c) * H + iy) * W + ix];
            s += et[(size_t)(w[c * 9 + k] + 128) * 256 + (code ^ xmask)];
          }
          out[(((size_t)n * C + c) * G::Ho + oy) * G::Wo + ox] = s;
        }
}

static int g_idx = 0;
template <int S, int H, int W, int NB, int IPB, int MINB>
void run(int C, int B, const char* tag, bool check) {
  const char* only = getenv("DP_ONLY");
  const int my = g_idx++;
  if (only && atoi(only) != my) return;
  const int reps = only ? 3 : 25;
  if (only) check = false;
  using G = Shp<S, H, W>;
  std::mt19937 rng(1234 + C + B);
  const size_t in_bytes = (size_t)B * C * H * W;
  std::vector<uint8_t> a(in_bytes);
  for (auto& x : a) x = rng() & 255;
  std::vector<int8_t> w((size_t)C * 9);
  for (auto& x : w) x = (int8_t)(rng() & 255);
  std::vector<int16_t> et(65536);
  for (auto& x : et) x = (int16_t)(rng() & 0xffff);
  const unsigned xmask = 0x80;
  uint8_t* da; int8_t* dw; int16_t* de; int32_t* dout;
  const size_t out_n = (size_t)B * C * G::HoWo;
  CK(cudaMalloc(&da, in_bytes + 16)); CK(cudaMalloc(&dw, w.size())); CK(cudaMalloc(&de, 65536 * 2));
  CK(cudaMalloc(&dout, out_n * 4));
  CK(cudaMemcpy(da, a.data(), in_bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dw, w.data(), w.size(), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(de, et.data(), 65536 * 2, cudaMemcpyHostToDevice));
  CK(cudaMemset(dout, 0xff, out_n * 4));
  std::vector<uint8_t> pt((size_t)C * kTabBytes);
  for (int ch = 0; ch < C; ++ch)
    for (int c = 0; c < 256; ++c) {
      uint32_t q[9];
      for (int k = 0; k < 9; ++k) q[k] = (uint16_t)et[(size_t)(w[ch * 9 + k] + 128) * 256 + (c ^ xmask)];
      uint8_t* t = pt.data() + (size_t)ch * kTabBytes;
      if (S == 1) {
        uint32_t v[4] = {q[0] | q[1] << 16, q[2] | q[3] << 16, q[4] | q[5] << 16, q[6] | q[7] << 16};
        memcpy(t + c * 16, v, 16);
      } else {
        uint32_t v[2] = {q[0] | q[2] << 16, q[6] | q[8] << 16};
        memcpy(t + c * 8, v, 8);
        uint32_t b = q[1] | q[7] << 16, cc = q[3] | q[5] << 16;
        memcpy(t + 2048 + c * 4, &b, 4);
        memcpy(t + 3072 + c * 4, &cc, 4);
      }
      int16_t d = (int16_t)q[S == 1 ? 8 : 4];
      memcpy(t + 4096 + c * 2, &d, 2);
    }
  uint8_t* dpt;
  CK(cudaMalloc(&dpt, pt.size()));
  CK(cudaMemcpy(dpt, pt.data(), pt.size(), cudaMemcpyHostToDevice));
  DpArgs p{da, dw, de, dout, getenv("DP_PREP") && atoi(getenv("DP_PREP")) ? dpt : nullptr, B, C, xmask,
           (unsigned)(in_bytes / 4)};
  const size_t smem = kTabBytes + (size_t)(IPB / 32) * NB * dp_stage_words<S, H, W, NB>() * 4;
  auto kern = dp_kernel<S, H, W, NB, IPB, MINB>;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid((B + IPB - 1) / IPB, C);
  kern<<<grid, IPB * NB, smem>>>(p);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  bool ok = true;
  if (check) {
    std::vector<int32_t> got(out_n), want;
    CK(cudaMemcpy(got.data(), dout, out_n * 4, cudaMemcpyDeviceToHost));
    reference<S, H, W>(a, w, et, B, C, xmask, want);
    size_t bad = 0;
    for (size_t i = 0; i < out_n; ++i) bad += got[i] != want[i];
    ok = bad == 0;
    if (!ok) printf("  MISMATCH %zu of %zu\n", bad, out_n);
  }
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int r = 0; r < reps; ++r) {
    spin<<<1, 1>>>(40000);
    CK(cudaEventRecord(e0));
    kern<<<grid, IPB * NB, smem>>>(p);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= (only ? 0 : 5)) ts.push_back(ms * 1000);
  }
  std::sort(ts.begin(), ts.end());
  int nreg = 0; cudaFuncAttributes at; CK(cudaFuncGetAttributes(&at, kern)); nreg = at.numRegs;
  int occ = 0; CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, IPB * NB, smem));
  const double macs = (double)B * C * G::HoWo * 9;
  printf("prep=%d %-14s C=%4d B=%4d NB=%d IPB=%3d regs=%3d blk/SM=%2d spill=%zu  med %7.2f us (min %7.2f max %7.2f)"
         "  %5.2f T MAC/s %s\n",
         p.ptab != nullptr, tag, C, B, NB, IPB, nreg, occ, (size_t)at.localSizeBytes, ts[ts.size() / 2], ts.front(),
         ts.back(),
         macs / ts[ts.size() / 2] / 1e6, check ? (ok ? "equal" : "DIFFERENT") : "");
  cudaFree(dpt); cudaFree(da); cudaFree(dw); cudaFree(de); cudaFree(dout);
}

int main(int argc, char** argv) {
  for (int B : {64, 256}) {
    const bool ck = DP_MODE == 0;
    run<2, 14, 14, 1, 64, 10>(576, B, "576@14 s2", ck);
    run<2, 14, 14, 1, 128, 5>(576, B, "576@14 s2", ck);
    run<1, 7, 7, 1, 64, 1>(960, B, "960@7 s1", ck);
    run<1, 7, 7, 1, 32, 1>(960, B, "960@7 s1", ck);
  }
  return 0;
}
