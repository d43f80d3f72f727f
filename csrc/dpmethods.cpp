// Schema of the dpmethods operators and the validation both kernels share.
//
// Dispatch: the op has one kernel per backend key (CPU, CUDA). The dispatcher
// picks the key from the *inputs* (CUDA wins over CPU), while the work depends
// on the *target*. Each kernel therefore looks at `device`: the CPU kernel
// redispatches to the CUDA kernel for a CUDA target (where it is built; else
// it gathers on the host and moves the results); the CUDA kernel moves its
// inputs to the host and calls the CPU kernel when the target is the CPU.
// Autograd and the fake (meta) kernel are registered from Python
// (dpmethods/ops.py).
#include "gather_common.h"

#include <ATen/ops/contiguous.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <sstream>

namespace dpmethods {
namespace {

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    os << (i ? ", " : "") << sizes[i];
  }
  os << "]";
  return os.str();
}

// The expected shape of a piece with the concatenation dim shown as "*".
std::string pattern_str(at::IntArrayRef sizes, int64_t dim) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < sizes.size(); ++i) {
    os << (i ? ", " : "");
    if (static_cast<int64_t>(i) == dim) {
      os << "*";
    } else {
      os << sizes[i];
    }
  }
  os << "]";
  return os.str();
}

}  // namespace

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}

at::Tensor as_raw_contiguous(const at::Tensor& t) {
  at::Tensor r = t;
  if (r.is_conj()) {
    r = r.resolve_conj();
  }
  if (r.is_neg()) {
    r = r.resolve_neg();
  }
  return r.contiguous();
}

std::vector<LeafPlan> plan_gather(at::TensorList tensors, int64_t num_replicas, int64_t dim) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  TORCH_CHECK_VALUE(
      num_replicas >= 1, "gather_coalesced(): num_replicas must be >= 1, got ", num_replicas);
  TORCH_CHECK_VALUE(
      n % num_replicas == 0, "gather_coalesced(): len(tensors) must be a multiple of num_replicas (",
      num_replicas, "), got ", n, " tensors");
  const int64_t num_leaves = n / num_replicas;
  std::vector<LeafPlan> plans;
  plans.reserve(num_leaves);
  for (int64_t l = 0; l < num_leaves; ++l) {
    const at::Tensor& first = tensors[l * num_replicas];
    TORCH_CHECK_VALUE(
        first.defined(), "gather_coalesced(): tensors[", l * num_replicas, "] (leaf ", l,
        ", replica 0) is undefined; expected a tensor");
    const int64_t ndim = first.dim();
    TORCH_CHECK_VALUE(
        ndim > 0, "gather_coalesced(): tensors[", l * num_replicas, "] (leaf ", l,
        ", replica 0) is 0-dimensional; expected a tensor with at least 1 dimension to "
        "concatenate along dim ", dim);
    TORCH_CHECK_INDEX(
        dim >= -ndim && dim < ndim, "gather_coalesced(): dim ", dim, " is out of range for leaf ",
        l, " with ", ndim, " dimensions (expected -", ndim, " <= dim < ", ndim, ")");
    LeafPlan p;
    p.dim = dim < 0 ? dim + ndim : dim;
    p.elsize = static_cast<int64_t>(first.element_size());
    const at::IntArrayRef ref = first.sizes();
    p.outer = 1;
    for (int64_t d = 0; d < p.dim; ++d) {
      p.outer *= ref[d];
    }
    p.inner = 1;
    for (int64_t d = p.dim + 1; d < ndim; ++d) {
      p.inner *= ref[d];
    }
    p.sizes.reserve(num_replicas);
    int64_t total = 0;
    for (int64_t r = 0; r < num_replicas; ++r) {
      const int64_t i = l * num_replicas + r;
      const at::Tensor& t = tensors[i];
      TORCH_CHECK_VALUE(
          t.defined(), "gather_coalesced(): tensors[", i, "] (leaf ", l, ", replica ", r,
          ") is undefined; expected a tensor");
      TORCH_CHECK_TYPE(
          t.scalar_type() == first.scalar_type(), "gather_coalesced(): tensors[", i, "] (leaf ", l,
          ", replica ", r, ") has dtype ", t.scalar_type(), " but expected ", first.scalar_type(),
          " (the dtype of replica 0 of this leaf)");
      bool ok = t.dim() == ndim;
      for (int64_t d = 0; ok && d < ndim; ++d) {
        ok = d == p.dim || t.size(d) == ref[d];
      }
      TORCH_CHECK_VALUE(
          ok, "gather_coalesced(): tensors[", i, "] (leaf ", l, ", replica ", r, ") has shape ",
          shape_str(t.sizes()), " but expected ", pattern_str(ref, p.dim),
          " (the shape of replica 0 of this leaf, any size along dim ", p.dim, ")");
      p.sizes.push_back(t.size(p.dim));
      total += t.size(p.dim);
    }
    p.out_shape.assign(ref.begin(), ref.end());
    p.out_shape[p.dim] = total;
    plans.push_back(std::move(p));
  }
  return plans;
}

}  // namespace dpmethods

TORCH_LIBRARY(dpmethods, m) {
  m.def("gather_coalesced(Tensor[] tensors, int num_replicas, int dim, Device device) -> Tensor[]");
  // Same computation with autograd done in C++ (csrc/autograd.cpp): the eager
  // fast path of dpmethods.ops.gather_coalesced. gather_coalesced itself gets
  // its autograd formula from Python (torch.library.register_autograd), which
  // is what torch.compile and direct torch.ops callers use.
  m.def(
      "_gather_coalesced_autograd(Tensor[] tensors, int num_replicas, int dim, Device device) "
      "-> Tensor[]");
  // Test op: the CUDA kernel's tiling (csrc/gather_tiles.h) run on the CPU,
  // so CPU-only CI checks the GPU path's offsets (csrc/cpu/gather_tiles_on_host.cpp).
  m.def(
      "_gather_tiles_on_host(Tensor[] tensors, int num_replicas, int dim, bool staged) "
      "-> Tensor[]");
}
