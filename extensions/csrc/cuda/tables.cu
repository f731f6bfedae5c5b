// Table preparation: effective products, int16 fit flags, conv tap table, weight-expanded tables.
//
// Per call (or once per cached layer, table_cache.cpp), a small "prep" kernel writes the
// effective product table E[a][w + 128] (weight sign folded in for unsigned multipliers) in int32
// and int16, and one flag per prep block saying whether every product fits int16. The main
// kernels read the flags on the device and take the int16 or the int32 path, so no call waits
// for the host. On the 3x3 depthwise shapes depthwise_planes takes, its channels' tables are built after prep (every
// variant's call prepares them, so the cached entry serves whichever auto picks: G x 4.5 KiB).
#include <c10/cuda/CUDAException.h>

#include <algorithm>

#include "kernels.h"

namespace approx_cuda {
namespace {

// ------------------------------------------------------------------------------------------------
// Prep: effective products (and their int16 transpose Et16), int16 fit flags, conv tap table.
__global__ void __launch_bounds__(kThreads) prep_kernel(const int32_t* __restrict__ lut, int uns,
                                                        int32_t* __restrict__ E32,
                                                        int16_t* __restrict__ E16,
                                                        int16_t* __restrict__ Et16, int* flags,
                                                        int4* __restrict__ kinfo, int nk, int K,
                                                        int kh, int kw, int dh, int dw, int H,
                                                        int W) {
  __shared__ int32_t rows[32 * 256];
  const int r0 = blockIdx.x * 32;
  const int4* src = reinterpret_cast<const int4*>(lut + r0 * 256);
#pragma unroll
  for (int i = 0; i < 32 * 256 / 4 / kThreads; ++i)
    reinterpret_cast<int4*>(rows)[threadIdx.x + i * kThreads] = src[threadIdx.x + i * kThreads];
  __syncthreads();
  int ok = 1;
  for (int e = threadIdx.x; e < 32 * 256; e += kThreads) {
    const int r = e >> 8, wi = e & 255, wv = wi - 128;
    uint32_t v;
    if (!uns) v = static_cast<uint32_t>(rows[e]);
    else if (wv > 0) v = static_cast<uint32_t>(rows[r * 256 + wv]);
    else if (wv < 0) v = 0u - static_cast<uint32_t>(rows[r * 256 - wv]);  // magnitude, then sign
    else v = 0u;  // sign(0) = 0: w = 0 contributes 0 (the contract in ops.cpp / runner/ops.py)
    const int sv = static_cast<int>(v);
    E32[r0 * 256 + e] = sv;
    E16[r0 * 256 + e] = static_cast<int16_t>(sv);
    Et16[wi * 256 + r0 + r] = static_cast<int16_t>(sv);
    ok &= (sv >= -32768 && sv <= 32767);
  }
  ok = __syncthreads_and(ok);
  if (threadIdx.x == 0) flags[blockIdx.x] = ok;
  if (kinfo) {
    const int taps = kh * kw;
    for (int k = blockIdx.x * kThreads + threadIdx.x; k < nk; k += kPrepBlocks * kThreads) {
      int4 ki = make_int4(0, 0, 0, 0);
      if (k < K) {
        const int c = k / taps, r = k - c * taps, i = r / kw, j = r - i * kw;
        ki.y = i * dh;
        ki.z = j * dw;
        ki.x = c * H * W + ki.y * W + ki.z;
        ki.w = 1;
      }
      kinfo[k] = ki;
    }
  }
}

// Expanded table, in the format the fit flags choose, group-major: T[g][ng][k][a][8 channels], so
// that one 8-channel group's rows for a run of taps are one contiguous block (a chunk copies as
// whole 32-byte sectors). One thread per pair of channels. 32-bit indices: the table budget keeps
// pairs far below 2^31 (64-bit divisions made this kernel a tenth of the five layers' time).
__global__ void build_table_kernel(Params p, int pairs) {
  const bool f16 = read_fits16(p.flags);
  for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < pairs; q += gridDim.x * blockDim.x) {
    const int jp = q & 3, rest = q >> 2;
    const int a = rest & 255, gk = rest >> 8;
    const int gng = gk / p.Kpad, k = gk - gng * p.Kpad;
    const int g = gng / p.NG, ng = gng - g * p.NG;
    const int n0 = ng * 8 + jp * 2;
    uint32_t v[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int n = n0 + t;
      v[t] = 0;
      if (k < p.K && n < p.N)
        v[t] = static_cast<uint32_t>(
            __ldg(p.E32 + a * 256 + (int)p.w[((long long)g * p.N + n) * p.K + k] + 128));
    }
    if (f16) {
      reinterpret_cast<uint32_t*>(const_cast<void*>(p.T))[q] =
          ((v[0] & 0xFFFFu) ^ 0x8000u) | (v[1] << 16);
    } else {
      reinterpret_cast<uint2*>(const_cast<void*>(p.T))[q] = make_uint2(v[0], v[1]);
    }
  }
}
// Pair-major copy of T for expanded_pairs: pair pr = channels 2pr, 2pr + 1 (int16 tables only).
__global__ void build_pairs_kernel(Params p, int np) {
  if (!read_fits16(p.flags)) return;  // int32 products: expanded_pairs reads T itself
  const uint32_t* src = static_cast<const uint32_t*>(p.T);
  uint32_t* dst = static_cast<uint32_t*>(const_cast<void*>(p.Tpairs));
  const int per = p.Kpad * 256, words = np * per;
  for (int q = blockIdx.x * blockDim.x + threadIdx.x; q < words; q += gridDim.x * blockDim.x) {
    const int pr = q / per, rest = q - pr * per;
    dst[q] = src[((long long)(pr >> 2) * per + rest) * 4 + (pr & 3)];
  }
}

constexpr int64_t kOffE32 = 256;
constexpr int64_t kOffE16 = kOffE32 + 256 * 256 * 4;
constexpr int64_t kOffEt16 = kOffE16 + 256 * 256 * 2;
constexpr int64_t kOffKinfo = kOffEt16 + 256 * 256 * 2;

}  // namespace

int64_t prep_bytes(const Params& p) { return round_up(kOffKinfo + (p.conv ? p.Kpad : 0) * 16, 256); }
int64_t table_bytes(const Params& p) { return (int64_t)p.G * p.Kpad * 256 * p.NG * 8 * 4; }
bool pairs_applies(const Params& p) { return !p.conv && p.N <= 16; }
int64_t pairs_bytes(const Params& p) {
  return pairs_applies(p) ? (int64_t)(p.N + 1) / 2 * p.Kpad * 256 * 4 : 0;
}

std::shared_ptr<Prepared> prepare(const Params& geo, const at::Tensor& lut, const ConvGeo& cg,
                                  bool need_table, cudaStream_t stream) {
  auto pr = std::make_shared<Prepared>();
  Params& p = pr->p;
  p = geo;
  const int64_t nk = p.conv ? p.Kpad : 0;
  const int64_t off_t = prep_bytes(p);
  const int64_t t_bytes = need_table ? table_bytes(p) : 0;
  const int64_t pa_bytes = need_table ? pairs_bytes(p) : 0;
  const int64_t dw_bytes = depthwise_planes_table_bytes(p, cg);
  pr->buf = at::empty({off_t + t_bytes + pa_bytes + dw_bytes}, lut.options().dtype(at::kByte));
  uint8_t* base = pr->buf.data_ptr<uint8_t>();
  p.flags = reinterpret_cast<int*>(base);
  p.E32 = reinterpret_cast<int32_t*>(base + kOffE32);
  p.E16 = reinterpret_cast<int16_t*>(base + kOffE16);
  p.Et16 = reinterpret_cast<int16_t*>(base + kOffEt16);
  p.kinfo = nk ? reinterpret_cast<int4*>(base + kOffKinfo) : nullptr;
  p.T = need_table ? base + off_t : nullptr;
  p.Tpairs = pa_bytes ? base + off_t + t_bytes : nullptr;
  p.Tdw = dw_bytes ? base + off_t + t_bytes + pa_bytes : nullptr;
  pr->has_table = need_table;
  pr->stream = stream;
  prep_kernel<<<kPrepBlocks, kThreads, 0, stream>>>(
      lut.data_ptr<int32_t>(), p.xmask == 0, const_cast<int32_t*>(p.E32),
      const_cast<int16_t*>(p.E16), const_cast<int16_t*>(p.Et16), const_cast<int*>(p.flags),
      const_cast<int4*>(p.kinfo),
      static_cast<int>(nk), p.K, cg.kh, cg.kw, cg.dh, cg.dw, p.H, p.W);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (dw_bytes) build_depthwise_planes_tables(p, const_cast<uint8_t*>(p.Tdw), stream);
  if (need_table) {
    const long long pairs = (long long)p.G * p.Kpad * 256 * p.NG * 4;
    TORCH_CHECK(pairs < (1ll << 31), "approx expanded table too large");
    const int blocks = static_cast<int>(std::min<long long>((pairs + 255) / 256, 16LL * sm_count()));
    build_table_kernel<<<blocks, 256, 0, stream>>>(p, static_cast<int>(pairs));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (pa_bytes) {
      const int words = static_cast<int>(pa_bytes / 4);
      build_pairs_kernel<<<std::min(64, (words + 255) / 256), 256, 0, stream>>>(p, (p.N + 1) / 2);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  return pr;
}

}  // namespace approx_cuda
