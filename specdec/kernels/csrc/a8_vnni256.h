// 8-bit activation kernels on 256-bit VNNI (vpdpbusd on ymm registers): the AVX2 kernels'
// tiles, passes and float steps (kernels_avx2_a8.cpp), with each block's integer dot products
// taken by vpdpbusd, 32 multiply-adds an instruction, instead of vpmaddubsw + vpaddw (4-bit
// formats) or widened codes and vpmaddwd (Q8_0: its unsigned codes go into vpdpbusd as they
// are).  Integer sums are exact, so the results are those of the AVX2, VNNI and scalar kernels,
// bit for bit.
//
// Included by two units, each defining SPECDEC_V256_DPBUSD (the instruction's intrinsic),
// SPECDEC_V256_NAME and SPECDEC_V256_TABLE (the table's accessor, declared in kernels.h):
//   kernels_avxvnni.cpp       AVX-VNNI, the VEX form: Intel Alder Lake and later client CPUs
//                              (AVX2 and AVX-VNNI, no AVX-512), -mavxvnni;
//   kernels_avx2_vnni_evex.cpp the same code with the EVEX form (AVX-512 VNNI + VL), so that a
//                              CPU with AVX-512 runs and tests these kernels when the AVX2 table
//                              is chosen (the VEX form does not run there).
// Needs 16 vector registers at most (AVX-VNNI CPUs have no more): four activation rows a pass,
// 8 accumulators, 4 unpacked weight vectors and 2 broadcasts.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "avx2_tiles.h"
#include "kernels.h"

namespace specdec {
namespace {

using avx2_tiles::bcast4;

// The int32 dot products of one 4-bit tile's 16 rows with R activation blocks: lo[r] lanes =
// rows 0-7, hi[r] = rows 8-15 (tile layout: kernels_vnni.cpp; byte (p, j, i) holds input 4p + i
// of row j in its low nibble and input 4(p + 4) + i in its high nibble).
template <int R>
inline void dot_q4(const uint8_t* quants, const int8_t* const* xb, __m256i* lo, __m256i* hi) {
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
        __m256i w0l, w0h, w1l, w1h;
        avx2_tiles::q4_codes(quants, p, w0l, w0h, w1l, w1h);
        for (int r = 0; r < R; ++r) {
            const __m256i x_lo = bcast4(xb[r] + 4 * p), x_hi = bcast4(xb[r] + 4 * (p + 4));
            lo[r] = SPECDEC_V256_DPBUSD(lo[r], w0l, x_lo);
            hi[r] = SPECDEC_V256_DPBUSD(hi[r], w1l, x_lo);
            lo[r] = SPECDEC_V256_DPBUSD(lo[r], w0h, x_hi);
            hi[r] = SPECDEC_V256_DPBUSD(hi[r], w1h, x_hi);
        }
    }
}

// Q8_0: 8 groups of 4 inputs, 64 bytes each (16 rows x 4 unsigned codes, u = q + 128); the
// activation quads broadcast as they are.
template <int R>
inline void dot_q8(const uint8_t* quants, const int8_t* const* xb, __m256i* lo, __m256i* hi) {
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + t * 64));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + t * 64 + 32));
        for (int r = 0; r < R; ++r) {
            const __m256i x = bcast4(xb[r] + 4 * t);
            lo[r] = SPECDEC_V256_DPBUSD(lo[r], w0, x);
            hi[r] = SPECDEC_V256_DPBUSD(hi[r], w1, x);
        }
    }
}

// A block's integer sums for R activation rows (the codes as they are, every format).
struct Sums {
    const int8_t* xq;
    int64_t K;

    template <int R, int kind>
    void block(const uint8_t* quants, int64_t m, int64_t b, __m256i* lo, __m256i* hi) const {
        const int8_t* xb[R];
        for (int r = 0; r < R; ++r) xb[r] = xq + (m + r) * K + b * 32;
        if constexpr (kind == A8_Q8) dot_q8<R>(quants, xb, lo, hi);
        else dot_q4<R>(quants, xb, lo, hi);
    }
};

// Activation rows go through a tile group four at a time (avx2_tiles.h group_rows: the float
// steps of the vpmaddubsw kernels, in the twins' order).
constexpr int kRowsPerPass = 4;

// The activations are quantized by the AVX2 kernels (the same codes and scales): no layout.
void quantize_rows(const float* x, int64_t K, int8_t* xq, float* dx, int32_t* sx, float* dxs, int64_t m0,
                   int64_t m1) {
    avx2_a8_table()->quantize_rows(x, K, xq, dx, sx, dxs, m0, m1);
}

void linear_groups(int kind, const int8_t* xq, const float* dx, const int32_t* sx, const float* dxs, int64_t M,
                   int64_t K, const uint8_t* w, const float* bias, float* y, int64_t N, int64_t g0, int64_t g1,
                   const void* /*prep*/) {
    const Sums sums{xq, K};
    if (kind == A8_Q8) avx2_tiles::groups_of<kRowsPerPass, A8_Q8>(sums, dx, sx, dxs, M, K, w, bias, y, N, g0, g1);
    else if (kind == A8_Q4_0) avx2_tiles::groups_of<kRowsPerPass, A8_Q4_0>(sums, dx, sx, dxs, M, K, w, bias, y, N, g0, g1);
    else avx2_tiles::groups_of<kRowsPerPass, A8_Q4_1>(sums, dx, sx, dxs, M, K, w, bias, y, N, g0, g1);
}

const A8Table kTable = {SPECDEC_V256_NAME, quantize_rows, linear_groups, nullptr, nullptr};

}  // namespace

const A8Table* SPECDEC_V256_TABLE() { return &kTable; }

}  // namespace specdec
