// Host-side interface between the CUDA files: prepared tables (tables.cu, table_cache.cpp), the
// kernel families (one .cu each), device queries. The algorithm table that ties the families
// together is algos.h.
#pragma once
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "../checks.h"
#include "common.cuh"

namespace approx_cuda {

inline int device_attr(cudaDeviceAttr attr) {
  int dev = 0, v = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, attr, dev));
  return v;
}
inline int sm_count() { return device_attr(cudaDevAttrMultiProcessorCount); }
inline int max_smem_optin() { return device_attr(cudaDevAttrMaxSharedMemoryPerBlockOptin); }

// ---- tables.cu: one layer's prepared tables
// Effective products (E32/E16, and E16 transposed), fit flags, conv tap table and, for the expanded algorithms, the
// weight-expanded table T (allocated in the int32 size) and, for linear layers of <= 16
// channels, its pair-major copy.
struct Prepared {
  at::Tensor buf;
  Params p;      // E32, E16, flags, kinfo, T, Tpairs point into buf
  bool has_table = false;
  int fmt = 0;   // table format known on the host: 0 unknown (read on the device), 1 int16, 2 int32
  bool t_refused = false;  // the cache had no room for this layer's T: it keeps E, auto runs without T
  cudaStream_t stream = nullptr;
  std::vector<cudaStream_t> users;  // other streams it was used on (cached entries)
};

int64_t prep_bytes(const Params& p);   // E32, E16, Et16, flags, tap table (every algorithm)
int64_t table_bytes(const Params& p);  // T, int32 layout
bool pairs_applies(const Params& p);   // linear, <= 16 channels: T's pair-major copy is built too
int64_t pairs_bytes(const Params& p);
// Allocates the buffer and launches prep (and the table builds when `need_table`).
std::shared_ptr<Prepared> prepare(const Params& geo, const at::Tensor& lut, const ConvGeo& cg,
                                  bool need_table, cudaStream_t stream);

// ---- table_cache.cpp
bool cache_enabled();
bool capturing();  // a CUDA graph capture is under way on the current stream
bool weights_changing(const at::Tensor& w);
// The format (Prepared::fmt) of the cached prepared tables of (w, lut) for these shapes, and their
// t_refused; -1 if none are cached. Builds nothing.
int cached_format(const Params& p, const at::Tensor& w, const at::Tensor& lut, const ConvGeo& cg,
                  bool* t_refused = nullptr);
// The format prepared tables of this LUT get (1 int16, 2 int32), computed on the host like prep.
int lut_format(const at::Tensor& lut, bool is_unsigned);
// The prepared tables for this call: cached, or built now (and cached where allowed).
std::shared_ptr<Prepared> get_prepared(const Params& p, const at::Tensor& w, const at::Tensor& lut,
                                       const ConvGeo& cg, bool need_table, cudaStream_t stream,
                                       bool changing);
// auto picked a variant without T: the cached entry of (w, lut) keeps its E tables only.
void drop_table(const Params& p, const at::Tensor& w, const at::Tensor& lut, const ConvGeo& cg,
                cudaStream_t stream);

// ---- kernel families. `fmt` as in Prepared; `Config` carries expanded_rows' knobs.
struct Config {
  int r = 0, cs = 0, th = 256;  // rows per thread (0: default config), cluster size, threads
  int mb = 0;                   // rows per block; 0: th * r
  int cc = 0;                   // expanded_window: channels staged at once; 0: as many as fit
  int rx = 0;                   // expanded_window: outputs a thread (7 or 5); 0: 8
  int build = 0;                // expanded_gemm: the table build, 0 scattered, 1 WH (_r8w), 2 CO (_r8c)
  int ks = 0;                   // expanded_gemm: K split over ks blocks (_k<ks>); 0 or 1: none
  int gx = 0;                   // depthwise_rows: blocks a channel (_g<gx>); 0: its grid model's
  int bb = 0;                   // depthwise_planes: bands a block (_bb<bb>); 0: every band
};

// The count a variant name's digit suffix spells (_g<N>, _k<N>): lo..hi, no sign and no leading zero; else -1
inline int suffix_count(const std::string& digits, int lo, int hi) {
  if (digits.empty() || digits.size() > 9 || digits[0] == '0' ||
      digits.find_first_not_of("0123456789") != std::string::npos)
    return -1;
  const int v = std::stoi(digits);
  return v >= lo && v <= hi ? v : -1;
}

void launch_direct(const Params& p, cudaStream_t stream);                  // direct.cu
bool smem_applies(const Params& p);                                        // expanded.cu
void launch_exp_smem(const Params& p, cudaStream_t stream);
void launch_exp_l2(const Params& p, cudaStream_t stream);
int64_t window_smem(const Params& p, const ConvGeo& cg, int fmt);         // window.cu (0: n/a)
void set_window_geometry(Params& p, const ConvGeo& cg);
std::vector<Config> window_candidates(const Params& p, int fmt);
void launch_window(const Params& p, const ConvGeo& cg, int fmt, const Config& c, cudaStream_t stream);
bool rows_applies(const Params& p);                                        // rows.cu
int rows_max_cs(const Params& p, int fmt);
std::vector<Config> rows_candidates(const Params& p, int fmt);
void launch_rows(const Params& p, int fmt, Config c, cudaStream_t stream);
std::string parse_rows_config(const std::string& name, Config& c);  // "" or what is wrong
std::string rows_config_name(const Config& c);
void launch_pairs(const Params& p, int fmt, cudaStream_t stream);           // pairs.cu
std::string gemm_why_not(const Params& p, const ConvGeo& cg);               // gemm.cu ("" : runs)
std::vector<Config> gemm_candidates(const Params& p, int fmt);
void launch_gemm(const Params& p, int fmt, Config c, cudaStream_t stream);
std::string parse_gemm_config(const std::string& name, Config& c);  // "" or what is wrong
std::string gemm_config_name(const Config& c);
std::string depthwise_why_not(const Params& p, const ConvGeo& cg);         // depthwise.cu ("" : runs)
void launch_depthwise(const Params& p, const ConvGeo& cg, cudaStream_t stream);
// depthwise_rows.cu; layout: depthwise_rows' table (kDrSingle), depthwise_rows_banked's (the int16 table
// in 16 copies, one a bank pair), depthwise_rows_split's (stride 2: 4-byte entries, even and odd columns')
// or depthwise_rows_banked8's (8 copies, each in two bank pairs)
enum DrLayout : int { kDrSingle = 0, kDrBanked = 1, kDrSplit = 2, kDrBanked8 = 3 };
std::string depthwise_rows_why_not(const Params& p, const ConvGeo& cg, int layout);
// where it applies a conv's end (Params::epi) in its stores: int16 products (fmt 1), inputs loaded directly
bool depthwise_rows_applies_end(const Params& p, int fmt);
// gx: blocks a channel, 0 for the grid model's pick
void launch_depthwise_rows(const Params& p, const ConvGeo& cg, int fmt, int layout, int gx, cudaStream_t stream);
// depthwise_planes.cu: 3x3, padding 1, on 7x7 planes at stride 1 and 14x14 or 28x28 ones at stride 2, a thread a
// plane or band of it (Config::r: bands, Config::mb: images a block, Config::bb: bands a block; r 0: the default)
std::string depthwise_planes_why_not(const Params& p, const ConvGeo& cg);
bool depthwise_planes_applies_end(const Params& p, int fmt);
std::vector<Config> depthwise_planes_candidates(const Params& p, int fmt);
std::string depthwise_planes_config_name(const Config& c);
std::string parse_depthwise_planes_config(const std::string& name, Config& c);  // "" or what is wrong
void launch_depthwise_planes(const Params& p, const ConvGeo& cg, int fmt, const Config& c, cudaStream_t stream);
// its channels' tables, prepared with the weights (Params::Tdw): the bytes (0 where it does not run the shape), and
// their build from Et16 and the weights, on the stream after prep
int64_t depthwise_planes_table_bytes(const Params& p, const ConvGeo& cg);
void build_depthwise_planes_tables(const Params& p, uint8_t* out, cudaStream_t stream);
// layouts.cu: a conv's codes (one group) in auto's GEMM layout, out [B][K][Ho][Wo] or folded [K][B][Ho][Wo]
void launch_gemm_layout(const at::Tensor& a, at::Tensor& out, const approx_checks::ConvShape& s, bool folded,
                        cudaStream_t stream);

}  // namespace approx_cuda
