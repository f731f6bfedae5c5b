// expanded_pairs: linear layers of at most 16 channels (see below).
#include <algorithm>

#include "launch.cuh"
#include "ptx.cuh"

namespace approx_cuda {
namespace {

// expanded_pairs (linear, N <= 16): a block sums one channel pair (one 4-byte word of T) over
// every tap for a tile of rows, so no partial sums cross blocks. What binds the narrow layers is
// the table each SM must pull from L2 (fc3: ~20 bytes a cycle an SM when all load at once); a
// pair's table is Kpad x 256 x 4 bytes (fc3: 88 KiB), and it streams through 8 KiB slots filled
// by a copy warp (SlotPipe), so the sums run while it arrives. Reads the pair-major copy of T
// built with T (tables.cu; int16 tables only).
constexpr int kPairsThreads = 512;
// 4 slots = 32 KiB (12 slots, the whole fc3 table in flight: 8.5 us, not faster)
constexpr int kPairsSlots = 4;
constexpr int kPairsChunk = 8 * 256;  // words: 8 taps

template <int MODE>
__global__ void __launch_bounds__(kPairsThreads + 32, 1) pairs_kernel(Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  constexpr int TH = kPairsThreads, S = kPairsSlots, CW = kPairsChunk;
  const int tid = threadIdx.x, pr = blockIdx.y;
  const long long m0 = (long long)blockIdx.x * p.rows_mb, m = m0 + tid;
  const bool live = tid < TH && m < min(p.M, m0 + p.rows_mb);
  const bool f16 = MODE == 1 || (MODE == 0 && read_fits16(p.flags));
  const int nchunks = p.Kpad / 8;
  const uint8_t* rowp = p.a + (live ? m : 0) * p.K;
  auto codes = [&](int c) { return load_codes<8>(p, rowp, c * 8); };
  uint32_t lo = 0, hi = 0;
  if (!f16) {  // int32 products: T's words straight from L2 (correct, not fast)
    if (!live) return;
    const uint2* T32 = static_cast<const uint2*>(p.T);
    for (int c = 0; c < nchunks; ++c) {
      const uint64_t cw = codes(c);
      for (int kk = 0; kk < 8; ++kk) {
        const int a = static_cast<int>((cw >> (8 * kk)) & 255);
        const long long row = ((long long)(pr >> 2) * p.Kpad + c * 8 + kk) * 256 + a;
        const uint2 x = __ldg(T32 + row * 4 + (pr & 3));
        lo += x.x;
        hi += x.y;
      }
    }
  } else {
    uint32_t* buf = reinterpret_cast<uint32_t*>(smem);
    SlotPipe<S> pipe(reinterpret_cast<uint64_t*>(smem + (size_t)S * CW * 4), TH / 32);
    __syncthreads();
    const int lane = tid & 31;
    if (tid >= TH) {  // the copy warp
      const int4* Tp = static_cast<const int4*>(p.Tpairs) + (long long)pr * p.Kpad * 64;
      for (int c = 0; c < nchunks; ++c)
        pipe.fill<CW / 4>(c, reinterpret_cast<int4*>(buf + (c % S) * CW),
                          Tp + (long long)c * (CW / 4), lane);
      cp_async_wait<0>();
      return;
    }
    uint32_t s = 0, h = 0;
    uint64_t cur = codes(0), nxt = 0;
    for (int c = 0; c < nchunks; ++c) {
      if (c + 1 < nchunks) nxt = codes(c + 1);
      pipe.wait_full(c);
      const uint32_t* tb = buf + (c % S) * CW;
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        const uint32_t x = tb[kk * 256 + static_cast<int>((cur >> (8 * kk)) & 255)];
        s += x;
        h += (uint32_t)((int)x >> 16);
      }
      cur = nxt;
      pipe.release(c, lane);
    }
    if (!live) return;
    lo = s - (h << 16) - 32768u * static_cast<uint32_t>(p.Kpad);
    hi = h;
  }
  int32_t* o = p.out + m * p.N + 2 * pr;
  if (2 * pr + 1 < p.N) {
    if ((p.N & 1) == 0) *reinterpret_cast<int2*>(o) = make_int2(lo, hi);
    else { o[0] = lo; o[1] = hi; }
  } else {
    o[0] = lo;
  }
}

}  // namespace

// Row tiles so that tiles x pairs blocks fill the SMs once (one block an SM), at most
// kPairsThreads rows a tile.
template <int MODE>
void launch_pairs_m(Params p, cudaStream_t stream) {
  const int np = (p.N + 1) / 2;
  int64_t tiles = std::max<int64_t>(1, sm_count() / np);
  tiles = std::max<int64_t>(tiles, (p.M + kPairsThreads - 1) / kPairsThreads);
  p.rows_mb = static_cast<int>((p.M + tiles - 1) / tiles);
  tiles = (p.M + p.rows_mb - 1) / p.rows_mb;
  TORCH_CHECK(tiles <= 0x7fffffff, "approx CUDA kernels: too many rows (", I(p.M), ")");
  const size_t smem = (size_t)kPairsSlots * kPairsChunk * 4 + 16 * kPairsSlots;
  auto kern = pairs_kernel<MODE>;
  set_smem(kern, smem);
  kern<<<dim3(static_cast<unsigned>(tiles), np), kPairsThreads + 32, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_pairs(const Params& p, int fmt, cudaStream_t stream) {
  if (fmt == 1) launch_pairs_m<1>(p, stream);
  else if (fmt == 2) launch_pairs_m<2>(p, stream);
  else launch_pairs_m<0>(p, stream);
}

}  // namespace approx_cuda
