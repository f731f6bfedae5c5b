// The algorithm table (see algos.h) and what is derived from it.
#include "algos.h"

#include <cstdio>
#include <cstring>

#include "../checks.h"

namespace approx_cuda {
namespace {

using approx_checks::I;

std::vector<Config> one(const Params&, int) { return {Config{}}; }

// Blocks a channel auto times beside the grid model's pick (0). On an H200 the model's pick was up to 1.2x
// slower than the best of these on MobileNetV2's 14x14 and 28x28 layers, and no simple model fitted every
// layer: which grid fills the SMs best moves with the channels, the tiles and the blocks an SM holds.
constexpr int kDrGrids[] = {0, 1, 2, 4};
constexpr const char* kDrNames[] = {"depthwise_rows", "depthwise_rows_banked", "depthwise_rows_split",
                                    "depthwise_rows_banked8"};  // by DrLayout

// depthwise_rows with table layout L (DrLayout); auto times it only where the products fit int16
template <int L>
Algo depthwise_rows_algo() {
  return {kDrNames[L], false, false,
          [](const Params& p, const ConvGeo& cg) { return depthwise_rows_why_not(p, cg, L); },
          [](const Params& p, const ConvGeo& cg, int fmt, const Config& c, cudaStream_t s) {
            launch_depthwise_rows(p, cg, fmt, L, c.gx, s);
          },
          [](const Params&, int fmt) {
            std::vector<Config> out;
            if (fmt == 2) return out;  // int32 products: not a contender
            for (int gx : kDrGrids) {
              out.emplace_back();
              out.back().gx = gx;
            }
            return out;
          },
          // int16 products, inputs it loads as words
          [](const Params& p, const Config&, int fmt) { return fmt == 0 || depthwise_rows_applies_end(p, fmt); }};
}

// depthwise_rows' variants with _g<blocks a channel, 1..4096>: "" (not such a name), else the variant's row and
// gx, or gx -1 where the suffix is malformed
std::string depthwise_rows_grid(const std::string& name, int& gx) {
  const size_t at = name.rfind("_g");
  if (at == std::string::npos) return "";
  const std::string base = name.substr(0, at), digits = name.substr(at + 2);
  bool known = false;
  for (const char* n : kDrNames) known = known || base == n;
  if (!known) return "";
  gx = suffix_count(digits, 1, 4096);
  return base;
}

}  // namespace

const std::vector<Algo>& algos() {
  static const std::vector<Algo> table = {
      {"direct", false, false,
       [](const Params&, const ConvGeo&) { return std::string(); },
       [](const Params& p, const ConvGeo&, int, const Config&, cudaStream_t s) {
         launch_direct(p, s);
       },
       one},
      // second: a graph capture's pick (auto_pick takes the second candidate of a large call) for the
      // depthwise shapes it alone is built for, ahead of the weight-expanded variants
      {"depthwise", false, false, depthwise_why_not,
       [](const Params& p, const ConvGeo& cg, int, const Config&, cudaStream_t s) {
         launch_depthwise(p, cg, s);
       },
       one},
      // 3x3 depthwise at stride 1 or 2: one table read per code and kernel row (three products as
      // int16); with int32 products it still runs (16-byte entries) but auto does not time it
      depthwise_rows_algo<kDrSingle>(),
      // the same with the int16 table in 16 copies, one a bank pair: reads without bank conflicts,
      // two blocks an SM; int32 products run depthwise_rows' single table
      depthwise_rows_algo<kDrBanked>(),
      // 8 copies, each in two bank pairs: 2 wavefronts a half warp, four blocks an SM
      depthwise_rows_algo<kDrBanked8>(),
      // stride 2: the int16 table split in 4-byte entries (even columns' taps 0 and 2, odd ones' tap 1)
      depthwise_rows_algo<kDrSplit>(),
      // 7x7 planes at stride 1, 14x14 and 28x28 at stride 2: a thread a plane (or band), each code read once for every
      // product it feeds; int32 products run depthwise_rows' single table
      {"depthwise_planes", false, false, depthwise_planes_why_not,
       [](const Params& p, const ConvGeo& cg, int fmt, const Config& c, cudaStream_t s) {
         launch_depthwise_planes(p, cg, fmt, c, s);
       },
       depthwise_planes_candidates,
       [](const Params& p, const Config&, int fmt) { return fmt == 0 || depthwise_planes_applies_end(p, fmt); }},
      {"expanded_window", true, true,
       [](const Params& p, const ConvGeo& cg) {
         return window_smem(p, cg, 0) ? std::string()
                                      : "needs a conv of dilation 1 with a 1-, 3- or 5-wide kernel "
                                        "at stride 1 or a 1- or 3-wide one at stride 2, whose input "
                                        "rows fit shared memory";
       },
       [](const Params& p, const ConvGeo& cg, int fmt, const Config& c, cudaStream_t s) {
         launch_window(p, cg, fmt, c, s);
       },
       window_candidates, [](const Params&, const Config&, int) { return true; }},
      {"expanded_rows", true, true,
       [](const Params& p, const ConvGeo&) {
         return rows_applies(p) ? std::string() : "is for lut_linear";
       },
       [](const Params& p, const ConvGeo&, int fmt, const Config& c, cudaStream_t s) {
         launch_rows(p, fmt, c, s);
       },
       rows_candidates},
      {"expanded_pairs", true, false,
       [](const Params& p, const ConvGeo&) {
         return pairs_applies(p) ? std::string()
                                 : "needs a linear layer of at most 16 output channels";
       },
       [](const Params& p, const ConvGeo&, int fmt, const Config&, cudaStream_t s) {
         launch_pairs(p, fmt, s);
       },
       // int32 products: its fallback path reads T from L2 and is not a contender
       [](const Params& p, int fmt) { return fmt == 1 ? one(p, fmt) : std::vector<Config>{}; }},
      // reads no T: builds its table slices from Et16 (no table budget); int32 products take a slow
      // path, so it is a contender only where the products may fit int16
      {"expanded_gemm", false, false, gemm_why_not,
       [](const Params& p, const ConvGeo&, int fmt, const Config& c, cudaStream_t s) {
         launch_gemm(p, fmt, c, s);
       },
       gemm_candidates,
       // unsplit (a K split's blocks add partial sums into the output), where a channel's plane is a multiple of 4
       // outputs (its rows in aligned fours: on 7x7 planes the end's short runs of stores measured slower than the
       // two ops, the tall tile's most; benchmarks/imagenet.md, "A conv's end in expanded_gemm's stores")
       [](const Params& p, const Config& c, int) { return c.ks <= 1 && p.HoWo % 4 == 0; }},
      {"expanded_smem", true, true,
       [](const Params& p, const ConvGeo&) {
         return smem_applies(p) ? std::string()
                                : "needs at most 16 output channels per group (got " + I(p.N) + ")";
       },
       [](const Params& p, const ConvGeo&, int, const Config&, cudaStream_t s) {
         launch_exp_smem(p, s);
       },
       one},
      {"expanded_l2", true, true,
       [](const Params&, const ConvGeo&) { return std::string(); },
       [](const Params& p, const ConvGeo&, int, const Config&, cudaStream_t s) {
         launch_exp_l2(p, s);
       },
       one},
  };
  return table;
}

Choice parse_choice(const std::string& name, const char* op) {
  if (name == "auto") return Choice{kAuto};
  if (name == "expanded") return Choice{kExpanded};
  const auto& t = algos();
  for (size_t i = 0; i < t.size(); ++i)
    if (name == t[i].name) return Choice{static_cast<int>(i)};
  int gx = 0;
  const std::string rows_base = depthwise_rows_grid(name, gx);
  if (!rows_base.empty()) {
    TORCH_CHECK(gx > 0, op, ": bad algo '", name, "': ", rows_base, "_g<blocks a channel, 1..4096>");
    Choice c = parse_choice(rows_base, op);
    c.cfg.gx = gx;
    return c;
  }
  if (name.rfind("depthwise_planes_", 0) == 0) {
    Choice c{kAuto};
    const std::string err = parse_depthwise_planes_config(name, c.cfg);
    TORCH_CHECK(err.empty(), op, ": ", err);
    return Choice{parse_choice("depthwise_planes", op).algo, c.cfg};
  }
  if (name.rfind("expanded_window_", 0) == 0) {
    // expanded_window_[x<outputs a thread: 5, 7 or 8>][_c<channels staged at once>]
    Choice c{kAuto};
    const char* rest = name.c_str() + 15;  // at the "_"
    int rx = 0, cc = 0, n = 0;
    bool ok = true;
    if (std::strncmp(rest, "_x", 2) == 0) {
      ok = std::sscanf(rest, "_x%d%n", &rx, &n) == 1 && (rx == 5 || rx == 7 || rx == 8);
      rest += n;
    }
    if (ok && *rest) {
      n = 0;
      ok = std::sscanf(rest, "_c%d%n", &cc, &n) == 1 && cc >= 1;
      rest += n;
    }
    TORCH_CHECK(ok && *rest == 0 && (rx || cc), op, ": bad algo '", name,
                "': expanded_window_x<outputs a thread: 5, 7 or 8>, expanded_window_c<channels staged at once, "
                ">= 1> or expanded_window_x<..>_c<..>");
    for (size_t i = 0; i < t.size(); ++i)
      if (std::string(t[i].name) == "expanded_window") c.algo = static_cast<int>(i);
    c.cfg.rx = rx == 8 ? 0 : rx;
    c.cfg.cc = cc;
    return c;
  }
  if (name.rfind("expanded_rows_r", 0) == 0) {
    Choice c{kAuto};
    const std::string err = parse_rows_config(name, c.cfg);
    TORCH_CHECK(err.empty(), op, ": ", err);
    for (size_t i = 0; i < t.size(); ++i)
      if (std::string(t[i].name) == "expanded_rows") c.algo = static_cast<int>(i);
    return c;
  }
  if (name.rfind("expanded_gemm_r", 0) == 0) {
    Choice c{kAuto};
    const std::string err = parse_gemm_config(name, c.cfg);
    TORCH_CHECK(err.empty(), op, ": ", err);
    for (size_t i = 0; i < t.size(); ++i)
      if (std::string(t[i].name) == "expanded_gemm") c.algo = static_cast<int>(i);
    return c;
  }
  std::string valid = "auto, expanded";
  for (const Algo& a : t) valid += std::string(", ") + a.name;
  TORCH_CHECK(false, op, ": unknown algo '", name, "'; valid: ", valid);
}

std::string choice_name(const Choice& c) {
  if (c.algo == kAuto) return "auto";
  if (c.algo == kExpanded) return "expanded";
  const Algo& a = algos()[c.algo];
  if (std::string(a.name) == "expanded_window")
    return std::string(a.name) + (c.cfg.rx ? "_x" + std::to_string(c.cfg.rx) : "") +
           (c.cfg.cc ? "_c" + std::to_string(c.cfg.cc) : "");
  if (std::string(a.name) == "expanded_gemm") return gemm_config_name(c.cfg);
  if (std::string(a.name) == "depthwise_planes") return depthwise_planes_config_name(c.cfg);
  if (c.cfg.gx > 0) return std::string(a.name) + "_g" + std::to_string(c.cfg.gx);
  return std::string(a.name) == "expanded_rows" ? rows_config_name(c.cfg) : a.name;
}

std::string why_not(const Algo& a, const Params& p, const ConvGeo& cg) {
  std::string why = a.why_not(p, cg);
  if (why.empty() && a.table && table_bytes(p) > kTableBudget)
    why = "would need an expanded table of " + I(table_bytes(p) >> 20) + " MiB (budget " +
          I(kTableBudget >> 20) + " MiB); use algo='direct'";
  return why;
}

Choice resolve(Choice c, const Params& p, const ConvGeo& cg, const char* op) {
  const auto& t = algos();
  if (c.algo == kExpanded) {
    for (size_t i = 0; i < t.size(); ++i)
      if (t[i].expanded && t[i].why_not(p, cg).empty()) {
        c.algo = static_cast<int>(i);
        break;
      }
    TORCH_CHECK(c.algo != kExpanded, op, ": no expanded variant runs this shape");
  }
  const std::string why = why_not(t[c.algo], p, cg);
  TORCH_CHECK(why.empty(), op, ": algo '", t[c.algo].name, "' ", why,
              why.find("use algo=") == std::string::npos ? "; use 'expanded' or 'auto'" : "");
  return c;
}

int64_t workspace_bytes(const Algo& a, const Params& p, const ConvGeo& cg) {
  return prep_bytes(p) + (a.table ? table_bytes(p) + pairs_bytes(p) : 0) + depthwise_planes_table_bytes(p, cg);
}

AutoInputs auto_inputs(const Params& p, const ConvGeo& cg, int fmt, bool t_refused) {
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  return AutoInputs{p, cg, fmt, table_bytes(p) <= kTableBudget && !t_refused, dev};
}

std::vector<Choice> auto_candidates(const AutoInputs& in) {
  const Params& p = in.p;
  const ConvGeo& cg = in.cg;
  const int fmt = in.fmt;
  const bool table = in.table;
  std::vector<Choice> out;
  const auto& t = algos();
  for (size_t i = 0; i < t.size(); ++i) {
    if ((t[i].table && !table) || !t[i].why_not(p, cg).empty()) continue;
    for (const Config& c : t[i].candidates(p, fmt)) out.push_back(Choice{static_cast<int>(i), c});
  }
  return out;
}

void run_choice(const Choice& c, Params p, const Prepared& pr, const ConvGeo& cg, cudaStream_t s) {
  p.flags = pr.p.flags;
  p.E32 = pr.p.E32;
  p.E16 = pr.p.E16;
  p.Et16 = pr.p.Et16;
  p.kinfo = pr.p.kinfo;
  p.T = pr.p.T;
  p.Tpairs = pr.p.Tpairs;
  p.Tdw = pr.p.Tdw;
  algos()[c.algo].launch(p, cg, pr.fmt, c.cfg, s);
}

}  // namespace approx_cuda
