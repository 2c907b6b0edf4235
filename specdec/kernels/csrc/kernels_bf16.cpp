// 16-bit weights (IEEE half and bfloat16) with float32 activations, AVX-512.  Compiled on its own
// with the AVX-512 flags of kernels_avx512.cpp; only called after ops.cpp has checked the CPU.
//
// The weights stay 16-bit in memory and are widened to float32 in registers: exactly (a half or a
// bfloat16 is a float with fewer bits; vcvtph2ps, or a 16-bit shift for bfloat16).  Every output
// then runs the AVX-512 f32 kernel's chain (kernels_avx512.cpp): one 16-lane accumulator, an FMA
// per 16 inputs in order (a masked partial vector last), the fixed horizontal sum hsum16, then
// + bias.  So a 16-bit weight gives bit for bit what its float32 expansion gives, whatever the
// number of rows (batch invariance), and the exactness tests of the f32 path carry over.
//
// Few activation rows (decode, verification): the weights are widened in registers as they
// stream.  Many rows (prefill): blocks of weight rows are widened once into a float scratch that
// stays in L2 while every activation row passes, in tiles of 6 activation rows x 4 weight rows
// whose accumulators stay in registers for the whole K.
#include <immintrin.h>
#include <stdint.h>

#include "kernels.h"

namespace specdec {
namespace {

inline float hsum16(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

inline __mmask16 tail_mask(int64_t r) { return static_cast<__mmask16>((1u << r) - 1u); }

constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// Sixteen 16-bit weights as floats (exact).
template <int QT>
inline __m512 widen(__m256i h);
template <>
inline __m512 widen<QT_F16>(__m256i h) {
    return _mm512_cvtph_ps(h);
}
template <>
inline __m512 widen<QT_BF16>(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
template <int QT>
inline __m512 load_w(const uint16_t* p) {
    return widen<QT>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <int QT>
inline __m512 load_w_masked(__mmask16 m, const uint16_t* p) {
    return widen<QT>(_mm256_maskz_loadu_epi16(m, p));
}

template <int MR, int NR>
inline void store_tile(__m512 (&acc)[MR][NR], float* y, int64_t ldy, const float* bias) {
    for (int m = 0; m < MR; ++m) {
        for (int n = 0; n < NR; ++n) {
            float s = hsum16(acc[m][n]);
            if (bias) s += bias[n];
            y[m * ldy + n] = s;
        }
    }
}

// MR activation rows (stride K) x NR 16-bit weight rows (stride K), widened in registers.
template <int QT, int MR, int NR>
inline void half_tile(const float* x, int64_t K, const uint16_t* w, float* y, int64_t ldy,
                      const float* bias) {
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[NR];
        for (int n = 0; n < NR; ++n) {
            wv[n] = load_w<QT>(w + n * K + k);
            prefetch(reinterpret_cast<const char*>(w + n * K + k) + kPrefetchBytes);
        }
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_loadu_ps(x + m * K + k);
            for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(wv[n], xv, acc[m][n]);
        }
    }
    if (k < K) {
        const __mmask16 mask = tail_mask(K - k);
        __m512 wv[NR];
        for (int n = 0; n < NR; ++n) wv[n] = load_w_masked<QT>(mask, w + n * K + k);
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
            for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(wv[n], xv, acc[m][n]);
        }
    }
    store_tile<MR, NR>(acc, y, ldy, bias);
}

template <int QT, int MR, int NR>
void half_rows_direct(const float* x, int64_t K, const uint16_t* w, const float* bias, float* y,
                      int64_t ldy, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) half_tile<QT, MR, NR>(x, K, w + n * K, y + n, ldy, bias ? bias + n : nullptr);
    for (; n < n1; ++n) half_tile<QT, MR, 1>(x, K, w + n * K, y + n, ldy, bias ? bias + n : nullptr);
}

// MR activation rows x NR float weight rows (the widened scratch), both stride K.
template <int MR, int NR>
inline void f32_tile(const float* x, int64_t K, const float* w, float* y, int64_t ldy, const float* bias) {
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[NR];
        for (int n = 0; n < NR; ++n) wv[n] = _mm512_loadu_ps(w + n * K + k);
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_loadu_ps(x + m * K + k);
            for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(wv[n], xv, acc[m][n]);
        }
    }
    if (k < K) {
        const __mmask16 mask = tail_mask(K - k);
        __m512 wv[NR];
        for (int n = 0; n < NR; ++n) wv[n] = _mm512_maskz_loadu_ps(mask, w + n * K + k);
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
            for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(wv[n], xv, acc[m][n]);
        }
    }
    store_tile<MR, NR>(acc, y, ldy, bias);
}

// r (< MR) activation rows against NR widened weight rows.
template <int NR>
void f32_tile_rest(int64_t r, const float* x, int64_t K, const float* w, float* y, int64_t ldy,
                   const float* bias) {
    switch (r) {
        case 1: f32_tile<1, NR>(x, K, w, y, ldy, bias); return;
        case 2: f32_tile<2, NR>(x, K, w, y, ldy, bias); return;
        case 3: f32_tile<3, NR>(x, K, w, y, ldy, bias); return;
        case 4: f32_tile<4, NR>(x, K, w, y, ldy, bias); return;
        case 5: f32_tile<5, NR>(x, K, w, y, ldy, bias); return;
        default: return;
    }
}

template <int QT>
void widen_rows(const uint16_t* w, int64_t K, int64_t rows, float* dst) {
    const int64_t n = rows * K;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load_w<QT>(w + i));
    if (i < n) _mm512_mask_storeu_ps(dst + i, tail_mask(n - i), load_w_masked<QT>(tail_mask(n - i), w + i));
}

// All M rows against weight rows [n0, n1): blocks of kHalfScratchRows rows widened into scratch,
// then tiles of MR x NR over them.
template <int QT>
void half_many_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, const float* bias,
                    float* y, int64_t ldy, int64_t n0, int64_t n1, float* scratch) {
    constexpr int MR = 6, NR = 4;
    const int64_t block = kHalfScratchFloats / K < 4 ? 4 : kHalfScratchFloats / K / 4 * 4;
    for (int64_t r0 = n0; r0 < n1; r0 += block) {
        const int64_t r1 = r0 + block < n1 ? r0 + block : n1, nr = r1 - r0;
        widen_rows<QT>(w + r0 * K, K, nr, scratch);
        const float* b0 = bias ? bias + r0 : nullptr;
        int64_t m = 0;
        for (; m + MR <= M; m += MR) {
            int64_t n = 0;
            for (; n + NR <= nr; n += NR)
                f32_tile<MR, NR>(x + m * K, K, scratch + n * K, y + m * ldy + r0 + n, ldy, b0 ? b0 + n : nullptr);
            for (; n < nr; ++n)
                f32_tile<MR, 1>(x + m * K, K, scratch + n * K, y + m * ldy + r0 + n, ldy, b0 ? b0 + n : nullptr);
        }
        if (m < M) {
            int64_t n = 0;
            for (; n + NR <= nr; n += NR)
                f32_tile_rest<NR>(M - m, x + m * K, K, scratch + n * K, y + m * ldy + r0 + n, ldy,
                                  b0 ? b0 + n : nullptr);
            for (; n < nr; ++n)
                f32_tile_rest<1>(M - m, x + m * K, K, scratch + n * K, y + m * ldy + r0 + n, ldy,
                                 b0 ? b0 + n : nullptr);
        }
    }
}

template <int QT>
void half_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, const float* bias, float* y,
               int64_t ldy, int64_t n0, int64_t n1, float* scratch) {
    switch (M) {
        case 1: half_rows_direct<QT, 1, 8>(x, K, w, bias, y, ldy, n0, n1); return;
        case 2: half_rows_direct<QT, 2, 6>(x, K, w, bias, y, ldy, n0, n1); return;
        case 3: half_rows_direct<QT, 3, 4>(x, K, w, bias, y, ldy, n0, n1); return;
        case 4: half_rows_direct<QT, 4, 4>(x, K, w, bias, y, ldy, n0, n1); return;
        case 5: half_rows_direct<QT, 5, 3>(x, K, w, bias, y, ldy, n0, n1); return;
        case 6: half_rows_direct<QT, 6, 3>(x, K, w, bias, y, ldy, n0, n1); return;
        case 7: half_rows_direct<QT, 7, 3>(x, K, w, bias, y, ldy, n0, n1); return;
        case 8: half_rows_direct<QT, 8, 2>(x, K, w, bias, y, ldy, n0, n1); return;
        default: half_many_rows<QT>(x, M, K, w, bias, y, ldy, n0, n1, scratch); return;
    }
}

}  // namespace

void half512_linear_rows(int qtype, const float* x, int64_t M, int64_t K, const uint16_t* w,
                         const float* bias, float* y, int64_t N, int64_t n0, int64_t n1, float* scratch) {
    if (qtype == QT_F16) half_rows<QT_F16>(x, M, K, w, bias, y, N, n0, n1, scratch);
    else half_rows<QT_BF16>(x, M, K, w, bias, y, N, n0, n1, scratch);
}

}  // namespace specdec
