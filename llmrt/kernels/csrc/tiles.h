// The loop order the multi-row linear kernels share: chunks of weight rows (kept in L2) outer,
// tiles of up to kMaxRowTile activation rows (kept in L1) inner. With every row of x behind
// each weight row instead, 16 rows of x (36 KB at K=576) no longer fit L1 and streamed from L2
// once per weight row (the LM head at 16 rows: 11.4 against 9.5 ms).
#pragma once

#include <algorithm>
#include <cstdint>

namespace llmrt_kernels {

// Activation rows one pass over a weight row serves: 8 rows of accumulators fill about half
// the 32 vector registers (8 against 4: the Q8_0 LM head at 16 rows 1.3x faster).
constexpr int64_t kMaxRowTile = 8;

// Calls ``tile.template run<MT>(r, c0, c1)`` for activation rows [r, r + MT) against weight
// rows [c0, c1), covering rows [0, rows_m) x weight rows [n0, n1).
template <typename Tile>
void run_tiles(const Tile& tile, int64_t rows_m, int64_t n0, int64_t n1, int64_t chunk) {
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
    const int64_t c1 = std::min(n1, c0 + chunk);
    for (int64_t r = 0; r < rows_m; r += kMaxRowTile) {
      switch (std::min(kMaxRowTile, rows_m - r)) {
        case 8: tile.template run<8>(r, c0, c1); break;
        case 7: tile.template run<7>(r, c0, c1); break;
        case 6: tile.template run<6>(r, c0, c1); break;
        case 5: tile.template run<5>(r, c0, c1); break;
        case 4: tile.template run<4>(r, c0, c1); break;
        case 3: tile.template run<3>(r, c0, c1); break;
        case 2: tile.template run<2>(r, c0, c1); break;
        default: tile.template run<1>(r, c0, c1); break;
      }
    }
  }
}

}  // namespace llmrt_kernels
