// Internal: which of the vector instruction sets that kernels are compiled for (each variant a
// function with a gnu::target attribute) this CPU runs — one rule for every kernel that picks.
#pragma once

namespace kvsnap::detail {

enum class VectorIsa {
  avx512,    // AVX-512F with FMA
  avx2,      // AVX2 with FMA
  baseline,  // what the build targets
};

inline VectorIsa vector_isa() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("fma")) return VectorIsa::baseline;
  if (__builtin_cpu_supports("avx512f")) return VectorIsa::avx512;
  if (__builtin_cpu_supports("avx2")) return VectorIsa::avx2;
#endif
  return VectorIsa::baseline;
}

}  // namespace kvsnap::detail
