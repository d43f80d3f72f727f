// The CUDA kernel's tiling as host/device code: which block copies which bytes
// of which piece, with which access width, and how staged pieces are packed.
//
// The CUDA kernel runs copy_tile on the GPU. The private op
// dpmethods::_gather_tiles_on_host (csrc/cpu/gather_tiles_on_host.cpp) runs the
// same functions on the CPU, block by block and thread by thread, so the CPU
// tests check the GPU path's tile numbering, offsets, vector widths and
// packing on machines without a GPU.
#pragma once

#include "gather_index.h"

// csrc/cuda/gather_pieces_kernel.cu defines DPMETHODS_KERNEL_ONLY: nvcc parses a
// .cu file once per GPU architecture plus once for the host, so the kernel's file
// leaves out the ATen-based packing helpers and the headers they need.
#ifndef DPMETHODS_KERNEL_ONLY
#include <ATen/core/Tensor.h>
#endif

#include <cstring>
#include <vector>

#if defined(__CUDACC__)
#define DPMETHODS_UNROLL _Pragma("unroll")
#elif defined(__GNUC__) && !defined(__clang__)
#define DPMETHODS_UNROLL _Pragma("GCC unroll 16")
#else
#define DPMETHODS_UNROLL
#endif

namespace dpmethods {

constexpr int kTileThreads = 256;
// 16 KiB per block: 4 16-byte accesses per thread, enough work to hide the
// table lookup while keeping many blocks in flight for small gathers.
constexpr int64_t kTileBytes = 16384;

// 16- and 8-byte access units, aligned like CUDA's uint4 and uint2, so that
// copying one is a single vector load or store on the GPU.
struct alignas(16) Unit16 {
  uint32_t words[4];
};
struct alignas(8) Unit8 {
  uint32_t words[2];
};

template <typename V>
DPMETHODS_HD inline V load_unit(const char* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const V*>(p);
#else
  V v;
  std::memcpy(&v, p, sizeof(V));  // the host reads raw bytes without aliasing a type
  return v;
#endif
}

template <typename V>
DPMETHODS_HD inline void store_unit(char* p, const V& v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<V*>(p) = v;
#else
  std::memcpy(p, &v, sizeof(V));
#endif
}

// Thread `tid`'s share of bytes [lo, hi) of piece p, in units of V.
template <typename V>
DPMETHODS_HD inline void copy_tile_units(const Piece& p, int64_t lo, int64_t hi, int tid) {
  constexpr int64_t w = sizeof(V);
  constexpr int64_t stride = kTileThreads * w;
  // The piece is one output row (dim 0) or spans whole output rows: its bytes
  // land contiguously, so there is no division per access.
  if (p.rows == 1 || p.row_bytes == p.dst_row_bytes) {
    char* dst = p.dst + p.col_offset;
    if constexpr (w >= 4) {
      if (hi - lo == kTileBytes) {
        // A full tile: every load is issued before the first store, so each
        // thread keeps 4 to 16 loads in flight (16 registers). Narrower
        // accesses would need 32 or 64 registers and spill.
        constexpr int kIters = static_cast<int>(kTileBytes / stride);
        V v[kIters];
        DPMETHODS_UNROLL
        for (int k = 0; k < kIters; ++k) {
          v[k] = load_unit<V>(p.src + lo + k * stride + tid * w);
        }
        DPMETHODS_UNROLL
        for (int k = 0; k < kIters; ++k) {
          store_unit<V>(dst + lo + k * stride + tid * w, v[k]);
        }
        return;
      }
    }
    for (int64_t b = lo + tid * w; b < hi; b += stride) {
      store_unit<V>(dst + b, load_unit<V>(p.src + b));
    }
    return;
  }
  for (int64_t b = lo + tid * w; b < hi; b += stride) {
    store_unit<V>(p.dst + dst_offset(p, b), load_unit<V>(p.src + b));
  }
}

// The work of thread `tid` of the block that copies tile `tile`.
DPMETHODS_HD inline void copy_tile(const Piece* pieces, int64_t n, int64_t tile, int tid) {
  const Piece p = pieces[find_owner(pieces, n, tile)];
  const int64_t lo = (tile - p.begin) * kTileBytes;
  const int64_t end = piece_bytes(p);
  const int64_t hi = lo + kTileBytes < end ? lo + kTileBytes : end;
  switch (p.vec_shift) {
    case 4:
      copy_tile_units<Unit16>(p, lo, hi, tid);
      break;
    case 3:
      copy_tile_units<Unit8>(p, lo, hi, tid);
      break;
    case 2:
      copy_tile_units<uint32_t>(p, lo, hi, tid);
      break;
    case 1:
      copy_tile_units<uint16_t>(p, lo, hi, tid);
      break;
    default:
      copy_tile_units<uint8_t>(p, lo, hi, tid);
  }
}

// ---- Host-side planning, shared by the CUDA launch and the host run. ----

// A piece with the widest access (up to 16 bytes) that every one of its
// addresses and lengths is aligned to.
inline Piece make_piece(const char* src, char* dst, const PieceGeometry& g) {
  Piece p{};
  p.src = src;
  p.dst = dst;
  p.rows = g.rows;
  p.row_bytes = g.row_bytes;
  p.dst_row_bytes = g.dst_row_bytes;
  p.col_offset = g.col_offset;
  p.vec_shift = common_vec_shift(
      reinterpret_cast<uint64_t>(src) | reinterpret_cast<uint64_t>(dst) |
      static_cast<uint64_t>(g.row_bytes) | static_cast<uint64_t>(g.dst_row_bytes) |
      static_cast<uint64_t>(g.col_offset));
  return p;
}

// Numbers the tiles of the pieces in order (sets Piece::begin); returns the total.
inline int64_t assign_tiles(std::vector<Piece>& pieces) {
  int64_t tiles = 0;
  for (Piece& p : pieces) {
    p.begin = tiles;
    tiles += (piece_bytes(p) + kTileBytes - 1) / kTileBytes;
  }
  return tiles;
}

inline int64_t slot_bytes(int64_t bytes) {
  // 16-byte aligned slots keep vectorized access possible on both sides.
  return (bytes + 15) / 16 * 16;
}

#ifndef DPMETHODS_KERNEL_ONLY
// A piece that travels through a packed buffer before it reaches its output.
struct StagedPiece {
  at::Tensor src;  // contiguous
  char* dst;
  PieceGeometry g;
};

// Where each item's bytes go in a packed buffer; returns the buffer's size.
inline int64_t pack_layout(const std::vector<StagedPiece>& items, std::vector<int64_t>& offsets) {
  int64_t total = 0;
  offsets.clear();
  offsets.reserve(items.size());
  for (const StagedPiece& s : items) {
    offsets.push_back(total);
    total += slot_bytes(piece_bytes(s.g));
  }
  return total;
}

// The pieces that copy each item's source into its slot of `packed`.
inline std::vector<Piece> pack_pieces(
    const std::vector<StagedPiece>& items, const std::vector<int64_t>& offsets, char* packed) {
  std::vector<Piece> pack;
  pack.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const int64_t bytes = piece_bytes(items[i].g);
    pack.push_back(make_piece(
        static_cast<const char*>(items[i].src.const_data_ptr()), packed + offsets[i],
        PieceGeometry{1, bytes, bytes, 0}));
  }
  return pack;
}

// Adds the pieces that copy each item from its slot of `packed` to its output.
inline void add_unpack(
    std::vector<Piece>& direct, const std::vector<StagedPiece>& items,
    const std::vector<int64_t>& offsets, const char* packed) {
  for (size_t i = 0; i < items.size(); ++i) {
    direct.push_back(make_piece(packed + offsets[i], items[i].dst, items[i].g));
  }
}

#endif  // DPMETHODS_KERNEL_ONLY

}  // namespace dpmethods
