// expanded_smem / expanded_l2: the weight-expanded table T[g][ng][k][a][8 channels] =
// E[a][w[g*N + n][k]]; thread (rs, ng) sums R rows x 8 channels, one 16-byte load giving 8
// channels (int16) for one code. expanded_smem streams T through shared memory in chunks of taps
// (cp.async, double-buffered; <= 16 channels per group); expanded_l2 reads it straight from L2/L1
// (any shape: the general weight-expanded fallback).
#include "launch.cuh"
#include "ptx.cuh"

namespace approx_cuda {
namespace {

// Expanded: thread (rs, ng) sums R rows (rs + rowsets * i) x 8 channels (group ng of the block).
template <typename TT, int KC, int NGT, int R, bool SMEM>
__device__ __forceinline__ void expanded_body(const Params& p, uint8_t* smem) {
  const RowSets b(NGT ? NGT : p.NGB, R);
  const int NGB = b.NGB, rowsets = b.rowsets, Mb = b.Mb, grp = b.grp, ngz = b.ngz, ng = b.ng;
  const int tid = threadIdx.x, rs = b.rs;
  const long long m0 = b.m0;
  constexpr int VPR = sizeof(TT) == 2 ? 1 : 2;  // int4 per 8 channels
  constexpr int chunk_q = KC * 256 * VPR;  // int4 per chunk of one 8-channel group
  const long long gq = (long long)p.Kpad * 256 * VPR;  // int4 per 8-channel group
  const int4* Tg = static_cast<const int4*>(p.T) + (long long)grp * p.NG * gq;

  // Shared memory: [T buffers (SMEM)][staged codes][act Mb*KC][row info (conv)]
  uint8_t* sp = smem;
  int4* tb0 = reinterpret_cast<int4*>(sp);
  int4* tb1 = tb0 + (SMEM ? NGB * chunk_q : 0);
  sp += SMEM ? 2 * NGB * chunk_q * 16 : 0;
  uint8_t* st = sp;
  sp += p.stage_bytes;
  uint8_t* act = sp;
  sp += ((Mb * KC + 15) / 16) * 16;
  RowInfo ri{reinterpret_cast<long long*>(sp), reinterpret_cast<int*>(sp + Mb * 8)};
  if (p.conv) fill_rowinfo(p, grp, m0, Mb, ri);
  stage_codes(p, grp, m0, Mb, st);
  // codes of row lr, chunk c: act + lr * KC (gathered per chunk) or st + lr * Kpad + c * KC
  const int cstride = p.stage == 2 ? p.Kpad : KC;

  // smem chunk layout [group of the block][KC taps][256 codes][VPR]
  auto copy_chunk = [&](int c, int4* dst) {
    for (int q = tid; q < NGB * chunk_q; q += kThreads) {
      const int gl = q / chunk_q, r = q - gl * chunk_q;
      cp_async16(dst + q, Tg + min(ngz + gl, p.NG - 1) * gq + (long long)c * chunk_q + r);
    }
    cp_async_commit();
  };

  uint32_t s[R][4], h[R][4];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) s[i][j] = h[i][j] = 0;

  const int nchunks = p.Kpad / KC;
  if (SMEM) copy_chunk(0, tb0);
  __syncthreads();  // row info
  for (int c = 0; c < nchunks; ++c) {
    if (p.stage != 2) gather_tile<KC>(p, grp, m0, Mb, c * KC, act, ri, st);
    if (SMEM) {
      if (c + 1 < nchunks) {
        copy_chunk(c + 1, (c & 1) ? tb0 : tb1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
    }
    // Also where nothing is shared per chunk (staged rows, T from L2): warps that stay in step
    // share each tap's slice of T in L1 (measured: fc1 0.16 ms with, 0.26 ms without).
    __syncthreads();
    if (rs < rowsets) {
      // threads of groups past NG (last grid.z slice) read group NG - 1 and store nothing
      const int4* tq = SMEM ? ((c & 1) ? tb1 : tb0) + ng * chunk_q
                            : Tg + min(ngz + ng, p.NG - 1) * gq + (long long)c * chunk_q;
      const uint8_t* cbase = p.stage == 2 ? st + c * KC : act;
      // Padded taps hold zeros: the last chunk skips their loads; full chunks run unguarded so
      // that all their loads can be in flight together.
      const bool full = (c + 1) * KC <= p.K;
      const int kmax = min(KC, p.K - c * KC);
      auto chunk = [&](auto full_tag) {
        constexpr bool kFull = decltype(full_tag)::value;
#pragma unroll
        for (int i = 0; i < R; ++i) {
          const uint64_t codes = load_word<KC>(cbase + (rs + rowsets * i) * cstride);
#pragma unroll
          for (int kk = 0; kk < KC; ++kk) {
            if (!kFull && kk >= kmax) break;
            const int idx = static_cast<int>((codes >> (8 * kk)) & 255);
            add_row<TT, !SMEM>(tq + (kk * 256 + idx) * VPR, s[i], h[i]);
          }
        }
      };
      if (full) chunk(std::true_type{});
      else chunk(std::false_type{});
    }
    __syncthreads();
  }
  if (rs >= rowsets) return;
  store_rows<R>(p, b, [&](int i, uint32_t (&v)[8]) {
    finish_row<TT>(s[i], h[i], static_cast<uint32_t>(p.K), v);  // padded taps were skipped
  });
}

template <int KC16, int KC32, int NGT, int R, bool SMEM>
__global__ void __launch_bounds__(kThreads, 2) expanded_kernel(Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (read_fits16(p.flags))
    expanded_body<int16_t, KC16, NGT, R, SMEM>(p, smem);
  else
    expanded_body<int32_t, KC32, NGT, R, SMEM>(p, smem);
}

}  // namespace

bool smem_applies(const Params& p) { return p.NG <= 2; }

template <int KC16, int KC32, int NGT, int R>
void launch_exp_smem_t(Params p, cudaStream_t stream) {
  p.NGB = NGT;
  const int Mb = (kThreads / NGT) * R;
  const int64_t chunk16 = (int64_t)KC16 * 256 * NGT * 16, chunk32 = (int64_t)KC32 * 256 * NGT * 32;
  choose_stage(p, Mb, 32 << 10);
  const size_t smem = 2 * std::max(chunk16, chunk32) + p.stage_bytes +
                      round_up((int64_t)Mb * std::max(KC16, KC32), 16) + rowinfo_bytes(p, Mb);
  auto kern = expanded_kernel<KC16, KC32, NGT, R, true>;
  set_smem(kern, smem);
  kern<<<grid_for(p, Mb), kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_exp_smem(const Params& p, cudaStream_t stream) {
  // Chunks of 32 KiB: 8 taps of 16-byte (int16, 8-channel) rows, fewer for wider rows.
  if (p.NG == 1) launch_exp_smem_t<8, 4, 1, 8>(p, stream);
  else launch_exp_smem_t<4, 2, 2, 8>(p, stream);
}

template <int R>
void launch_exp_l2_t(Params p, cudaStream_t stream) {
  p.NGB = std::min(p.NG, kMaxNGB);
  const int Mb = (kThreads / p.NGB) * R;
  choose_stage(p, Mb, 64 << 10);
  const size_t smem = round_up((int64_t)Mb * 8, 16) + p.stage_bytes + rowinfo_bytes(p, Mb);
  auto kern = expanded_kernel<8, 8, 0, R, false>;
  set_smem(kern, smem);
  kern<<<grid_for(p, Mb), kThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_exp_l2(const Params& p, cudaStream_t stream) {
  const int ngb = std::min(p.NG, kMaxNGB);
  auto blocks = [&](int r) {
    const int64_t mb = (int64_t)(kThreads / ngb) * r;
    return (p.M + mb - 1) / mb * p.G * ((p.NG + ngb - 1) / ngb);
  };
  // Fewer rows per thread when more would leave SMs idle.
  const int64_t want = 2 * sm_count();
  if (blocks(4) >= want) launch_exp_l2_t<4>(p, stream);
  else if (blocks(2) >= want) launch_exp_l2_t<2>(p, stream);
  else launch_exp_l2_t<1>(p, stream);
}
}  // namespace approx_cuda
