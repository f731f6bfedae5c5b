// CPU kernels for approx::lut_linear and approx::lut_conv2d (arithmetic: see ../ops.cpp).
//
// Both ops run one engine: a linear layer is a conv whose rows are the rows of `a` and whose taps
// are offsets 0..K-1; a conv row is one output pixel of one group, its taps are the offsets of the
// K input codes relative to the pixel's top-left corner in a (zero-code padded) input. So there is
// no im2col: the kernels read codes straight from the input through a K-entry offset table.
//
// Three algorithms:
//   direct    one LUT lookup per MAC (lookup column precomputed per weight). No per-call table,
//             so it suits small batches and training, where weights change every step.
//   expanded  a weight-expanded table T[g][k][a][n] = product(a, w[g*Ng+n][k]) with the weight
//             sign folded in and n padded to a multiple of 8, built once per (weights, LUT) and
//             cached. For one activation code the inner loop adds a contiguous run of output
//             channels with vector loads into int32 accumulators held in registers; int16
//             entries when every product fits. Rows go in cache-sized blocks and taps in chunks
//             whose table slice stays in L2.
//   tiled     the same table built every call, one tile (32 channels x 16 taps) at a time, each tile serving every
//             row of its group: no cache, no size limit. At few rows a tile builds only the codes its rows read;
//             a depthwise conv's tile is a group, its output pixels 8 a vector gather (lut_cpu_kernels.inc).
// auto runs the one measured cheaper for the call (decide(), below); approx::lut_algos reports
// decide()'s answer, so the reported pick is what runs.
//
// Vector code: lut_cpu_kernels.inc is compiled three times (AVX-512, AVX2, baseline) under
// `#pragma GCC target`; the build needs no -march flag and the variant is picked at run time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../checks.h"
#include "cpu_isa.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <compare>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#pragma GCC diagnostic ignored "-Wpsabi"  // vector types never cross a non-inlined call

#define AR_INLINE inline __attribute__((always_inline))

namespace {

// ------------------------------------------------------------------------------------------------
// Problem description shared by both ops.
struct Problem {
  const uint8_t* act;     // activation codes (raw bytes; padded copy for convs with padding)
  uint8_t xmask;          // code ^ xmask = LUT row: 0x80 for int8 (a + 128), 0 for uint8
  bool is_unsigned;
  int64_t K;              // taps per row (per group)
  const int32_t* off;     // [K] tap offsets from a row's base
  int64_t B, G, Ho, Wo;   // rows are (b, g, oh, ow); linear: B = G = Wo = 1, Ho = M
  int64_t a_img, a_grp, a_oh, a_ow;  // strides of a row's base pointer
  int32_t* out;
  int64_t o_img, o_grp, o_pix, o_ch;  // out strides; pixel p = oh * Wo + ow
  int64_t Ng;             // output channels per group
  int64_t Np;             // Ng rounded up to a multiple of 8 (table row length)
  bool conv;              // lut_conv2d (auto keeps its costs apart from lut_linear's)
  const uint8_t* seen = nullptr;  // tiled at few rows: [G][K][256], the codes a group's rows read at each tap
  const int32_t* lut_t = nullptr;  // tiled: the LUT transposed, [column][row], for its tiles' build
};

// tiled on a call of one output channel a group and few taps (depthwise convs): a tile is a group, computed by
// gathering 8 output pixels a vector (pixel_group), not by the channel tile, whose lanes are output channels.
inline bool gathers_pixels(const Problem& p) { return p.Ng == 1 && p.K <= 64; }

// tiled at <= 2048 rows a group: a tile builds only the codes the group's rows read at each tap. A network's
// activations take few of the 256 (8-75 a channel at ResNet-18's and MobileNetV2's 14x14 and 7x7 layers at batch 8),
// where the build would cost 0.16-0.65 table entries a product; above, it is a small share and the codes vary more.
constexpr int64_t kSparseRows = 2048;
inline bool builds_seen_codes(const Problem& p) {
  return p.B * p.Ho * p.Wo <= kSparseRows && !gathers_pixels(p) && p.G * p.K <= (1 << 18);
}

// The hot loops, once per instruction set (see lut_cpu_kernels.inc).
#define AR_NS isabase
#define AR_ISA 0
#include "lut_cpu_kernels.inc"
#undef AR_NS
#undef AR_ISA

#pragma GCC push_options
#pragma GCC target("avx2,fma,bmi,bmi2,popcnt")
#define AR_NS isa256
#define AR_ISA 256
#include "lut_cpu_kernels.inc"
#undef AR_NS
#undef AR_ISA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,bmi,bmi2,popcnt")
#define AR_NS isa512
#define AR_ISA 512
#include "lut_cpu_kernels.inc"
#undef AR_NS
#undef AR_ISA
#pragma GCC pop_options

using approx_cpu::detect_isa;
using approx_cpu::Isa;

#define AR_DISPATCH(FN, ...)                                      \
  switch (detect_isa()) {                                         \
    case Isa::Avx512: isa512::FN(__VA_ARGS__); break;             \
    case Isa::Avx2: isa256::FN(__VA_ARGS__); break;               \
    default: isabase::FN(__VA_ARGS__);                            \
  }

// ------------------------------------------------------------------------------------------------
// The CPU variants (the order approx::lut_algos lists them in).
enum class Algo { Auto, Direct, Expanded, Tiled };
constexpr const char* kAlgoNames[] = {"direct", "expanded", "tiled"};

Algo parse_algo(c10::string_view s, const char* op) {
  if (s == "auto") return Algo::Auto;
  if (s == kAlgoNames[0]) return Algo::Direct;
  if (s == kAlgoNames[1]) return Algo::Expanded;
  if (s == kAlgoNames[2]) return Algo::Tiled;
  TORCH_CHECK(false, op, ": unknown algo '", std::string(s.data(), s.size()),
              "'; valid: auto, direct, expanded, tiled");
}

// Weight column in the LUT and sign handling for weight tap k of output channel n of group g.
// A product is ((lut[row][col] ^ neg) - neg) & keep: neg = all ones negates (w < 0, unsigned),
// keep = 0 zeroes it (w == 0, unsigned: sign(0) * lut[a][0] = 0).
struct WeightCols {
  std::vector<int32_t> col;    // [G][K][Np], padded channels -> a valid column (results unused)
  std::vector<uint32_t> neg;   // [G][K][Np]
  std::vector<uint32_t> keep;  // [G][K][Np]
};

WeightCols weight_cols(const at::Tensor& w, const Problem& p) {
  const int8_t* wd = w.data_ptr<int8_t>();
  WeightCols wc;
  const int64_t n = p.G * p.K * p.Np;
  wc.col.assign(n, p.is_unsigned ? 0 : 128);
  wc.neg.assign(n, 0);
  wc.keep.assign(n, 0xFFFFFFFFu);
  for (int64_t g = 0; g < p.G; ++g)
    for (int64_t j = 0; j < p.Ng; ++j)
      for (int64_t k = 0; k < p.K; ++k) {
        const int v = wd[(g * p.Ng + j) * p.K + k];
        const int64_t i = (g * p.K + k) * p.Np + j;
        if (p.is_unsigned) {
          wc.col[i] = v < 0 ? -v : v;
          wc.neg[i] = v < 0 ? 0xFFFFFFFFu : 0u;
          wc.keep[i] = v != 0 ? 0xFFFFFFFFu : 0u;
        } else {
          wc.col[i] = v + 128;
        }
      }
  return wc;
}

// Per LUT column: whether some product in it falls outside int16 (unsigned: so does its negation).
std::array<bool, 256> wide_columns(const int32_t* lut) {
  int32_t bad[256] = {};
  for (int a = 0; a < 256; ++a) {
    const int32_t* row = lut + a * 256;
    for (int c = 0; c < 256; ++c) bad[c] |= (row[c] < -32767) | (row[c] > 32767);
  }
  std::array<bool, 256> out;
  for (int c = 0; c < 256; ++c) out[c] = bad[c] != 0;
  return out;
}

// Whether every product the table of these weights would hold fits int16: the LUT columns the
// weights use (and the padded channels' column, see weight_cols) are all narrow.
bool fits_int16(const std::array<bool, 256>& wide, const at::Tensor& w, const Problem& p) {
  const int8_t* wd = w.data_ptr<int8_t>();
  bool used[256] = {};
  for (int64_t i = 0, n = w.numel(); i < n; ++i) used[p.is_unsigned ? std::abs(wd[i]) : wd[i] + 128] = true;
  if (p.Np > p.Ng) used[p.is_unsigned ? 0 : 128] = true;
  for (int c = 0; c < 256; ++c)
    if (used[c] && wide[c]) return false;
  return true;
}

// The table format a build uses: from the LUT's bytes, always.
bool products_fit_int16(const int32_t* lut, const at::Tensor& w, const Problem& p) {
  return fits_int16(wide_columns(lut), w, p);
}

constexpr int64_t kTableBudget = 64ll << 20;   // auto: expanded only below this table size
constexpr int64_t kCacheBudget = 256ll << 20;  // all cached tables together
constexpr size_t kCacheEntries = 64;

// Expanded tables, reused across calls while the weights and the LUT are byte-identical (at
// inference they never change, so the build is paid once per layer). Entries are matched by
// content, not by pointer, so a freed and reallocated tensor can never hit a stale table.
struct TableEntry {
  std::vector<int8_t> w;
  std::vector<int32_t> lut;
  bool is_unsigned;
  int64_t G, K, Ng, Np;
  bool fit16;
  at::Tensor table;
};

struct TableCache {
  std::mutex mu;
  std::list<std::shared_ptr<TableEntry>> entries;  // most recently used first
  int64_t bytes = 0;
};

TableCache& table_cache() {
  static TableCache c;
  return c;
}

bool cache_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("APPROX_RUN_TABLE_CACHE");
    return !(e && std::string(e) == "0");
  }();
  return on;
}

std::shared_ptr<TableEntry> cache_find(const Problem& p, const at::Tensor& w, const int32_t* lut) {
  if (!cache_enabled()) return nullptr;
  TableCache& c = table_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  const int64_t wn = w.numel();
  for (auto it = c.entries.begin(); it != c.entries.end(); ++it) {
    const TableEntry& e = **it;
    if (e.is_unsigned != p.is_unsigned || e.G != p.G || e.K != p.K || e.Ng != p.Ng ||
        (int64_t)e.w.size() != wn || std::memcmp(e.w.data(), w.data_ptr<int8_t>(), wn) != 0 ||
        std::memcmp(e.lut.data(), lut, 256 * 256 * sizeof(int32_t)) != 0)
      continue;
    auto hit = *it;
    c.entries.erase(it);
    c.entries.push_front(hit);
    return hit;
  }
  return nullptr;
}

void cache_insert(std::shared_ptr<TableEntry> e) {
  if (!cache_enabled()) return;
  TableCache& c = table_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.entries.push_front(e);
  c.bytes += e->table.numel();
  while ((c.bytes > kCacheBudget || c.entries.size() > kCacheEntries) && c.entries.size() > 1) {
    c.bytes -= c.entries.back()->table.numel();
    c.entries.pop_back();
  }
}

// CPU time of the calling thread: auto's trials run on it alone, so time the machine's other
// work takes from it does not count (wall-clock trials on a busy 2-core machine picked a variant
// 4x slower).
double thread_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

// cpu_ns: the CPU time the build took, summed over its threads.
std::shared_ptr<TableEntry> build_entry(const Problem& p, const at::Tensor& w, const int32_t* lut,
                                        const WeightCols& wc, bool fit16, int64_t tbytes,
                                        double& cpu_ns) {
  auto e = std::make_shared<TableEntry>();
  e->w.assign(w.data_ptr<int8_t>(), w.data_ptr<int8_t>() + w.numel());
  e->lut.assign(lut, lut + 256 * 256);
  e->is_unsigned = p.is_unsigned;
  e->G = p.G; e->K = p.K; e->Ng = p.Ng; e->Np = p.Np;
  e->fit16 = fit16;
  e->table = at::empty({tbytes}, at::TensorOptions().dtype(at::kByte));
  void* T = e->table.data_ptr();
  const int32_t* col = wc.col.data();
  const uint32_t* neg = wc.neg.data();
  const uint32_t* keep = wc.keep.data();
  std::atomic<int64_t> ns{0};
  at::parallel_for(0, p.G * p.K, 8, [&](int64_t s, int64_t t) {
    const double t0 = thread_ns();
    if (fit16) { AR_DISPATCH(build16, static_cast<int16_t*>(T), lut, col, neg, keep, p, s, t) }
    else { AR_DISPATCH(build32, static_cast<int32_t*>(T), lut, col, neg, keep, p, s, t) }
    ns += (int64_t)(thread_ns() - t0);
  });
  cpu_ns = (double)ns.load();
  return e;
}

int64_t table_bytes(const Problem& p, bool fit16) {
  return p.G * p.K * 256 * p.Np * (fit16 ? 2 : 4);
}

// At least ~1M MACs per task: below that, waking a second thread costs more than it saves
// (milliseconds when the other core is busy). grain = 0: the calling thread alone.
int64_t grain_of(const Problem& p) {
  return std::max<int64_t>(1, (1 << 20) / std::max<int64_t>(1, p.K * p.Np));
}

void direct_range(const Problem& p, const int32_t* lut, const WeightCols& wc, int64_t r0, int64_t r1,
                  bool parallel = true) {
  const int32_t* col = wc.col.data();
  const uint32_t* neg = wc.neg.data();
  const uint32_t* keep = wc.keep.data();
  auto body = [&](int64_t s, int64_t t) { AR_DISPATCH(direct_rows, lut, col, neg, keep, p, s, t) };
  if (parallel) at::parallel_for(r0, r1, grain_of(p), body);
  else if (r0 < r1) body(r0, r1);
}

void expanded_range(const Problem& p, const TableEntry& e, int64_t r0, int64_t r1, bool parallel = true) {
  const void* T = e.table.data_ptr();
  auto body = [&](int64_t s, int64_t t) {
    if (e.fit16) { AR_DISPATCH(exp16_rows, static_cast<const int16_t*>(T), p, s, t) }
    else { AR_DISPATCH(exp32_rows, static_cast<const int32_t*>(T), p, s, t) }
  };
  if (parallel) at::parallel_for(r0, r1, grain_of(p), body);
  else if (r0 < r1) body(r0, r1);
}

// tiled: one task per (group, 32-channel tile), each over every row of its group.
constexpr int64_t kTileChannels = 32;
int64_t tiles_of(const Problem& p) { return p.G * ((p.Np + kTileChannels - 1) / kTileChannels); }

// Row base and output pointers of every row, group-major, each group padded to whole kRowPad (the pads' outputs
// null, the pointers past the last group's null). Filled per group on every thread, into memory that is not zeroed
// first: a depthwise conv's call has one per row (3.2 M rows, 51 MB, in MobileNetV2's first at batch 8), which a
// zeroing resize and one thread took several ms to write, while tiled's tiles wait.
struct RowPointers {
  std::unique_ptr<const uint8_t*[]> base;
  std::unique_ptr<int32_t*[]> outp;
  std::vector<uint8_t> seen;  // builds_seen_codes: [G][K][256] (Problem::seen), marked once for all of a call's tiles
};
RowPointers row_pointers(const Problem& p) {
  if (gathers_pixels(p)) return {};
  const int64_t rpg = p.B * p.Ho * p.Wo, rpad = (rpg + isabase::kRowPad - 1) / isabase::kRowPad * isabase::kRowPad;
  const int64_t n = p.G * rpad + isabase::kRowPad;
  RowPointers rp{std::unique_ptr<const uint8_t*[]>(new const uint8_t*[n]),
                 std::unique_ptr<int32_t*[]>(new int32_t*[n])};
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, rpg));  // ~64 K rows a task
  at::parallel_for(0, p.G, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      isabase::next_block(p, g * rpg, (g + 1) * rpg, rpg, rp.base.get() + g * rpad, rp.outp.get() + g * rpad);
      std::fill(rp.outp.get() + g * rpad + rpg, rp.outp.get() + (g + 1) * rpad, nullptr);
    }
  });
  std::fill(rp.base.get() + n - isabase::kRowPad, rp.base.get() + n, nullptr);
  std::fill(rp.outp.get() + n - isabase::kRowPad, rp.outp.get() + n, nullptr);
  if (builds_seen_codes(p)) {  // the padding rows repeat their group's last row
    rp.seen.assign(p.G * p.K * 256, 0);
    at::parallel_for(0, p.G * p.K, grain, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const uint8_t* const* b = rp.base.get() + i / p.K * rpad;
        const int32_t o = p.off[i % p.K];
        uint8_t* s = rp.seen.data() + i * 256;
        for (int64_t r = 0; r < rpg; ++r) s[b[r][o]] = 1;
      }
    });
  }
  return rp;
}

// The LUT transposed ([column][row]) for tiled's tile builds, which read it by column (tile_build_t): made once a
// call, outside auto's timed trials; none for calls that gather by pixels, which build no tiles.
std::vector<int32_t> transposed_lut(const Problem& p, const int32_t* lut) {
  if (gathers_pixels(p)) return {};
  std::vector<int32_t> t(256 * 256);
  for (int r = 0; r < 256; ++r)
    for (int c = 0; c < 256; ++c) t[c * 256 + r] = lut[r * 256 + c];
  return t;
}

void tiled_range(const Problem& p, const int32_t* lut, const std::vector<int32_t>& lut_t, const WeightCols& wc,
                 bool fit16, const RowPointers& rp, int64_t t0, int64_t t1, bool parallel = true) {
  const int32_t* col = wc.col.data();
  const uint32_t* neg = wc.neg.data();
  const uint32_t* keep = wc.keep.data();
  const uint8_t* const* base = rp.base.get();
  int32_t* const* outp = rp.outp.get();
  Problem q = p;
  q.seen = rp.seen.empty() ? nullptr : rp.seen.data();
  q.lut_t = lut_t.empty() ? nullptr : lut_t.data();
  auto body = [&](int64_t s, int64_t t) {
    if (fit16) { AR_DISPATCH(tiled16, lut, col, neg, keep, q, base, outp, s, t) }
    else { AR_DISPATCH(tiled32, lut, col, neg, keep, q, base, outp, s, t) }
  };
  if (parallel) at::parallel_for(t0, t1, 1, body);
  else if (t0 < t1) body(t0, t1);
}

void tiled_all(const Problem& p, const int32_t* lut, const at::Tensor& w) {
  tiled_range(p, lut, transposed_lut(p, lut), weight_cols(w, p), products_fit_int16(lut, w, p), row_pointers(p), 0,
              tiles_of(p));
}

#include "lut_cpu_auto.inc"

void run(Problem& p, const at::Tensor& w, const at::Tensor& lut_t, Algo algo) {
  if (rows_of(p) == 0 || p.Ng == 0) return;
  const int32_t* lut = lut_t.data_ptr<int32_t>();
  std::shared_ptr<TableEntry> entry;
  if (algo == Algo::Auto) {
    const Decision d = decide(p, w, lut, key_fits_int16(lut_t, w, p), /*note=*/true);
    if (d.algo == Algo::Auto) return trial(p, w, lut_t);
    algo = d.algo;
    entry = d.entry;
  } else if (algo == Algo::Expanded) {
    entry = cache_find(p, w, lut);
  }
  if (algo == Algo::Direct) {
    direct_range(p, lut, weight_cols(w, p), 0, rows_of(p));
    g_runs[0]++;
    return;
  }
  if (algo == Algo::Tiled) {
    tiled_all(p, lut, w);
    g_runs[2]++;
    return;
  }
  if (!entry) entry = built_entry(p, w, lut, weight_cols(w, p));
  expanded_range(p, *entry, 0, rows_of(p));
  g_runs[1]++;
}

// Table rows and accumulator tiles are padded to whole 8-lane vectors.
int64_t round8(int64_t n) { return (n + 7) / 8 * 8; }

// The fields linear and conv fill alike: where the codes are, their kind, the taps, the output.
Problem code_problem(const at::Tensor& codes, at::ScalarType code_type, const std::vector<int32_t>& off,
                     at::Tensor& out) {
  Problem p{};
  p.act = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  p.is_unsigned = code_type == at::kByte;
  p.xmask = p.is_unsigned ? 0 : 0x80;
  p.K = static_cast<int64_t>(off.size());
  p.off = off.data();
  p.out = out.data_ptr<int32_t>();
  return p;
}

at::Tensor lut_linear_cpu(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                          c10::string_view algo_name) {
  const auto s = approx_checks::check_linear(a, w, lut, c10::DeviceType::CPU);
  const Algo algo = parse_algo(algo_name, "lut_linear");
  const int64_t M = s.M, K = s.K, N = s.N;
  at::Tensor out = at::empty({M, N}, a.options().dtype(at::kInt));
  if (K == 0) return out.zero_();
  std::vector<int32_t> off(K);
  for (int64_t k = 0; k < K; ++k) off[k] = (int32_t)k;
  Problem p = code_problem(a, a.scalar_type(), off, out);
  p.B = 1; p.G = 1; p.Ho = M; p.Wo = 1;
  p.a_img = 0; p.a_grp = 0; p.a_oh = K; p.a_ow = 0;
  p.o_img = 0; p.o_grp = 0; p.o_pix = N; p.o_ch = 1;
  p.Ng = N; p.Np = round8(N);
  run(p, w, lut, algo);
  return out;
}

at::Tensor lut_conv2d_cpu(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                          at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                          int64_t groups, c10::string_view algo_name) {
  const auto s = approx_checks::check_conv(a, w, lut, stride, padding, dilation, groups,
                                           c10::DeviceType::CPU);
  const int64_t sh = s.sh, sw = s.sw, ph = s.ph, pw = s.pw, dh = s.dh, dw = s.dw;
  const int64_t B = s.B, C = s.C, H = s.H, W = s.W, N = s.N, Cg = s.Cg, kh = s.kh, kw = s.kw;
  const int64_t Ho = s.Ho, Wo = s.Wo;
  const Algo algo = parse_algo(algo_name, "lut_conv2d");
  at::Tensor out = at::empty({B, N, Ho, Wo}, a.options().dtype(at::kInt));
  const int64_t K = s.K;
  if (K == 0) return out.zero_();

  // Padding becomes stored code 0, so every tap is an in-bounds read; the copy is O(input).
  at::Tensor src = a;
  if (ph || pw) {
    src = at::zeros({B, C, H + 2 * ph, W + 2 * pw}, a.options());
    src.narrow(2, ph, H).narrow(3, pw, W).copy_(a);
  }
  const int64_t Hp = H + 2 * ph, Wp = W + 2 * pw;
  TORCH_CHECK(C * Hp * Wp < (int64_t(1) << 31), "lut_conv2d: image too large");
  std::vector<int32_t> off(K);
  for (int64_t c = 0; c < Cg; ++c)
    for (int64_t i = 0; i < kh; ++i)
      for (int64_t j = 0; j < kw; ++j)
        off[(c * kh + i) * kw + j] = (int32_t)(c * Hp * Wp + i * dh * Wp + j * dw);
  Problem p = code_problem(src, a.scalar_type(), off, out);
  p.B = B; p.G = groups; p.Ho = Ho; p.Wo = Wo;
  p.a_img = C * Hp * Wp; p.a_grp = Cg * Hp * Wp; p.a_oh = sh * Wp; p.a_ow = sw;
  p.Ng = N / groups; p.Np = round8(p.Ng);
  p.o_img = N * Ho * Wo; p.o_grp = p.Ng * Ho * Wo; p.o_pix = 1; p.o_ch = Ho * Wo;
  p.conv = true;
  run(p, w, lut, algo);
  return out;
}

// See ops.cpp. The expanded table's size follows the format this LUT and these weights need;
// auto's pick is decide()'s answer for these tensors now, i.e. the variant their next call runs
// ("" while auto has not measured this call's key: its first call will).
std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<std::string>, std::string>
lut_algos_cpu(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
              at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
              int64_t groups) {
  Problem p{};
  if (a.dim() == 4) {
    const auto s = approx_checks::check_conv(a, w, lut, stride, padding, dilation, groups,
                                             c10::DeviceType::CPU);
    p.B = s.B, p.G = s.groups, p.Ho = s.Ho, p.Wo = s.Wo, p.K = s.K, p.Ng = s.N / s.groups;
    p.conv = true;
  } else {
    const auto s = approx_checks::check_linear(a, w, lut, c10::DeviceType::CPU);
    p.B = 1, p.G = 1, p.Ho = s.M, p.Wo = 1, p.K = s.K, p.Ng = s.N;
  }
  p.Np = round8(p.Ng);
  p.is_unsigned = a.scalar_type() == at::kByte;
  const int32_t* lut_d = lut.data_ptr<int32_t>();
  const int64_t tbytes = table_bytes(p, products_fit_int16(lut_d, w, p));
  const bool fits = tbytes <= 16 * kTableBudget;
  std::string pick;
  if (rows_of(p) > 0 && p.Ng > 0 && p.K > 0) {
    const Algo d = decide(p, w, lut_d, key_fits_int16(lut, w, p), /*note=*/false).algo;
    pick = d == Algo::Auto ? "" : kAlgoNames[(int)d - 1];
  }
  // tiled: per thread, one tile's table and its rows' accumulators
  const int64_t rpg = p.B * p.Ho * p.Wo, tile_entries = 256 * kTileChannels * ((256 << 10) / (256 * kTileChannels * 2));
  const int64_t tile_bytes = gathers_pixels(p) ? p.K * 256 * 4 : tile_entries * 2 + (rpg + 8) * kTileChannels * 4;
  const int64_t tiled_ws = at::get_num_threads() * tile_bytes;
  return {{kAlgoNames[0], kAlgoNames[1], kAlgoNames[2]},
          {0, fits ? tbytes : -1, tiled_ws},
          {"", fits ? "" : "would need an expanded table of " + std::to_string(tbytes >> 20) + " MiB", ""},
          pick};
}

// See ops.cpp: calls in which each variant computed output rows, in lut_algos' order.
std::vector<int64_t> lut_runs_cpu(const at::Tensor&) {
  return {g_runs[0].load(), g_runs[1].load(), g_runs[2].load()};
}

// See ops.cpp: reads per second of a pure gather loop, every thread at once, each timed by its own CPU
// time (on a shared machine, time a thread spends descheduled is not the hardware's), summed.
double lookup_rate_cpu(const at::Tensor&, double seconds) {
  std::vector<int32_t> row(256);
  for (int i = 0; i < 256; ++i) row[i] = i * 2654435761u >> 8;
  const int threads = at::get_num_threads();
  const Isa isa = detect_isa();
  const int lanes = isa == Isa::Avx512 ? isa512::kLanes : isa == Isa::Avx2 ? isa256::kLanes : isabase::kLanes;
  auto gathers = [&](int64_t n) {
    return isa == Isa::Avx512 ? isa512::gather_loop(row.data(), n)
           : isa == Isa::Avx2 ? isa256::gather_loop(row.data(), n)
                              : isabase::gather_loop(row.data(), n);
  };
  std::vector<double> rate(threads, 0.0);
  std::atomic<int64_t> sink{0};
  at::parallel_for(0, threads, 1, [&](int64_t s, int64_t t) {
    for (int64_t i = s; i < t; ++i) {
      int64_t n = 1 << 12;
      double spent = 0;
      for (int rep = 0; spent < seconds; ++rep) {
        const double t0 = thread_ns();
        sink += gathers(n);
        const double dt = (thread_ns() - t0) * 1e-9;
        spent += dt;
        if (dt < 2e-3) n *= 2;  // long enough for the clock, short enough to be rarely interrupted
        else rate[i] = std::max(rate[i], (double)n * lanes / dt);
      }
    }
  });
  double total = 0;
  for (double r : rate) total += r;
  return sink.load() == 42 ? total + 1e-9 : total;
}

}  // namespace

TORCH_LIBRARY_IMPL(approx, CPU, m) {
  m.impl("lookup_rate", &lookup_rate_cpu);
  m.impl("lut_linear", &lut_linear_cpu);
  m.impl("lut_conv2d", &lut_conv2d_cpu);
  m.impl("lut_algos", &lut_algos_cpu);
  m.impl("lut_runs", &lut_runs_cpu);
}
