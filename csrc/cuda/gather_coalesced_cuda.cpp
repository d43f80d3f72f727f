// CUDA kernel of dpmethods::gather_coalesced: the host side. The kernel itself is
// in gather_pieces_kernel.cu, so that nvcc, which parses a .cu file once per GPU
// architecture, never parses torch's headers; this file is compiled by the C++
// compiler.
//
// Direct path (sources on the target device, or readable over peer access):
// one launch copies every (leaf, replica) piece. The launch reads a table of
// Piece records from device memory (uploaded from a pinned buffer), so the
// number of pieces is not bounded by the kernel-argument limit. Each block
// copies one tile of kTileBytes of one piece with the widest access (up to
// 16 bytes) that the piece's addresses and row lengths allow. That tiling
// lives in csrc/gather_tiles.h, which the CPU tests run on the host as well.
//
// Staged path (no peer access, or DPMETHODS_FORCE_STAGED=1): per source
// device, one pack launch concatenates its pieces into a staging buffer, one
// peer copy moves the buffer to the target, and the unpack pieces join the
// direct table, so the target still runs a single launch. Host sources are
// packed into one pinned buffer and uploaded with one copy, the same way.
//
// Host target: per source device, one pack launch and one copy to pinned
// memory, then the CPU kernel gathers from there.
#include "../gather_common.h"
#include "../gather_tiles.h"

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/cuda/PeerToPeerAccess.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <map>
#include <vector>

namespace dpmethods {

// csrc/cuda/gather_pieces_kernel.cu
cudaError_t launch_gather_pieces(
    const Piece* pieces, int64_t n, int64_t tile_base, unsigned int blocks, cudaStream_t stream);

namespace {

// Uploads `pieces` to `device` and runs the copy on the current stream there.
void launch_pieces(std::vector<Piece>& pieces, c10::Device device) {
  if (pieces.empty()) {
    return;
  }
  const int64_t tiles = assign_tiles(pieces);
  const int64_t table_bytes = static_cast<int64_t>(pieces.size() * sizeof(Piece));
  // Pinned staging lets the upload run asynchronously; copy_ records an event
  // on the pinned block so the host allocator does not reuse it too early.
  at::Tensor host = at::empty(
      {table_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), pieces.data(), static_cast<size_t>(table_bytes));
  at::Tensor table = at::empty({table_bytes}, at::TensorOptions().dtype(at::kByte).device(device));
  table.copy_(host, /*non_blocking=*/true);
  const auto stream = c10::cuda::getCurrentCUDAStream(device.index());
  const auto* dev_pieces = reinterpret_cast<const Piece*>(table.const_data_ptr());
  const int64_t n = static_cast<int64_t>(pieces.size());
  // gridDim.x is limited to 2^31 - 1 blocks; launch in chunks beyond that.
  for (int64_t base = 0; base < tiles; base += INT_MAX) {
    const auto blocks = static_cast<unsigned int>(std::min<int64_t>(tiles - base, INT_MAX));
    C10_CUDA_CHECK(launch_gather_pieces(dev_pieces, n, base, blocks, stream.stream()));
  }
}

// One launch on `device` that copies each item's source into its slot of `packed`.
void launch_pack(
    const std::vector<StagedPiece>& items, const std::vector<int64_t>& offsets, char* packed,
    c10::Device device) {
  std::vector<Piece> pack = pack_pieces(items, offsets, packed);
  launch_pieces(pack, device);
}

// A host target. Per source device, one pack launch puts that device's pieces
// side by side and one asynchronous copy brings them to pinned memory; after
// one wait per device, the CPU kernel gathers from views of those buffers.
// Copying each CUDA input to the host on its own cost one blocking copy per
// (leaf, replica) piece.
std::vector<at::Tensor> gather_to_host(
    at::TensorList tensors, int64_t num_replicas, int64_t dim, c10::Device device) {
  plan_gather(tensors, num_replicas, dim);  // bad input fails before any transfer
  std::vector<at::Tensor> host(tensors.begin(), tensors.end());
  std::map<c10::DeviceIndex, std::vector<size_t>> by_device;
  for (size_t i = 0; i < host.size(); ++i) {
    if (!host[i].is_cuda()) {
      continue;
    }
    if (host[i].numel() == 0) {
      host[i] = at::empty(host[i].sizes(), host[i].options().device(at::kCPU));
    } else {
      by_device[host[i].device().index()].push_back(i);
    }
  }
  std::vector<c10::cuda::CUDAStream> streams;
  for (const auto& [d, indices] : by_device) {
    const c10::Device sdev(c10::kCUDA, d);
    c10::cuda::CUDAGuard guard(sdev);
    // Contiguous sources, freed in stream order after the pack launch.
    std::vector<StagedPiece> items;
    items.reserve(indices.size());
    for (const size_t i : indices) {
      at::Tensor src = as_raw_contiguous(host[i]);
      const auto bytes = static_cast<int64_t>(src.nbytes());
      items.push_back(StagedPiece{std::move(src), nullptr, PieceGeometry{1, bytes, bytes, 0}});
    }
    std::vector<int64_t> offsets;
    const int64_t total = pack_layout(items, offsets);
    at::Tensor packed = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(sdev));
    launch_pack(items, offsets, static_cast<char*>(packed.data_ptr()), sdev);
    // copy_ records an event on the pinned block, so the host allocator does
    // not hand it out again before the copy ends.
    at::Tensor pinned =
        at::empty({total}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    pinned.copy_(packed, /*non_blocking=*/true);
    for (size_t k = 0; k < items.size(); ++k) {
      const at::Tensor& src = items[k].src;
      host[indices[k]] = pinned.narrow(0, offsets[k], items[k].g.row_bytes)
                             .view(src.scalar_type())
                             .view(src.sizes());
    }
    streams.push_back(c10::cuda::getCurrentCUDAStream(d));
  }
  for (const auto& stream : streams) {
    stream.synchronize();
  }
  return gather_coalesced_cpu(host, num_replicas, dim, device);
}

}  // namespace

std::vector<at::Tensor> gather_coalesced_cuda(
    at::TensorList tensors, int64_t num_replicas, int64_t dim, c10::Device device) {
  if (!device.is_cuda()) {
    return gather_to_host(tensors, num_replicas, dim, device);
  }
  if (!device.has_index()) {
    device = c10::Device(c10::kCUDA, c10::cuda::current_device());
  }
  const std::vector<LeafPlan> plans = plan_gather(tensors, num_replicas, dim);
  const c10::DeviceIndex target = device.index();
  c10::cuda::CUDAGuard guard(device);
  const auto stream = c10::cuda::getCurrentCUDAStream(target);
  const bool force_staged = env_flag("DPMETHODS_FORCE_STAGED");
  const bool poison = env_flag("DPMETHODS_POISON");

  std::vector<at::Tensor> outs;
  outs.reserve(plans.size());
  std::vector<at::Tensor> keep;  // sources the target stream reads
  std::vector<Piece> direct;
  std::map<c10::DeviceIndex, std::vector<StagedPiece>> staged;
  std::vector<c10::DeviceIndex> remote;  // other devices the target stream reads from
  std::vector<StagedPiece> uploads;  // host sources, contiguous

  for (size_t l = 0; l < plans.size(); ++l) {
    const LeafPlan& p = plans[l];
    const at::Tensor& first = tensors[l * num_replicas];
    // Straight from the caching allocator, not through the dispatcher: with
    // hundreds of leaves the dispatch of at::empty adds up.
    at::Tensor out(at::detail::empty_cuda(p.out_shape, first.scalar_type(), device, std::nullopt));
    char* base = static_cast<char*>(out.data_ptr());
    if (poison && out.numel() > 0) {
      C10_CUDA_CHECK(cudaMemsetAsync(base, 0xFF, out.nbytes(), stream.stream()));
    }
    for_each_piece(p, num_replicas, [&](int64_t r, const PieceGeometry& g) {
      at::Tensor t = tensors[l * num_replicas + r];
      if (!t.is_cuda()) {
        uploads.push_back(
            StagedPiece{as_raw_contiguous(t.is_cpu() ? t : t.to(at::kCPU)), base, g});
        return;
      }
      if (!t.is_contiguous() || t.is_conj() || t.is_neg()) {
        t = as_raw_contiguous(t);  // on the source's device and current stream
      }
      const c10::DeviceIndex src_dev = t.device().index();
      const bool local = src_dev == target;
      if (!force_staged && (local || at::cuda::get_p2p_access(target, src_dev))) {
        direct.push_back(make_piece(static_cast<const char*>(t.const_data_ptr()), base, g));
        if (!local && std::find(remote.begin(), remote.end(), src_dev) == remote.end()) {
          remote.push_back(src_dev);
        }
        keep.push_back(std::move(t));
      } else {
        staged[src_dev].push_back(StagedPiece{std::move(t), base, g});
      }
    });
    outs.push_back(std::move(out));
  }

  // Staging buffers must live until the unpack launch is queued; the caching
  // allocator then keeps them for the stream they were allocated on.
  std::vector<at::Tensor> staging;
  for (auto& [src_dev, items] : staged) {
    const c10::Device sdev(c10::kCUDA, src_dev);
    std::vector<int64_t> offsets;
    const int64_t total = pack_layout(items, offsets);
    at::Tensor packed_dst = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(device));
    {
      c10::cuda::CUDAGuard src_guard(sdev);
      const auto src_stream = c10::cuda::getCurrentCUDAStream(src_dev);
      if (src_stream != stream) {
        // packed_dst may be a block the target stream used until just now;
        // the peer copy on the source stream must not overtake that work.
        at::cuda::CUDAEvent allocated;
        allocated.record(stream);
        allocated.block(src_stream);
      }
      at::Tensor packed_src =
          at::empty({total}, at::TensorOptions().dtype(at::kByte).device(sdev));
      char* ps = static_cast<char*>(packed_src.data_ptr());
      launch_pack(items, offsets, ps, sdev);
      // packed_dst belongs to the target's stream; the copy runs on the
      // source's stream and the target stream waits for it below, so any
      // later reuse of packed_dst on the target stream is ordered after it.
      if (src_dev == target) {
        C10_CUDA_CHECK(cudaMemcpyAsync(
            packed_dst.data_ptr(), ps, static_cast<size_t>(total), cudaMemcpyDeviceToDevice,
            src_stream.stream()));
      } else {
        C10_CUDA_CHECK(cudaMemcpyPeerAsync(
            packed_dst.data_ptr(), target, ps, src_dev, static_cast<size_t>(total),
            src_stream.stream()));
      }
      at::cuda::CUDAEvent copied;
      copied.record(src_stream);
      copied.block(stream);
      staging.push_back(std::move(packed_src));
    }
    add_unpack(direct, items, offsets, static_cast<const char*>(packed_dst.const_data_ptr()));
    staging.push_back(std::move(packed_dst));
  }

  if (!uploads.empty()) {
    // Host sources travel together: packed into one pinned buffer, uploaded
    // with one asynchronous copy on the target stream, then read from there.
    std::vector<int64_t> offsets;
    const int64_t total = pack_layout(uploads, offsets);
    at::Tensor pinned =
        at::empty({total}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    char* ph = static_cast<char*>(pinned.data_ptr());
    for (size_t i = 0; i < uploads.size(); ++i) {
      std::memcpy(
          ph + offsets[i], uploads[i].src.const_data_ptr(),
          static_cast<size_t>(piece_bytes(uploads[i].g)));
    }
    at::Tensor uploaded = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(device));
    // copy_ records an event on the pinned block, so the host allocator does
    // not hand it out again before the upload ends.
    uploaded.copy_(pinned, /*non_blocking=*/true);
    add_unpack(direct, uploads, offsets, static_cast<const char*>(uploaded.const_data_ptr()));
    staging.push_back(std::move(uploaded));
  }

  // Remote sources are written on their own devices' current streams.
  for (const c10::DeviceIndex d : remote) {
    at::cuda::CUDAEvent ready;
    ready.record(c10::cuda::getCurrentCUDAStream(d));
    ready.block(stream);
  }
  launch_pieces(direct, device);
  if (!remote.empty()) {
    // The target stream reads memory owned by other devices' streams: make
    // those streams wait, so the memory is not reused before the read ends.
    at::cuda::CUDAEvent done;
    done.record(stream);
    for (const c10::DeviceIndex d : remote) {
      done.block(c10::cuda::getCurrentCUDAStream(d));
    }
  }
  return outs;
}

}  // namespace dpmethods

TORCH_LIBRARY_IMPL(dpmethods, CUDA, m) {
  m.impl("gather_coalesced", &dpmethods::gather_coalesced_cuda);
}
