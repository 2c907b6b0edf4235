// A linear tile's outputs from its vector accumulators, shared by the float kernels of every
// vector width (kernels_avx2.cpp: 8 lanes and hsum8; simd512.h: 16 lanes and hsum16).  Internal
// linkage (as half.h): each unit compiles its own copy under its own flags, so no code built with
// one ISA's flags reaches another unit through the linker.
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace specdec {
namespace {  // NOLINT: internal linkage on purpose

// The float vector of L lanes.  Named here, not deduced: a template argument drops the intrinsic
// types' may_alias attribute, and with it the code GCC makes around the accumulators changes.
template <int L>
struct FloatLanes;
template <>
struct FloatLanes<8> {
    typedef __m256 V;
};
template <>
struct FloatLanes<16> {
    typedef __m512 V;
};

// A tile's MR x NR accumulators of L lanes to y (row stride ldy): each one's horizontal sum HSUM
// (the unit's fixed order), plus bias[n] when given.
template <auto HSUM, int L, int MR, int NR>
inline void store_tile(typename FloatLanes<L>::V (&acc)[MR][NR], float* y, int64_t ldy, const float* bias) {
    for (int m = 0; m < MR; ++m) {
        for (int n = 0; n < NR; ++n) {
            float s = HSUM(acc[m][n]);
            if (bias) s += bias[n];
            y[m * ldy + n] = s;
        }
    }
}

}  // namespace
}  // namespace specdec
