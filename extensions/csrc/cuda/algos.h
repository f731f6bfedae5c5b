// The algorithm table: every CUDA variant of approx::lut_linear / approx::lut_conv2d, once.
// Dispatch, `expanded`, auto's candidates, approx::lut_algos (which bench, the tests and the config
// check read) and the error messages all come from it. To add a variant: write its family file
// (kernels.h declares the launcher) and add one row to algos() in algos.cpp.
#pragma once
#include <string>
#include <vector>

#include "kernels.h"

namespace approx_cuda {

struct Algo {
  const char* name;
  bool table;     // reads the weight-expanded table T (so the table budget applies)
  bool expanded;  // one of algo="expanded"'s picks: the first such row that runs the shape
  // "" where the variant runs this shape, else why not (completes "<op>: algo '<name>' ...")
  std::string (*why_not)(const Params& p, const ConvGeo& cg);
  void (*launch)(const Params& p, const ConvGeo& cg, int fmt, const Config& c, cudaStream_t s);
  // the configurations auto's trial times (fmt: table format); {} = not a contender here
  std::vector<Config> (*candidates)(const Params& p, int fmt);
  // whether configuration c writes a conv's end (Params::epi) in its stores in place of the sums; asked before the
  // call's tables and codes are known (fmt 0: could it) and again with both (fmt 1 or 2, p.a the codes it reads).
  // nullptr: never (lut_conv2d_dequantize / _requantize_codes then run the conv and the end's op)
  bool (*applies_end)(const Params& p, const Config& c, int fmt) = nullptr;
};

const std::vector<Algo>& algos();

// A concrete variant and its configuration; algo is an index into algos(), or kAuto / kExpanded.
constexpr int kAuto = -1, kExpanded = -2;
struct Choice {
  int algo = kAuto;
  Config cfg{};
};

Choice parse_choice(const std::string& name, const char* op);  // TORCH_CHECKs unknown names
std::string choice_name(const Choice& c);
// `expanded` made concrete; a variant that cannot run this shape is an error that says why.
Choice resolve(Choice c, const Params& p, const ConvGeo& cg, const char* op);
std::string why_not(const Algo& a, const Params& p, const ConvGeo& cg);  // incl. the table budget
// Device memory the prepared tables of a call with this variant take (what prepare() allocates).
int64_t workspace_bytes(const Algo& a, const Params& p, const ConvGeo& cg);
// Everything auto's candidate list and their timings depend on: the call's shape and geometry
// (Params without its pointers, ConvGeo), the table format, whether the table fits its budget and
// the device (its SM count and shared memory size the candidates). auto_candidates() reads nothing
// else, and the pick cache keys on all of it (pick_key), so the two cannot drift apart.
struct AutoInputs {
  const Params& p;
  const ConvGeo& cg;
  int fmt;     // Prepared::fmt: 0 unknown (read on the device), 1 int16, 2 int32
  bool table;  // T fits kTableBudget and the cache had room for it
  int device;
};
// table and device filled in; t_refused: the layer's cache entry had no room for T (Prepared::t_refused)
AutoInputs auto_inputs(const Params& p, const ConvGeo& cg, int fmt, bool t_refused);
// auto's candidates, most promising first (the pick inside a graph capture, where nothing is timed).
std::vector<Choice> auto_candidates(const AutoInputs& in);
// Runs one concrete choice on prepared tables.
void run_choice(const Choice& c, Params p, const Prepared& pr, const ConvGeo& cg, cudaStream_t s);

// How auto times a way to run a call: once to warm up (auto's trials, the tables), then the best of 3
// CUDA-event timings of two back-to-back runs (the second launch queues behind the first, so the time
// is mostly the GPU's; host-clock timing of single runs was noisy enough to pick a variant ~2-10 %
// slower). Milliseconds of the two runs.
template <class Run>
float best_ms(Run run, cudaStream_t stream) {
  run();
  cudaEvent_t ev[2];
  for (auto& e : ev) C10_CUDA_CHECK(cudaEventCreate(&e));
  float best = 1e30f;
  for (int r = 0; r < 3; ++r) {
    C10_CUDA_CHECK(cudaEventRecord(ev[0], stream));
    run();
    run();
    C10_CUDA_CHECK(cudaEventRecord(ev[1], stream));
    C10_CUDA_CHECK(cudaEventSynchronize(ev[1]));
    float ms = 0;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    best = ms < best ? ms : best;
  }
  for (auto& e : ev) C10_CUDA_CHECK(cudaEventDestroy(e));
  return best;
}

// autotune.cpp: auto's pick per AutoInputs (timed once, cached).
using PickKey = std::vector<long long>;
PickKey pick_key(const AutoInputs& in);  // every field of AutoInputs but Params' pointers
Choice auto_pick(const AutoInputs& in, const Prepared& pr, cudaStream_t stream);
bool cached_pick(const AutoInputs& in, Choice& out);  // auto's pick for these inputs, if made already

}  // namespace approx_cuda
