// CUDA kernel of approx::lut_bmm (arithmetic: ../ops.cpp): out[i] = lut_linear(a[i], b[i]) per batch, both
// operands dynamic (attention's Q.K^T and P.V). Design (../README.md has the longer story):
//
// No operand is constant, so lut_linear's weight-expanded tables do not apply (a table per batch would take
// more writes than the batch has MACs); this is the direct lookup, one table read per MAC, from shared memory:
//   * a prep kernel writes the effective table E32[row(a)][b + 128] (b's sign folded in for unsigned
//     multipliers) and two flags: every E32 entry fits int16; (uint8 a) every lut[a][m], m <= 128, fits
//     uint16. The main kernel reads the flags on the device (no host wait) and takes one of three modes:
//       S16  E as int16 in shared memory, rows padded to 258 entries (row r's column c in bank
//            (r + c / 2) % 32, so the rows of a warp spread over the banks) -- signed tables;
//       U16  unsigned tables whose products exceed int16 (mul8u: up to 65025): the magnitude table
//            lut[a][0..128] as uint16 (66 KiB), the sign of b applied with one multiply-add per MAC;
//       G32  anything else (tables with products beyond 16 bits): E32 read through L1/L2 (__ldg).
//   * persistent blocks (one per SM: the int16 table is 129 KiB) load the table once and loop over
//     tiles (batch, row block, column block); per tile and chunk of KC taps the block stages its codes
//     transposed in shared memory ([KC][rows], [KC][cols]), so a thread's 4 rows' (4 columns') codes of a
//     tap are one 32-bit load;
//   * thread (tm, tn) of a TM x TN grid (TM * TN <= 256) sums R = 4 rows x C = 4 columns in int32
//     registers: per tap 2 code loads, 16 table reads and 16 adds (wrapping like lut_linear's int32
//     accumulators). TM x TN is chosen on the host per shape so the tiles cover M and N with the least
//     padding (197 tokens: 10 x 25 threads, tiles of 40 x 100, 1.5 % padding instead of 23 % with 64 x 64).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "../checks.h"

namespace {

constexpr int kThreads = 256;
constexpr int R = 4, C = 4;      // rows x columns per thread
constexpr int KC = 32;           // taps per staged chunk
constexpr int kMaxTile = 256;    // rows or columns of a tile at most (TM, TN in [1, 64])
constexpr int kS16Stride = 258;  // int16 entries per shared row in S16 mode
constexpr int kU16Stride = 130;  // uint16 entries per shared row in U16 mode (129 used)
constexpr int kTableBytes = 256 * kS16Stride * 2;
constexpr int kSmem = kTableBytes + 2 * KC * kMaxTile;

enum Mode { S16 = 0, U16 = 1, G32 = 2 };

// E32 and the flags: flags[0] = 1 while every E32 entry fits int16, flags[1] = 1 while every lut[r][m],
// m <= 128, fits uint16 (meaningful for uint8 a only). One thread per entry; flags start at 1.
__global__ void prep_kernel(const int32_t* __restrict lut, int32_t* __restrict E, int* flags, bool is_unsigned) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= 65536) return;
  const int r = e >> 8, c = e & 255, v = c - 128;
  int32_t val;
  if (is_unsigned) {
    const uint32_t mag = (uint32_t)__ldg(lut + r * 256 + (v < 0 ? -v : v));
    val = v > 0 ? (int32_t)mag : v < 0 ? (int32_t)(0u - mag) : 0;
    if (c <= 128) {
      const int32_t l = __ldg(lut + e);
      if (l < 0 || l > 65535) atomicAnd(flags + 1, 0);
    }
  } else {
    val = __ldg(lut + e);
  }
  E[e] = val;
  if (val < -32768 || val > 32767) atomicAnd(flags, 0);
}

struct Args {
  const uint8_t* a;
  const int8_t* b;
  const int32_t* lut;  // raw table (U16 mode)
  const int32_t* E;    // effective table
  const int* flags;
  int32_t* out;
  long long B, M, N;
  int K, TM, TN;
  long long mtiles, ntiles, tiles;
  unsigned xmask;  // code ^ xmask = row of E (0x80 for int8 a)
  bool is_unsigned;
};

template <int MODE>
__device__ __forceinline__ void run(const Args& p, uint8_t* smem) {
  const int tid = threadIdx.x;
  const int TM = p.TM, TN = p.TN, Mt = TM * R, Nt = TN * C;
  const int tm = tid / TN, tn = tid - (tid / TN) * TN;
  const bool active = tm < TM;
  int16_t* S = reinterpret_cast<int16_t*>(smem);
  uint16_t* U = reinterpret_cast<uint16_t*>(smem);
  uint8_t* as = smem + kTableBytes;   // [KC][Mt] codes, row(a) form
  uint8_t* bs = as + KC * kMaxTile;   // [KC][Nt] b codes (raw int8 bytes)
  if (MODE == S16) {
    for (int e = tid; e < 65536; e += kThreads) S[(e >> 8) * kS16Stride + (e & 255)] = (int16_t)__ldg(p.E + e);
  } else if (MODE == U16) {
    for (int e = tid; e < 256 * 129; e += kThreads) {
      const int r = e / 129, m = e - r * 129;
      U[r * kU16Stride + m] = (uint16_t)__ldg(p.lut + r * 256 + m);
    }
  }
  for (long long t = blockIdx.x; t < p.tiles; t += gridDim.x) {
    const long long i = t / (p.mtiles * p.ntiles), rem = t - i * p.mtiles * p.ntiles;
    const long long m0 = (rem / p.ntiles) * Mt, n0 = (rem - (rem / p.ntiles) * p.ntiles) * Nt;
    const uint8_t* ai = p.a + (i * p.M) * p.K;
    const int8_t* bi = p.b + (i * p.N) * p.K;
    uint32_t acc[R][C];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < C; ++c) acc[r][c] = 0;
    for (int k0 = 0; k0 < p.K; k0 += KC) {
      const int kn = min(KC, p.K - k0);
      __syncthreads();  // the previous chunk's (or tile's) reads are done; the table is stored
      // consecutive threads read consecutive taps of a row (coalesced), and store them transposed
      for (int e = tid; e < Mt * KC; e += kThreads) {
        const int r = e / KC, kk = e - r * KC;
        const long long m = m0 + r;
        uint8_t v = 0;
        if (m < p.M && kk < kn) v = ai[m * p.K + k0 + kk];
        as[kk * Mt + r] = (uint8_t)(v ^ p.xmask);
      }
      for (int e = tid; e < Nt * KC; e += kThreads) {
        const int c = e / KC, kk = e - c * KC;
        const long long n = n0 + c;
        int8_t v = 0;
        if (n < p.N && kk < kn) v = bi[n * p.K + k0 + kk];
        bs[kk * Nt + c] = (uint8_t)v;
      }
      __syncthreads();
      if (active) {
        for (int kk = 0; kk < kn; ++kk) {
          const uint32_t aw = *reinterpret_cast<const uint32_t*>(as + kk * Mt + tm * R);
          const uint32_t bw = *reinterpret_cast<const uint32_t*>(bs + kk * Nt + tn * C);
          int col[C], sgn[C];
#pragma unroll
          for (int c = 0; c < C; ++c) {
            const int bv = (int)(int8_t)((bw >> (8 * c)) & 255);
            if (MODE == U16) {
              col[c] = bv < 0 ? -bv : bv;
              sgn[c] = (bv > 0) - (bv < 0);
            } else {
              col[c] = bv + 128;
              sgn[c] = 1;
            }
          }
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const int row = (int)((aw >> (8 * r)) & 255);
#pragma unroll
            for (int c = 0; c < C; ++c) {
              if (MODE == S16) {
                acc[r][c] += (uint32_t)(int32_t)S[row * kS16Stride + col[c]];
              } else if (MODE == U16) {
                acc[r][c] += (uint32_t)U[row * kU16Stride + col[c]] * (uint32_t)sgn[c];
              } else {
                acc[r][c] += (uint32_t)__ldg(p.E + row * 256 + col[c]);
              }
            }
          }
        }
      }
    }
    if (active) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const long long m = m0 + tm * R + r;
        if (m >= p.M) break;
        int32_t* o = p.out + (i * p.M + m) * p.N;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          const long long n = n0 + tn * C + c;
          if (n < p.N) o[n] = (int32_t)acc[r][c];
        }
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) lut_bmm_kernel(Args p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const bool fits16 = p.flags[0] != 0, fitsu16 = p.is_unsigned && p.flags[1] != 0;
  if (fitsu16 && !fits16)
    run<U16>(p, smem);
  else if (fits16)
    run<S16>(p, smem);
  else
    run<G32>(p, smem);
}

// The thread grid (TM rows x TN columns of threads, TM * TN <= 256) whose tiles pad M and N least: the work
// computed (padded rows x padded columns, idle threads counted) over the useful work. Ties go to the larger
// tile (fewer code loads per MAC).
void choose_grid(int64_t M, int64_t N, int& TM, int& TN) {
  double best = 1e300;
  for (int tn = 1; tn <= kMaxTile / C; ++tn)
    for (int tm = std::min(kThreads / tn, kMaxTile / R); tm >= 1; --tm) {
      const int64_t mt = (int64_t)tm * R, nt = (int64_t)tn * C;
      const double rows = (double)((M + mt - 1) / mt * mt), cols = (double)((N + nt - 1) / nt * nt);
      const double cost = rows * cols * kThreads / ((double)tm * tn);
      if (cost < best * (1 - 1e-9) || (cost <= best * (1 + 1e-9) && tm * tn > TM * TN)) {
        best = cost, TM = tm, TN = tn;
      }
    }
}

at::Tensor lut_bmm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& lut) {
  const auto s = approx_checks::check_bmm(a, b, lut, c10::DeviceType::CUDA);
  TORCH_CHECK(s.K < (1ll << 30), "lut_bmm: K must be below 2^30 on CUDA");
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor out = at::empty({s.B, s.M, s.N}, a.options().dtype(at::kInt));
  if (out.numel() == 0) return out;
  if (s.K == 0) return out.zero_();
  auto stream = c10::cuda::getCurrentCUDAStream();
  const bool is_unsigned = a.scalar_type() == at::kByte;
  at::Tensor E = at::empty({256, 256}, lut.options());
  at::Tensor flags = at::ones({2}, lut.options());
  prep_kernel<<<256, 256, 0, stream>>>(lut.data_ptr<int32_t>(), E.data_ptr<int32_t>(), flags.data_ptr<int>(),
                                       is_unsigned);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  Args p{};
  p.a = reinterpret_cast<const uint8_t*>(a.data_ptr());
  p.b = b.data_ptr<int8_t>();
  p.lut = lut.data_ptr<int32_t>();
  p.E = E.data_ptr<int32_t>();
  p.flags = flags.data_ptr<int>();
  p.out = out.data_ptr<int32_t>();
  p.B = s.B, p.M = s.M, p.N = s.N, p.K = (int)s.K;
  choose_grid(s.M, s.N, p.TM, p.TN);
  p.mtiles = (s.M + p.TM * R - 1) / (p.TM * R);
  p.ntiles = (s.N + p.TN * C - 1) / (p.TN * C);
  p.tiles = s.B * p.mtiles * p.ntiles;
  p.xmask = is_unsigned ? 0u : 0x80u;
  p.is_unsigned = is_unsigned;
  int dev = 0, sms = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  TORCH_CHECK(kSmem <= optin, "lut_bmm: the CUDA kernel needs " + std::to_string(kSmem) +
                                  " bytes of shared memory per block, the device allows " + std::to_string(optin));
  // per call: cheap next to a launch, and right when the process moves to another device
  C10_CUDA_CHECK(cudaFuncSetAttribute(lut_bmm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const int64_t grid = std::min<int64_t>(p.tiles, sms);
  lut_bmm_kernel<<<(unsigned)grid, kThreads, kSmem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(approx, CUDA, m) { m.impl("lut_bmm", &lut_bmm_cuda); }
