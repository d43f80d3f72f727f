// C++ autograd for gather_coalesced, used by the eager fast path.
//
// A Python autograd.Function (what torch.library.register_autograd builds)
// costs about a microsecond per input tensor to set up, and even the C++
// torch::autograd::Function records metadata per input that this op never
// needs. With 1024 inputs that bookkeeping costs more than the gather, so this
// file builds the graph node directly, like torch's generated CatBackward.
// Its backward matches the Python formula in dpmethods/ops.py: each slice of
// the gradient goes back to its piece's device, as a view when it is already
// there.
#include "gather_common.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <memory>
#include <type_traits>

namespace dpmethods {
namespace {

using torch::autograd::variable_list;

std::vector<at::Tensor> call_gather(
    at::TensorList tensors, int64_t num_replicas, int64_t dim, c10::Device device) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpmethods::gather_coalesced", "")
          .typed<std::vector<at::Tensor>(at::TensorList, int64_t, int64_t, c10::Device)>();
  return op.call(tensors, num_replicas, dim, device);
}

struct GatherCoalescedBackward : public torch::autograd::Node {
  int64_t num_replicas = 1;
  std::vector<int64_t> sizes;         // per piece: size along dim
  std::vector<c10::Device> devices;   // per piece: where its gradient goes
  std::vector<int64_t> dims;          // per leaf: normalized dim
  std::vector<int64_t> leaf_of_grad;  // per differentiable output: its leaf

  std::string name() const override {
    return "GatherCoalescedBackward";
  }

  variable_list apply(variable_list&& grads) override {
    variable_list out(sizes.size());
    for (size_t k = 0; k < grads.size(); ++k) {
      const at::Tensor& g = grads[k];
      if (!g.defined()) {
        continue;
      }
      const int64_t l = leaf_of_grad[k];
      const int64_t first = l * num_replicas;
      const std::vector<int64_t> leaf_sizes(
          sizes.begin() + first, sizes.begin() + first + num_replicas);
      std::vector<at::Tensor> parts = g.split_with_sizes(leaf_sizes, dims[l]);
      for (int64_t r = 0; r < num_replicas; ++r) {
        if (!should_compute_output(static_cast<size_t>(first + r))) {
          continue;
        }
        const c10::Device dev = devices[first + r];
        out[first + r] = parts[r].device() == dev ? parts[r] : parts[r].to(dev);
      }
    }
    return out;
  }
};

// torch >= 2.14 owns graph nodes with c10::intrusive_ptr, earlier releases with
// std::shared_ptr; `if constexpr` on a dependent branch keeps both compiling.
template <typename T>
auto make_node() {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>) {
    return c10::make_intrusive<T>();
  } else {
    return std::make_shared<T>();
  }
}

}  // namespace

std::vector<at::Tensor> gather_coalesced_autograd(
    at::TensorList tensors, int64_t num_replicas, int64_t dim, c10::Device device) {
  std::vector<at::Tensor> outs;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    outs = call_gather(tensors, num_replicas, dim, device);
  }
  if (!c10::GradMode::is_enabled()) {
    return outs;
  }
  // The op validated the inputs, so ranks and dims are consistent here.
  const size_t n = tensors.size();
  std::vector<char> leaf_requires_grad(outs.size(), 0);
  bool any = false;
  for (size_t i = 0; i < n; ++i) {
    if (tensors[i].requires_grad()) {
      leaf_requires_grad[i / num_replicas] = 1;
      any = true;
    }
  }
  if (!any) {
    return outs;
  }
  auto node = make_node<GatherCoalescedBackward>();
  node->num_replicas = num_replicas;
  node->sizes.resize(n);
  node->devices.reserve(n);
  node->dims.resize(outs.size());
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t d = dim < 0 ? dim + t.dim() : dim;
    node->sizes[i] = t.size(d);
    node->devices.push_back(t.device());
    node->dims[i / num_replicas] = d;
  }
  node->set_next_edges(torch::autograd::collect_next_edges(tensors));
  for (size_t l = 0; l < outs.size(); ++l) {
    // Leaves whose pieces need no gradient stay plain tensors, as with torch.cat.
    if (leaf_requires_grad[l] && torch::autograd::isDifferentiableType(outs[l].scalar_type())) {
      node->leaf_of_grad.push_back(static_cast<int64_t>(l));
      torch::autograd::set_history(outs[l], node);
    }
  }
  return outs;
}

}  // namespace dpmethods

TORCH_LIBRARY_IMPL(dpmethods, CompositeImplicitAutograd, m) {
  m.impl("_gather_coalesced_autograd", &dpmethods::gather_coalesced_autograd);
}
