// CPU kernel of dpmethods::gather_coalesced: one parallel pass of memcpys over
// the bytes of every (leaf, replica) piece.
#include "../gather_common.h"
#include "../gather_index.h"

#include <ATen/Parallel.h>
#include <ATen/EmptyTensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace dpmethods {
namespace {

// Below this many bytes a gather runs on the calling thread: waking the pool
// costs more than copying. Above it every core gets at least this much.
constexpr int64_t kGrainBytes = int64_t{1} << 20;

// Copies bytes [lo, hi) of piece p (local to the piece) as contiguous runs.
void copy_range(const Piece& p, int64_t lo, int64_t hi) {
  if (p.row_bytes == p.dst_row_bytes) {
    // The piece covers whole output rows (one replica, or dim 0): one run.
    std::memcpy(p.dst + p.col_offset + lo, p.src + lo, static_cast<size_t>(hi - lo));
    return;
  }
  while (lo < hi) {
    const int64_t row = lo / p.row_bytes;
    const int64_t col = lo - row * p.row_bytes;
    const int64_t n = std::min(p.row_bytes - col, hi - lo);
    std::memcpy(p.dst + dst_offset(p, lo), p.src + lo, static_cast<size_t>(n));
    lo += n;
  }
}

}  // namespace

std::vector<at::Tensor> gather_coalesced_cpu(
    at::TensorList tensors, int64_t num_replicas, int64_t dim, c10::Device device) {
  const std::vector<LeafPlan> plans = plan_gather(tensors, num_replicas, dim);
  const bool poison = env_flag("DPMETHODS_POISON");
  std::vector<at::Tensor> outs;
  outs.reserve(plans.size());
  // Contiguous copies of non-contiguous inputs must outlive the copy loop.
  std::vector<at::Tensor> keep;
  std::vector<Piece> pieces;
  pieces.reserve(tensors.size());
  int64_t total = 0;
  for (size_t l = 0; l < plans.size(); ++l) {
    const LeafPlan& p = plans[l];
    const at::Tensor& first = tensors[l * num_replicas];
    // empty_cpu skips the dispatcher: with hundreds of small leaves the
    // per-allocation overhead is most of the cost of a gather.
    at::Tensor out = at::detail::empty_cpu(
        p.out_shape, first.scalar_type(), /*pin_memory=*/false, std::nullopt);
    char* base = static_cast<char*>(out.data_ptr());
    if (poison && out.numel() > 0) {
      std::memset(base, 0xFF, out.nbytes());
    }
    const int64_t dim_total = p.out_shape[p.dim];
    int64_t offset = 0;
    for (int64_t r = 0; r < num_replicas; ++r) {
      const int64_t size_r = p.sizes[r];
      const int64_t bytes = p.outer * size_r * p.inner * p.elsize;
      if (bytes > 0) {
        const at::Tensor& t = tensors[l * num_replicas + r];
        const char* src = nullptr;
        if (t.is_contiguous() && !t.is_conj() && !t.is_neg()) {
          src = static_cast<const char*>(t.const_data_ptr());
        } else {
          keep.push_back(as_raw_contiguous(t));
          src = static_cast<const char*>(keep.back().const_data_ptr());
        }
        Piece piece{};
        piece.src = src;
        piece.dst = base;
        piece.rows = p.outer;
        piece.row_bytes = size_r * p.inner * p.elsize;
        piece.dst_row_bytes = dim_total * p.inner * p.elsize;
        piece.col_offset = col_offset_bytes(offset, p.inner, p.elsize);
        piece.begin = total;
        pieces.push_back(piece);
        total += bytes;
      }
      offset += size_r;
    }
    outs.push_back(std::move(out));
  }
  if (total > 0) {
    const Piece* table = pieces.data();
    const int64_t n = static_cast<int64_t>(pieces.size());
    at::parallel_for(0, total, kGrainBytes, [table, n](int64_t begin, int64_t end) {
      for (int64_t i = find_piece(table, n, begin); i < n && table[i].begin < end; ++i) {
        const Piece& p = table[i];
        const int64_t lo = std::max(begin, p.begin) - p.begin;
        const int64_t hi = std::min(end, p.begin + piece_bytes(p)) - p.begin;
        copy_range(p, lo, hi);
      }
    });
  }
  if (!device.is_cpu()) {
    // Inputs were all on the host (otherwise the CUDA kernel would run):
    // gather here, then move each finished leaf once.
    for (auto& o : outs) {
      o = o.to(device);
    }
  }
  return outs;
}

}  // namespace dpmethods

TORCH_LIBRARY_IMPL(dpmethods, CPU, m) {
  m.impl("gather_coalesced", &dpmethods::gather_coalesced_cpu);
}
