// Software prefetch along a weight stream, for the AVX2 kernel units (kernels_avx2*.cpp).
//
// Tiles touch only 1-16 weight rows at a time, too few concurrent misses for the hardware
// prefetchers to reach full bandwidth at one activation row (decode): quantized tiles prefetch
// 8 KiB ahead (the 8-bit activation Q8_0 output layer of a 152k vocabulary at one row: 20.5 ->
// 13.7 ms on a 2-core AVX2 EPYC, 2026-11-27; `git show 610d18e:BENCHMARKS.md`).
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace specdec {

constexpr int64_t kPrefetchBytes = 8192;

// NOTE: asm statements, not _mm_prefetch: GCC 12 finds a function made of the builtin alone free of
// side effects and deletes the loops that only call it (the attention kernels' prefetch_span, such
// a loop, compiled to a bare return: none of their L1 key or value prefetches was ever issued).
inline void prefetch(const void* p) { __asm__ volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }

// Into L2 only: for bytes needed later in the same call, which would crowd L1 now.
inline void prefetch_l2(const void* p) { __asm__ volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

// Every cache line of the TB-byte tile kPrefetchBytes ahead of tile.
template <int64_t TB>
inline void prefetch_tile(const uint8_t* tile) {
    for (int64_t o = 0; o < TB; o += 64) prefetch(tile + kPrefetchBytes + o);
}

}  // namespace specdec
