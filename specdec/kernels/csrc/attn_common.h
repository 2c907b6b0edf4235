// What the vector attention kernels (kernels_avx2.cpp, attention_avx512.cpp) share and that no
// vector width enters: the prefetches along a key block's keys and values, and the rows' key
// ranges within a block.  Internal linkage (as half.h): each unit compiles its own copy under its
// own flags, so no code built with one ISA's flags reaches another unit through the linker.
#pragma once

#include <stdint.h>

#include "kernels.h"
#include "prefetch.h"

namespace specdec {
namespace {  // NOLINT: internal linkage on purpose

// NOTE: the hardware prefetchers left a third of the time on K and V loads at one row (the
// development machine): keys and values are prefetched this many positions ahead (8 KiB of a
// half cache at D = 64), past the block into the next, which the same task usually takes.
constexpr int64_t kAttnPrefetchKeys = 64;

// Every cache line of [p, p + bytes), four a loop step (the loop's own instructions cost a tenth
// of a row's time at one MHA row otherwise).
inline void prefetch_span(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    int64_t o = 0;
    for (; o + 256 <= bytes; o += 256) {
        prefetch(c + o);
        prefetch(c + o + 64);
        prefetch(c + o + 128);
        prefetch(c + o + 192);
    }
    for (; o < bytes; o += 64) prefetch(c + o);
}

// Every cache line of [p, p + bytes) into L2.
inline void prefetch_span_l2(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t o = 0; o < bytes; o += 64) prefetch_l2(c + o);
}

// The value rows of keys [j, e) (v_stride apart, D each) into L2, while their keys are scored.
// NOTE: one row over a cache in memory read K and V at ~14 GB/s against `torch.sum`'s 31-33: the
// values' stream started only after the keys' softmax. Fetched alongside the keys, a step at 2,000
// cached ran 1.02-1.09x faster (AVX2 EPYC, benchmarks/trees_ab.py).
template <typename KV>
inline void prefetch_values_l2(const KV* v, int64_t v_stride, int64_t D, int64_t j, int64_t e) {
    if (v_stride == D) {
        prefetch_span_l2(v + j * D, (e - j) * D * int64_t(sizeof(KV)));
    } else {
        for (; j < e; ++j) prefetch_span_l2(v + j * v_stride, D * int64_t(sizeof(KV)));
    }
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
