// expanded_gemm_r16c: expanded_gemm's tall tile. Rows, taps, code staging and the int16-pair
// products are gemm.cu's (its header); the tile and the slot differ.
//
// gemm.cu's R = 8 tiles (1024 rows x 32 channels) use each built table entry 4 times, and the
// build (Et16 lines copied into a staging area, transposed into the slot) is about half of a
// stage's L1/shared wavefronts; ncu on an H200 (r8c, ResNet-50's 1x1 256 -> 64 at batch 64 and
// ViT-B/16's fc1) shows the L1/shared pipe 61-73 % busy against 30-35 % of issue slots. This tile
// is 2048 rows x 16 channels (a thread 16 rows x 4 channels: the same 64 accumulators), so a
// stage builds half the table (32 KiB) for the same products, and its 64 staging rows are copied
// once a stage, not in two halves.
//
// Slot: [code a][tap k of 4][8 pair words] (128 B a code; pair word pw holds channels 2 pw, 2 pw + 1
// of the tile as gemm.cu's pairs: the low one offset binary, the high one signed). Thread t: quad
// g = t >> 2 owns rows g + 128 i (i < 16), lane jj = t & 3 channels 4 jj .. 4 jj + 3, read as one
// LDS.64 (pair words 2 jj, 2 jj + 1) a row and tap. Conflicts: a 64-bit load is served a half warp
// at a time, 4 quads with unrelated codes; at step s quad qh = (lane >> 2) & 3 of its half warp
// reads tap s ^ qh, so the 4 quads read 4 different 32-byte quarters of their 128-byte rows: all
// 32 banks, whatever the codes. A row's code word is permuted once a stage so that byte s holds
// tap s ^ qh's code; a lookup's address is then a shift and a LOP3.
// Build: lane (tap kk, pair word pw) of warp w makes the words of codes 8 ab .. 8 ab + 7 (ab = w,
// w + 16) from staging rows (kk, 2 pw) and (kk, 2 pw + 1): a warp stores 32 consecutive words
// (all banks); the staging rows are ordered [tap][lo/hi channel][pair word], 528 B apart, so a
// quarter warp's 16-byte loads read 8 consecutive rows, 8 distinct bank groups.
// Shared memory: 2 slots (64 KiB), 2 x 2048 code words (16 KiB), staging 64 x 528 B (33 KiB), the
// rows' code addresses (24 KiB): 137 KiB. A 1x1 conv at stride 1 on planes of a multiple of 4 pixels (what auto's
// GEMM layout makes of most convs) copies its codes by cp.async instead, as r8c does (gemm.cuh's CodeCopies), into
// the addresses' area. Measured (H200): 13 % fewer shared-memory wavefronts than r8c, 24 % more instructions;
// faster on ViT-B/16's Linear layers, and with the copied codes on 36 of ResNet-50's 54 layers at batch 64 (auto's
// picks; benchmarks/imagenet.md, "The tall tile with codes by cp.async"). At 13 rows a thread (r13c, 1664 rows) it
// fills waves and last tiles differently, and auto picks it (and its splits) on 45 of those 54 layers and all of
// ViT-B/16's Linears (benchmarks/imagenet.md, "A second tall tile" and "Stride-1 3x3 convs"); tiles of equal rows,
// and 12 rows a thread, which filled two whole waves where 13 left SMs idle and still ran slower: "Tall tiles of
// equal rows".

#include <algorithm>

#include "gemm.cuh"

namespace approx_cuda {
namespace {

// R: rows a thread at most, 16 (2048 rows a block) or 13 (1664, expanded_gemm_r13c); a call's tiles share its rows
// equally (launch_tall_m).
constexpr int kTallRowsPerQuad = kGemmThreads / 4;  // a block's rows: R x this
constexpr int kTallBN = 16;          // channels a block: 4 a thread
constexpr int kTallSlot = 256 * 128;  // one stage's table: [code][4 taps][8 pair words]

// AC: the codes copied by cp.async (gemm.cuh's CodeCopies) into the rows' address area, which they then leave unused.
// EPI: a conv's end in place of the sums (Params::epi), as gemm.cu's tiles do it: the sums through shared memory,
// free after the stage loop (end_put, end_tile), then stored along each channel's plane.
template <int R, bool KX, bool SK, bool AC, bool EPI>
__device__ __forceinline__ void tall_body(const Params& p, uint8_t* smem) {
  // LR: rows a thread stages, the last partly past BM where BM is not a multiple of TH (R = 13)
  constexpr int TH = kGemmThreads, BM = R * kTallRowsPerQuad, LR = (BM + TH - 1) / TH;
  static_assert(!EPI || (BM + 2) * kTallBN * 4 <= 2 * kTallSlot + 2 * BM * 4 + 64 * kGemmRawRow + BM * 12,
                "the end's tile of sums fits the shared memory the stage loop used");
  const int t = threadIdx.x, g = t >> 2, jj = t & 3;
  const int warp = t >> 5, lane = t & 31, qh = (lane >> 2) & 3;
  // the tile's rows: p.rows_mb <= BM, the call's tiles of equal size (launch_tall_m)
  const long long m0 = (long long)blockIdx.x * p.rows_mb;
  const int n0 = blockIdx.y * kTallBN;
  const int2 stages = gemm_stages<SK>(p);
  const int qa = stages.x, qb = stages.y;
  if (SK && qa >= qb) return;
  uint32_t* cod = reinterpret_cast<uint32_t*>(smem + 2 * kTallSlot);  // [2][BM] code words
  uint8_t* stg = smem + 2 * kTallSlot + 2 * BM * 4;                   // 64 Et16 rows

  // The rows whose codes this thread stages (row t + TH * u of the tile; rows past M stay 0), where
  // their codes are kept in shared memory, each thread reading back only its own: in registers,
  // 12 of them through the loop, KxK convs spilled.
  const int rows = static_cast<int>(std::min<long long>(p.M - m0, p.rows_mb));
  long long* rbase = reinterpret_cast<long long*>(stg + 64 * kGemmRawRow);  // [BM]
  int* riyx = reinterpret_cast<int*>(rbase + BM);                          // [BM], KxK convs
#pragma unroll
  for (int u = 0; u < LR && !AC; ++u) {
    const int r = t + TH * u;
    if (r >= rows) continue;
    const GemmRow gr = gemm_row<KX>(p, m0 + r);
    rbase[r] = gr.base;
    if (KX) riyx[r] = gr.iyx;
  }
  auto codes_of = [&](int q, uint32_t (&cw)[LR]) {
#pragma unroll
    for (int u = 0; u < LR; ++u) {
      const int r = t + TH * u;
      cw[u] = r < rows ? gemm_codes<KX>(p, GemmRow{rbase[r], KX ? riyx[r] : 0}, 4 * q) : 0u;
    }
  };
  auto put_codes = [&](int slot, const uint32_t (&cw)[LR]) {
#pragma unroll
    for (int u = 0; u < LR; ++u)
      if (BM % TH == 0 || t + TH * u < BM) cod[slot * BM + t + TH * u] = cw[u];
  };
  uint8_t* codp = reinterpret_cast<uint8_t*>(rbase);  // AC: [2][4 taps][BM] bytes (16 KiB of the area's 24)
  const CodeCopies<BM, TH, LR, AC> copies(p, m0, m0 + rows, t);
  auto issue = [&](int q, int slot) { copies.issue(p, codp + slot * 4 * BM, q, t); };  // stage q's into codp[slot]
  auto convert = [&](int slot) { convert_codes<BM>(codp + slot * 4 * BM, cod + slot * BM, t); };
  const uint32_t cxm = AC ? 0x01010101u * p.xmask : 0u;  // copied codes are raw: LUT row = code ^ xmask

  // Staging row rr = kk * 16 + hl * 8 + pw: channel n0 + 2 pw + hl at tap 4 q + kk, the Et16 row of
  // its weight, copied by 8 lanes (lane rc the 16-byte pieces rc of its 4 lines: a warp-wide load
  // is 4 lines, a quarter warp's store 128 contiguous bytes). Taps past K, channels past N: zeros.
  const int rr0 = warp * 4 + (lane >> 3), rc = lane & 7, rk = rr0 >> 4;
  const int rn = n0 + 2 * (rr0 & 7) + ((rr0 >> 3) & 1);
  const uint8_t* rw = reinterpret_cast<const uint8_t*>(p.w) + (rn < p.N ? (long long)rn * p.K + rk : 0);
  const int rklim = rn < p.N ? p.K - rk : 0;
  auto raw_load = [&](int q, int4 (&L)[4]) { et16_load(p, rw, 4 * q, rklim, rc, L); };
  auto raw_store = [&](const int4 (&L)[4]) { et16_store(stg + rr0 * kGemmRawRow + rc * 16, L); };
  // The slot from the staging area (the header's build).
  auto transpose = [&](int slot) {
    const int kk = lane >> 3, pw = lane & 7;
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      const int ab = warp + 16 * v;
      const uint8_t* src = stg + (kk * 16 + pw) * kGemmRawRow + ab * 16;
      const int4 A = *reinterpret_cast<const int4*>(src), B = *reinterpret_cast<const int4*>(src + 8 * kGemmRawRow);
      put_pair_words(reinterpret_cast<uint32_t*>(smem + slot * kTallSlot) + ab * 8 * 32 + lane, A, B);
    }
  };

  // rows i of this quad are live while 128 i < left (a 32-bit compare against a constant)
  const int left = rows - g;
  uint32_t s[R][2], h[R][2], cr[R];
#pragma unroll
  for (int i = 0; i < R; ++i) s[i][0] = s[i][1] = h[i][0] = h[i][1] = 0;
  // byte st of cr: the code of tap st ^ qh
  const uint32_t rot = (0u ^ qh) | ((1u ^ qh) << 4) | ((2u ^ qh) << 8) | ((3u ^ qh) << 12);
  const uint32_t off = jj * 8;
  auto sum_steps = [&](int slot, int s0) {
    const uint8_t* base = smem + slot * kTallSlot;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      // rows past M in a live group of 4 sum code 0, never stored: a branch a row costs ~150
      // instructions a stage, none spills (ptxas hoists later rows' loads and spills then)
      if (i % 4 == 0 && 128 * i >= left) break;
#pragma unroll
      for (int st = s0; st < s0 + 2; ++st) {
        const uint32_t c = st == 0 ? cr[i] << 7 : cr[i] >> (8 * st - 7);
        const uint32_t a = (c & 0x7F80u) | (((st ^ qh) << 5) | off);
        const uint2 v = *reinterpret_cast<const uint2*>(base + a);
        s[i][0] += v.x;
        h[i][0] += static_cast<uint32_t>(static_cast<int>(v.x) >> 16);
        s[i][1] += v.y;
        h[i][1] += static_cast<uint32_t>(static_cast<int>(v.y) >> 16);
      }
    }
  };

  // Stage q's loop step builds slot q + 1 from the staging area (filled in step q - 1), copies
  // stage q + 2's rows into it once every warp has read it (barrier A), and sums stage q.
  {
    uint32_t cw[LR];
    int4 L[4];
    if (AC) first_copied_codes(qa, qb, issue, convert);
    else codes_of(qa, cw);
    raw_load(qa, L);
    raw_store(L);
    if (!AC) put_codes(qa & 1, cw);
    __syncthreads();
    transpose(qa & 1);
    if (qb - qa > 1) {
      __syncthreads();
      raw_load(qa + 1, L);
      raw_store(L);
    }
  }
  if (AC) cp_async_wait<0>();
  __syncthreads();
  for (int q = qa; q < qb; ++q) {
    const int slot = q & 1;
    const bool nxt = q + 1 < qb, nxt2 = q + 2 < qb;
    uint32_t cw[LR];
    int4 L[4];
    if (nxt) {  // slot ^ 1 was last read in stage q - 1, before the barrier that ended it
      if (AC) convert(slot ^ 1);  // stage q + 1's bytes, copied in step q - 1
      else codes_of(q + 1, cw);
      transpose(slot ^ 1);
      if (!AC) put_codes(slot ^ 1, cw);
    }
    if (AC && nxt2) issue(q + 2, slot);  // codp[slot] was converted in step q - 1
    if (nxt2) raw_load(q + 2, L);
#pragma unroll
    for (int i = 0; i < R; ++i) cr[i] = __byte_perm(cod[slot * BM + g + 128 * i] ^ cxm, 0, rot);
    sum_steps(slot, 0);
    if (nxt2) {
      __syncthreads();  // A: the staging area is read
      raw_store(L);
    }
    sum_steps(slot, 2);
    if (AC) cp_async_wait<0>();
    __syncthreads();
  }
  // the stages again, not kept live through the loop
  const uint32_t taps = gemm_taps<SK>(p);
  const bool add = SK && gridDim.z > 1;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (128 * i >= left) continue;
    uint32_t v[4];
    finish_row<int16_t, 2>(s[i], h[i], taps, v);
    if constexpr (EPI) end_put<BM, 4>(smem, g + 128 * i, 4 * jj, v);  // the loop's last barrier freed it all
    else gemm_store<4>(p, m0 + g + 128 * i, n0 + 4 * jj, v, add);
  }
  if constexpr (EPI) end_tile<BM, kTallBN, 4>(p, smem, m0, n0, rows);
}

// MODE: 1 int16 products; 0 the format read on the device (the int32 path where they do not fit,
// its first split doing all of a K split).
template <int MODE, int R, bool KX, bool SK, bool AC = false, bool EPI = false>
__global__ void __launch_bounds__(kGemmThreads, 1) tall_kernel(Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (MODE == 1 || read_fits16(p.flags))
    tall_body<R, KX, SK, AC, EPI>(p, smem);
  else
    gemm32_body<R, KX, kTallBN, EPI>(p);
}

template <int MODE, int R>
void launch_tall_m(const Params& p, int ks, cudaStream_t stream) {
  constexpr int BM = R * kTallRowsPerQuad;
  const size_t smem = gemm_tall_smem(R);
  TORCH_CHECK((long long)smem <= max_smem_optin(), "approx expanded_gemm_r", R, "c: needs ", I((int64_t)smem),
              " bytes of shared memory, the device allows ", I(max_smem_optin()));
  const int64_t bx = (p.M + BM - 1) / BM, by = (p.N + kTallBN - 1) / kTallBN;
  TORCH_CHECK(bx <= 0x7fffffff, "approx CUDA kernels: too many rows (", I(p.M), ")");
  TORCH_CHECK(by <= 65535, "approx expanded_gemm_r", R, "c: needs at most 65535 x 16 output channels");
  ks = std::max(1, std::min(ks, (p.K + 3) / 4));
  // The call's rows in bx tiles of equal size (a multiple of 16 rows, so the copied codes' fours stay whole), not
  // bx - 1 full ones and a remainder: a block's time goes with its live rows, so the tiles' waves end together
  // (ResNet-50's 3,136 rows of layer4 at batch 64: two tiles of 1,568, not 1,664 and 1,472).
  Params q = p;
  q.rows_mb = static_cast<int>(round_up((p.M + bx - 1) / bx, 16));
  auto kern = gemm_kx(p)             ? (ks > 1 ? tall_kernel<MODE, R, true, true> : tall_kernel<MODE, R, true, false>)
              : gemm_copies_codes(p) ? (ks > 1 ? tall_kernel<MODE, R, false, true, true>
                                               : tall_kernel<MODE, R, false, false, true>)
                                     : (ks > 1 ? tall_kernel<MODE, R, false, true>
                                               : tall_kernel<MODE, R, false, false>);
  if (p.epi.kind != 0) {
    // a conv's end: lut_ops.cpp's run_with_end runs it unsplit, with int16 products (int32 ones take gemm.cu's tile)
    TORCH_CHECK(MODE == 1 && ks == 1, "approx expanded_gemm_r", R,
                "c: a conv's end needs an unsplit tile of int16 products");
    if constexpr (MODE == 1)
      kern = gemm_kx(p)             ? tall_kernel<MODE, R, true, false, false, true>
             : gemm_copies_codes(p) ? tall_kernel<MODE, R, false, false, true, true>
                                    : tall_kernel<MODE, R, false, false, false, true>;
  }
  set_smem(kern, smem);
  if (ks > 1)  // the splits add into it
    C10_CUDA_CHECK(cudaMemsetAsync(p.out, 0, static_cast<size_t>(p.M) * p.Ntot * sizeof(int32_t), stream));
  kern<<<dim3(static_cast<unsigned>(bx), static_cast<unsigned>(by), ks), kGemmThreads, smem, stream>>>(q);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

size_t gemm_tall_smem(int r) {
  const int bm = r * kTallRowsPerQuad;
  return 2 * kTallSlot + 2 * bm * 4 + 64 * kGemmRawRow + bm * 12;
}

int64_t gemm_tall_blocks(const Params& p, int r) {
  const int bm = r * kTallRowsPerQuad;
  return (p.M + bm - 1) / bm * ((p.N + kTallBN - 1) / kTallBN);
}

void launch_gemm_tall(const Params& p, int mode, int r, int ks, cudaStream_t stream) {
  TORCH_CHECK(r == 16 || r == 13, "approx expanded_gemm: the tall tile takes 16 or 13 rows a thread, not ", r);
  if (mode == 1) r == 16 ? launch_tall_m<1, 16>(p, ks, stream) : launch_tall_m<1, 13>(p, ks, stream);
  else r == 16 ? launch_tall_m<0, 16>(p, ks, stream) : launch_tall_m<0, 13>(p, ks, stream);
}

}  // namespace approx_cuda
