// CUDA entry points of approx::lut_linear, approx::lut_conv2d and approx::lut_algos (arithmetic:
// see ../ops.cpp; design: ../README.md). Checks shapes, builds the launch parameters, gets the
// prepared tables and runs the chosen variant (algos.h) on the current stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "../fused.h"
#include "algos.h"

namespace approx_cuda {
namespace {

using approx_checks::I;

Params base_params(const at::Tensor& a, const at::Tensor& w, const at::Tensor* out) {
  Params p{};
  p.a = reinterpret_cast<const uint8_t*>(a.data_ptr());
  p.w = w.data_ptr<int8_t>();
  p.out = out ? out->data_ptr<int32_t>() : nullptr;
  p.xmask = a.scalar_type() == at::kChar ? 0x80u : 0u;
  return p;
}

Params linear_params(const at::Tensor& a, const at::Tensor& w, const at::Tensor* out,
                     const approx_checks::LinearShape& s) {
  TORCH_CHECK(s.K < (1ll << 30) && s.N < (1ll << 30), "lut_linear: K and N must be below 2^30");
  Params p = base_params(a, w, out);
  p.M = s.M;
  p.HoWo = 1;
  p.K = static_cast<int>(s.K);
  p.N = p.Ntot = static_cast<int>(s.N);
  p.G = 1;
  p.NG = static_cast<int>((s.N + 7) / 8);
  p.Kpad = static_cast<int>(round_up(s.K, kKAlign));
  p.conv = 0;
  p.vec = (s.K % 8 == 0) && (reinterpret_cast<uintptr_t>(p.a) % 8 == 0);
  p.vec4 = (s.K % 4 == 0) && (reinterpret_cast<uintptr_t>(p.a) % 4 == 0);
  return p;
}

Params conv_params(const at::Tensor& a, const at::Tensor& w, const at::Tensor* out,
                   const approx_checks::ConvShape& s, ConvGeo& cg) {
  TORCH_CHECK(s.Cg * s.H * s.W < (1ll << 31) && s.K < (1ll << 30) && s.H + s.ph < (1 << 15) &&
                  s.W + s.pw < (1 << 15) && s.Ho * s.sh < (1 << 15) && s.Wo * s.sw < (1 << 15) &&
                  s.dh * (s.kh - 1) < (1 << 15) && s.dw * (s.kw - 1) < (1 << 15),
              "lut_conv2d: input too large for the CUDA kernel (one group's image must stay "
              "below 2^31 codes, its height, width, padding and dilated kernel below 32768)");
  TORCH_CHECK(s.groups <= 65535, "lut_conv2d: at most 65535 groups on CUDA, got ", I(s.groups));
  Params p = base_params(a, w, out);
  p.M = s.B * s.Ho * s.Wo;
  p.HoWo = s.Ho * s.Wo;
  p.K = static_cast<int>(s.K);
  p.G = static_cast<int>(s.groups);
  p.N = static_cast<int>(s.N / s.groups);
  p.Ntot = static_cast<int>(s.N);
  p.NG = (p.N + 7) / 8;
  p.Kpad = static_cast<int>(round_up(s.K, kKAlign));
  p.conv = 1;
  p.vec = 0;
  p.C = static_cast<int>(s.C);
  p.H = static_cast<int>(s.H);
  p.W = static_cast<int>(s.W);
  p.Cg = static_cast<int>(s.Cg);
  p.Wo = static_cast<int>(s.Wo);
  p.sh = static_cast<int>(s.sh);
  p.sw = static_cast<int>(s.sw);
  p.ph = static_cast<int>(s.ph);
  p.pw = static_cast<int>(s.pw);
  p.fHoWo = make_fastdiv(static_cast<unsigned>(s.Ho * s.Wo));
  p.fWo = make_fastdiv(static_cast<unsigned>(s.Wo));
  cg.kh = static_cast<int>(s.kh);
  cg.kw = static_cast<int>(s.kw);
  cg.dh = static_cast<int>(s.dh);
  cg.dw = static_cast<int>(s.dw);
  set_window_geometry(p, cg);
  return p;
}

void run(Choice choice, const Params& p, const at::Tensor& w, const at::Tensor& lut,
         const ConvGeo& cg, const char* op) {
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool changing = cache_enabled() && weights_changing(w);
  if (choice.algo == kAuto && changing && p.M * p.N < 512LL * p.NG * 8) {
    // Training: this table would serve this call only. Building costs ~K*256*Np writes per group,
    // each row saves ~K*N lookups, so below ~512 rows per group direct lookups are cheaper.
    choice = parse_choice("direct", op);
  }
  if (choice.algo != kAuto) {
    choice = resolve(choice, p, cg, op);
    const auto pr = get_prepared(p, w, lut, cg, algos()[choice.algo].table, stream, changing);
    run_choice(choice, p, *pr, cg, stream);
    return;
  }
  // E first (cached, or built with its format read back), which tells whether auto's pick for this
  // format is known; T (where it fits) only for a first trial or a pick that reads it (drop_table),
  // and none where the cache has no room for it (t_refused: auto then picks without T)
  const bool fits = table_bytes(p) <= kTableBudget;
  auto pr = get_prepared(p, w, lut, cg, fits && changing, stream, changing);
  AutoInputs in = auto_inputs(p, cg, pr->fmt, pr->t_refused);
  Choice pick;
  bool known = cached_pick(in, pick);
  if (in.table && !pr->has_table && (!known || algos()[pick.algo].table)) {
    pr = get_prepared(p, w, lut, cg, true, stream, changing);
    if (pr->t_refused) in.table = false, known = cached_pick(in, pick);
  }
  if (!known) pick = auto_pick(in, *pr, stream);
  run_choice(pick, p, *pr, cg, stream);
  if (pr->has_table && !algos()[pick.algo].table) drop_table(p, w, lut, cg, stream);
}

// auto's GEMM layout for a conv of one group: its codes copied so that expanded_gemm runs it as a 1x1 conv of stride 1
// over its taps (tap k = (c, ky, kx) of an output pixel, as the weights [N][C][kh][kw] are [N][K]) on the path that
// copies a stage's codes with cp.async (planes of a multiple of 4 pixels, K a multiple of 4). A pointwise conv of
// stride 1 on such planes is that already; a strided one gets its sampled pixels, a strided or dilated KxK conv its
// taps (im2col: K / C times its codes, a tap in the padding code 0, as every kernel reads it), and planes of another
// size (ResNet-50's 7x7) the batch folded into one image ([K, B x plane] codes, the sums transposed back), a KxK
// conv's too. Both where the conv has at least two tiles of output rows. On an H200 the pointwise layouts took
// 0.82-0.94 of the best variant's time on the shapes as given at ResNet-50's batch 64 and 256, and folded at 1,568
// rows (batch 32) 1.02-1.03; ResNet-18's 3x3 convs on 7x7 planes 0.86. A KxK conv of stride 1 on planes of a
// multiple of 4 can run either way, and which is faster depends on the codes (expanded_window reads a network's
// activations up to 1.3x faster than uniform ones) as much as on the shape: on an H200 at batch 64 the taps took
// 0.91-0.95 of the time as given on ResNet-18's 64x56 and 128x28 convs and 1.10 on ResNet-50's 64x56. So auto times
// both on the conv's first call (GemmLayout::timed, takes_taps) and keeps the faster; the conv alone, without the end
// expanded_window would apply in its stores (whole models at batch 64: ResNet-18 1.6 % faster, ResNet-50 0.35 %
// slower, the taps then costing more in the model than alone). Measured in
// benchmarks/imagenet.md, "Pointwise convs in the copied-codes layout", "3x3 convs as a GEMM over their taps" and
// "Stride-1 3x3 convs: the taps timed against the shape as given". A named variant runs the shape as given.
constexpr int64_t kLayoutRows = 2048;
constexpr int64_t kLayoutBytes = 1ll << 30;  // the taps' codes at most: a KxK conv's copy is K / C times its input

struct GemmLayout {
  bool rewrite = false, folded = false;
  bool timed = false;  // either way: the taps where they ran faster on the shape's first call (takes_taps)
  std::vector<int64_t> sizes;  // the codes' sizes in the layout the conv runs in
};

GemmLayout gemm_layout(const approx_checks::ConvShape& s, const Choice& algo) {
  GemmLayout l;
  const int64_t plane = s.Ho * s.Wo, rows = s.B * plane;
  // an empty conv runs as given
  if (algo.algo != kAuto || s.groups != 1 || rows < kLayoutRows || s.N == 0 || s.K == 0 || s.K % 4 != 0 ||
      s.K * rows > kLayoutBytes)
    return l;
  l.folded = plane % 4 != 0 && rows % 4 == 0 && s.B < (1 << 15) && plane < (1 << 15);  // conv_params' bounds
  // as given: a pointwise conv already on that path; a KxK one that expanded_window runs (stride 1, dilation 1) is
  // timed against its taps
  const bool pointwise = s.kh == 1 && s.kw == 1;
  const bool as_given =
      s.sh == 1 && s.sw == 1 && (pointwise ? s.ph == 0 && s.pw == 0 : s.dh == 1 && s.dw == 1);
  l.rewrite = l.folded || (plane % 4 == 0 && !as_given);
  l.timed = plane % 4 == 0 && as_given && !pointwise;
  l.sizes = l.folded ? std::vector<int64_t>{1, s.K, s.B, plane} : std::vector<int64_t>{s.B, s.K, s.Ho, s.Wo};
  return l;
}

at::Tensor layout_codes(const at::Tensor& a, const approx_checks::ConvShape& s, const GemmLayout& l) {
  at::Tensor codes = at::empty(l.sizes, a.options());
  launch_gemm_layout(a, codes, s, l.folded, c10::cuda::getCurrentCUDAStream());
  return codes;
}

// The weights of the conv in the layout: [N][K] as a 1x1 conv's (a view: the same tensor to the table cache).
at::Tensor layout_weights(const at::Tensor& w) { return w.view({w.size(0), -1, 1, 1}); }

// The shape of a stride-1 1x1 conv of one group, without padding, over codes [B, K, H, W] with N channels out.
approx_checks::ConvShape pointwise_shape(int64_t B, int64_t K, int64_t H, int64_t W, int64_t N) {
  approx_checks::ConvShape s{};
  s.B = B;
  s.C = s.Cg = s.K = K;
  s.H = s.Ho = H;
  s.W = s.Wo = W;
  s.N = N;
  s.kh = s.kw = s.sh = s.sw = s.dh = s.dw = s.groups = 1;
  return s;
}

// The launch parameters of a conv in auto's layout, before its codes are copied: those of the stride-1 1x1 conv over
// codes of `sizes` ([B, K, H, W]) with N channels out. p.a is the given codes' until run_with_end sets the copy's,
// before anything reads it (a cached pick's and table's lookups read only the shapes). lw: the weights' [N, K, 1, 1].
Params layout_params(const std::vector<int64_t>& sizes, int64_t N, const at::Tensor& a, const at::Tensor& lw,
                     ConvGeo& cg) {
  return conv_params(a, lw, nullptr, pointwise_shape(sizes[0], sizes[1], sizes[2], sizes[3], N), cg);
}

at::Tensor lut_conv2d_cuda(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                           c10::IntArrayRef stride, c10::IntArrayRef padding,
                           c10::IntArrayRef dilation, int64_t groups, c10::string_view algo_name);

// The conv in auto's layout l: the stride-1 1x1 conv over the copied codes (whose own layout is as given), the sums
// transposed back where the batch was folded.
at::Tensor conv_in_layout(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                          const approx_checks::ConvShape& s, const GemmLayout& l) {
  const at::Tensor sums =
      lut_conv2d_cuda(layout_codes(a, s, l), layout_weights(w), lut, {1, 1}, {0, 0}, {1, 1}, 1, "auto");
  return l.folded ? sums.view({s.N, s.B, s.Ho, s.Wo}).transpose(0, 1).contiguous() : sums;
}

at::Tensor conv_as_given(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                         const approx_checks::ConvShape& s, const Choice& algo) {
  at::Tensor out = at::empty({s.B, s.N, s.Ho, s.Wo}, a.options().dtype(at::kInt));
  if (out.numel() == 0) return out;
  if (s.K == 0) return out.zero_();
  ConvGeo cg;
  const Params p = conv_params(a, w, &out, s, cg);
  run(algo, p, w, lut, cg, "lut_conv2d");
  return out;
}

// Timed layouts: whether the taps ran faster, per shape as given (auto's pick key without a table format: both ways
// read the same table, and the codes the first call brings decide).
std::mutex g_taps_mu;
std::map<PickKey, bool> g_taps_faster;

PickKey taps_key(const at::Tensor& a, const at::Tensor& w, const approx_checks::ConvShape& s) {
  ConvGeo cg;
  const Params p = conv_params(a, w, nullptr, s, cg);
  return pick_key(auto_inputs(p, cg, 0, false));
}

// 1 where a timed layout's conv runs in its taps, 0 where as given, -1 where not timed yet.
int taps_known(const PickKey& key) {
  std::lock_guard<std::mutex> lock(g_taps_mu);
  const auto it = g_taps_faster.find(key);
  return it == g_taps_faster.end() ? -1 : it->second;
}

// A timed layout's choice: made on the shape's first call, both ways timed (auto's picks for each made on the way);
// inside a graph capture, where nothing is timed, as given.
bool takes_taps(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut, const approx_checks::ConvShape& s,
                const GemmLayout& l) {
  const PickKey key = taps_key(a, w, s);
  const int known = taps_known(key);
  if (known >= 0 || capturing()) return known == 1;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float given = best_ms([&] { return conv_as_given(a, w, lut, s, Choice{kAuto}); }, stream);
  const float taps = best_ms([&] { return conv_in_layout(a, w, lut, s, l); }, stream);
  std::lock_guard<std::mutex> lock(g_taps_mu);
  return g_taps_faster[key] = taps < given;
}

at::Tensor lut_conv2d_cuda(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                           c10::IntArrayRef stride, c10::IntArrayRef padding,
                           c10::IntArrayRef dilation, int64_t groups, c10::string_view algo_name) {
  const auto s = approx_checks::check_conv(a, w, lut, stride, padding, dilation, groups,
                                           c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(a.device());
  const Choice algo = parse_choice(std::string(algo_name), "lut_conv2d");
  const GemmLayout l = gemm_layout(s, algo);
  if (l.rewrite || (l.timed && takes_taps(a, w, lut, s, l))) return conv_in_layout(a, w, lut, s, l);
  return conv_as_given(a, w, lut, s, algo);
}

// auto's layout for a linear layer: its codes transposed, [K, M] as one image of M pixels, so that expanded_gemm runs
// it as a stride-1 1x1 conv whose stage codes it copies with cp.async; its sums come back [N, M] and are transposed.
// As given, a row's codes are K-contiguous, 4 bytes a row a stage, and a copy by rows was slower (4-5 % on r8c). At
// >= 2 tiles of rows, M and K multiples of 4; the plane H x W within conv_params' bounds. Empty: as given.
std::vector<int64_t> linear_layout(const approx_checks::LinearShape& s, const Choice& algo) {
  if (algo.algo != kAuto || s.M < kLayoutRows || s.M % 4 != 0 || s.K % 4 != 0 || s.N == 0 || s.K == 0 ||
      s.K * s.M > kLayoutBytes)
    return {};
  const int64_t width = 4 * std::gcd(s.M / 4, int64_t{4096});  // a multiple of 4 that divides M, at most 16384
  if (s.M / width >= (1 << 15)) return {};
  return {1, s.K, s.M / width, width};
}

at::Tensor lut_linear_cuda(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                           c10::string_view algo_name) {
  const auto s = approx_checks::check_linear(a, w, lut, c10::DeviceType::CUDA);
  const Choice algo = parse_choice(std::string(algo_name), "lut_linear");
  const c10::cuda::CUDAGuard guard(a.device());
  const std::vector<int64_t> sizes = linear_layout(s, algo);
  if (!sizes.empty()) {
    // the copy as gemm_layout's of a 1x1 conv whose images are a's rows, 1x1 planes folded into one image: a
    // transposed (PyTorch's uint8 transpose ran at 0.13 TB/s on an H200, 76 us for ViT-B/16's codes at batch 64)
    at::Tensor codes = at::empty(sizes, a.options());
    launch_gemm_layout(a, codes, pointwise_shape(s.M, s.K, 1, 1, s.N), true, c10::cuda::getCurrentCUDAStream());
    const at::Tensor sums = lut_conv2d_cuda(codes, layout_weights(w), lut, {1, 1}, {0, 0}, {1, 1}, 1, algo_name);
    return sums.view({s.N, s.M}).t().contiguous();
  }
  at::Tensor out = at::empty({s.M, s.N}, a.options().dtype(at::kInt));
  if (s.M == 0 || s.N == 0) return out;
  if (s.K == 0) return out.zero_();
  run(algo, linear_params(a, w, &out, s), w, lut, ConvGeo{}, "lut_linear");
  return out;
}

// The variant a call of these shapes runs where that is known without running anything: a named one, or auto's
// cached pick for the cached tables' format. kAuto where it is not (a first call, weights changing in place).
Choice known_pick(Choice choice, const Params& p, const at::Tensor& w, const at::Tensor& lut, const ConvGeo& cg,
                  const char* op) {
  if (!cache_enabled() || weights_changing(w)) return Choice{kAuto};
  if (choice.algo != kAuto) return resolve(choice, p, cg, op);
  bool refused = false;
  const int fmt = cached_format(p, w, lut, cg, &refused);
  Choice pick;
  return fmt >= 0 && cached_pick(auto_inputs(p, cg, fmt, refused), pick) ? pick : Choice{kAuto};
}

// Whether the pick writes the end in its stores (Algo::applies_end; fmt 0 before the tables and codes are known)
bool applies_end(const Choice& c, const Params& p, int fmt) {
  return c.algo >= 0 && algos()[c.algo].applies_end && algos()[c.algo].applies_end(p, c.cfg, fmt);
}

// Runs the conv with its end in the kernel's stores (p.epi) where the variant applies it (applies_end); false
// where it does not, and nothing ran (the caller then runs lut_conv2d and the end's op). codes() gives the codes the
// conv reads, made only once it is known to run (until then p.a may point at codes of another layout: layout_params).
template <class Codes>
bool run_with_end(Choice algo, Params p, const at::Tensor& w, const at::Tensor& lut, const ConvGeo& cg, Codes codes) {
  const Choice pick = known_pick(algo, p, w, lut, cg, "lut_conv2d");
  if (!applies_end(pick, p, 0)) return false;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto pr = get_prepared(p, w, lut, cg, algos()[pick.algo].table, stream, false);
  if ((algos()[pick.algo].table && !pr->has_table) || pr->fmt == 0) return false;  // fmt: cached, so known
  const at::Tensor a = codes();
  p.a = reinterpret_cast<const uint8_t*>(a.data_ptr());
  if (!applies_end(pick, p, pr->fmt)) return false;  // the depthwise variants read the products' format and p.a
  run_choice(pick, p, *pr, cg, stream);
  return true;
}

bool aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// A conv and its end, the end in the kernel's stores where the variant applies it (run_with_end): check_end(sums)
// checks the end's arguments against a placeholder of the sums' shape on their device, freed before anything runs;
// fill_end(epi, out) sets the end for an output of `dtype`. Undefined where it did not run (a variant that cannot
// apply the end, a first call, an empty conv): the caller then runs the composite, which makes its own sums.
template <class CheckEnd, class FillEnd>
at::Tensor conv_with_end(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut, c10::IntArrayRef stride,
                         c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                         c10::string_view algo_name, at::ScalarType dtype, CheckEnd check_end, FillEnd fill_end) {
  const auto s = approx_checks::check_conv(a, w, lut, stride, padding, dilation, groups, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(a.device());
  const Choice algo = parse_choice(std::string(algo_name), "lut_conv2d");
  check_end(at::empty({s.B, s.N, s.Ho, s.Wo}, a.options().dtype(at::kInt)));
  if (s.B * s.N * s.Ho * s.Wo == 0 || s.K == 0) return at::Tensor();
  const GemmLayout l = gemm_layout(s, algo);
  if (l.folded) return at::Tensor();  // the composite: its lut_conv2d folds, then the end's op
  // a timed layout not timed yet: the composite, whose lut_conv2d times it
  const int taps = l.timed ? taps_known(taps_key(a, w, s)) : l.rewrite;
  if (taps < 0) return at::Tensor();
  ConvGeo cg;
  const at::Tensor lw = taps ? layout_weights(w) : w;
  Params p = taps ? layout_params(l.sizes, s.N, a, lw, cg) : conv_params(a, w, nullptr, s, cg);
  at::Tensor out = at::empty({s.B, s.N, s.Ho, s.Wo}, a.options().dtype(dtype));
  fill_end(p.epi, out);
  return run_with_end(algo, p, lw, lut, cg, [&] { return taps ? layout_codes(a, s, l) : a; }) ? out : at::Tensor();
}

at::Tensor lut_conv2d_dequantize_cuda(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                                      c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                      int64_t groups, c10::string_view algo_name, const at::Tensor& act_scale,
                                      const at::Tensor& weight_scale, const at::Tensor& bias,
                                      const std::optional<at::Tensor>& residual, bool relu,
                                      const std::optional<at::Tensor>& codes,
                                      const std::optional<at::Tensor>& codes_scale) {
  auto check_end = [&](const at::Tensor& acc) {
    approx_checks::check_dequantize(acc, act_scale, weight_scale, bias);
    approx_checks::check_residual(residual, acc);
    approx_checks::check_dequantize_codes(codes, codes_scale, acc);
  };
  auto fill_end = [&](Epi& e, const at::Tensor& out) {
    e.kind = 1;
    e.relu = relu;
    e.act_scale = act_scale.data_ptr<float>();
    e.wscale = weight_scale.data_ptr<float>();
    e.bias = bias.data_ptr<float>();
    e.residual = residual ? residual->data_ptr<float>() : nullptr;
    e.outf = out.data_ptr<float>();
    if (codes) {
      const bool is_signed = codes->scalar_type() == at::kChar;
      e.codes = reinterpret_cast<uint8_t*>(codes->data_ptr());
      e.codes_scale = codes_scale->data_ptr<float>();
      e.cqmin = is_signed ? -128.f : 0.f;
      e.cqmax = is_signed ? 127.f : 255.f;
    }
    e.vec = aligned(e.outf, 16) && aligned(e.residual, 16) && aligned(e.codes, 4);
  };
  at::Tensor out = conv_with_end(a, w, lut, stride, padding, dilation, groups, algo_name, at::kFloat, check_end,
                                 fill_end);
  return out.defined() ? out
                       : approx_fused::lut_conv2d_dequantize(a, w, lut, stride, padding, dilation, groups, algo_name,
                                                             act_scale, weight_scale, bias, residual, relu, codes,
                                                             codes_scale);
}

at::Tensor lut_conv2d_requantize_codes_cuda(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                                            c10::IntArrayRef stride, c10::IntArrayRef padding,
                                            c10::IntArrayRef dilation, int64_t groups, c10::string_view algo_name,
                                            const at::Tensor& bias, const at::Tensor& multiplier,
                                            const at::Tensor& shift, int64_t qmin, int64_t qmax, bool is_signed) {
  auto check_end = [&](const at::Tensor& acc) {
    approx_checks::check_requantize_codes(acc, bias, multiplier, shift, qmin, qmax, is_signed);
  };
  auto fill_end = [&](Epi& e, const at::Tensor& out) {
    e.kind = 2;
    e.codes = reinterpret_cast<uint8_t*>(out.data_ptr());
    e.qbias = bias.data_ptr<int32_t>();
    e.mult = multiplier.data_ptr<int32_t>();
    e.shift = shift.data_ptr<int32_t>();
    e.qmin = qmin;
    e.qmax = qmax;
    e.vec = aligned(e.codes, 4);
  };
  at::Tensor out = conv_with_end(a, w, lut, stride, padding, dilation, groups, algo_name,
                                 is_signed ? at::kChar : at::kByte, check_end, fill_end);
  return out.defined() ? out
                       : approx_fused::lut_conv2d_requantize_codes(a, w, lut, stride, padding, dilation, groups,
                                                                   algo_name, bias, multiplier, shift, qmin, qmax,
                                                                   is_signed);
}

// A call's shapes as given (p, cg) and as auto picks for them (pick_*: a conv's or linear layer's in auto's layout
// where it takes one; pick_w keeps the laid-out weights pick_p points at alive).
struct PickShapes {
  Params p, pick_p;
  ConvGeo cg, pick_cg;
  at::Tensor pick_w;
};
PickShapes pick_shapes(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut, c10::IntArrayRef stride,
                       c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups) {
  PickShapes r;
  r.pick_w = w;
  if (a.dim() == 4) {
    const auto s = approx_checks::check_conv(a, w, lut, stride, padding, dilation, groups, c10::DeviceType::CUDA);
    r.p = r.pick_p = conv_params(a, w, nullptr, s, r.cg);
    r.pick_cg = r.cg;
    const GemmLayout l = gemm_layout(s, Choice{kAuto});
    if (l.rewrite || (l.timed && taps_known(taps_key(a, w, s)) == 1))
      r.pick_w = layout_weights(w), r.pick_p = layout_params(l.sizes, s.N, a, r.pick_w, r.pick_cg);
  } else {
    const auto s = approx_checks::check_linear(a, w, lut, c10::DeviceType::CUDA);
    r.p = r.pick_p = linear_params(a, w, nullptr, s);
    const std::vector<int64_t> sizes = linear_layout(s, Choice{kAuto});
    if (!sizes.empty()) r.pick_w = layout_weights(w), r.pick_p = layout_params(sizes, s.N, a, r.pick_w, r.pick_cg);
  }
  return r;
}

// For the call's shapes: every variant, the device memory its prepared tables take (-1 where it
// does not run the shape), why not ("" where it does), and auto's pick ("" until auto has run
// this shape; picks are timed on the first call).
std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<std::string>, std::string>
lut_algos_cuda(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
               c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
               int64_t groups) {
  const c10::cuda::CUDAGuard guard(a.device());
  const PickShapes ps = pick_shapes(a, w, lut, stride, padding, dilation, groups);
  const Params& p = ps.p;
  const ConvGeo& cg = ps.cg;
  std::vector<std::string> names, notes;
  std::vector<int64_t> bytes;
  for (const Algo& al : algos()) {
    const std::string why = why_not(al, p, cg);
    names.push_back(al.name);
    notes.push_back(why);
    bytes.push_back(why.empty() ? workspace_bytes(al, p, cg) : -1);
  }
  // auto's pick is cached per table format too: the format the prepared tables of (w, lut) have
  // (cached_format), else the one the LUT gives (lut_format), else 0, that of tables built uncached
  // (weights changing in place, graph captures); without T where the cache had no room for it.
  Choice pick;
  bool found = false;
  bool refused = false;
  for (int fmt : {cached_format(ps.pick_p, ps.pick_w, lut, ps.pick_cg, &refused), lut_format(lut, p.xmask == 0), 0}) {
    if (fmt < 0 || found) continue;
    found = cached_pick(auto_inputs(ps.pick_p, ps.pick_cg, fmt, refused), pick);
  }
  return {names, bytes, notes, found ? choice_name(pick) : std::string()};
}

// What auto's first call of these shapes times, in its order: each candidate's exact name (one a named call runs),
// for the table format the LUT gives and with T where it fits its budget.
std::vector<std::string> lut_auto_candidates_cuda(const at::Tensor& a, const at::Tensor& w, const at::Tensor& lut,
                                                  c10::IntArrayRef stride, c10::IntArrayRef padding,
                                                  c10::IntArrayRef dilation, int64_t groups) {
  const c10::cuda::CUDAGuard guard(a.device());
  const PickShapes ps = pick_shapes(a, w, lut, stride, padding, dilation, groups);
  std::vector<std::string> out;
  for (const Choice& c : auto_candidates(auto_inputs(ps.pick_p, ps.pick_cg, lut_format(lut, ps.p.xmask == 0), false)))
    out.push_back(choice_name(c));
  return out;
}

}  // namespace
}  // namespace approx_cuda

TORCH_LIBRARY_IMPL(approx, CUDA, m) {
  m.impl("lut_linear", &approx_cuda::lut_linear_cuda);
  m.impl("lut_conv2d", &approx_cuda::lut_conv2d_cuda);
  m.impl("lut_algos", &approx_cuda::lut_algos_cuda);
  m.impl("lut_auto_candidates", &approx_cuda::lut_auto_candidates_cuda);
  m.impl("lut_conv2d_dequantize", &approx_cuda::lut_conv2d_dequantize_cuda);
  m.impl("lut_conv2d_requantize_codes", &approx_cuda::lut_conv2d_requantize_codes_cuda);
}
