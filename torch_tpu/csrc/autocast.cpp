// Autocast for "tpu": torch.autocast("tpu", dtype=...) follows CUDA's rules.
//
// It owns: the AutocastPrivateUse1 kernels.  The op lists are PyTorch's own
// (the AT_FORALL_* policy lists of ATen/autocast_mode.h, the ones AutocastCUDA
// is registered from), expanded here for PrivateUse1; nothing is listed by
// hand except the one op CUDA bans.  Casting, the weight cache and nesting are
// PyTorch's (at::autocast::WrapFunction / cached_cast).  The autocast dtype
// defaults to bfloat16 (set from Python, torch_tpu/autocast.py).
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace {

// CUDA bans binary_cross_entropy under autocast (the sigmoid before it is
// unsafe in float16/bfloat16); so do we, with the same advice.
at::Tensor binary_cross_entropy_banned(
    const at::Tensor&,
    const at::Tensor&,
    const std::optional<at::Tensor>&,
    int64_t) {
  TORCH_CHECK(
      false,
      "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast on 'tpu' "
      "(as on 'cuda'): their inputs usually come from a sigmoid that loses precision in bfloat16/float16.\n"
      "Combine the sigmoid and the loss with torch.nn.functional.binary_cross_entropy_with_logits or "
      "torch.nn.BCEWithLogitsLoss, which are safe to autocast.");
}

}  // namespace

// The lists spell their signatures with ATen's unqualified names.
using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
using at::Tensor;

// Ops off the lists run unchanged (PyTorch registers this for its own autocast keys only).
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define TPU_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TPU_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define TPU_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define TPU_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(TPU_LOWER_PRECISION_FP)
  AT_FORALL_FP32(TPU_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(TPU_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(TPU_PROMOTE)
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN(binary_cross_entropy_banned));
#undef TPU_LOWER_PRECISION_FP
#undef TPU_FP32
#undef TPU_FP32_SET_OPT_DTYPE
#undef TPU_PROMOTE
}
