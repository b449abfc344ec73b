#include "ops/kernel_report.h"

#include "ops/activations.h"
#include "ops/decode_kernels.h"
#include "ops/softmax.h"

namespace kvsnap::detail {

OpsKernels ops_kernels() {
  const std::vector<DecodeKernelVariant> attention = decode_kernel_variants();
  return {attention.empty() ? "OpenBLAS" : attention.back().name, softmax_variants().back().name,
          silu_gated_variants().back().name};
}

}  // namespace kvsnap::detail
