// IEEE 754 half precision for the 16-bit KV cache (kv_cache_dtype float16).
//
// A half converts to float exactly, so attention over a half cache computes what attention over a
// float cache holding the same (rounded) values computes, bit for bit, in every ISA.
#pragma once

#include <stdint.h>

#include <cstring>

namespace specdec {
namespace {  // internal linkage: each translation unit compiles its own copy under its own flags

inline float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        // zero or subnormal: mant * 2^-24, exact in float
        const float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    if (exp == 31) bits = sign | 0x7f800000u | (mant << 13);  // inf / NaN
    else bits = sign | ((exp + 112u) << 23) | (mant << 13);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

}  // namespace
}  // namespace specdec
