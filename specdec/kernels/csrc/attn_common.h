// What the vector attention kernels (kernels_avx2.cpp, attention_avx512.cpp) share and that no
// vector width enters: the L2 prefetch of a key block's keys and values, and the rows' key
// ranges within a block.  Internal linkage (as half.h): each unit compiles its own copy under its
// own flags, so no code built with one ISA's flags reaches another unit through the linker.
#pragma once

#include <stdint.h>

#include "kernels.h"
#include "prefetch.h"

namespace specdec {
namespace {  // NOLINT: internal linkage on purpose

// How far ahead the AVX-512 kernels fetch a half or float cache's keys into L2 (8 KiB of a half
// cache at D = 64), past the block into the next, which the same task usually takes.
constexpr int64_t kAttnPrefetchKeys = 64;

// Every cache line of [p, p + bytes) into L2.
inline void prefetch_span_l2(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t o = 0; o < bytes; o += 64) prefetch_l2(c + o);
}

// The rows' keys within block [j0, j0 + kAttnBlock): row r reads [beg[r], end[r]) (empty when
// beg >= end); [jmin, jmax) spans them, ``active`` rows have any; kend is one past the last key
// any row reads anywhere (prefetches stop there: none past a unit's end).
struct BlockRows {
    int64_t beg[kAttnRows], end[kAttnRows];
    int64_t jmin, jmax, active, kend;

    BlockRows(const AttnRows& a, int64_t j0) : jmin(j0 + kAttnBlock), jmax(j0), active(0), kend(0) {
        for (int64_t r = 0; r < a.R; ++r) {
            beg[r] = a.lo[r] > j0 ? a.lo[r] : j0;
            end[r] = a.hi[r] + 1 < j0 + kAttnBlock ? a.hi[r] + 1 : j0 + kAttnBlock;
            if (beg[r] < end[r]) {
                jmin = beg[r] < jmin ? beg[r] : jmin;
                jmax = end[r] > jmax ? end[r] : jmax;
                ++active;
            }
            kend = a.hi[r] + 1 > kend ? a.hi[r] + 1 : kend;
        }
    }
};

}  // namespace
}  // namespace specdec
