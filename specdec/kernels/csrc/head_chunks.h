// The GQA head loop shared by the ISA attention kernels.
//
// for_head_chunks(G, f) calls f(std::integral_constant<int, GB>{}, g0) for the G query heads of a
// kv head in chunks of at most 4 (GB, the chunk's size, a compile-time constant).  It generates no
// code by itself: each ISA file instantiates it with its own lambda (a type local to that file),
// under that file's compile flags, so no AVX code can reach another translation unit.
#pragma once

#include <stdint.h>

#include <type_traits>

namespace specdec {

template <class F>
inline void for_head_chunks(int64_t G, F&& f) {
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        switch (G - g0 < 4 ? G - g0 : 4) {
            case 1: f(std::integral_constant<int, 1>{}, g0); break;
            case 2: f(std::integral_constant<int, 2>{}, g0); break;
            case 3: f(std::integral_constant<int, 3>{}, g0); break;
            default: f(std::integral_constant<int, 4>{}, g0); break;
        }
    }
}

}  // namespace specdec
