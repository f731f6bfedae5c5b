// expanded_gemm: linear layers and convolutions of one group (any kernel size, stride, padding
// and dilation) as a GEMM-like tiling, for large K and N (ResNet-50's convs, ViT's Linear layers).
//
// Convs are an implicit im2col: row m = output pixel (b, oy, ox), tap k = (c, ky, kx) with
// k = (c * kh + ky) * kw + kx, so the weights [N][C][kh][kw] are already [N][K]. Only the code
// staging differs from a linear layer's. 1x1: a row's taps are one input pixel's channels, the
// pixel in the padding or not for all of them. KxK (the KX instantiation): a row keeps where its
// tap (0, 0, 0) would read and that pixel's (iy, ix); a stage's 4 taps take {offset, dy, dx} from
// the conv's tap table (one broadcast load each, no division), and each tap tests its own pixel
// against the padding (a padded tap reads code 0, through the LUT like any code, as everywhere).
//
// Block tile: BM = 128 * R rows x 32 output channels (R = 2, 4 or 8 rows a thread), 512 threads.
// Threads form quads (4 lanes); quad g owns rows g + 128 * i (i < R), lane j of it channels
// 8j..8j+7 of the tile, as 4 int16 pairs (offset binary, gather.cuh): R x 8 int32 accumulators.
// Taps go in stages of 4 (2 tap pairs). Per stage the block builds the table slice
// T[k][a][32 channels] of its 4 taps in shared memory, straight from Et16 (E transposed: the 256
// products of one weight value are 512 contiguous bytes, so a 16-byte load gives 8 codes of one
// channel), two channels' values interleaved into one 32-bit word per code by byte_perm. No
// weight-expanded table T in global memory, hence no table budget: ViT's 768x3072 layers (T over
// 1 GiB) run too. Each code of a row is read once from shared memory per stage (as part of a
// 32-bit word of 4 taps) and used for 32 channels; each table word read gives 2 products.
//
// Shared memory per stage: 4 taps x 256 codes x 32 channels x 2 B = 64 KiB; two slots (the next
// stage is built while this one is summed) = 128 KiB, plus the staged codes 2 x BM x 4 B (8 KiB
// at R = 8): 136 KiB, one block an SM (its 512 threads take <= 128 registers each).
//
// Layout of a slot: [tap pair tp][code a][tap parity e][16 words: channel pairs 0..15], 128 B
// per (tp, a). Bank conflicts: lane j of a quad reads the 16 bytes of its 4 pairs (LDS.128), so a
// quad reads 64 contiguous bytes of one code's row; a 128-bit load is served a quarter warp at a
// time, i.e. two quads with unrelated (random) codes. Quads of even g read tap 2tp first (half
// e = 0), quads of odd g tap 2tp + 1 first (half e = 1), then the other: at every load the two
// quads of a quarter warp read opposite 64-byte halves of 128-byte lines, all 32 banks, whatever
// their codes (conflict-free by construction, not by luck). The codes of a quad's row are read
// as one broadcast word per stage. Building: a warp stores 32 words of one (tp, a) (lane =
// (e, pair)): 32 banks.
//
// Where the time goes, r8w, r8c and the K split (_k<ks>): the design and its measurements are in
// extensions/csrc/README.md ("expanded_gemm: where the time goes").

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "gemm.cuh"
#include "ptx.cuh"

namespace approx_cuda {
namespace {

constexpr int kGemmBN = 32;                    // channels a block
constexpr int kGemmSlot = 2 * 256 * 128;       // bytes of one stage's table (4 taps)

// BUILD: 0 scattered Et16 loads (expanded_gemm_r<R>); 1 WH (expanded_gemm_r8w): a lane's 2 weight
// bytes loaded once a half stage, not once a piece; 2 CO (expanded_gemm_r8c): whole Et16 lines
// copied into a staging area, the slot built from there (the header).
// KX: a conv with a kernel larger than 1x1 (gemm_kx), its own instantiation so that the linear
// and 1x1 paths keep their code and registers. SK: K split over gridDim.z blocks (_k<ks>), its own
// instantiation too: the others keep theirs (the split's stage bounds and atomic stores cost R = 8
// tiles of the scattered builds spills). AC (CO only): a 1x1 conv at stride 1 without padding
// (H W % 4 == 0, C % 4 == 0) copies a stage's codes by cp.async (4 rows of one tap a copy, into
// plane-major bytes that the next step converts to row words), not through registers. ncu (H200,
// r8c, a 1x1 conv): a quarter of the warps' stall samples were long-scoreboard, 15 % on assembling
// the code bytes right after their loads; a copy has nothing to wait on until the stage's last
// barrier (1.10-1.21x on ResNet-50's 1x1 convs). A linear layer's rows the same way (4 bytes a
// row) ran 4-5 % slower (their 32 sectors a warp the same either way): not offered.
// past r8c's slots, codes, staging and copied codes: KB's row addresses (12 B a row)
constexpr int gemm_smem_kb_base(int bm) { return 2 * kGemmSlot + 2 * bm * 4 + 128 * kGemmRawRow + 8 * bm; }

template <int R, int BUILD, bool KX, bool SK, bool AC = false, bool EPI = false>
__device__ __forceinline__ void gemm16_body(const Params& p, uint8_t* smem) {
  constexpr int TH = kGemmThreads, BM = TH / 4 * R, LR = (BM + TH - 1) / TH;
  constexpr bool WH = BUILD == 1, CO = BUILD == 2;
  const int t = threadIdx.x, g = t >> 2, j = t & 3, par = g & 1;
  const int warp = t >> 5, lane = t & 31;
  const long long m0 = (long long)blockIdx.x * BM;
  const int n0 = blockIdx.y * kGemmBN;
  // its stages: all, or its K split's share (slot q & 1 holds stage q's table either way)
  const int2 stages = gemm_stages<SK>(p);
  const int qa = stages.x, qb = stages.y;
  if (SK && qa >= qb) return;
  uint32_t* cod = reinterpret_cast<uint32_t*>(smem + 2 * kGemmSlot);  // [2][BM] code words

  // the rows whose codes this thread stages (row t + TH * u of the tile); rows past M stay 0
  // (never stored)
  GemmRow crow[LR];
  bool cload[LR];
#pragma unroll
  for (int u = 0; u < LR; ++u) {
    const long long m = m0 + t + TH * u;
    cload[u] = t + TH * u < BM && m < p.M;
    crow[u] = cload[u] ? gemm_row<KX>(p, m) : GemmRow{0, 0};
  }
  auto codes_of = [&](int q, uint32_t (&cw)[LR]) {
#pragma unroll
    for (int u = 0; u < LR; ++u) cw[u] = cload[u] ? gemm_codes<KX>(p, crow[u], 4 * q) : 0u;
  };
  auto put_codes = [&](int slot, const uint32_t (&cw)[LR]) {
#pragma unroll
    for (int u = 0; u < LR; ++u)
      if (t + TH * u < BM) cod[slot * BM + t + TH * u] = cw[u];
  };
  uint8_t* codp = smem + 2 * kGemmSlot + 2 * BM * 4 + 128 * kGemmRawRow;  // AC: [2][4 taps][BM] bytes
  const CodeCopies<BM, TH, LR, AC> copies(p, m0, p.M, t);
  auto issue = [&](int q, int slot) { copies.issue(p, codp + slot * 4 * BM, q, t); };  // stage q's into codp[slot]
  auto convert = [&](int slot) { convert_codes<BM>(codp + slot * 4 * BM, cod + slot * BM, t); };
  const uint32_t cxm = AC || (KX && CO) ? 0x01010101u * p.xmask : 0u;  // raw codes: LUT row = code ^ xmask
  // KX with CO: a stage's code bytes loaded at the step's start and stored one STS.U8 each after
  // barrier A, nothing between load and store for ptxas to place where the load stalls
  // KB: the rows' code addresses in shared memory, each thread reading back its own (registers for the bytes)
  long long* rbase = reinterpret_cast<long long*>(smem + gemm_smem_kb_base(BM));
  int* riyx = reinterpret_cast<int*>(rbase + BM);
  // rows past M (most of a tile at batch 1) neither load nor store bytes: at ResNet's layer4 shapes at batch 1
  // they made r8c_k 20 % slower than the loads in registers, which skip them
  constexpr int kDead = 0x7FFF7FFF;  // riyx of a row past M
  if constexpr (KX && CO) {
#pragma unroll
    for (int u = 0; u < LR; ++u)
      if (t + TH * u < BM) rbase[t + TH * u] = crow[u].base, riyx[t + TH * u] = cload[u] ? crow[u].iyx : kDead;
  }
  auto load_bytes = [&](int q, uint32_t (&cb)[LR][4]) {
#pragma unroll
    for (int u = 0; u < LR; ++u) {
      const int r = t + TH * u;
      if (r >= BM || riyx[r] == kDead) continue;
      const int iyx = riyx[r];
      const long long base = rbase[r];
      const int iy0 = static_cast<int>(static_cast<short>(iyx & 0xFFFF)), ix0 = iyx >> 16;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int4 kc = __ldg(p.kinfo + 4 * q + c);
        const int iy = iy0 + kc.y, ix = ix0 + kc.z;
        cb[u][c] = 0;
        if ((unsigned)iy < (unsigned)p.H && (unsigned)ix < (unsigned)p.W) cb[u][c] = __ldg(p.a + base + kc.x);
      }
    }
  };
  auto put_bytes = [&](int slot, const uint32_t (&cb)[LR][4]) {
    uint8_t* cb8 = reinterpret_cast<uint8_t*>(cod + slot * BM);
#pragma unroll
    for (int u = 0; u < LR; ++u)
      if (t + TH * u < BM && riyx[t + TH * u] != kDead)  // a dead row's sums read stale bytes (a slot row), unused
#pragma unroll
        for (int c = 0; c < 4; ++c) cb8[4 * (t + TH * u) + c] = static_cast<uint8_t>(cb[u][c]);
  };
  constexpr bool KB = KX && CO;

  // Table build: a stage is 64 (tp, 8-code block) pieces x 32 lanes (e = lane >> 4, pair
  // pr = lane & 15); warp w builds pieces w + 16u, u < 4: u = 0, 1 tap pair 0, u = 2, 3 tap pair 1.
  const int e = lane >> 4, pr = lane & 15;
  const int nlo = n0 + 2 * pr, nhi = nlo + 1;
  const int4 zero = make_int4(0, 0, 0, 0);
  const long long wrow = p.K;  // weight row stride (bytes)
  auto load_half = [&](int q, int half, int4 (&A)[2], int4 (&B)[2]) {
    if constexpr (WH) {
      // a half's pieces are all of tap pair `half` (piece >> 5 == half), so of the one tap
      // k below: its 2 weight bytes loaded once, not once a piece; Et16 row of weight value w:
      // w + 128 = its byte ^ 0x80.
      const int k = 4 * q + 2 * half + e;
      uint32_t rl = 0, rh = 0;
      if (k < p.K) {
        if (nlo < p.N) rl = __ldg(reinterpret_cast<const uint8_t*>(p.w) + nlo * wrow + k) ^ 128u;
        if (nhi < p.N) rh = __ldg(reinterpret_cast<const uint8_t*>(p.w) + nhi * wrow + k) ^ 128u;
      }
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const int ab = (warp + 16 * v) & 31;
        A[v] = B[v] = zero;
        if (k < p.K) {
          if (nlo < p.N) A[v] = __ldg(reinterpret_cast<const int4*>(p.Et16 + rl * 256 + ab * 8));
          if (nhi < p.N) B[v] = __ldg(reinterpret_cast<const int4*>(p.Et16 + rh * 256 + ab * 8));
        }
      }
      return;
    }
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      const int piece = warp + 16 * (2 * half + v), tp = piece >> 5, ab = piece & 31;
      const int k = 4 * q + 2 * tp + e;
      A[v] = B[v] = zero;
      if (k < p.K) {
        if (nlo < p.N)
          A[v] = __ldg(reinterpret_cast<const int4*>(p.Et16 + ((int)__ldg(p.w + (long long)nlo * p.K + k) + 128) * 256 + ab * 8));
        if (nhi < p.N)
          B[v] = __ldg(reinterpret_cast<const int4*>(p.Et16 + ((int)__ldg(p.w + (long long)nhi * p.K + k) + 128) * 256 + ab * 8));
      }
    }
  };
  auto store_half = [&](int slot, int half, const int4 (&A)[2], const int4 (&B)[2]) {
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      // piece warp + 16 (2 half + v): tp = half, ab = warp + 16 v, so CO's addresses are one base
      // and constants (the general form left CO's loop short of registers: ptxas spilled)
      const int piece = warp + 16 * (2 * half + v);
      const int tp = CO ? half : piece >> 5, ab = CO ? warp + 16 * v : piece & 31;
      put_pair_words(reinterpret_cast<uint32_t*>(smem + slot * kGemmSlot) + ((tp * 256 + ab * 8) * 2 + e) * 16 + pr,
                     A[v], B[v]);
    }
  };

  // CO: the staging area holds a stage's 128 Et16 rows whole, row rr = (tap kk, lo/hi channel of
  // pair cp) = kk * 32 + hl * 16 + cp at rr * kGemmRawRow. Copy: 8 lanes a row, lane rc the 16-byte
  // pieces rc of its 4 lines, so a warp-wide load is 4 lines (4 wavefronts, not 32) and a quarter
  // warp's 16-byte store 128 contiguous bytes (all banks); a half stage is rows 64 half + 0..63.
  uint8_t* stg = smem + 2 * kGemmSlot + 2 * BM * 4;
  // a lane's channel is the same in both halves (rr0 < 64), its tap 2 half + (rr0 >> 5): one
  // weight pointer for both
  const int rr0 = warp * 4 + (lane >> 3), rc = lane & 7, rk = rr0 >> 5;
  const int rn = n0 + 2 * (rr0 & 15) + ((rr0 >> 4) & 1);
  const uint8_t* rw = reinterpret_cast<const uint8_t*>(p.w) + (rn < p.N ? (long long)rn * wrow + rk : 0);
  const int rklim = rn < p.N ? p.K - rk : 0;  // taps past K or channels past N: zero rows
  auto raw_load = [&](int q, int half, int4 (&L)[4]) { et16_load(p, rw, 4 * q + 2 * half, rklim, rc, L); };
  auto raw_store = [&](int half, const int4 (&L)[4]) { et16_store(stg + (64 * half + rr0) * kGemmRawRow + rc * 16, L); };
  // The slot from the staging area: the other builds' pieces and stores, their 16-byte loads from
  // the staging rows; a quarter warp reads rows kk * 32 + hl * 16 + 8 c .. + 7 (the row stride is
  // 33 16-byte bank groups), so 8 consecutive rows: all banks.
  auto transpose = [&](int slot) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      int4 A[2], B[2];
#pragma unroll
      for (int v = 0; v < 2; ++v) {
        const uint8_t* src = stg + ((2 * half + e) * 32 + pr) * kGemmRawRow + (warp + 16 * v) * 16;
        A[v] = *reinterpret_cast<const int4*>(src);
        B[v] = *reinterpret_cast<const int4*>(src + 16 * kGemmRawRow);
      }
      store_half(slot, half, A, B);
    }
  };

  bool live[R];
#pragma unroll
  for (int i = 0; i < R; ++i) live[i] = m0 + g + 128 * i < p.M;
  uint32_t s[R][4], h[R][4], cr[R];
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) s[i][jj] = h[i][jj] = 0;
  // A lookup's address as slot | code * 128 | off (disjoint bits; the other half's off0 ^ 64): a
  // shift and a LOP3. As tb + code * 128 + off, ptxas rematerialized off at every lookup. The
  // branch on live rows stays: without it ptxas hoists later rows' loads and spills.
  const uint32_t off0 = (par * 4 + j) * 16;
  auto sum_pair = [&](int slot, int tp) {
    const uint32_t b0 = slot * kGemmSlot | off0;
#pragma unroll
    for (int i = 0; i < R; ++i) {
      if (!live[i]) continue;
      const uint32_t c = cr[i] >> (16 * tp);
      const uint32_t a0 = ((c << 7) & 0x7F80u) | b0, a1 = (((c >> 1) & 0x7F80u) | b0) ^ 64u;
      add_row<int16_t>(reinterpret_cast<const int4*>(smem + tp * 32768 + a0), s[i], h[i]);
      add_row<int16_t>(reinterpret_cast<const int4*>(smem + tp * 32768 + a1), s[i], h[i]);
    }
  };

  const uint32_t swap = par ? 0x2301u : 0x3210u;  // odd quads: taps of a pair swapped (e = par ^ step)
  if constexpr (CO) {
    // Stage q's loop step builds slot q + 1 from the staging area (filled in step q - 1), copies
    // stage q + 2's rows into it once every warp has read it (barrier A), and sums stage q.
    {
      uint32_t cw[LR];
      int4 L[4];
      if (AC) first_copied_codes(qa, qb, issue, convert);
      else codes_of(qa, cw);
      if (KB) for (int u = 0; u < LR; ++u) cw[u] ^= 0x01010101u * p.xmask;  // raw, as put_bytes leaves them
      raw_load(qa, 0, L);
      raw_store(0, L);
      raw_load(qa, 1, L);
      raw_store(1, L);
      if (!AC) put_codes(qa & 1, cw);
      __syncthreads();
      transpose(qa & 1);
      if (qb - qa > 1) {
        __syncthreads();
        raw_load(qa + 1, 0, L);
        raw_store(0, L);
        raw_load(qa + 1, 1, L);
        raw_store(1, L);
      }
    }
    if (AC) cp_async_wait<0>();
    __syncthreads();
    for (int q = qa; q < qb; ++q) {
      const int slot = q & 1;
      const bool nxt = q + 1 < qb, nxt2 = q + 2 < qb;
      uint32_t cw[LR];
      uint32_t cb[LR][4];
      int4 L[4];
      if (nxt) {  // slot ^ 1 was last read in stage q - 1, before the barrier that ended it
        if (AC) convert(slot ^ 1);  // stage q + 1's bytes, copied in step q - 1
        if (KB) load_bytes(q + 1, cb);
        if (!AC && !KB) codes_of(q + 1, cw);
        transpose(slot ^ 1);
        if (!AC && !KB) put_codes(slot ^ 1, cw);  // here, not at the end: 2 registers fewer through the sums
      }
      if (AC && nxt2) issue(q + 2, slot);  // codp[slot] was converted in step q - 1
      if (nxt2) raw_load(q + 2, 0, L);
#pragma unroll
      for (int i = 0; i < R; ++i) cr[i] = __byte_perm(cod[slot * BM + g + 128 * i] ^ cxm, 0, swap);
      sum_pair(slot, 0);
      if (nxt2) {
        __syncthreads();  // A: the staging area is read
        raw_store(0, L);
        raw_load(q + 2, 1, L);
      }
      if (KB && nxt) put_bytes(slot ^ 1, cb);
      sum_pair(slot, 1);
      if (nxt2) raw_store(1, L);
      if (AC) cp_async_wait<0>();
      __syncthreads();
    }
  } else {
    {  // stage qa
      uint32_t cw[LR];
      int4 A[2], B[2];
      codes_of(qa, cw);
      load_half(qa, 0, A, B);
      store_half(qa & 1, 0, A, B);
      load_half(qa, 1, A, B);
      store_half(qa & 1, 1, A, B);
      put_codes(qa & 1, cw);
    }
    __syncthreads();
    for (int q = qa; q < qb; ++q) {
      const int slot = q & 1;
      const bool nxt = q + 1 < qb;
      uint32_t cw[LR];
      int4 A[2], B[2];
      if (nxt) {
        codes_of(q + 1, cw);
        load_half(q + 1, 0, A, B);
      }
#pragma unroll
      for (int i = 0; i < R; ++i) cr[i] = __byte_perm(cod[slot * BM + g + 128 * i], 0, swap);
      sum_pair(slot, 0);
      if (nxt) {  // slot ^ 1 was last read in stage q - 1, before the barrier that ended it
        store_half(slot ^ 1, 0, A, B);
        load_half(q + 1, 1, A, B);
      }
      sum_pair(slot, 1);
      if (nxt) {
        store_half(slot ^ 1, 1, A, B);
        put_codes(slot ^ 1, cw);
      }
      __syncthreads();
    }
  }
  // the stages again, not kept live through the loop (R = 8 has no register to spare)
  const uint32_t taps = gemm_taps<SK>(p);
  const bool add = SK && gridDim.z > 1;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (!live[i]) continue;
    uint32_t v[8];
    finish_row<int16_t>(s[i], h[i], taps, v);
    if constexpr (EPI) end_put<BM, 8>(smem, g + 128 * i, 8 * j, v);
    else gemm_store(p, m0 + g + 128 * i, n0 + 8 * j, v, add);
  }
  if constexpr (EPI) end_tile<BM, kGemmBN, 8>(p, smem, m0, n0, static_cast<int>(min(p.M - m0, (long long)BM)));
}

// EPI: a conv's end in the stores (Params::epi), its own instantiation: the others keep their code and registers.
template <int R, int MODE, int BUILD, bool KX, bool SK, bool AC = false, bool EPI = false>
__global__ void __launch_bounds__(kGemmThreads, 1) gemm_kernel(Params p) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (MODE == 1 || (MODE == 0 && read_fits16(p.flags)))
    gemm16_body<R, BUILD, KX, SK, AC, EPI>(p, smem);
  else
    gemm32_body<R, KX, kGemmBN, EPI>(p);
}

int64_t gemm_blocks(const Params& p, int r) {
  return (p.M + 128LL * r - 1) / (128LL * r) * ((p.N + kGemmBN - 1) / kGemmBN);
}

// Without a timed trial: the tallest tile that still gives every SM a block.
Config gemm_default(const Params& p) {
  for (int r : {8, 4})
    if (gemm_blocks(p, r) >= sm_count()) return Config{r};
  return Config{2};
}

// Shared memory of a tile of R rows a thread: two slots, the staged codes, CO's staging area.
constexpr size_t gemm_smem(int r, int build) {
  return 2 * kGemmSlot + 2 * (kGemmThreads / 4 * r) * 4 + (build == 2 ? 128 * kGemmRawRow + 20 * (128 * r) : 0);
}
// a conv's end stages the tile's int32 sums in it (end_put)
static_assert(gemm_smem(2, 0) >= kGemmBN * end_stride<256, 8>() * 4 &&
              gemm_smem(4, 0) >= kGemmBN * end_stride<512, 8>() * 4 &&
              gemm_smem(8, 0) >= kGemmBN * end_stride<1024, 8>() * 4);

template <int R, int MODE, int BUILD>
void launch_gemm_t(const Params& p, int ks, cudaStream_t stream) {
  constexpr int BM = kGemmThreads / 4 * R;
  const size_t smem = gemm_smem(R, BUILD);
  TORCH_CHECK((long long)smem <= max_smem_optin(), "approx expanded_gemm: needs ", I((int64_t)smem),
              " bytes of shared memory, the device allows ", I(max_smem_optin()));
  // only r8c's int16 path splits K (where the products do not fit int16 its first split does all)
  constexpr bool S2 = BUILD == 2 && MODE != 2;
  ks = S2 ? std::max(1, std::min(ks, (p.K + 3) / 4)) : 1;
  // CO's codes by cp.async where a 1x1 conv's layout allows it (gemm16_body's AC)
  constexpr bool CA = BUILD == 2;
  const bool ac = CA && gemm_copies_codes(p);
  auto kern = gemm_kx(p)
      ? (ks > 1 ? gemm_kernel<R, MODE, BUILD, true, S2> : gemm_kernel<R, MODE, BUILD, true, false>)
      : ac ? (ks > 1 ? gemm_kernel<R, MODE, BUILD, false, S2, CA> : gemm_kernel<R, MODE, BUILD, false, false, CA>)
           : (ks > 1 ? gemm_kernel<R, MODE, BUILD, false, S2> : gemm_kernel<R, MODE, BUILD, false, false>);
  if (p.epi.kind != 0) {
    // a conv's end: lut_ops.cpp's run_with_end runs it unsplit, with the tables' format known (MODE 1 or 2)
    TORCH_CHECK(MODE != 0 && ks == 1, "approx expanded_gemm: a conv's end needs an unsplit tile of known format");
    if constexpr (MODE != 0)
      kern = gemm_kx(p) ? gemm_kernel<R, MODE, BUILD, true, false, false, true>
                        : ac ? gemm_kernel<R, MODE, BUILD, false, false, CA, true>
                             : gemm_kernel<R, MODE, BUILD, false, false, false, true>;
  }
  set_smem(kern, smem);
  const int64_t bx = (p.M + BM - 1) / BM;
  TORCH_CHECK(bx <= 0x7fffffff, "approx CUDA kernels: too many rows (", I(p.M), ")");
  if (ks > 1)  // the splits add into it
    C10_CUDA_CHECK(cudaMemsetAsync(p.out, 0, static_cast<size_t>(p.M) * p.Ntot * sizeof(int32_t), stream));
  kern<<<dim3(static_cast<unsigned>(bx), (p.N + kGemmBN - 1) / kGemmBN, ks), kGemmThreads, smem, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// build: Config::build (0 scattered, 1 WH, 2 CO, 3 the tall CO tile); WH and CO are R = 8 tiles only.
template <int MODE>
void launch_gemm_m(const Params& p, const Config& c, cudaStream_t stream) {
  const int build = MODE == 2 ? 0 : c.build;
  if (build == 3) launch_gemm_tall(p, MODE, c.r, c.ks, stream);  // expanded_gemm_r16c, _r13c (gemm_tall.cu)
  else if (build == 1) launch_gemm_t<8, MODE, 1>(p, c.ks, stream);  // expanded_gemm_r8w
  else if (build == 2) launch_gemm_t<8, MODE, 2>(p, c.ks, stream);  // expanded_gemm_r8c
  else if (c.r == 8) launch_gemm_t<8, MODE, 0>(p, c.ks, stream);
  else if (c.r == 4) launch_gemm_t<4, MODE, 0>(p, c.ks, stream);
  else launch_gemm_t<2, MODE, 0>(p, c.ks, stream);
}

}  // namespace

// The K split that best fills the SMs with a tile's blocks: time ~ ceil(blocks x ks / SMs) / ks, each
// split >= min_stages stages, each larger split 3 % better than the last. 1: the tiles fill their waves.
int gemm_split(const Params& p, int64_t blocks, int min_stages) {
  const int64_t sms = sm_count();
  const int nst = (p.K + 3) / 4;
  int best = 1;
  double best_t = static_cast<double>((blocks + sms - 1) / sms);
  for (int ks = 2; ks <= 64 && nst / ks >= min_stages; ++ks) {
    const double t = static_cast<double>((blocks * ks + sms - 1) / sms) / ks;
    if (t < 0.97 * best_t) best = ks, best_t = t;
  }
  return best;
}

std::string gemm_why_not(const Params& p, const ConvGeo& cg) {
  (void)cg;  // any kernel size, stride, padding and dilation: the tap table says where a tap reads
  if (p.conv && p.G != 1) return "needs a linear layer or a conv of one group";
  if ((p.N + kGemmBN - 1) / kGemmBN > 65535) return "needs at most 65535 x 32 output channels";
  return "";
}

// A tile's K splits for auto to time: the one of >= 16 stages a split and, where it differs, the one of >= 8. The
// wave model alone misjudged small batches: at batch 1 the best split named on ResNet-50's 3x3 convs ran up to 2.1x
// faster than the one of >= 16 stages (64 at 56x56: k16, 9 stages a split, against k9). Where the tiles fill less
// than one wave, also the fewest blocks a tile that fill 90 % of their waves: the model counts waves only, not that
// each block pays a prologue and adds its partial sums (ResNet-50's layer4 at batch 64: r13c's 64 blocks in two
// ways fill 128 of 132 SMs; the model's 33 ways, 2,112 blocks of 35 stages each, gain 3 % in waves). There, also
// splits of 4, 2 and 1 stages: on short K at small batches they won by up to 1.38x (MobileNetV2's 1x1 convs at batch
// 8: 144x28 -> 32, 36 stages, r8c_k33 against r13c_k4), the block's prologue then short beside its table build.
static void add_splits(std::vector<Config>& out, Config c, const Params& p, int64_t blocks) {
  std::vector<int> seen;
  auto add = [&](int ks) {
    if (ks < 2 || std::find(seen.begin(), seen.end(), ks) != seen.end()) return;
    seen.push_back(ks);
    c.ks = ks;
    out.push_back(c);
  };
  add(gemm_split(p, blocks, 16));
  add(gemm_split(p, blocks, 8));
  const int64_t sms = sm_count();
  if (blocks >= sms) return;
  const int nst = (p.K + 3) / 4;
  for (int ks = 2; ks <= 64 && nst / ks >= 8; ++ks) {
    const int64_t b = blocks * ks;
    if (b * 10 < (b + sms - 1) / sms * sms * 9) continue;
    add(ks);
    break;
  }
  for (int per : {4, 2, 1}) add(std::min(64, (nst + per - 1) / per));
}

std::vector<Config> gemm_candidates(const Params& p, int fmt) {
  if (fmt == 2) return {};  // int32 products: the slow path
  std::vector<Config> out;
  if (gemm_kx(p)) {
    // KxK convs: auto times the direct and window variants too, so at most four configs here
    // (a first call of a large conv times each 7 times): the default tile, R = 4 (ResNet-50's
    // layer4 at 7x7 outputs fills the SMs at R = 2-4, not 8), and r8w and r8c in place of R = 8,
    // which r8w beat on every 1x1 shape measured
    const Config d = gemm_default(p);
    if (d.r != 8 || p.M <= 512) out.push_back(d);
    if (d.r != 4 && p.M > 256) out.push_back(Config{4});
  } else {
    out.push_back(gemm_default(p));
    for (int r : {8, 4, 2})  // taller tiles only where the shorter ones' rows do not fit one
      if (r != out[0].r && (r == 2 || p.M > 64LL * r)) out.push_back(Config{r});
  }
  const bool co = (long long)gemm_smem(8, 2) <= max_smem_optin();  // r8c's staging area fits
  if (p.M > 512) {  // expanded_gemm_r8w, expanded_gemm_r8c
    Config c{8};
    c.build = 1;
    out.push_back(c);
    c.build = 2;
    if (co) out.push_back(c);
  }
  // r8c with K split where its tiles leave SMs idle, at any row count (ResNet-50's layer4: 64 tiles
  // at batch 64, 16 at batch 1, each of 49 rows there)
  Config c{8};
  c.build = 2;
  if (co) add_splits(out, c, p, gemm_blocks(p, 8));
  // the tall tile (2048 rows x 16 channels: half the table build a product), where a tile's rows
  // are mostly live; split as r8c where its tiles leave SMs idle. The tile of 1664 rows (r13c) too: its blocks take
  // 0.81 of 16's time, so it fills the last wave and the last tile differently (ViT-B/16's fc1 at batch 64: r16c's
  // 1,344 blocks fill 10.2 of 11 waves of 132 SMs, r13c's 1,536 11.6 of 12 shorter ones, 1.12x faster; on an H200
  // auto picks r13c and its splits on 45 of ResNet-50's 54 layers at batch 64), at any size (ResNet-50's 64x56 ->
  // 256, 200,704 rows: 605 -> 579 us once timed there)
  for (int r : {16, 13}) {
    Config tall{r};
    tall.build = 3;
    if ((long long)gemm_tall_smem(r) > max_smem_optin() || p.M <= 1024 || (p.N + 15) / 16 > 65535) continue;
    out.push_back(tall);
    add_splits(out, tall, p, gemm_tall_blocks(p, r));
  }
  return out;
}

void launch_gemm(const Params& p, int fmt, Config c, cudaStream_t stream) {
  if (c.r == 0) c = gemm_default(p);
  // int32 products: the E32 path, as r8, whatever the build
  if (fmt == 1) launch_gemm_m<1>(p, c, stream);
  else if (fmt == 2) launch_gemm_m<2>(p, c, stream);
  else launch_gemm_m<0>(p, c, stream);
}

// "expanded_gemm_r<R>": R = 2, 4 or 8 rows a thread (tiles of 256, 512 or 1024 rows);
// "expanded_gemm_r8w": R = 8 with the WH build (weight bytes loaded once a half stage);
// "expanded_gemm_r8c": R = 8 with the CO build (Et16 lines copied whole, then transposed);
// "expanded_gemm_r8c_k<ks>": r8c with K split over ks blocks (2..64), their sums added into the zeroed
// output (gemm_split: where the tiles alone leave SMs idle);
// "expanded_gemm_r16c" and "_r16c_k<ks>": the tall tile (gemm_tall.cu), 16 rows x 4 channels a thread;
// "expanded_gemm_r13c" and "_r13c_k<ks>": the same tile at 13 rows a thread (1664 rows a block).
std::string parse_gemm_config(const std::string& name, Config& c) {
  const std::string bad = "bad algo '" + name + "': expanded_gemm_r<2, 4 or 8>, expanded_gemm_r8w, "
                          "expanded_gemm_r8c, expanded_gemm_r16c, expanded_gemm_r13c, or one of the last three "
                          "with _k<K split, 2..64>";
  // the tall tile's rows a thread, 0 for other names
  auto tall_rows = [](const std::string& b) {
    return b == "expanded_gemm_r16c" ? 16 : b == "expanded_gemm_r13c" ? 13 : 0;
  };
  std::string base = name;
  int ks = 0;
  const size_t at = name.find("_k", 14);  // past "expanded_gemm_"
  if (at != std::string::npos) {
    const std::string digits = name.substr(at + 2);
    base = name.substr(0, at);
    if ((base != "expanded_gemm_r8c" && !tall_rows(base)) || (ks = suffix_count(digits, 2, 64)) < 0) return bad;
  }
  if (tall_rows(base)) {
    c = Config{tall_rows(base)};
    c.build = 3;
  } else if (base == "expanded_gemm_r8w" || base == "expanded_gemm_r8c") {
    c = Config{8};
    c.build = base.back() == 'w' ? 1 : 2;
  } else {
    int r = 0, n = 0;
    const bool ok = std::sscanf(base.c_str(), "expanded_gemm_r%d%n", &r, &n) == 1 &&
                    base[n] == 0 && (r == 2 || r == 4 || r == 8);
    if (!ok) return bad;
    c = Config{r};
  }
  c.ks = ks;
  return "";
}

std::string gemm_config_name(const Config& c) {
  if (c.r == 8 && c.build == 1) return "expanded_gemm_r8w";
  const std::string split = c.ks > 1 ? "_k" + std::to_string(c.ks) : "";
  if (c.r == 8 && c.build == 2) return "expanded_gemm_r8c" + split;
  if (c.build == 3) return "expanded_gemm_r" + std::to_string(c.r) + "c" + split;
  return c.r ? "expanded_gemm_r" + std::to_string(c.r) : "expanded_gemm";
}

}  // namespace approx_cuda
