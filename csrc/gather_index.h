// Index math shared by the CPU and CUDA gather kernels.
//
// Keeping it in one header (host+device inline functions) means the CPU build
// exercises exactly the offsets the CUDA kernels use, so the CPU tests cover
// the geometry even on machines without a GPU.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DPMETHODS_HD __host__ __device__
#else
#define DPMETHODS_HD
#endif

namespace dpmethods {

// Where one (leaf, replica) piece lands in its leaf's output, which is viewed
// as [rows, dst_row_bytes]: row i of the piece, row_bytes long, starts at byte
// col_offset of output row i.
struct PieceGeometry {
  int64_t rows;
  int64_t row_bytes;
  int64_t dst_row_bytes;
  int64_t col_offset;
};

// One (leaf, replica) piece. The source is contiguous and viewed as
// [rows, row_bytes]; row i lands at dst + i * dst_row_bytes + col_offset.
// rows == outer (product of sizes before dim), row_bytes == size_r * inner *
// elsize, dst_row_bytes == dim_total * inner * elsize and col_offset ==
// offset_r * inner * elsize.
struct Piece {
  const char* src;
  char* dst;
  int64_t rows;
  int64_t row_bytes;
  int64_t dst_row_bytes;
  int64_t col_offset;
  // CUDA: exclusive prefix sum of the tiles of earlier pieces, so a block
  // finds its piece with a binary search. Unused on the CPU, which splits the
  // work by leaf output bytes instead.
  int64_t begin;
  // log2 of the widest access (1..16 bytes) that every address and length of
  // this piece is aligned to; the CUDA kernel copies in units of 1 << vec_shift.
  int32_t vec_shift;
  int32_t pad_;
};

DPMETHODS_HD inline int64_t piece_bytes(const Piece& p) {
  return p.rows * p.row_bytes;
}

DPMETHODS_HD inline int64_t piece_bytes(const PieceGeometry& g) {
  return g.rows * g.row_bytes;
}

// Byte offset of leaf column `offset_r` (in elements along dim) in an output row.
DPMETHODS_HD inline int64_t col_offset_bytes(int64_t offset_r, int64_t inner, int64_t elsize) {
  return offset_r * inner * elsize;
}

// Destination byte offset of byte `local` of a piece (0 <= local < piece_bytes).
DPMETHODS_HD inline int64_t dst_offset(const Piece& p, int64_t local) {
  const int64_t row = local / p.row_bytes;
  const int64_t col = local - row * p.row_bytes;
  return row * p.dst_row_bytes + p.col_offset + col;
}

// Index of the last item whose `begin` is <= unit; items are sorted by begin.
// The CUDA kernel looks up pieces by tile, the CPU kernel leaves by output byte.
template <typename Item>
DPMETHODS_HD inline int64_t find_owner(const Item* items, int64_t n, int64_t unit) {
  int64_t lo = 0;
  int64_t hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (items[mid].begin <= unit) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Widest power-of-two access width (<= 16) that all of `values` are multiples of.
DPMETHODS_HD inline int32_t common_vec_shift(uint64_t values) {
  int32_t shift = 0;
  while (shift < 4 && (values & ((uint64_t{1} << (shift + 1)) - 1)) == 0) {
    ++shift;
  }
  return shift;
}

}  // namespace dpmethods
