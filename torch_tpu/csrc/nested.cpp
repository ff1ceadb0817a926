// Strided nested tensors (torch.nested, PyTorch's NestedTensorImpl) moved between devices.
//
// A nested tensor is one buffer plus CPU metadata (sizes, strides, storage offsets per
// component). PyTorch has no NestedTensorPrivateUse1 kernels, so a nested op on "tpu" runs
// PyTorch's NestedTensorCPU kernel on copies (eager/kernels.py, cpu_fallback). Moving a
// nested tensor cannot go through `Tensor.to`, which dispatches back to that fallback: these
// copy its whole storage as a plain tensor and rebuild the impl around the copy with the same
// metadata.
#include <torch/extension.h>
#include <ATen/NestedTensorImpl.h>

namespace {

at::Tensor storage_as_tensor(const at::Tensor& t) {
  return at::native::get_nested_tensor_impl(t)->get_unsafe_storage_as_tensor();
}

at::Tensor nested_to(const at::Tensor& t, c10::Device device) {
  const auto* impl = at::native::get_nested_tensor_impl(t);
  at::Tensor buffer = storage_as_tensor(t).to(device);
  return at::detail::make_tensor<at::native::NestedTensorImpl>(
      buffer, impl->get_nested_sizes().clone(), impl->get_nested_strides().clone(),
      impl->get_storage_offsets().clone());
}

void nested_copy_(const at::Tensor& dst, const at::Tensor& src) {
  // `src` was made from `dst` by nested_to and written by a kernel: the same layout.
  at::Tensor to = storage_as_tensor(dst), from = storage_as_tensor(src);
  TORCH_CHECK(to.numel() == from.numel(), "nested tensor copy-back: the CPU kernel changed the buffer's size");
  to.copy_(from);
}

}  // namespace

void init_nested(py::module& m) {
  m.def("nested_to", &nested_to, "A copy of nested tensor `t` on `device` (same components, same layout).");
  m.def("nested_copy_", &nested_copy_, "Write nested tensor `src`'s values into `dst` (made from it by nested_to).");
}
