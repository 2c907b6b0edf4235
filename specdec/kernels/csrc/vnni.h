// vpdpbusd as asm statements, for the units that use AVX-512 VNNI (kernels_vnni.cpp,
// attention_avx512.cpp).  Internal linkage (as half.h): each unit compiles its own copy.
//
// NOTE: GCC 12 gives _mm512_dpbusd_epi32's result a register of its own and copies every
// accumulator of a tile into it and back on each pass of the loop (a 2-query integer value tile:
// 16 vpdpbusd and ~30 register moves and a spill a pass), and it emits a separate vpbroadcastd for
// a broadcast operand; the asm statements keep each accumulator in its register and fold the
// broadcast into the instruction.  The sums are the same exact int32 either way.
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace specdec {
namespace {  // NOLINT: internal linkage on purpose

// acc += u . s, four bytes a lane: u's unsigned, s's signed (exact int32).
inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
    return acc;
}

// acc += u . broadcast(the 4 int8 at p): the broadcast folded into the instruction (the folded
// form issues measurably faster than the intrinsic's separate vpbroadcastd, kernels_vnni.cpp).
inline __m512i dpbusd_bcast(__m512i acc, __m512i u, const void* p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
}

}  // namespace
}  // namespace specdec
