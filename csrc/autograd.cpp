// C++ autograd for gather_coalesced, used by the eager fast path.
//
// A Python autograd.Function (what torch.library.register_autograd builds)
// costs about a microsecond per input tensor to set up; with 1024 inputs that
// is more than the gather itself. This node does the same bookkeeping in C++.
// Its backward matches the Python formula in dpmethods/ops.py: each slice of
// the gradient goes back to its piece's device, as a view when it is already
// there.
#include "gather_common.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

namespace dpmethods {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::vector<at::Tensor> call_gather(
    at::TensorList tensors, int64_t num_replicas, int64_t dim, c10::Device device) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dpmethods::gather_coalesced", "")
          .typed<std::vector<at::Tensor>(at::TensorList, int64_t, int64_t, c10::Device)>();
  return op.call(tensors, num_replicas, dim, device);
}

struct GatherFunction : public torch::autograd::Function<GatherFunction> {
  static variable_list forward(
      AutogradContext* ctx, at::TensorList tensors, int64_t num_replicas, int64_t dim,
      c10::Device device) {
    std::vector<at::Tensor> outs = call_gather(tensors, num_replicas, dim, device);
    // The op validated the inputs, so dims and ranks are consistent here.
    const int64_t n = static_cast<int64_t>(tensors.size());
    std::vector<int64_t> sizes(n);
    std::vector<int64_t> dev_types(n);
    std::vector<int64_t> dev_index(n);
    std::vector<int64_t> dims(outs.size());
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor& t = tensors[i];
      const int64_t d = dim < 0 ? dim + t.dim() : dim;
      sizes[i] = t.size(d);
      dims[i / num_replicas] = d;
      dev_types[i] = static_cast<int64_t>(t.device().type());
      dev_index[i] = static_cast<int64_t>(t.device().index());
    }
    ctx->saved_data["sizes"] = sizes;
    ctx->saved_data["dims"] = dims;
    ctx->saved_data["dev_types"] = dev_types;
    ctx->saved_data["dev_index"] = dev_index;
    ctx->saved_data["num_replicas"] = num_replicas;
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const auto dims = ctx->saved_data["dims"].toIntVector();
    const auto dev_types = ctx->saved_data["dev_types"].toIntVector();
    const auto dev_index = ctx->saved_data["dev_index"].toIntVector();
    const int64_t num_replicas = ctx->saved_data["num_replicas"].toInt();
    variable_list out;
    // One gradient per forward input: the tensors, then num_replicas, dim, device.
    out.reserve(sizes.size() + 3);
    for (size_t l = 0; l < grads.size(); ++l) {
      const at::Tensor& g = grads[l];
      const int64_t first = static_cast<int64_t>(l) * num_replicas;
      if (!g.defined()) {
        out.insert(out.end(), num_replicas, at::Tensor());
        continue;
      }
      const std::vector<int64_t> leaf_sizes(
          sizes.begin() + first, sizes.begin() + first + num_replicas);
      std::vector<at::Tensor> parts = g.split_with_sizes(leaf_sizes, dims[l]);
      for (int64_t r = 0; r < num_replicas; ++r) {
        const c10::Device dev(
            static_cast<c10::DeviceType>(dev_types[first + r]),
            static_cast<c10::DeviceIndex>(dev_index[first + r]));
        out.push_back(parts[r].device() == dev ? parts[r] : parts[r].to(dev));
      }
    }
    out.insert(out.end(), 3, at::Tensor());
    return out;
  }
};

std::vector<at::Tensor> gather_coalesced_autograd(
    at::TensorList tensors, int64_t num_replicas, int64_t dim, c10::Device device) {
  return GatherFunction::apply(tensors, num_replicas, dim, device);
}

}  // namespace
}  // namespace dpmethods

TORCH_LIBRARY_IMPL(dpmethods, CompositeImplicitAutograd, m) {
  m.impl("_gather_coalesced_autograd", &dpmethods::gather_coalesced_autograd);
}
