// dpmethods::_gather_tiles_on_host: the CUDA kernel's tiling, run on the CPU.
//
// Builds the same Piece tables as the CUDA kernel (csrc/cuda/), numbers their
// tiles the same way and runs copy_tile (csrc/gather_tiles.h) for every block
// and every thread of the launch, one after another. With `staged`, the pieces
// go through a packed buffer first, as on the staged path: pack, then unpack.
// A test op: the CPU tests compare its outputs with torch.cat, which checks
// the GPU path's offsets, tiles, access widths and packing without a GPU.
#include "../gather_common.h"
#include "../gather_tiles.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace dpmethods {
namespace {

// Every block of a launch over `pieces`, each block thread by thread.
void run_launch(std::vector<Piece>& pieces) {
  const int64_t tiles = assign_tiles(pieces);
  const auto n = static_cast<int64_t>(pieces.size());
  for (int64_t tile = 0; tile < tiles; ++tile) {
    for (int tid = 0; tid < kTileThreads; ++tid) {
      copy_tile(pieces.data(), n, tile, tid);
    }
  }
}

at::Tensor poisoned_empty(at::IntArrayRef shape, at::ScalarType dtype) {
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
  if (t.numel() > 0) {
    std::memset(t.data_ptr(), 0xFF, t.nbytes());  // unwritten bytes show
  }
  return t;
}

std::vector<at::Tensor> gather_tiles_on_host(
    at::TensorList tensors, int64_t num_replicas, int64_t dim, bool staged) {
  const std::vector<LeafPlan> plans = plan_gather(tensors, num_replicas, dim);
  std::vector<at::Tensor> outs;
  outs.reserve(plans.size());
  std::vector<Piece> direct;
  std::vector<StagedPiece> items;
  std::vector<at::Tensor> keep;  // contiguous sources of the direct pieces
  for (size_t l = 0; l < plans.size(); ++l) {
    const LeafPlan& p = plans[l];
    at::Tensor out = poisoned_empty(p.out_shape, tensors[l * num_replicas].scalar_type());
    char* base = static_cast<char*>(out.data_ptr());
    for_each_piece(p, num_replicas, [&](int64_t r, const PieceGeometry& g) {
      at::Tensor src = as_raw_contiguous(tensors[l * num_replicas + r]);
      if (staged) {
        items.push_back(StagedPiece{std::move(src), base, g});
      } else {
        direct.push_back(make_piece(static_cast<const char*>(src.const_data_ptr()), base, g));
        keep.push_back(std::move(src));
      }
    });
    outs.push_back(std::move(out));
  }
  at::Tensor packed;
  if (!items.empty()) {
    std::vector<int64_t> offsets;
    packed = poisoned_empty({pack_layout(items, offsets)}, at::kByte);
    char* buffer = static_cast<char*>(packed.data_ptr());
    std::vector<Piece> pack = pack_pieces(items, offsets, buffer);
    run_launch(pack);
    add_unpack(direct, items, offsets, buffer);
  }
  run_launch(direct);
  return outs;
}

}  // namespace
}  // namespace dpmethods

TORCH_LIBRARY_IMPL(dpmethods, CPU, m) {
  m.impl("_gather_tiles_on_host", &dpmethods::gather_tiles_on_host);
}
