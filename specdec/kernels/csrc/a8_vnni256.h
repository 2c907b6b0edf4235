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
#include <string.h>

#include "kernels.h"
#include "prefetch.h"

namespace specdec {
namespace {

inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// The int32 dot products of one 4-bit tile's 16 rows with R activation blocks: lo[r] lanes =
// rows 0-7, hi[r] = rows 8-15 (tile layout: kernels_vnni.cpp; byte (p, j, i) holds input 4p + i
// of row j in its low nibble and input 4(p + 4) + i in its high nibble).
template <int R>
inline void dot_q4(const uint8_t* quants, const int8_t* const* xb, __m256i* lo, __m256i* hi) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + p * 64));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + p * 64 + 32));
        const __m256i w0l = _mm256_and_si256(w0, mask), w0h = _mm256_and_si256(_mm256_srli_epi16(w0, 4), mask);
        const __m256i w1l = _mm256_and_si256(w1, mask), w1h = _mm256_and_si256(_mm256_srli_epi16(w1, 4), mask);
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

inline __m256 f16x8(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Outputs of tile group g for activation rows [m, m + R): each row's float steps in the twins'
// order (kernels_avx2_a8.cpp group_rows), in the lanes of its two accumulators.
template <int R, int kind>
void group_rows(const int8_t* xq, const float* dx, const int32_t* sx, const float* dxs, int64_t m, int64_t K,
                const uint8_t* wg, const float* bias, float* y, int64_t N, int64_t g) {
    constexpr int64_t TB = a8_tile_bytes(kind), H = a8_head_bytes(kind);
    constexpr int32_t offset = kind == A8_Q8 ? 128 : kind == A8_Q4_0 ? 8 : 0;
    const int64_t nb = K / 32;
    __m256 acc_lo[R], acc_hi[R];
    for (int r = 0; r < R; ++r) acc_lo[r] = acc_hi[r] = _mm256_setzero_ps();
#pragma GCC unroll 1
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* tile = wg + b * TB;
        if (m == 0) prefetch_tile<TB>(tile);  // NOTE: later passes find the tile cached
        const int8_t* xb[R];
        for (int r = 0; r < R; ++r) xb[r] = xq + (m + r) * K + b * 32;
        __m256i s_lo[R], s_hi[R];
        if constexpr (kind == A8_Q8) dot_q8<R>(tile + H, xb, s_lo, s_hi);
        else dot_q4<R>(tile + H, xb, s_lo, s_hi);
        const __m256 d_lo = f16x8(tile), d_hi = f16x8(tile + 16);
        for (int r = 0; r < R; ++r) {
            const int64_t blk = (m + r) * nb + b;
            if constexpr (offset != 0) {
                const __m256i o = _mm256_set1_epi32(offset * sx[blk]);
                s_lo[r] = _mm256_sub_epi32(s_lo[r], o);
                s_hi[r] = _mm256_sub_epi32(s_hi[r], o);
            }
            const __m256 dxv = _mm256_set1_ps(dx[blk]);
            acc_lo[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s_lo[r]), dxv), d_lo, acc_lo[r]);
            acc_hi[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s_hi[r]), dxv), d_hi, acc_hi[r]);
            if constexpr (kind == A8_Q4_1) {
                const __m256 dxs_v = _mm256_set1_ps(dxs[blk]);
                acc_lo[r] = _mm256_fmadd_ps(f16x8(tile + 32), dxs_v, acc_lo[r]);
                acc_hi[r] = _mm256_fmadd_ps(f16x8(tile + 48), dxs_v, acc_hi[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        float* yr = y + (m + r) * N + g * kA8TileRows;
        if (bias) {
            acc_lo[r] = _mm256_add_ps(acc_lo[r], _mm256_loadu_ps(bias + g * kA8TileRows));
            acc_hi[r] = _mm256_add_ps(acc_hi[r], _mm256_loadu_ps(bias + g * kA8TileRows + 8));
        }
        _mm256_storeu_ps(yr, acc_lo[r]);
        _mm256_storeu_ps(yr + 8, acc_hi[r]);
    }
}

// Activation rows go through a tile group four at a time (a row's result does not depend on
// which rows share its pass: every lane's arithmetic is its own).
constexpr int64_t kRowsPerPass = 4;

template <int kind>
void groups_of(const int8_t* xq, const float* dx, const int32_t* sx, const float* dxs, int64_t M, int64_t K,
               const uint8_t* w, const float* bias, float* y, int64_t N, int64_t g0, int64_t g1) {
    const int64_t group_bytes = K / 32 * a8_tile_bytes(kind);
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* wg = w + g * group_bytes;
        int64_t m = 0;
        for (; m + kRowsPerPass <= M; m += kRowsPerPass)
            group_rows<kRowsPerPass, kind>(xq, dx, sx, dxs, m, K, wg, bias, y, N, g);
        switch (M - m) {
            case 3: group_rows<3, kind>(xq, dx, sx, dxs, m, K, wg, bias, y, N, g); break;
            case 2: group_rows<2, kind>(xq, dx, sx, dxs, m, K, wg, bias, y, N, g); break;
            case 1: group_rows<1, kind>(xq, dx, sx, dxs, m, K, wg, bias, y, N, g); break;
            default: break;
        }
    }
}

// The activations are quantized by the AVX2 kernels (the same codes and scales): no layout.
void quantize_rows(const float* x, int64_t K, int8_t* xq, float* dx, int32_t* sx, float* dxs, int64_t m0,
                   int64_t m1) {
    avx2_a8_table()->quantize_rows(x, K, xq, dx, sx, dxs, m0, m1);
}

void linear_groups(int kind, const int8_t* xq, const float* dx, const int32_t* sx, const float* dxs, int64_t M,
                   int64_t K, const uint8_t* w, const float* bias, float* y, int64_t N, int64_t g0, int64_t g1,
                   const void* /*prep*/) {
    if (kind == A8_Q8) groups_of<A8_Q8>(xq, dx, sx, dxs, M, K, w, bias, y, N, g0, g1);
    else if (kind == A8_Q4_0) groups_of<A8_Q4_0>(xq, dx, sx, dxs, M, K, w, bias, y, N, g0, g1);
    else groups_of<A8_Q4_1>(xq, dx, sx, dxs, M, K, w, bias, y, N, g0, g1);
}

const A8Table kTable = {SPECDEC_V256_NAME, quantize_rows, linear_groups, nullptr, nullptr};

}  // namespace

const A8Table* SPECDEC_V256_TABLE() { return &kTable; }

}  // namespace specdec
