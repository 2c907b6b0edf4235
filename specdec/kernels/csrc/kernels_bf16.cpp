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
// stream.  Many rows (prefill): blocks of up to 64 weight rows are widened once into a float
// scratch that stays in L2 while every activation row passes, in tiles of 6 activation rows x 4
// weight rows, K-block by K-block (below).
#include <immintrin.h>
#include <stdint.h>

#include "kernels.h"
#include "simd512.h"

namespace specdec {
namespace {

constexpr int64_t kPrefetchBytes = 4096;

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
        fma_rows(acc, wv, x, K, k);
    }
    if (k < K) {
        const __mmask16 mask = tail_mask(K - k);
        __m512 wv[NR];
        for (int n = 0; n < NR; ++n) wv[n] = load_w_masked<QT>(mask, w + n * K + k);
        fma_rows_masked(acc, wv, mask, x, K, k);
    }
    store_tile<hsum16, 16>(acc, y, ldy, bias);
}

template <int QT, int MR, int NR>
void half_rows_direct(const float* x, int64_t K, const uint16_t* w, const float* bias, float* y,
                      int64_t ldy, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) half_tile<QT, MR, NR>(x, K, w + n * K, y + n, ldy, bias ? bias + n : nullptr);
    for (; n < n1; ++n) half_tile<QT, MR, 1>(x, K, w + n * K, y + n, ldy, bias ? bias + n : nullptr);
}

template <int QT>
void widen_rows(const uint16_t* w, int64_t K, int64_t rows, float* dst) {
    const int64_t n = rows * K;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load_w<QT>(w + i));
    if (i < n) _mm512_mask_storeu_ps(dst + i, tail_mask(n - i), load_w_masked<QT>(tail_mask(n - i), w + i));
}

// K-blocked: accumulators of MR x NR outputs stay in registers for kKBlock inputs, then are parked in
// c (L1) while the other weight rows of the block take their turn, so the MR activation rows of a
// K-block stay in L1 and only the weights stream from L2.  Parking a vector and reloading it
// changes nothing: each output still runs one FMA chain over k in order, then hsum16, then + bias.
constexpr int64_t kKBlock = 512;
constexpr int64_t kMaxBlockRows = 64;

template <int MR, int NR>
inline void f32_tile_kb(const float* x, int64_t K, const float* w, int64_t k0, int64_t k1, float* c,
                        float* y, int64_t ldy, const float* bias) {
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n)
            acc[m][n] = k0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(c + (m * NR + n) * 16);
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16) {
        __m512 wv[NR];
        for (int n = 0; n < NR; ++n) wv[n] = _mm512_loadu_ps(w + n * K + k);
        fma_rows(acc, wv, x, K, k);
    }
    if (k1 < K) {
        for (int m = 0; m < MR; ++m)
            for (int n = 0; n < NR; ++n) _mm512_store_ps(c + (m * NR + n) * 16, acc[m][n]);
        return;
    }
    if (k < K) f32_tail(acc, x, K, w, K, k, K);
    store_tile<hsum16, 16>(acc, y, ldy, bias);
}

// MR activation rows against nr (<= kMaxBlockRows) widened weight rows, K-block by K-block.
template <int MR>
void mtile_kb(const float* x, int64_t K, const float* wb, int64_t nr, const float* bias, float* y,
              int64_t ldy) {
    constexpr int NR = 4;
    alignas(64) static thread_local float c[MR * kMaxBlockRows * 16];
    for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
        const int64_t k1 = k0 + kKBlock < K ? k0 + kKBlock : K;
        int64_t n = 0;
        for (; n + NR <= nr; n += NR)
            f32_tile_kb<MR, NR>(x, K, wb + n * K, k0, k1, c + n * MR * 16, y + n, ldy, bias ? bias + n : nullptr);
        for (; n < nr; ++n)
            f32_tile_kb<MR, 1>(x, K, wb + n * K, k0, k1, c + n * MR * 16, y + n, ldy, bias ? bias + n : nullptr);
    }
}

template <int QT>
void half_many_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, const float* bias,
                       float* y, int64_t ldy, int64_t n0, int64_t n1, float* scratch) {
    constexpr int MR = 6;
    int64_t block = kHalfScratchFloats / K < 4 ? 4 : kHalfScratchFloats / K / 4 * 4;
    block = block < kMaxBlockRows ? block : kMaxBlockRows;
    for (int64_t r0 = n0; r0 < n1; r0 += block) {
        const int64_t r1 = r0 + block < n1 ? r0 + block : n1, nr = r1 - r0;
        widen_rows<QT>(w + r0 * K, K, nr, scratch);
        const float* b0 = bias ? bias + r0 : nullptr;
        int64_t m = 0;
        for (; m + MR <= M; m += MR) mtile_kb<MR>(x + m * K, K, scratch, nr, b0, y + m * ldy + r0, ldy);
        const float* xr = x + m * K;
        float* yr = y + m * ldy + r0;
        switch (M - m) {
            case 1: mtile_kb<1>(xr, K, scratch, nr, b0, yr, ldy); break;
            case 2: mtile_kb<2>(xr, K, scratch, nr, b0, yr, ldy); break;
            case 3: mtile_kb<3>(xr, K, scratch, nr, b0, yr, ldy); break;
            case 4: mtile_kb<4>(xr, K, scratch, nr, b0, yr, ldy); break;
            case 5: mtile_kb<5>(xr, K, scratch, nr, b0, yr, ldy); break;
            default: break;
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
