// CPU kernel of approx::lut_bmm (arithmetic: ../ops.cpp): out[i] = lut_linear(a[i], b[i]) for every batch i,
// both operands dynamic (attention's Q.K^T and P.V).
//
// No operand is constant, so lut_linear's weight-expanded tables (256 x K x N entries per batch) would cost
// more to build than the M x K x N lookups they save for attention's M ~ N ~ 200. The kernel is the direct
// lookup, vectorised over output columns:
//   1. once per call, the effective table E[row(a)][b + 128]: the LUT itself for a signed multiplier, with
//      b's sign folded in (E[a][c] = sign(c - 128) * lut[a][|c - 128|]) for an unsigned one, so both kinds
//      run one loop and need no per-product sign;
//   2. per task (one batch, a block of rows), b[i] transposed to column indices C[k][n] = b[i, n, k] + 128,
//      n padded to a multiple of 8, so 8 consecutive outputs' indices are one vector load;
//   3. per row m and 32 columns, four int32 accumulators of 8 lanes; per tap k one row pointer
//      E + row(a[m, k]) * 256 and four AVX2 gathers (one 1 KiB table row per tap, the whole 256 KiB table
//      stays in L2). The adds wrap like lut_linear's int32 accumulators.
// Tasks are (batch, row block) pairs over at::parallel_for: whole batches when there are enough of them
// (attention has B = images x heads), smaller row blocks otherwise, so two cores stay busy on one head.
// Without AVX2 (or with APPROX_RUN_CPU_ISA=base) a scalar loop over E computes the same sums.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../checks.h"
#include "cpu_isa.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct Bmm {
  const uint8_t* a;  // [B, M, K] codes as bytes; row(a) = code ^ xmask
  const int8_t* b;   // [B, N, K]
  const int32_t* E;  // [256][256] effective table
  int32_t* out;      // [B, M, N]
  int64_t B, M, N, K;
  uint8_t xmask;     // 0x80 for int8 a (a + 128), 0 for uint8
};

constexpr int64_t kPad = 8;

// C[k][n] = b[n, k] + 128 for n < N, 0 (any valid column; the lanes are never stored) up to Np.
void transpose_columns(const Bmm& p, int64_t i, int64_t Np, int32_t* C) {
  const int8_t* bi = p.b + i * p.N * p.K;
  for (int64_t k = 0; k < p.K; ++k) {
    int32_t* c = C + k * Np;
    for (int64_t n = 0; n < p.N; ++n) c[n] = (int32_t)bi[n * p.K + k] + 128;
    for (int64_t n = p.N; n < Np; ++n) c[n] = 0;
  }
}

__attribute__((target("avx2"))) void rows_avx2(const Bmm& p, int64_t i, int64_t m0, int64_t m1,
                                               const int32_t* C, int64_t Np) {
  alignas(32) int32_t tail[32];
  for (int64_t m = m0; m < m1; ++m) {
    const uint8_t* ar = p.a + (i * p.M + m) * p.K;
    int32_t* o = p.out + (i * p.M + m) * p.N;
    for (int64_t n0 = 0; n0 < Np; n0 += 32) {
      const int nv = (int)std::min<int64_t>(4, (Np - n0) / kPad);
      __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
      const int32_t* c = C + n0;
      if (nv == 4) {
        for (int64_t k = 0; k < p.K; ++k, c += Np) {
          const int32_t* row = p.E + ((int32_t)(ar[k] ^ p.xmask) << 8);
          const __m256i* cv = reinterpret_cast<const __m256i*>(c);
          acc0 = _mm256_add_epi32(acc0, _mm256_i32gather_epi32(row, _mm256_loadu_si256(cv), 4));
          acc1 = _mm256_add_epi32(acc1, _mm256_i32gather_epi32(row, _mm256_loadu_si256(cv + 1), 4));
          acc2 = _mm256_add_epi32(acc2, _mm256_i32gather_epi32(row, _mm256_loadu_si256(cv + 2), 4));
          acc3 = _mm256_add_epi32(acc3, _mm256_i32gather_epi32(row, _mm256_loadu_si256(cv + 3), 4));
        }
      } else {
        for (int64_t k = 0; k < p.K; ++k, c += Np) {
          const int32_t* row = p.E + ((int32_t)(ar[k] ^ p.xmask) << 8);
          const __m256i* cv = reinterpret_cast<const __m256i*>(c);
          acc0 = _mm256_add_epi32(acc0, _mm256_i32gather_epi32(row, _mm256_loadu_si256(cv), 4));
          if (nv > 1) acc1 = _mm256_add_epi32(acc1, _mm256_i32gather_epi32(row, _mm256_loadu_si256(cv + 1), 4));
          if (nv > 2) acc2 = _mm256_add_epi32(acc2, _mm256_i32gather_epi32(row, _mm256_loadu_si256(cv + 2), 4));
        }
      }
      const int64_t valid = std::min<int64_t>(32, p.N - n0);
      int32_t* dst = valid == 32 ? o + n0 : tail;
      __m256i* d = reinterpret_cast<__m256i*>(dst);
      _mm256_storeu_si256(d, acc0);
      if (nv > 1) _mm256_storeu_si256(d + 1, acc1);
      if (nv > 2) _mm256_storeu_si256(d + 2, acc2);
      if (nv > 3) _mm256_storeu_si256(d + 3, acc3);
      if (valid < 32) std::memcpy(o + n0, tail, valid * sizeof(int32_t));
    }
  }
}

void rows_base(const Bmm& p, int64_t i, int64_t m0, int64_t m1) {
  const int8_t* bi = p.b + i * p.N * p.K;
  for (int64_t m = m0; m < m1; ++m) {
    const uint8_t* ar = p.a + (i * p.M + m) * p.K;
    int32_t* o = p.out + (i * p.M + m) * p.N;
    for (int64_t n = 0; n < p.N; ++n) {
      const int8_t* br = bi + n * p.K;
      uint32_t s = 0;  // unsigned: wraps like an int32 accumulator, without signed overflow
      for (int64_t k = 0; k < p.K; ++k) s += (uint32_t)p.E[((ar[k] ^ p.xmask) << 8) | (uint8_t)(br[k] ^ 0x80)];
      o[n] = (int32_t)s;
    }
  }
}

// E[row][b + 128] (see the file comment).
std::vector<int32_t> effective_table(const at::Tensor& lut, bool is_unsigned) {
  const int32_t* L = lut.data_ptr<int32_t>();
  std::vector<int32_t> E(L, L + 65536);
  if (is_unsigned) {
    for (int r = 0; r < 256; ++r)
      for (int c = 0; c < 256; ++c) {
        const int v = c - 128;
        const uint32_t mag = (uint32_t)L[r * 256 + (v < 0 ? -v : v)];
        E[r * 256 + c] = v > 0 ? (int32_t)mag : v < 0 ? (int32_t)(0u - mag) : 0;
      }
  }
  return E;
}

at::Tensor lut_bmm_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& lut) {
  const auto s = approx_checks::check_bmm(a, b, lut, c10::DeviceType::CPU);
  at::Tensor out = at::empty({s.B, s.M, s.N}, a.options().dtype(at::kInt));
  if (out.numel() == 0) return out;
  if (s.K == 0) return out.zero_();
  const bool is_unsigned = a.scalar_type() == at::kByte;
  const std::vector<int32_t> E = effective_table(lut, is_unsigned);
  const Bmm p{static_cast<const uint8_t*>(a.data_ptr()), b.data_ptr<int8_t>(), E.data(), out.data_ptr<int32_t>(),
              s.B, s.M, s.N, s.K, (uint8_t)(is_unsigned ? 0 : 0x80)};
  // row blocks: whole batches when there are a few per thread, else about 4 tasks per thread (>= 16 rows,
  // so the per-task transpose of b stays a small share of the work)
  const int64_t threads = at::get_num_threads();
  const int64_t rows = s.B >= 4 * threads
                           ? s.M
                           : std::clamp<int64_t>((s.B * s.M + 4 * threads - 1) / (4 * threads), 16, s.M);
  const int64_t blocks = (s.M + rows - 1) / rows;
  const bool avx2 = approx_cpu::has_avx2();
  const int64_t Np = (s.N + kPad - 1) / kPad * kPad;
  // a thread's share at least ~1M MACs: a small call (a small ViT's head) is cheaper on one thread than
  // the wake-up and join of the others
  const int64_t grain = std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, rows * s.N * s.K));
  at::parallel_for(0, s.B * blocks, grain, [&](int64_t t0, int64_t t1) {
    std::vector<int32_t> C(avx2 ? s.K * Np : 0);
    int64_t have = -1;  // the batch whose columns C holds
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / blocks, m0 = (t % blocks) * rows, m1 = std::min(s.M, m0 + rows);
      if (!avx2) {
        rows_base(p, i, m0, m1);
        continue;
      }
      if (have != i) transpose_columns(p, i, Np, C.data()), have = i;
      rows_avx2(p, i, m0, m1, C.data(), Np);
    }
  });
  return out;
}

// lut_bmm_variant: the variants are the CUDA kernel's layouts; here every valid one is the one kernel.
at::Tensor lut_bmm_variant_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& lut, int64_t variant) {
  approx_checks::check_bmm_variant(variant);
  return lut_bmm_cpu(a, b, lut);
}

}  // namespace

TORCH_LIBRARY_IMPL(approx, CPU, m) {
  m.impl("lut_bmm", &lut_bmm_cpu);
  m.impl("lut_bmm_variant", &lut_bmm_variant_cpu);
}
