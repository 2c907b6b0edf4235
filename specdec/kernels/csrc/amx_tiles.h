// What the AMX units (kernels_amx.cpp: AMX-INT8, kernels_amx16.cpp: AMX-BF16) share: the tile
// configuration and its loading and release.  Include only from units built with -mamx-tile.
#pragma once

#include <stdint.h>
#include <string.h>

namespace specdec {
namespace {

// Palette 1's 64-byte configuration: rows and bytes per row of each of the 8 tile registers.
struct alignas(64) TileConfig {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// A palette-1 configuration with every register unused (rows 0), to fill in.
inline TileConfig tile_config() {
    TileConfig c;
    memset(&c, 0, sizeof(c));
    c.palette_id = 1;
    return c;
}

// Each call loads its configuration on its own thread and releases it at the end, so that no
// tile state is left for the kernel to save at context switches between calls.
inline void load_tile_config(const TileConfig& c) { __asm__ volatile("ldtilecfg %0" ::"m"(c)); }
inline void release_tiles() { __asm__ volatile("tilerelease" ::: "memory"); }

#define SPECDEC_TILE_ZERO(T) __asm__ volatile("tilezero %%tmm" #T ::)
// Tile register T from / to rows `stride` bytes apart at base (a memory clobber: the compiler
// keeps every other load and store on its side of them).
#define SPECDEC_TILE_LOADD(T, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #T ::"r"(base), "r"(static_cast<long>(stride)) : "memory")
#define SPECDEC_TILE_STORED(T, base, stride) \
    __asm__ volatile("tilestored %%tmm" #T ", (%0,%1,1)" ::"r"(base), "r"(static_cast<long>(stride)) : "memory")

}  // namespace
}  // namespace specdec
