// depthwise_rows: 3x3 depthwise convolutions of dilation 1 at stride 1 or 2 (MobileNetV2's), with
// one table read per input code and kernel row.
//
// `depthwise` (depthwise.cu) pays, per output, 9 byte loads from global memory and 9 int32 lookups:
// 0.23-0.65 T MAC/s on an H100. Here a block owns one channel and builds, per kernel row ky and LUT
// row r, one entry holding the products of that row's three taps, E[r][w(ky, 0..2)]: as int16
// (8 bytes, 6 KiB a channel) where every product of the table fits int16, else as int32 (16 bytes,
// 12 KiB; auto does not time it then, see algos.cpp). A thread computes R consecutive outputs of
// one output row, reading each of its input codes once per kernel row: one shared-memory read then
// gives up to 3 products (stride 1: each feeds 3 outputs; stride 2: 1 or 2 of them), so a 3x3
// output costs about 3 (R + 2) / R reads instead of 9.
//
// Work is cut into tasks (image, output row, segment of R outputs), numbered row-major over the
// whole batch; a tile is kDrThreads consecutive tasks, one a thread, so a tile may start and end
// mid-row and span several small images (7x7 planes: 36 images a tile).
//
// depthwise_rows_banked: the same with the int16 table held 16 times, copy c in bank pair c only
// (entry (ky, r) of copy c at 8 * (16 (256 ky + r) + c) bytes), and lane l reading copy l % 16. A
// half warp's 8-byte reads then fall in 16 different bank pairs whatever the codes: one wavefront,
// where random codes take 3.08 on average (the fullest of 16 bank pairs). The table takes 96 KiB,
// so two blocks share an SM; each thread stores its code's entries into every copy, two copies a 16-byte store.
//
// depthwise_rows_banked8: 8 copies, entry (ky, r) of copy c at 8 * (8 (256 ky + r) + c) bytes, so in bank
// pair c + 8 (r & 1), lane l reading copy l % 8: the two lanes of a half warp on one copy meet in a bank pair
// when their codes' parities agree, 2 wavefronts (about 2 - 2^-8), against the single table's 3.08 and the
// 16 copies' 1, for 48 KiB of table: four blocks an SM, as many as the single table's registers allow.
//
// depthwise_rows_split (stride 2): an even column of a thread's window feeds taps 0 and 2 (of two
// outputs), an odd one tap 1 alone, so the int16 table is split in two of 4-byte entries: E[ky][r]
// holding the products of taps (ky, 0) and (ky, 2) side by side, O[ky][r] tap (ky, 1)'s. A read is
// then 4 bytes (a warp's 32 random codes over 32 banks: 3.53 wavefronts on average) where the 8-byte
// entry took two half warps of 3.08 each, for the same 17 reads a kernel row and 8 outputs.
//
// The table is indexed by raw codes: entry c holds LUT row c ^ xmask, so window words are read as loaded and
// padding is code 0. A code's byte offset in the table is one shift and one LOP3 from its window word.
//
// Window loads (DrStage). A task loads its window's words straight from global memory (kStDirect: rows a
// multiple of 4 wide, where a word holds one row's bytes or none; kStDirect8: the same in aligned 8-byte pairs where
// rows are a multiple of 8 wide and R x stride too, so every window starts on the same word of a pair, 1.02-1.09x;
// kStDirectU: other rows, words read at byte offsets from the input's start and funnel-shifted, the columns outside
// the row masked to padding; kStDirectQ: kStDirectU's words at stride 2 from aligned 16-byte quads, where the input
// sits on them). Neighbouring tasks share most of their words, which L1 serves; there is no staging and no block
// barrier after the table build. These kernels are bound by L1's data pipe (84-94 % busy while the SMs run, on
// MobileNetV2's small layers): the table reads take 43-61 % of its wavefronts, the window loads 30-44 %, and a
// warp's load costs about as many wavefronts (the lines its lanes touch) at 4 or 16 bytes a lane. Staging each
// tile's rows in shared memory first (whole words, or whole small planes) was 1.0-1.6x slower: at stride 2 and on
// small planes the staging's address arithmetic outweighed the table reads (benchmarks/imagenet.md). Inputs off a
// word, and other rows of inputs not a multiple of 4 bytes or past 2^31 bytes, still stage their rows byte-wise
// realigned (kStRows), at the tile's barrier.
//
// Stores (depthwise_stores.cuh): a task's run of sums, or, under the conv-and-end ops (Params::epi, int16 products,
// direct loads: depthwise_rows_applies_end), the layer's end in their place, so the sums are never written.
#include <algorithm>
#include <array>
#include <map>
#include <mutex>
#include <type_traits>

#include "depthwise_stores.cuh"
#include "launch.cuh"
#include "ptx.cuh"

namespace approx_cuda {
namespace {

constexpr int kDrThreads = 256;
constexpr int kDrSlackWords = 4;  // after the staged rows: the unaligned reads' last word
constexpr int kDrCopies = 16;     // banked: one table copy per bank pair
constexpr int kDrBankedBlocksPerSM = 2;
__host__ __device__ constexpr int dr_log2(int n) { return n > 1 ? 1 + dr_log2(n / 2) : 0; }
// the table's copies (banked: 16, banked8: 8; the others hold one)
__host__ __device__ constexpr int dr_copies(int layout) {
  return layout == kDrBanked ? kDrCopies : layout == kDrBanked8 ? kDrCopies / 2 : 1;
}
enum DrStage : int { kStRows = 0, kStDirect = 1, kStDirectU = 2, kStDirect8 = 3, kStDirectQ = 4 };
// loads at byte offsets from the input's start, the columns outside the row masked
__host__ __device__ constexpr bool dr_wide(int stg) { return stg == kStDirectU || stg == kStDirectQ; }

struct DrGeo {
  int Ho, segs;    // output rows per image, R-output segments per output row
  int Hn;          // staged rows of a slot holding a whole image: (Ho - 1) * S + 3
  int nw;          // kStRows: staged words per row (the row pitch / 4)
  int stage;       // DrStage
  int table_bytes; // offset of the staged rows in shared memory
  unsigned total;  // tasks of one channel: B * Ho * segs (< 2^31: depthwise_rows_why_not)
  unsigned tiles;
  unsigned in_words;  // kStDirectU: the input's words
  int gx;             // blocks a channel (auto's trial or a _g<N> name); 0: the grid model's
  FastDiv fsegs, fHo, fnw, fHn;
};

// acc plus the int16 in the low (HI false) or high half of w, sign-extended: one IDP.2A (dp2a with the byte pair
// (1, 0) or (0, 1)), where the extension and the add took two instructions. The banked tables' kernels gain up to
// 16 % by it at stride 1; the single table's and the split one's lose up to 8 % (the split one's low halves come
// sign-extended by LDS.S16 already), so only the banked ones use it (benchmarks/imagenet.md)
template <bool HI>
__device__ __forceinline__ uint32_t add_half(uint32_t acc, uint32_t w) {
  return static_cast<uint32_t>(__dp2a_lo(static_cast<int>(w), HI ? 0x100 : 1, static_cast<int>(acc)));
}

// Products of one kernel row as int16, sign-extended on use into the wrapping accumulator.
// entry(): kernel row ky's three products for LUT row r (wk: that row's weights), read where a
// warp's loads are contiguous: int16 from Et16 (a weight's 256 products side by side), int32 from E32.
struct Tab16 {
  using E = uint2;
  __device__ static E entry(const Params& p, const int8_t* wk, int r) {
    const int16_t* et = p.Et16 + 128 * 256 + r;
    return pack(__ldg(et + __ldg(wk) * 256), __ldg(et + __ldg(wk + 1) * 256), __ldg(et + __ldg(wk + 2) * 256));
  }
  __device__ static E pack(int a, int b, int c) {
    return make_uint2((static_cast<uint32_t>(a) & 0xffffu) | (static_cast<uint32_t>(b) << 16),
                      static_cast<uint32_t>(c) & 0xffffu);
  }
  template <int KX>
  __device__ static uint32_t get(E e) {
    if constexpr (KX == 0) return static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(e.x)));
    if constexpr (KX == 1) return static_cast<uint32_t>(static_cast<int32_t>(e.x) >> 16);
    return static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(e.y)));
  }
  template <int KX>
  __device__ static uint32_t add(uint32_t acc, E e) {
    return add_half<KX == 1>(acc, KX == 2 ? e.y : e.x);
  }
};

struct Tab32 {
  using E = uint4;
  __device__ static E entry(const Params& p, const int8_t* wk, int r) {
    const int32_t* er = p.E32 + r * 256 + 128;
    return pack(__ldg(er + __ldg(wk)), __ldg(er + __ldg(wk + 1)), __ldg(er + __ldg(wk + 2)));
  }
  __device__ static E pack(int a, int b, int c) {
    return make_uint4(static_cast<uint32_t>(a), static_cast<uint32_t>(b), static_cast<uint32_t>(c), 0u);
  }
  template <int KX>
  __device__ static uint32_t get(E e) {
    return KX == 0 ? e.x : KX == 1 ? e.y : e.z;
  }
};

// Adds input code i's products (e) to the outputs it feeds: input column i of the thread's window
// feeds output j through tap kx where i = j * S + kx. DP: by dp2a (Tab16::add).
template <int S, int R, class Tab, int KX, bool DP>
__device__ __forceinline__ void feed(uint32_t (&acc)[R], typename Tab::E e, int i) {
  const int d = i - KX;
  if (d >= 0 && d % S == 0 && d / S < R) {
    if constexpr (DP) acc[d / S] = Tab::template add<KX>(acc[d / S], e);
    else acc[d / S] += Tab::template get<KX>(e);
  }
}

// A tile: tasks t0..t1 - 1; its staged rows start at output row oyA of image bA (slot 0), later
// images (slots 1, 2, ...) start at their output row 0; Q staged rows, n0 of them in slot 0.
struct DrTile {
  unsigned t0, t1, bA;
  int oyA, n0, Q;
};

__device__ __forceinline__ DrTile dr_tile(const DrGeo& g, unsigned tile, int S) {
  DrTile tl;
  tl.t0 = tile * kDrThreads;
  tl.t1 = min(tl.t0 + kDrThreads, g.total);
  // output rows (row-major over the batch) gA..gB; images bA..bB
  const unsigned gA = fdiv(tl.t0, g.fsegs), gB = fdiv(tl.t1 - 1, g.fsegs);
  tl.bA = fdiv(gA, g.fHo);
  const unsigned bB = fdiv(gB, g.fHo);
  tl.oyA = static_cast<int>(gA - tl.bA * g.Ho);
  const int oyB = static_cast<int>(gB - bB * g.Ho);
  // slot 0's local row 0 is input row oyA * S - ph; a later slot's is input row -ph
  tl.n0 = ((tl.bA == bB ? oyB : g.Ho - 1) - tl.oyA) * S + 3;
  const int nimg = static_cast<int>(bB - tl.bA) + 1;
  tl.Q = nimg == 1 ? tl.n0 : tl.n0 + (nimg - 2) * g.Hn + oyB * S + 3;
  return tl;
}

// The input row staged as local row q of tile tl, or nullptr where that row is padding.
__device__ __forceinline__ const uint8_t* staged_row(const Params& p, const DrGeo& g, const DrTile& tl, unsigned q,
                                                     const uint8_t* a_ch, long long img_in, int S) {
  unsigned k = 0;
  int iy = tl.oyA * S - p.ph + static_cast<int>(q);
  if (static_cast<int>(q) >= tl.n0) {
    const unsigned u = q - tl.n0, kk = fdiv(u, g.fHn);
    k = kk + 1;
    iy = static_cast<int>(u - kk * g.Hn) - p.ph;
  }
  return iy >= 0 && iy < p.H ? a_ch + (tl.bA + k) * img_in + (long long)iy * p.W : nullptr;
}

// Other rows: staged column 0 is input column -pw; a word's four raw codes (padding: code 0).
__device__ __forceinline__ uint32_t unaligned_word(const Params& p, const DrGeo& g, const DrTile& tl, unsigned w,
                                                   const uint8_t* a_ch, long long img_in) {
  const unsigned q = fdiv(w, g.fnw);
  const int j = static_cast<int>(w - q * g.nw);
  const uint8_t* row = staged_row(p, g, tl, q, a_ch, img_in, p.sh);
  if (!row) return 0u;
  const int gc = 4 * j - p.pw;
  // Aligned 4-byte loads realigned in registers (rows of odd widths start anywhere), where
  // every byte they touch lies inside the row; bytes at the row's ends and in the padding.
  const uintptr_t r0 = reinterpret_cast<uintptr_t>(row);
  const uintptr_t at = r0 + static_cast<intptr_t>(gc), al = at & ~uintptr_t(3);
  const unsigned sh = static_cast<unsigned>(at & 3) * 8;
  if (gc >= 0 && al >= r0 && al + (sh ? 8 : 4) <= r0 + static_cast<unsigned>(p.W)) {
    const uint32_t* wp = reinterpret_cast<const uint32_t*>(al);
    const uint32_t lo = __ldg(wp);
    return sh ? __funnelshift_r(lo, __ldg(wp + 1), sh) : lo;
  }
  uint32_t v = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int c = gc + i;
    const uint32_t r = c >= 0 && c < p.W ? __ldg(row + c) : 0u;
    v |= r << (8 * i);
  }
  return v;
}

// TL: the table's layout (DrLayout; banked and split hold int16 entries only). STG: DrGeo::stage. EPI: the conv's
// end in the stores (depthwise_stores.cuh; 0: the int32 sums).
template <int S, int R, class Tab, int TL, int STG, int EPI>
__device__ __forceinline__ void dr_body(const Params& p, const DrGeo& g, uint8_t* smem) {
  using E = typename Tab::E;
  constexpr int COPIES = dr_copies(TL);
  constexpr bool SPLIT = TL == kDrSplit;
  static_assert(!SPLIT || (S == 2 && sizeof(E) == 8), "the split table is for int16 products at stride 2");
  constexpr int NC = (R - 1) * S + 3;  // input columns a thread reads per input row
  constexpr int NWA = (NC + 3) / 4;    // as whole words
  E* tab = reinterpret_cast<E*>(smem);  // [ky][LUT row][copy]
  uint32_t* st = reinterpret_cast<uint32_t*>(smem + g.table_bytes);
  const int ch = blockIdx.y, tid = threadIdx.x;
  // The table is indexed by raw codes (entry c holds LUT row c ^ xmask), so window words go to the reads as loaded
  // and padding is code 0: no XOR a word, and a masked column is a cleared byte
  const unsigned lrow = static_cast<unsigned>(tid) ^ p.xmask;
  const long long plane = (long long)p.H * p.W, img_in = (long long)p.C * plane;
  const long long img_out = (long long)p.C * p.HoWo;
  const uint8_t* a_ch = p.a + (long long)ch * plane;
  const DrEnd dend = dr_end<EPI>(p.epi, ch);
  const int Ho = g.Ho;
  constexpr bool DIRECT = STG != kStRows;
  constexpr bool WIDE = dr_wide(STG);
  const uint32_t* a32 = reinterpret_cast<const uint32_t*>(p.a);  // direct: dr_geo checked it sits on a word
  DrTile tl{};
  {
    const int8_t* wch = p.w + (long long)ch * 9;
    // a fixed trip count, unrolled: the nine weight loads, then the nine product loads, go out together (two
    // latencies, where a loop waited on six)
    static_assert(kDrThreads == 256, "a thread builds code tid's entry of each kernel row");
    if constexpr (SPLIT) {
      uint32_t* t = reinterpret_cast<uint32_t*>(smem);  // E [3][256], then O [3][256]
      const int16_t* et = p.Et16 + 128 * 256 + lrow;
#pragma unroll
      for (int ky = 0; ky < 3; ++ky) {
        const int8_t* wk = wch + ky * 3;
        t[ky * 256 + tid] = (static_cast<uint32_t>(__ldg(et + __ldg(wk) * 256)) & 0xffffu) |
                            (static_cast<uint32_t>(__ldg(et + __ldg(wk + 2) * 256)) << 16);
        t[(3 + ky) * 256 + tid] = static_cast<uint32_t>(static_cast<int32_t>(__ldg(et + __ldg(wk + 1) * 256)));
      }
    } else {
      E e[3];
#pragma unroll
      for (int ky = 0; ky < 3; ++ky) e[ky] = Tab::entry(p, wch + ky * 3, lrow);
      if constexpr (COPIES == 1) {
#pragma unroll
        for (int ky = 0; ky < 3; ++ky) tab[ky * 256 + tid] = e[ky];
      } else {
        // the thread's entries into every copy, two copies a 16-byte store (no compact table, no barrier before
        // the copies). A quarter warp's 8 lanes start at different copy pairs, so that their stores fall in the 8
        // 16-byte bank groups: pair q of code r is 16-byte word r * PAIRS + q, in group (r * PAIRS + q) % 8
        static_assert(sizeof(E) == 8, "the banked table holds int16 entries");
        constexpr int PAIRS = COPIES / 2, LS = dr_log2(8 / PAIRS);
        uint4* t4 = reinterpret_cast<uint4*>(tab) + tid * PAIRS;  // code tid's copies of kernel row 0
#pragma unroll
        for (int i = 0; i < PAIRS; ++i) {
          const int q = (i + (tid >> LS)) & (PAIRS - 1);  // one pair index for the three rows
#pragma unroll
          for (int ky = 0; ky < 3; ++ky) t4[ky * 256 * PAIRS + q] = make_uint4(e[ky].x, e[ky].y, e[ky].x, e[ky].y);
        }
      }
    }
  }
  if constexpr (DIRECT) __syncthreads();  // the table is built; no barrier after it
  for (unsigned tile = blockIdx.x; tile < g.tiles; tile += gridDim.x) {
    if constexpr (DIRECT) {
      tl.t0 = tile * kDrThreads;
      tl.t1 = min(tl.t0 + kDrThreads, g.total);
    } else {
      tl = dr_tile(g, tile, S);
      const int nst = tl.Q * g.nw;  // staged words
      // the previous tile's reads of the staged rows are done (the first tile's table is built beside them,
      // and the barrier below orders that)
      if (tile != blockIdx.x) __syncthreads();
      for (unsigned w = tid; w < static_cast<unsigned>(nst); w += kDrThreads)
        st[w] = unaligned_word(p, g, tl, w, a_ch, img_in);
      if (tid < kDrSlackWords) st[nst + tid] = 0u;
      __syncthreads();
    }
    const unsigned t0 = tl.t0, t1 = tl.t1, bA = tl.bA;
    const int oyA = tl.oyA, n0 = tl.n0;
    const unsigned t = t0 + tid;
    if (t >= t1) continue;
    const unsigned gr = fdiv(t, g.fsegs);
    const int seg = static_cast<int>(t - gr * g.segs);
    const unsigned b = fdiv(gr, g.fHo);
    const int oy = static_cast<int>(gr - b * Ho);
    const unsigned k = b - bA;
    const int q0 = k == 0 ? (oy - oyA) * S : n0 + static_cast<int>(k - 1) * g.Hn + oy * S;
    // kStDirectU: the window's columns left of 0 and from W on hold the neighbouring rows' (or planes')
    // codes; keep clears their bytes (padding's code 0). Padding is at most 1, so only column 0 can lie left
    // of the row; a word's bytes from window column W - col0 on lie right of it. Two or three instructions a
    // word, where testing each column took four a column
    const int col0 = seg * R * S - p.pw;
    constexpr bool MASK = WIDE;
    uint32_t keep[MASK ? NWA : 1];
    if constexpr (MASK) {
      const int n8 = 8 * (p.W - col0);
#pragma unroll
      for (int i = 0; i < NWA; ++i) keep[i] = __funnelshift_lc(~0u, 0u, static_cast<unsigned>(max(n8 - 32 * i, 0)));
      if (col0 < 0) keep[0] &= ~0xffu;
    }
    uint32_t acc[R];
#pragma unroll
    for (int j = 0; j < R; ++j) acc[j] = 0;  // wraps like every kernel's accumulator
#pragma unroll
    for (int ky = 0; ky < 3; ++ky) {
      // the thread's window: input columns col0 .. col0 + NC - 1 of input row iy (kStRows: local row q0 + ky)
      const int iy = oy * S + ky - p.ph;
      const bool row_in = iy >= 0 && iy < p.H;
      uint32_t raw[NWA + 1], wv[NWA];
      unsigned sh;
      if constexpr (STG == kStDirect) {
        // a word holds one row's bytes or none, so the words left of the row, past it and of rows outside the
        // plane are padding (code 0), and no column needs a mask
        const uint32_t* row = reinterpret_cast<const uint32_t*>(a_ch + b * img_in + (long long)(row_in ? iy : 0) * p.W);
        const int w0 = col0 >> 2;  // col0 >= -1: the word before the row where the window starts at -1
        ldg_words_if(raw, row + w0, w0, row_in ? static_cast<unsigned>(p.W) / 4 : 0u);
        sh = static_cast<unsigned>(col0 & 3) * 8;
      } else if constexpr (STG == kStDirect8) {
        // kStDirect's words as aligned 8-byte pairs, a pair in the row or out of it whole. dr_geo takes this
        // only where R * S is a multiple of 8, so every task's window starts on the same word of a pair (the
        // second where the padding is 1): the select below is uniform
        const uint2* row2 = reinterpret_cast<const uint2*>(a_ch + b * img_in + (long long)(row_in ? iy : 0) * p.W);
        const int w0 = col0 >> 2, k0 = w0 >> 1;  // col0 >= -1: w0 and k0 >= -1
        constexpr int NP = (NWA + 3) / 2;       // pairs that hold NWA + 1 words from an odd word
        uint32_t q[2 * NP];
#pragma unroll
        for (int j = 0; j < NP; ++j) {
          const int kj = k0 + j;
          const bool in = row_in && kj >= 0 && 8 * kj < p.W;
          const uint2 v = in ? __ldg(row2 + kj) : make_uint2(0u, 0u);
          q[2 * j] = v.x;
          q[2 * j + 1] = v.y;
        }
        const bool odd = w0 & 1;
#pragma unroll
        for (int i = 0; i <= NWA; ++i) raw[i] = odd ? q[i + 1] : q[i];
        sh = static_cast<unsigned>(col0 & 3) * 8;
      } else if constexpr (WIDE) {
        // byte offsets from the input's start (dr_geo keeps the input under 2^31 bytes, a multiple of 4): the
        // words outside the input, and a row outside the plane, are padding; keep clears the columns outside
        // the row below. kStDirectQ: the words from aligned 16-byte quads, fewer requests through L1
        const int pos = static_cast<int>(b * img_in + ch * plane) + iy * p.W + col0;
        const int w0 = pos >> 2;
        const unsigned lim = row_in ? g.in_words : 0u;
        if constexpr (STG == kStDirectU) ldg_words_if(raw, a32 + w0, w0, lim);
        else ldg_words_by_quads(raw, p.a, w0, lim);
        sh = static_cast<unsigned>(pos & 3) * 8;
      } else {
        const int start = (q0 + ky) * g.nw * 4 + seg * R * S;
#pragma unroll
        for (int i = 0; i <= NWA; ++i) raw[i] = st[(start >> 2) + i];
        sh = static_cast<unsigned>(start & 3) * 8;  // 0 where every window starts on a word: R S % 4 == 0
      }
#pragma unroll
      for (int i = 0; i < NWA; ++i)
        wv[i] = (R * S) % 4 == 0 && STG == kStRows ? raw[i] : __funnelshift_r(raw[i], raw[i + 1], sh);
      if constexpr (MASK) {
#pragma unroll
        for (int i = 0; i < NWA; ++i) wv[i] &= keep[i];
      }
      if constexpr (SPLIT) {
        const uint32_t* te = reinterpret_cast<const uint32_t*>(smem) + ky * 256;
        const uint32_t* to = te + 3 * 256;
#pragma unroll
        for (int i = 0; i < NC; ++i) {  // column i = 2 j + kx feeds output j through tap kx
          const uint32_t code = (wv[i >> 2] >> (8 * (i & 3))) & 255u;
          if (i % 2 == 0) {
            const uint32_t e = te[code];
            if (i / 2 < R) acc[i / 2] += static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(e)));
            if (i / 2 >= 1) acc[i / 2 - 1] += static_cast<uint32_t>(static_cast<int32_t>(e) >> 16);
          } else {
            acc[i / 2] += to[code];
          }
        }
      } else {
        // a code's entries are 2^SH bytes apart: its byte offset is one shift and one LOP3 (which also adds the
        // lane's copy) from the window word, where indexing by the code took four instructions with copies
        constexpr int SH = dr_log2(static_cast<int>(sizeof(E)) * COPIES);
        const uint8_t* tk = reinterpret_cast<const uint8_t*>(tab + ky * 256 * COPIES);
        const uint32_t copy = static_cast<uint32_t>(tid & (COPIES - 1)) * sizeof(E);
#pragma unroll
        for (int i = 0; i < NC; ++i) {
          const int bit = 8 * (i & 3);
          const uint32_t w = wv[i >> 2];
          const uint32_t off = ((bit >= SH ? w >> (bit - SH) : w << (SH - bit)) & (255u << SH)) | copy;
          const E e = *reinterpret_cast<const E*>(tk + off);
          feed<S, R, Tab, 0, (COPIES > 1)>(acc, e, i);
          feed<S, R, Tab, 1, (COPIES > 1)>(acc, e, i);
          feed<S, R, Tab, 2, (COPIES > 1)>(acc, e, i);
        }
      }
    }
    const int ox0 = seg * R;
    dr_store<R, EPI>(p, dend, (long long)ch * p.HoWo + b * img_out + (long long)oy * p.Wo + ox0, min(R, p.Wo - ox0),
                     acc);
  }
}

// MODE 1: int16 entries, 2: int32 entries, 0: the fit flags decide on the device. Banked: int16
// entries in kDrCopies copies (int32 ones stay single: 16 of them would not fit).
// int16 entries: registers capped for the blocks an SM is meant to hold; the others run two bodies' worth
// and stay uncapped. banked8: 4 blocks, what its table allows. kStDirectU's and kStDirectQ's single and split
// tables (14x14 and 7x7 planes, few tiles a block): 7 blocks at stride 1 and 6 at stride 2, without spills (on an
// H200 384 at 14x14 1.70 -> 1.80 T MAC/s at batch 64, 576 at 14x14 1.79 -> 1.97; 7 at stride 2 lost up to 4 %).
// The single and split tables elsewhere: 4 blocks at stride 1, 5 at stride 2 (48 registers; at 50-55 they held 4)
template <int TL, int STG, int S>
constexpr int dr_min_blocks() {
  if constexpr (TL == kDrBanked) return kDrBankedBlocksPerSM;
  if constexpr (TL == kDrBanked8) return 4;  // what its 48 KiB table allows at either stride
  if constexpr (STG == kStRows) return 5;
  if constexpr (dr_wide(STG)) return S == 1 ? 7 : 6;
  return S == 1 ? 4 : 5;
}
template <int S, int R, int MODE, int TL, int STG, int EPI>
__global__ void __launch_bounds__(kDrThreads, MODE != 1 ? 1 : dr_min_blocks<TL, STG, S>())
    depthwise_rows_kernel(Params p, DrGeo g) {
  extern __shared__ __align__(16) uint8_t smem[];
  if (MODE == 1 || (MODE == 0 && read_fits16(p.flags)))
    dr_body<S, R, Tab16, TL, STG, EPI>(p, g, smem);
  else
    dr_body<S, R, Tab32, kDrSingle, STG, EPI>(p, g, smem);
}

// Outputs a thread: 7 where rows are a multiple of 7 wide but not of 8 (MobileNetV2's 7, 14, 28),
// so no lane computes outputs past the row's end.
int dr_r(const Params& p) { return p.Wo % 8 != 0 && p.Wo % 7 == 0 ? 7 : 8; }

// fmt 1: int16 entries; else int32-sized (fmt 0 reads the flags on the device). copies > 1 (banked): fmt 1 or 0.
// (The split table takes the single one's 6 KiB.)
DrGeo dr_geo(const Params& p, int fmt, int copies, size_t& smem) {
  const bool banked = copies > 1;
  const int S = p.sh, R = dr_r(p);
  DrGeo g{};
  g.Ho = static_cast<int>(p.HoWo / p.Wo);
  g.segs = (p.Wo + R - 1) / R;
  g.Hn = (g.Ho - 1) * S + 3;
  const long long B = p.M / p.HoWo, total = B * g.Ho * g.segs;
  // Most staged rows a tile can need: kDrThreads consecutive tasks touch at most rt output rows
  // and imgs images; an image with r of them stages (r - 1) * S + 3 rows.
  const long long rt = std::min<long long>((kDrThreads - 1) / g.segs + 2, B * g.Ho);
  const long long imgs = std::min<long long>({rt, (rt - 1) / g.Ho + 2, B});
  const long long rows = S * rt + (3 - S) * imgs;
  g.nw = ((g.segs * R - 1) * S + 3 + 3) / 4;  // kStRows: every window's columns, the last overhanging
  // direct loads where the input sits on a word; other rows address it by 32-bit offsets
  const long long in_bytes = B * p.C * p.H * p.W;
  const bool on_word = reinterpret_cast<uintptr_t>(p.a) % 4 == 0;
  g.stage = on_word && p.W % 4 == 0                                           ? kStDirect
            : on_word && in_bytes % 4 == 0 && in_bytes < (1ll << 31) - 16 ? kStDirectU
                                                                           : kStRows;
  if (g.stage == kStDirect && p.W % 8 == 0 && R * S % 8 == 0 && reinterpret_cast<uintptr_t>(p.a) % 8 == 0)
    g.stage = kStDirect8;
  // kStDirectU's words at stride 2 from aligned 16-byte quads where the input sits on them and is a whole number of
  // them (benchmarks/imagenet.md: 576 at 14x14 1.10x at batch 64, 1.14x at 256; at stride 1, and for kStDirect's
  // rows, quads and 8-byte pairs gained on uniform codes but lost up to 5 % on MobileNetV2's own)
  if (g.stage == kStDirectU && S == 2 && reinterpret_cast<uintptr_t>(p.a) % 16 == 0 && in_bytes % 16 == 0)
    g.stage = kStDirectQ;
  g.in_words = static_cast<unsigned>(dr_wide(g.stage) ? in_bytes / 4 : 0);
  g.table_bytes = banked ? 3 * 256 * 8 * copies : 3 * 256 * (fmt == 1 ? 8 : 16);
  g.total = static_cast<unsigned>(total);
  g.tiles = static_cast<unsigned>((total + kDrThreads - 1) / kDrThreads);
  g.fsegs = make_fastdiv(g.segs);
  g.fHo = make_fastdiv(g.Ho);
  g.fnw = make_fastdiv(g.nw);
  g.fHn = make_fastdiv(g.Hn);
  const size_t staged = (size_t)((g.stage == kStRows ? rows * g.nw : 0) + kDrSlackWords) * 4;
  smem = g.table_bytes + staged;
  return g;
}

template <int S, int R, int TL, int STG, int EPI>
void launch_dr_sr(const Params& p, int fmt, const DrGeo& g, size_t smem, cudaStream_t stream) {
  // an end: int16 entries only (depthwise_rows_applies_end)
  auto kern = EPI != 0 || fmt == 1 ? depthwise_rows_kernel<S, R, 1, TL, STG, EPI>
              : fmt == 2          ? depthwise_rows_kernel<S, R, 2, kDrSingle, STG, 0>
                                  : depthwise_rows_kernel<S, R, 0, TL, STG, 0>;
  set_smem(kern, smem);
  // Blocks per channel, each walking its channel's tiles: SMs take blocks as slots free, so the
  // busiest SM runs about ceil(blocks / SMs) of them, at no better than `per_sm` at once; a block
  // costs its tiles and its table build (16 copies: about 1.5 tiles' worth of stores). Auto also times
  // 1, 2 and 4 blocks a channel (g.gx), which beat this model by up to 1.2x on 14x14 and 28x28 planes.
  const long long per_sm = blocks_per_sm(kern, kDrThreads, smem), sms = sm_count();
  // the search takes microseconds a launch at large batches: once per (occupancy, SMs, channels, tiles)
  static std::mutex mu;
  static std::map<std::array<long long, 4>, long long> chosen;
  std::lock_guard<std::mutex> lock(mu);
  long long& gx = chosen[{per_sm, sms, (long long)p.G, (long long)g.tiles}];
  if (gx == 0) {
    const double build = TL == kDrBanked ? 1.5 : TL == kDrBanked8 ? 0.9 : 0.25;
    double best = 0;
    for (long long x = 1; x <= std::min<long long>(g.tiles, 4096); ++x) {
      const long long busiest = std::max((p.G * x + sms - 1) / sms, per_sm);
      const double cost = busiest * ((g.tiles + x - 1) / x + build);
      if (x == 1 || cost < best) best = cost, gx = x;
    }
  }
  const dim3 grid(static_cast<unsigned>(g.gx > 0 ? std::min<long long>(g.gx, g.tiles) : gx), p.G);
  kern<<<grid, kDrThreads, smem, stream>>>(p, g);
}

template <int TL, int A, int EPI>
void launch_dr_tl(const Params& p, int fmt, const DrGeo& g, size_t smem, cudaStream_t stream) {
  const bool r7 = dr_r(p) == 7;
  if constexpr (TL != kDrSplit) {  // the split table is for stride 2 only (no stride-1 instantiation)
    if (p.sh == 1) {
      if (r7) launch_dr_sr<1, 7, TL, A, EPI>(p, fmt, g, smem, stream);
      else launch_dr_sr<1, 8, TL, A, EPI>(p, fmt, g, smem, stream);
      return;
    }
  }
  if (r7) launch_dr_sr<2, 7, TL, A, EPI>(p, fmt, g, smem, stream);
  else launch_dr_sr<2, 8, TL, A, EPI>(p, fmt, g, smem, stream);
}

// the end in the stores (EPI 1, 2) where the inputs load directly (kStRows' inputs, rare, run the two ops)
template <int TL, int A>
void launch_dr_end(const Params& p, int fmt, const DrGeo& g, size_t smem, cudaStream_t stream) {
  if constexpr (A != kStRows) {
    if (p.epi.kind == 1) return launch_dr_tl<TL, A, 1>(p, fmt, g, smem, stream);
    if (p.epi.kind == 2) return launch_dr_tl<TL, A, 2>(p, fmt, g, smem, stream);
  }
  TORCH_CHECK(p.epi.kind == 0, "depthwise_rows: no end in the stores of these inputs (depthwise_rows_applies_end)");
  launch_dr_tl<TL, A, 0>(p, fmt, g, smem, stream);
}

}  // namespace

std::string depthwise_rows_why_not(const Params& p, const ConvGeo& cg, int layout) {
  if (!p.conv || p.N != 1 || p.Cg != 1)
    return "needs a depthwise conv (one input and one output channel per group)";
  if (cg.kh != 3 || cg.kw != 3 || cg.dh != 1 || cg.dw != 1) return "needs a 3x3 kernel of dilation 1";
  if (p.sh != p.sw || (p.sh != 1 && p.sh != 2)) return "needs stride 1 or 2, the same along both axes";
  if (layout == kDrSplit && p.sh != 2) return "needs stride 2 (at stride 1 every column feeds three taps)";
  if (p.ph > 1 || p.pw > 1) return "needs padding of at most 1";
  if (p.M >= (1ll << 31)) return "needs fewer than 2^31 output pixels per channel";
  const int copies = dr_copies(layout);
  size_t smem = 0;
  dr_geo(p, copies > 1 ? 0 : 2, copies, smem);  // the most either format takes
  if ((long long)smem > max_smem_optin())
    return "needs a tile's input rows and the table (" + std::to_string(smem) + " bytes) to fit shared memory";
  return "";
}

bool depthwise_rows_applies_end(const Params& p, int fmt) {
  size_t smem = 0;
  return fmt == 1 && dr_geo(p, fmt, 1, smem).stage != kStRows;
}

void launch_depthwise_rows(const Params& p, const ConvGeo&, int fmt, int layout, int gx, cudaStream_t stream) {
  TORCH_CHECK(p.epi.kind == 0 || fmt == 1, "depthwise_rows: an end in the stores needs int16 products");
  if (fmt == 2) layout = kDrSingle;  // int32 products: the single table (the others hold int16 ones)
  size_t smem = 0;
  DrGeo g = dr_geo(p, fmt, dr_copies(layout), smem);
  g.gx = gx;
  // one instantiation per (layout, staging): STG is a template argument
  const auto with_stage = [&](auto tl) {
    constexpr int TL = decltype(tl)::value;
    if (g.stage == kStDirect) launch_dr_end<TL, kStDirect>(p, fmt, g, smem, stream);
    else if (g.stage == kStDirectU) launch_dr_end<TL, kStDirectU>(p, fmt, g, smem, stream);
    else if (g.stage == kStDirect8) launch_dr_end<TL, kStDirect8>(p, fmt, g, smem, stream);
    else if (g.stage == kStDirectQ) launch_dr_end<TL, kStDirectQ>(p, fmt, g, smem, stream);
    else launch_dr_end<TL, kStRows>(p, fmt, g, smem, stream);
  };
  if (layout == kDrBanked) with_stage(std::integral_constant<int, kDrBanked>{});
  else if (layout == kDrBanked8) with_stage(std::integral_constant<int, kDrBanked8>{});
  else if (layout == kDrSplit) with_stage(std::integral_constant<int, kDrSplit>{});
  else with_stage(std::integral_constant<int, kDrSingle>{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace approx_cuda
