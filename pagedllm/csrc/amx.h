// AMX (Advanced Matrix Extensions) support shared by the linear and attention kernels: whether this
// build and this process may use the tiles, and the tile configuration they load.
//
// A build has AMX when -march=native saw amx_tile, amx_bf16 and amx_int8 (PAGEDLLM_AMX); a process must
// still ask Linux for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, once) before its first tile
// instruction, or it faults. Tile registers and their configuration are per thread: a kernel loads its
// configuration at the start of each parallel chunk it runs (LDTILECFG costs about 50 ns, too much per
// output block), since any other AMX code on the thread (oneDNN's) may have loaded its own in between.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#define PAGEDLLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace pagedllm_amx {

// Whether the kernel may use the tiles: Linux granted this process the tile data state.
inline bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Palette 1's 64-byte configuration: bytes per row and rows of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};

  TileConfig& tile(int t, int num_rows, int bytes_per_row) {
    rows[t] = static_cast<uint8_t>(num_rows);
    colsb[t] = static_cast<uint16_t>(bytes_per_row);
    return *this;
  }
  // Not _tile_loadconfig: GCC 12 declares its operand as the first 8 bytes only, so the stores that fill
  // the rest of the configuration may be dropped as dead and LDTILECFG faults on what is left.
  void load() const { asm volatile("ldtilecfg %0" : : "m"(*this)); }
};

}  // namespace pagedllm_amx
#endif
