// Host-side helpers shared by the CPU and CUDA kernels of gather_coalesced.
#pragma once

#include "gather_index.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <vector>

namespace dpmethods {

// Validated geometry of one output leaf.
struct LeafPlan {
  int64_t dim;    // normalized (non-negative) concatenation dim
  int64_t outer;  // product of sizes before dim
  int64_t inner;  // product of sizes after dim
  int64_t elsize;
  // Inline storage: a gather usually has few replicas and low-rank leaves, and
  // heap allocations per leaf would dominate small gathers.
  c10::SmallVector<int64_t, 8> sizes;      // size along dim of each replica's piece
  c10::SmallVector<int64_t, 6> out_shape;  // shape of the gathered leaf
};

// Checks counts, dtypes and shapes and returns one plan per leaf. Raises with
// the argument name, leaf and replica index, expected and actual values.
std::vector<LeafPlan> plan_gather(at::TensorList tensors, int64_t num_replicas, int64_t dim);

// Calls fn(r, geometry) for each non-empty piece of leaf `p`, in replica order.
template <typename Fn>
void for_each_piece(const LeafPlan& p, int64_t num_replicas, Fn&& fn) {
  const int64_t dst_row_bytes = p.out_shape[p.dim] * p.inner * p.elsize;
  int64_t offset = 0;
  for (int64_t r = 0; r < num_replicas; ++r) {
    const int64_t size_r = p.sizes[r];
    const PieceGeometry g{
        p.outer, size_r * p.inner * p.elsize, dst_row_bytes,
        col_offset_bytes(offset, p.inner, p.elsize)};
    offset += size_r;
    if (piece_bytes(g) > 0) {
      fn(r, g);
    }
  }
}

// Returns `t` in a form whose bytes can be copied raw: contiguous, with any
// lazy conjugate/negative bit materialized.
at::Tensor as_raw_contiguous(const at::Tensor& t);

// True when the environment variable `name` is set to a non-empty value other than "0".
bool env_flag(const char* name);

// The CPU implementation; the CUDA kernel calls it for a CPU target after
// moving its CUDA inputs to the host. For a CUDA target it redispatches to
// the CUDA kernel where that is built.
std::vector<at::Tensor> gather_coalesced_cpu(
    at::TensorList tensors, int64_t num_replicas, int64_t dim, c10::Device device);

// The gather with its autograd node built in C++ (csrc/autograd.cpp); the
// kernel behind _gather_coalesced_autograd and the eager Python entry point.
std::vector<at::Tensor> gather_coalesced_autograd(
    at::TensorList tensors, int64_t num_replicas, int64_t dim, c10::Device device);

}  // namespace dpmethods
