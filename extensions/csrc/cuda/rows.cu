// expanded_rows: linear layers of any width (see below).
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "launch.cuh"
#include "ptx.cuh"

namespace approx_cuda {
namespace {

// expanded_rows (linear): block = TH threads * R rows x one 8-channel group x one slice of the
// taps. Each thread keeps its R rows' codes for a chunk of taps in registers (one load per row,
// the next chunk's loaded while this one is summed); the group's table streams through shared
// memory in 32 KiB chunks (8 int16 taps or 4 int32 taps), copied by a warp of its own (see
// rows_body). Each block streams its slice of the table once per row tile, so L2 traffic is
// row tiles x table size: on sm_90 a thread-block cluster of `gridDim.y` blocks splits the taps
// instead, which allows 4x taller row tiles at the same parallelism; the blocks' partial sums
// (exact in int32) are added through distributed shared memory. Padded taps are summed too:
// their rows hold zero products, and the int16 offset counts them.
constexpr int kRowsChunkQ = 2048;  // int4 per chunk (32 KiB)

// Table chunk slots: two where three blocks share an SM (3 x 64 KiB), else three.
template <int TH, int R>
__host__ __device__ constexpr int rows_stages() {
  return TH == 256 && R <= 2 ? 2 : 3;
}

template <typename TT, int TH, int R>
__device__ __forceinline__ void rows_body(const Params& p, uint8_t* smem) {
  constexpr int S = rows_stages<TH, R>();
  constexpr int VPR = sizeof(TT) == 2 ? 1 : 2;
  constexpr int CQ = kRowsChunkQ, KC = CQ / (256 * VPR);
  const int tid = threadIdx.x, ng = blockIdx.z, ks = blockIdx.y, cs = gridDim.y;
  const long long m0 = (long long)blockIdx.x * p.rows_mb;
  const long long mlim = min(p.M, m0 + p.rows_mb);
  const int4* Tg = static_cast<const int4*>(p.T) + (long long)ng * p.Kpad * 256 * VPR;
  int4* buf = reinterpret_cast<int4*>(smem);
  const int nchunks = p.Kpad / KC;
  const int cb = static_cast<int>((long long)nchunks * ks / cs);
  const int ce = static_cast<int>((long long)nchunks * (ks + 1) / cs);
  const uint8_t* rowp[R];
  bool live[R];  // rows past the block's tile are skipped (whole warps, but for one)
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const long long m = m0 + tid + TH * i;
    live[i] = m < mlim;
    rowp[i] = p.a + (live[i] ? m : 0) * p.K;
  }
  auto load_chunk = [&](int c, uint64_t (&cw)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) cw[i] = load_codes<KC>(p, rowp[i], c * KC);
  };
  uint32_t s[R][4], h[R][4];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) s[i][j] = h[i][j] = 0;
  uint64_t cur[R], nxt[R];
#pragma unroll
  for (int i = 0; i < R; ++i) nxt[i] = 0;
  auto sum_chunk = [&](const int4* tb) {
#pragma unroll
    for (int kk = 0; kk < KC; ++kk)
#pragma unroll
      for (int i = 0; i < R; ++i) {
        if (!live[i]) continue;
        const int idx = static_cast<int>((cur[i] >> (8 * kk)) & 255);
        add_row<TT>(tb + (kk * 256 + idx) * VPR, s[i], h[i]);
      }
#pragma unroll
    for (int i = 0; i < R; ++i) cur[i] = nxt[i];
  };
  // An extra warp (threads TH..TH+31) copies the chunks of this block's taps (SlotPipe).
  SlotPipe<S> pipe(reinterpret_cast<uint64_t*>(smem + (size_t)S * CQ * 16), TH / 32);
  __syncthreads();
  const int lane = tid & 31;
  if (tid >= TH) {
    for (int c = cb; c < ce; ++c)
      pipe.template fill<CQ>(c - cb, buf + ((c - cb) % S) * CQ, Tg + (long long)c * CQ, lane);
    cp_async_wait<0>();  // this warp's copies land before it leaves
    if (cs == 1) return;
  } else {
    if (cb < ce) load_chunk(cb, cur);
    for (int c = cb; c < ce; ++c) {
      if (c + 1 < ce) load_chunk(c + 1, nxt);
      pipe.wait_full(c - cb);
      sum_chunk(buf + ((c - cb) % S) * CQ);
      pipe.release(c - cb, lane);
    }
  }
  const uint32_t taps = static_cast<uint32_t>((ce - cb) * KC);
  if (cs == 1) {
    const bool vec = (p.N & 3) == 0;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const long long m = m0 + tid + TH * i;
      if (m >= mlim) continue;
      uint32_t v[8];
      finish_row<TT>(s[i], h[i], taps, v);
      store8(p.out + m * p.N + ng * 8, ng * 8, p.N, vec, v);
    }
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Partials [R][TH][8] in this block's shared memory (the table slots are free once every
  // summing warp passed the last chunk, whose copies it waited for); block `ks` of the cluster
  // sums its share of them all.
  __syncthreads();
  uint32_t* part = reinterpret_cast<uint32_t*>(smem);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (tid >= TH) break;  // the copy warp
    uint32_t v[8];
    finish_row<TT>(s[i], h[i], taps, v);
    uint4* d = reinterpret_cast<uint4*>(part + (i * TH + tid) * 8);
    d[0] = make_uint4(v[0], v[1], v[2], v[3]);
    d[1] = make_uint4(v[4], v[5], v[6], v[7]);
  }
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  constexpr int P = R * TH * 8;
  const int lo = P * ks / cs, hi = P * (ks + 1) / cs;
  for (int f = lo + tid; f < hi && tid < TH; f += TH) {
    uint32_t sum = 0;
    for (int r = 0; r < cs; ++r) sum += cluster.map_shared_rank(part, r)[f];
    const int i = f / (TH * 8), t = (f >> 3) & (TH - 1), j = f & 7;
    const long long m = m0 + t + TH * i;
    const int n = ng * 8 + j;
    if (m < mlim && n < p.N) p.out[m * p.N + n] = static_cast<int32_t>(sum);
  }
  cluster.sync();  // no block leaves while another still reads its shared memory
#endif
}

// Blocks per SM (threads + the copy warp): 256, R <= 2: three (75 registers at most); R > 2: two;
// 512: two or one.
template <int TH, int R, int MODE>
__global__ void __launch_bounds__(TH + 32, TH == 256 ? (R <= 2 ? 3 : 2) : (R <= 2 ? 2 : 1)) rows_kernel(Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (MODE == 1 || (MODE == 0 && read_fits16(p.flags)))
    rows_body<int16_t, TH, R>(p, smem);
  else
    rows_body<int32_t, TH, R>(p, smem);
}

}  // namespace

bool rows_applies(const Params& p) { return !p.conv && p.NG <= 65535; }

// A launch configuration with a thread-block cluster of `cluster` blocks along grid axis `axis`
// (0: x, 1: y); cluster == 1 launches without the attribute. Not copyable: cfg points at attr.
struct ClusterLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr = {};
  ClusterLaunch(dim3 grid, int threads, size_t smem, cudaStream_t stream, int cluster, int axis) {
    cfg.gridDim = grid;
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = axis == 0 ? cluster : 1;
    attr.val.clusterDim.y = axis == 1 ? cluster : 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = cluster > 1 ? 1 : 0;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

template <int TH, int R, int MODE>
void launch_rows_t(const Params& p, int cs, cudaStream_t stream) {
  constexpr int S = rows_stages<TH, R>();
  const size_t smem = (size_t)kRowsChunkQ * 16 * S + 16 * S;  // chunk slots, then 2 S mbarriers
  auto kern = rows_kernel<TH, R, MODE>;
  set_smem(kern, smem);
  const int64_t bx = (p.M + p.rows_mb - 1) / p.rows_mb;
  TORCH_CHECK(bx <= 0x7fffffff, "approx CUDA kernels: too many rows (", I(p.M), ")");
  const ClusterLaunch l(dim3(static_cast<unsigned>(bx), cs, p.NG), TH + 32, smem, stream, cs, 1);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&l.cfg, kern, p));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Clusters need sm_90 hardware and this kernel built for it (an sm_80-only build runs there too).
static bool clusters_ok(const void* kern) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, bool> known;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find({dev, kern});
  if (it != known.end()) return it->second;
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  cudaFuncAttributes fa{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&fa, kern));
  return known[{dev, kern}] = major >= 9 && fa.binaryVersion >= 90;
}

// Blocks of one configuration an SM holds (registers and shared memory, see rows_kernel).
static int rows_blocks_per_sm(int th, int r) {
  return th == 256 ? (r <= 2 ? 3 : 2) : (r <= 2 ? 2 : 1);
}

int rows_max_cs(const Params& p, int fmt) {
  const int nchunks = p.Kpad / (fmt == 1 ? 8 : 4);
  const void* kern = fmt == 1 ? reinterpret_cast<const void*>(rows_kernel<256, 1, 1>)
                              : reinterpret_cast<const void*>(rows_kernel<256, 1, 2>);
  return clusters_ok(kern) ? std::min(8, std::max(1, nchunks)) : 1;
}

static int64_t rows_blocks(const Params& p, int r, int cs, int th = 256, int mb = 0) {
  if (mb == 0) mb = th * r;
  return (p.M + mb - 1) / mb * p.NG * cs;
}

// The same configuration with shorter row tiles, so that every SM gets the same number of blocks
// (e.g. fc2 at batch 10,000: 220 blocks of 512 rows leave 88 SMs with two and 44 with one; 264
// blocks of 417 rows give every SM two): `per_sm` blocks per SM, 0 = the fewest that hold all
// of the full tiles' blocks. Returns 0 where that changes nothing.
static int rows_balanced_mb(const Params& p, const Config& c, int per_sm = 0) {
  const int64_t sms = sm_count();
  const int64_t full = rows_blocks(p, c.r, c.cs, c.th);
  if (per_sm == 0) per_sm = static_cast<int>((full + sms - 1) / sms);
  const int64_t tiles = per_sm * sms / ((int64_t)p.NG * c.cs);
  if (tiles <= 0) return 0;
  const int64_t mb = (p.M + tiles - 1) / tiles;
  return mb < c.th * c.r && rows_blocks(p, c.r, c.cs, c.th, static_cast<int>(mb)) <= per_sm * sms
             ? static_cast<int>(mb) : 0;
}

// Without a timed trial (explicit expanded_rows, graph capture): two rows per thread, the
// smallest cluster that gives every SM a block, row tiles balanced over the SMs. On the H100 this
// is the fastest or within 3 % of it for the LeNet-5 fc layers (benchmarks/CUDA.md).
static Config rows_default(const Params& p, int fmt) {
  const int max_cs = rows_max_cs(p, fmt);
  Config c{1, max_cs};
  for (int cs = 1; cs <= max_cs; cs *= 2)
    if (rows_blocks(p, 2, cs) >= sm_count()) {
      c = Config{2, cs};
      break;
    }
  c.mb = rows_balanced_mb(p, c);
  return c;
}

// Candidates for auto's trial: every configuration that fills the GPU at least once.
std::vector<Config> rows_candidates(const Params& p, int fmt) {
  std::vector<Config> out{rows_default(p, fmt)};
  const int max_cs = rows_max_cs(p, fmt);
  for (int r : {4, 3, 2, 1})
    for (int cs = 1; cs <= max_cs; cs *= 2) {
      const int64_t b = rows_blocks(p, r, cs);
      const bool dup = r == out[0].r && cs == out[0].cs;
      if (!dup && b >= sm_count() && b <= 64 * sm_count()) out.push_back(Config{r, cs});
      // 512-thread blocks: twice the rows per pass over the table
      if ((r == 2 || r == 4) && rows_blocks(p, r, cs, 512) >= sm_count() &&
          rows_blocks(p, r, cs, 512) <= 32 * sm_count())
        out.push_back(Config{r, cs, 512});
    }
  const size_t n = out.size();
  for (size_t i = 0; i < n; ++i) {
    Config c = out[i];
    const int a = rows_balanced_mb(p, c), b = rows_balanced_mb(p, c, rows_blocks_per_sm(c.th, c.r));
    for (int mb : {a, b})
      if (mb > 0) {
        c.mb = mb;
        if (std::none_of(out.begin(), out.end(), [&](const Config& o) {
              return o.r == c.r && o.cs == c.cs && o.th == c.th && o.mb == c.mb;
            }))
          out.push_back(c);
      }
  }
  return out;
}

template <int MODE>
void launch_rows_cfg(const Params& p, const Config& c, cudaStream_t stream) {
  if (c.th == 512 && c.r == 4) launch_rows_t<512, 4, MODE>(p, c.cs, stream);
  else if (c.th == 512) launch_rows_t<512, 2, MODE>(p, c.cs, stream);
  else if (c.r == 4) launch_rows_t<256, 4, MODE>(p, c.cs, stream);
  else if (c.r == 3) launch_rows_t<256, 3, MODE>(p, c.cs, stream);
  else if (c.r == 2) launch_rows_t<256, 2, MODE>(p, c.cs, stream);
  else launch_rows_t<256, 1, MODE>(p, c.cs, stream);
}

template <int MODE>
void launch_rows_m(const Params& p, Config c, cudaStream_t stream) {
  if (c.r == 0) c = rows_default(p, MODE);
  Params q = p;
  q.rows_mb = c.mb > 0 ? c.mb : c.th * c.r;
  launch_rows_cfg<MODE>(q, c, stream);
}

void launch_rows(const Params& p, int fmt, Config c, cudaStream_t stream) {
  TORCH_CHECK(c.cs <= rows_max_cs(p, fmt), "expanded_rows: a cluster of ", I(c.cs),
              " blocks is more than this GPU, build or layer allows (", I(rows_max_cs(p, fmt)), ")");
  if (fmt == 1) launch_rows_m<1>(p, c, stream);
  else if (fmt == 2) launch_rows_m<2>(p, c, stream);
  else launch_rows_m<0>(p, c, stream);
}

// "expanded_rows_r<R>_c<CS>[_t512][_m<rows>]": one configuration of expanded_rows (tests, tuning):
// R rows per thread, a cluster of CS blocks, 256 (or 512) threads per block, and optionally fewer
// rows per block than threads x R. Returns "" when `name` is one, else what is wrong with it.
std::string parse_rows_config(const std::string& name, Config& c) {
  const std::string pre = "expanded_rows_r";
  int r = 0, cs = 0, th = 256, mb = 0, n = 0, n2 = 0;
  const char* rest = name.c_str() + pre.size();
  bool ok = std::sscanf(rest, "%d_c%d%n", &r, &cs, &n) == 2;
  if (ok && std::strncmp(rest + n, "_t512", 5) == 0) {
    th = 512;
    n += 5;
    ok = r == 2 || r == 4;
  }
  if (ok && rest[n] != 0)
    ok = std::sscanf(rest + n, "_m%d%n", &mb, &n2) == 1 && rest[n + n2] == 0 && mb >= 1;
  ok = ok && r >= 1 && r <= 4 && cs >= 1 && cs <= 8 && mb <= th * r;
  if (!ok)
    return "bad algo '" + name + "': expanded_rows_r<1..4>_c<1..8>[_t512][_m<rows>] (512 threads: "
           "r 2 or 4; rows per block at most threads x r)";
  c = Config{r, cs, th, mb};
  return "";
}

std::string rows_config_name(const Config& c) {
  if (c.r == 0) return "expanded_rows";
  return "expanded_rows_r" + std::to_string(c.r) + "_c" + std::to_string(c.cs) +
         (c.th == 512 ? "_t512" : "") + (c.mb ? "_m" + std::to_string(c.mb) : "");
}

}  // namespace approx_cuda
