// Small AVX-512 helpers the AVX-512 kernel units share (include only from units built with
// -mavx512f/dq/bw/vl).  Internal linkage (as half.h): each unit compiles its own copy under its own
// flags.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "prefetch.h"
#include "tile_store.h"

namespace specdec {
namespace {  // NOLINT: internal linkage on purpose

inline float hsum16(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

inline __mmask16 tail_mask(int64_t r) { return static_cast<__mmask16>((1u << r) - 1u); }

// One step of a tile's FMA chains: acc[m][n] += wv[n] * (inputs k .. k + 15 of row m, at x + m * ldx),
// every m, n.
template <int MR, int NR>
inline void fma_rows(__m512 (&acc)[MR][NR], const __m512 (&wv)[NR], const float* x, int64_t ldx, int64_t k) {
    for (int m = 0; m < MR; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(wv[n], xv, acc[m][n]);
    }
}

// The chains' last step, over the inputs of mask only (the partial vector: the rest read as zero).
template <int MR, int NR>
inline void fma_rows_masked(__m512 (&acc)[MR][NR], const __m512 (&wv)[NR], __mmask16 mask, const float* x,
                            int64_t ldx, int64_t k) {
    for (int m = 0; m < MR; ++m) {
        const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * ldx + k);
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(wv[n], xv, acc[m][n]);
    }
}

// The last K - k (< 16) inputs of MR activation rows (stride ldx) against NR float weight rows
// (stride ldw): the masked last step.
template <int MR, int NR>
inline void f32_tail(__m512 (&acc)[MR][NR], const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t k,
                     int64_t K) {
    const __mmask16 mask = tail_mask(K - k);
    __m512 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm512_maskz_loadu_ps(mask, w + n * ldw + k);
    fma_rows_masked(acc, wv, mask, x, ldx, k);
}

}  // namespace
}  // namespace specdec
