// The x86 vector variant every CPU kernel file runs, decided once per process: the widest the CPU has,
// or a narrower one forced with APPROX_RUN_CPU_ISA=avx2|base (to measure the variants, and to test each
// on one machine: tests/ops). One decision for all ops, so a forced variant holds for quantize and
// requantize as for the LUT kernels and their gradients. x86-64 only (__builtin_cpu_supports).
#pragma once
#include <cstdlib>
#include <string>

namespace approx_cpu {

enum class Isa { Base, Avx2, Avx512 };

inline Isa detect_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    const bool a512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    const bool a2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("bmi2");
    const char* force = std::getenv("APPROX_RUN_CPU_ISA");
    const std::string f = force ? force : "";
    if (f == "base") return Isa::Base;
    if (f == "avx2" && a2) return Isa::Avx2;
    return a512 ? Isa::Avx512 : a2 ? Isa::Avx2 : Isa::Base;
  }();
  return isa;
}

// AVX2 (with FMA and BMI2) or wider, unless forced to the baseline.
inline bool has_avx2() { return detect_isa() != Isa::Base; }

}  // namespace approx_cpu
