// The CUDA kernel of dpmethods::gather_coalesced, alone: one block copies one
// tile of one piece (csrc/gather_tiles.h). The host side, which uses torch, is
// csrc/cuda/gather_coalesced_cuda.cpp. nvcc parses a .cu file once for the host
// and once per GPU architecture, so this file includes no torch header: it
// compiles in seconds where the whole gather took over a minute.
#define DPMETHODS_KERNEL_ONLY
#include "../gather_tiles.h"

#include <cuda_runtime.h>

namespace dpmethods {
namespace {

__global__ void __launch_bounds__(kTileThreads)
    gather_pieces_kernel(const Piece* __restrict__ pieces, int64_t n, int64_t tile_base) {
  copy_tile(pieces, n, tile_base + blockIdx.x, static_cast<int>(threadIdx.x));
}

}  // namespace

// Launches `blocks` blocks, tiles tile_base .. tile_base + blocks - 1, of the
// device-side table `pieces` on `stream`; returns the launch's error.
cudaError_t launch_gather_pieces(
    const Piece* pieces, int64_t n, int64_t tile_base, unsigned int blocks, cudaStream_t stream) {
  gather_pieces_kernel<<<blocks, kTileThreads, 0, stream>>>(pieces, n, tile_base);
  return cudaGetLastError();
}

}  // namespace dpmethods
