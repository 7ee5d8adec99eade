// How the matmul kernels split a call's activation rows into register tiles.
#pragma once

#include <cstdint>
#include <type_traits>

namespace specedge_ops {

// Rows are taken in chunks of at most `most` (a tile's registers), split evenly: 7 rows as 4 + 3.
// Which chunk a row falls in never changes its arithmetic, only how often weights are unpacked.
template <typename F>
inline void ForRowChunks(int64_t rows, int64_t most, F tile) {
  for (int64_t r = 0; r < rows;) {
    const int64_t left = rows - r, chunks = (left + most - 1) / most, n = (left + chunks - 1) / chunks;
    tile(r, n);
    r += n;
  }
}

template <int R, typename F>
inline void TileOf(int64_t n, int64_t r, F& tile) {
  if constexpr (R > 1) {
    if (n < R) return TileOf<R - 1>(n, r, tile);
  }
  tile(std::integral_constant<int, R>{}, r);
}

// ForRowChunks with each chunk's size a compile-time constant: tile(std::integral_constant<int, R>, r).
template <int Most, typename F>
inline void ForRowTiles(int64_t rows, F tile) {
  ForRowChunks(rows, Most, [&](int64_t r, int64_t n) { TileOf<Most>(n, r, tile); });
}

}  // namespace specedge_ops
