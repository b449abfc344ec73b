// Internal interface: which variant of each of this layer's hand-written kernels the CPU runs —
// decode attention's products, softmax's exponentials, SiLU — for reports such as kvsnap bench
// (figures from an AVX-512 and from an AVX2 machine are not comparable).
#pragma once

#include <string>

namespace kvsnap::detail {

struct OpsKernels {
  std::string attention;  // "avx512", "avx2", or "OpenBLAS" where neither runs
  std::string softmax;    // "avx512", "avx2" or "portable"
  std::string silu;       // likewise
};

OpsKernels ops_kernels();

}  // namespace kvsnap::detail
