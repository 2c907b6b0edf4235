// AVX-512 linear kernels (16-lane FMA).  Compiled on its own with -mavx512f -mavx512dq
// -mavx512bw -mavx512vl -mavx2 -mfma -mf16c -O3 -ffp-contract=off; only called after ops.cpp has
// checked the CPU supports those instruction sets.  rms_norm comes from the AVX2 table; attention
// (below) has its own 16-lane kernel.
//
// Same linkage rule as kernels_avx2.cpp: everything has internal linkage except the accessor.
//
// Reduction order (what makes the kernels batch-invariant): a dot product of length K is one
// 16-lane float accumulator updated with FMA over k = 0, 16, 32, ... in order (a masked partial
// vector last when K % 16 != 0), then the fixed horizontal sum hsum16().  Every path below -- the
// register-decoding tiles for a few rows and the decode-to-scratch tiles for many -- runs that
// same chain per output; tiling only runs several chains side by side.
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

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

constexpr int64_t kPrefetchBytes = 8192;

inline void prefetch(const void* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

inline float load_f16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// ---------------------------------------------------------------------------------------------
// GGUF block decoding: one 32-element block -> 2 vectors holding elements 0-15 and 16-31.
// The values equal gguf.quants.dequantize exactly (same float32 operations as the AVX2 path).

template <int QT>
struct Block;

template <>
struct Block<QT_Q8_0> {
    static constexpr int64_t kBytes = 34;  // f16 d, 32 x int8
    static inline void decode(const uint8_t* b, __m512 out[2]) {
        const __m512 d = _mm512_set1_ps(load_f16(b));
        for (int i = 0; i < 2; ++i) {
            const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 + 16 * i));
            out[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d);
        }
    }
};

// The 16 nibble bytes zero-extended to 32-bit lanes: low nibbles are elements 0-15, high 16-31.
inline void nibbles_i32(const uint8_t* qs, __m512i out[2]) {
    const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    out[0] = _mm512_and_si512(a, _mm512_set1_epi32(0x0F));
    out[1] = _mm512_srli_epi32(a, 4);
}

template <>
struct Block<QT_Q4_0> {
    static constexpr int64_t kBytes = 18;  // f16 d, 16 bytes of nibbles; value (q - 8) * d
    static inline void decode(const uint8_t* b, __m512 out[2]) {
        // fma(q, d, -8d) rounds the exact (q - 8) * d once (-8d is exact): same as (q - 8) * d.
        const __m512 d = _mm512_set1_ps(load_f16(b));
        const __m512 c = _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
        __m512i q[2];
        nibbles_i32(b + 2, q);
        for (int i = 0; i < 2; ++i) out[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q[i]), d, c);
    }
};

template <>
struct Block<QT_Q4_1> {
    static constexpr int64_t kBytes = 20;  // f16 d, f16 m, 16 bytes of nibbles; value q * d + m
    static inline void decode(const uint8_t* b, __m512 out[2]) {
        int32_t dm;
        memcpy(&dm, b, 4);
        const __m128 dm4 = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        const __m512 d = _mm512_broadcastss_ps(dm4);
        const __m512 m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm4));
        __m512i q[2];
        nibbles_i32(b + 4, q);
        // Two roundings, like gguf's (d * q) + m.
        for (int i = 0; i < 2; ++i) out[i] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q[i]), d), m);
    }
};

// ---------------------------------------------------------------------------------------------
// Tiles.

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

// MR activation rows (stride ldx) x NR float weight rows (stride ldw).
template <int MR, int NR, bool kPrefetch>
inline void f32_tile(const float* x, int64_t ldx, int64_t K, const float* w, int64_t ldw, float* y,
                     int64_t ldy, const float* bias) {
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
    const int64_t pf = NR * ldw * 4 > kPrefetchBytes ? NR * ldw * 4 : kPrefetchBytes;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 wv[NR];
        for (int n = 0; n < NR; ++n) {
            wv[n] = _mm512_loadu_ps(w + n * ldw + k);
            if (kPrefetch) prefetch(reinterpret_cast<const char*>(w + n * ldw + k) + pf);
        }
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_loadu_ps(x + m * ldx + k);
            for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(wv[n], xv, acc[m][n]);
        }
    }
    if (k < K) {
        const __mmask16 mask = tail_mask(K - k);
        __m512 wv[NR];
        for (int n = 0; n < NR; ++n) wv[n] = _mm512_maskz_loadu_ps(mask, w + n * ldw + k);
        for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * ldx + k);
            for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(wv[n], xv, acc[m][n]);
        }
    }
    store_tile<MR, NR>(acc, y, ldy, bias);
}

// MR activation rows x NR quantized weight rows, each block decoded in registers once for the MR
// rows.  Same FMA chain per output as f32_tile on the decoded weights.
template <int QT, int MR, int NR>
inline void quant_tile(const float* x, int64_t ldx, int64_t K, const uint8_t* w, int64_t ldw,
                       float* y, int64_t ldy, const float* bias) {
    using B = Block<QT>;
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
    const int64_t nb = K / 32;
    for (int64_t b = 0; b < nb; ++b) {
        __m512 wv[NR][2];
        for (int n = 0; n < NR; ++n) {
            B::decode(w + n * ldw + b * B::kBytes, wv[n]);
            prefetch(w + n * ldw + b * B::kBytes + kPrefetchBytes);
        }
        for (int h = 0; h < 2; ++h) {
            for (int m = 0; m < MR; ++m) {
                const __m512 xv = _mm512_loadu_ps(x + m * ldx + b * 32 + 16 * h);
                for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_fmadd_ps(wv[n][h], xv, acc[m][n]);
            }
        }
    }
    store_tile<MR, NR>(acc, y, ldy, bias);
}

// ---------------------------------------------------------------------------------------------
// Row loops.

// All mc (<= 8) rows against quantized weight rows [n0, n1), decoding in registers.
template <int QT, int MR, int NR>
inline void quant_rows_direct(const float* x, int64_t K, const uint8_t* w, int64_t ldw,
                              const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + NR <= n1; n += NR)
        quant_tile<QT, MR, NR>(x, K, K, w + n * ldw, ldw, y + n, ldy, bias ? bias + n : nullptr);
    for (; n < n1; ++n)
        quant_tile<QT, MR, 1>(x, K, K, w + n * ldw, ldw, y + n, ldy, bias ? bias + n : nullptr);
}

template <int QT>
void quant_few_rows(const float* x, int64_t mc, int64_t K, const uint8_t* w, int64_t ldw,
                    const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    switch (mc) {
        case 1: quant_rows_direct<QT, 1, 8>(x, K, w, ldw, bias, y, ldy, n0, n1); return;
        case 2: quant_rows_direct<QT, 2, 6>(x, K, w, ldw, bias, y, ldy, n0, n1); return;
        case 3: quant_rows_direct<QT, 3, 4>(x, K, w, ldw, bias, y, ldy, n0, n1); return;
        case 4: quant_rows_direct<QT, 4, 4>(x, K, w, ldw, bias, y, ldy, n0, n1); return;
        case 5: quant_rows_direct<QT, 5, 3>(x, K, w, ldw, bias, y, ldy, n0, n1); return;
        case 6: quant_rows_direct<QT, 6, 3>(x, K, w, ldw, bias, y, ldy, n0, n1); return;
        case 7: quant_rows_direct<QT, 7, 3>(x, K, w, ldw, bias, y, ldy, n0, n1); return;
        default: quant_rows_direct<QT, 8, 2>(x, K, w, ldw, bias, y, ldy, n0, n1); return;
    }
}

// r (< 8) activation rows against NR weight rows: the remainder of an MR-row loop.
template <int NR, bool PF>
inline void f32_tile_rows(int64_t r, const float* x, int64_t K, const float* w, int64_t ldw,
                          float* y, int64_t ldy, const float* bias) {
    switch (r) {
        case 1: f32_tile<1, NR, PF>(x, K, K, w, ldw, y, ldy, bias); return;
        case 2: f32_tile<2, NR, PF>(x, K, K, w, ldw, y, ldy, bias); return;
        case 3: f32_tile<3, NR, PF>(x, K, K, w, ldw, y, ldy, bias); return;
        case 4: f32_tile<4, NR, PF>(x, K, K, w, ldw, y, ldy, bias); return;
        case 5: f32_tile<5, NR, PF>(x, K, K, w, ldw, y, ldy, bias); return;
        default: return;
    }
}

// Activation rows [m0, m1) against NR weight rows, MR rows per tile.
template <int NR, int MR, bool PF>
inline void f32_row_tiles(const float* x, int64_t m0, int64_t m1, int64_t K, const float* w,
                          int64_t ldw, const float* bias, float* y, int64_t ldy) {
    static_assert(MR <= 6, "f32_tile_rows handles remainders up to 5 rows");
    int64_t m = m0;
    for (; m + MR <= m1; m += MR) f32_tile<MR, NR, PF>(x + m * K, K, K, w, ldw, y + m * ldy, ldy, bias);
    if (m < m1) f32_tile_rows<NR, PF>(m1 - m, x + m * K, K, w, ldw, y + m * ldy, ldy, bias);
}

// M rows (any number, stride K) against float weight rows [0, nr) at w (stride ldw): weight tiles
// of NR rows stay in L1 while the activation rows stream past, kChunkRows at a time.
template <int NR, int MR, bool PF>
void f32_block(const float* x, int64_t M, int64_t K, const float* w, int64_t ldw, int64_t nr,
               const float* bias, float* y, int64_t ldy) {
    for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
        const int64_t m1 = M - m0 < kChunkRows ? M : m0 + kChunkRows;
        int64_t n = 0;
        for (; n + NR <= nr; n += NR)
            f32_row_tiles<NR, MR, PF>(x, m0, m1, K, w + n * ldw, ldw, bias ? bias + n : nullptr, y + n, ldy);
        for (; n < nr; ++n)
            f32_row_tiles<1, MR, PF>(x, m0, m1, K, w + n * ldw, ldw, bias ? bias + n : nullptr, y + n, ldy);
    }
}

// f32 weights, few rows: one tile shape per row count.
void f32_few_rows(const float* x, int64_t mc, int64_t K, const float* w, const float* bias,
                  float* y, int64_t ldy, int64_t n0, int64_t n1) {
    const float* wn = w + n0 * K;
    const float* bn = bias ? bias + n0 : nullptr;
    float* yn = y + n0;
    switch (mc) {
        case 1: f32_block<8, 1, true>(x, mc, K, wn, K, n1 - n0, bn, yn, ldy); return;
        case 2: f32_block<6, 2, true>(x, mc, K, wn, K, n1 - n0, bn, yn, ldy); return;
        case 3: f32_block<4, 3, true>(x, mc, K, wn, K, n1 - n0, bn, yn, ldy); return;
        default: f32_block<4, 4, true>(x, mc, K, wn, K, n1 - n0, bn, yn, ldy); return;
    }
}

// Many rows of a quantized weight: decode up to kMaxScratchRows weight rows into scratch (L1/L2)
// once, then run every activation row over them.
template <int QT>
void quant_many_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t ldw,
                     const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1,
                     float* scratch) {
    using B = Block<QT>;
    const int64_t nb = K / 32;
    for (int64_t r0 = n0; r0 < n1; r0 += kMaxScratchRows) {
        const int64_t r1 = r0 + kMaxScratchRows < n1 ? r0 + kMaxScratchRows : n1;
        for (int64_t r = r0; r < r1; ++r) {
            const uint8_t* src = w + r * ldw;
            float* dst = scratch + (r - r0) * K;
            for (int64_t b = 0; b < nb; ++b) {
                __m512 wv[2];
                B::decode(src + b * B::kBytes, wv);
                prefetch(src + b * B::kBytes + kPrefetchBytes);
                _mm512_storeu_ps(dst + b * 32, wv[0]);
                _mm512_storeu_ps(dst + b * 32 + 16, wv[1]);
            }
        }
        f32_block<4, 6, false>(x, M, K, scratch, K, r1 - r0, bias ? bias + r0 : nullptr, y + r0, ldy);
    }
}

template <int QT>
void quant_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t ldw,
                const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1, float* scratch) {
    if (M <= 8) quant_few_rows<QT>(x, M, K, w, ldw, bias, y, ldy, n0, n1);
    else quant_many_rows<QT>(x, M, K, w, ldw, bias, y, ldy, n0, n1, scratch);
}

void linear_rows(int qtype, const float* x, int64_t M, int64_t K, const uint8_t* w,
                 int64_t w_row_bytes, const float* bias, float* y, int64_t N, int64_t n0,
                 int64_t n1, float* scratch) {
    switch (qtype) {
        case QT_F32: {
            const float* wf = reinterpret_cast<const float*>(w);
            if (M <= 4) f32_few_rows(x, M, K, wf, bias, y, N, n0, n1);
            else f32_block<4, 6, true>(x, M, K, wf + n0 * K, K, n1 - n0, bias ? bias + n0 : nullptr, y + n0, N);
            break;
        }
        case QT_Q8_0: quant_rows<QT_Q8_0>(x, M, K, w, w_row_bytes, bias, y, N, n0, n1, scratch); break;
        case QT_Q4_0: quant_rows<QT_Q4_0>(x, M, K, w, w_row_bytes, bias, y, N, n0, n1, scratch); break;
        case QT_Q4_1: quant_rows<QT_Q4_1>(x, M, K, w, w_row_bytes, bias, y, N, n0, n1, scratch); break;
        default: break;
    }
}

// ---------------------------------------------------------------------------------------------
// Attention for one query row and the G query heads of one kv head (GQA group).
//
// Scores: per (head, key) one 16-lane FMA chain over d (a masked partial vector last), then the
// lanes are summed by reduce16(): sixteen keys' accumulators at once, through one fixed
// pairwise tree that treats every key the same (missing keys are zero vectors that never mix
// with other keys' lanes).  Softmax: exp of (s - max), summed in 16-lane chunks in key order.
// Values: per output element one FMA chain over keys in order.  None of it depends on other
// rows, so a row's result is the same whatever the batch.

inline __m512 exp512(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f));
    __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    const __m512 z = _mm512_mul_ps(x, x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, z, x);
    y = _mm512_add_ps(y, one);
    __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127));
    e = _mm512_slli_epi32(e, 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// a[0..16) -> one vector whose lane i is the sum of a[i]'s 16 lanes.  Every vector goes through
// the same tree: lane l + lane l+8, then +4, +2, +1 (in that order).
inline __m512 reduce16(__m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)  // lanes 0-7: a[2i] partial sums, 8-15: a[2i+1]
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; ++i)  // 128-bit quarters: b[2i] key, b[2i] key, b[2i+1] key, b[2i+1] key
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; ++i)  // per quarter: 2 lanes of c[2i]'s key, 2 of c[2i+1]'s
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
    // Lane of r holding key i's sum, worked out from the shuffles above.
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, r);
}

// q . k for 16 keys (nk of them real, the rest zero vectors): per key one FMA chain over d in
// order.  DV > 0: D == 16 DV, q held in registers and the key loop unrolled; DV == 0: any D.
template <int DV>
inline __m512 key_block_scores(const float* q, const float* k, int64_t k_stride, int64_t nk,
                               int64_t D, int64_t D16, __mmask16 dmask) {
    __m512 acc[16];
    if (DV > 0 && nk == 16) {
        __m512 qv[DV > 0 ? DV : 1];
        for (int d = 0; d < DV; ++d) qv[d] = _mm512_loadu_ps(q + 16 * d);
        for (int i = 0; i < 16; ++i) {
            const float* kj = k + i * k_stride;
            __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kj));
            for (int d = 1; d < DV; ++d) a = _mm512_fmadd_ps(qv[d], _mm512_loadu_ps(kj + 16 * d), a);
            acc[i] = a;
        }
        return reduce16(acc);
    }
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nk; ++i) {
        const float* kj = k + i * k_stride;
        __m512 a = _mm512_setzero_ps();
        int64_t d = 0;
        if (D16 > 0) {
            a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(kj));
            d = 16;
        }
        for (; d < D16; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(kj + d), a);
        if (D16 < D)
            a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(dmask, q + D16), _mm512_maskz_loadu_ps(dmask, kj + D16), a);
        acc[i] = a;
    }
    return reduce16(acc);
}

// Raw scores q_g . k_j (scaled, soft-capped) of G heads against n keys into s[g * s_stride + j];
// mx[g] = their max.  (The first product of a chain is a multiply: fma(q, k, 0) rounds the same.)
template <int DV>
inline void scores512(const float* q, int64_t q_hs, int64_t G, const float* k, int64_t k_stride,
                      int64_t n, int64_t D, float scale, float softcap, float* s, int64_t s_stride,
                      float* mx) {
    const int64_t D16 = D & ~int64_t(15);
    const __mmask16 dmask = tail_mask(D - D16);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * q_hs;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t nk = n - j0 < 16 ? n - j0 : 16;
            __m512 sc = _mm512_mul_ps(
                key_block_scores<DV>(qg, k + j0 * k_stride, k_stride, nk, D, D16, dmask), vscale);
            const __mmask16 kmask = tail_mask(nk);
            if (softcap > 0.0f) {
                alignas(64) float tmp[16];
                _mm512_store_ps(tmp, sc);
                for (int64_t i = 0; i < nk; ++i) tmp[i] = softcap * tanhf(tmp[i] / softcap);
                sc = _mm512_load_ps(tmp);
            }
            _mm512_mask_storeu_ps(s + g * s_stride + j0, kmask, sc);
            vmax = _mm512_mask_max_ps(vmax, kmask, vmax, sc);
        }
        mx[g] = _mm512_reduce_max_ps(vmax);
    }
}

// s[0..n) <- exp(s - mx) in place; returns 1 / sum (16-lane sums in key order, then hsum16).
inline float softmax512(float* s, int64_t n, float mx) {
    const __m512 vmx = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = tail_mask(n - j < 16 ? n - j : 16);
        const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmx)));
        _mm512_mask_storeu_ps(s + j, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    return 1.0f / hsum16(sum);
}

// out_g[c : c + 16 NV) = inv_g * sum_j p_g[j] v_j[c : c + 16 NV), GB heads sharing each load.
// MASKED: one vector (NV == 1) of which only the `last` columns exist.
template <int GB, int NV, bool MASKED>
inline void values512(const float* p, int64_t p_stride, int64_t n, const float* v, int64_t v_stride,
                      const float* inv, float* out, int64_t out_hs, __mmask16 last) {
    static_assert(!MASKED || NV == 1, "a masked tail is one vector");
    __m512 acc[GB][NV];
    for (int g = 0; g < GB; ++g)
        for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
        const float* vj = v + j * v_stride;
        __m512 vv[NV];
        for (int i = 0; i < NV; ++i)
            vv[i] = MASKED ? _mm512_maskz_loadu_ps(last, vj + 16 * i) : _mm512_loadu_ps(vj + 16 * i);
        for (int g = 0; g < GB; ++g) {
            const __m512 pj = _mm512_set1_ps(p[g * p_stride + j]);
            for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_fmadd_ps(pj, vv[i], acc[g][i]);
        }
    }
    for (int g = 0; g < GB; ++g) {
        const __m512 sc = _mm512_set1_ps(inv[g]);
        for (int i = 0; i < NV; ++i) {
            const __m512 r = _mm512_mul_ps(acc[g][i], sc);
            if (MASKED) _mm512_mask_storeu_ps(out + g * out_hs + 16 * i, last, r);
            else _mm512_storeu_ps(out + g * out_hs + 16 * i, r);
        }
    }
}

template <int GB>
void values_heads(const float* p, int64_t p_stride, int64_t n, const float* v, int64_t v_stride,
                  int64_t D, const float* inv, float* out, int64_t out_hs) {
    constexpr int NV = GB == 1 ? 8 : GB == 2 ? 6 : 4;  // <= 24 accumulators + NV loads
    int64_t c = 0;
    for (; c + 16 * NV <= D; c += 16 * NV)
        values512<GB, NV, false>(p, p_stride, n, v + c, v_stride, inv, out + c, out_hs, 0xFFFF);
    for (; c + 16 <= D; c += 16)
        values512<GB, 1, false>(p, p_stride, n, v + c, v_stride, inv, out + c, out_hs, 0xFFFF);
    if (c < D) values512<GB, 1, true>(p, p_stride, n, v + c, v_stride, inv, out + c, out_hs, tail_mask(D - c));
}

void attention_group(const float* q, int64_t q_head_stride, int64_t G, const float* k,
                     int64_t k_stride, const float* v, int64_t v_stride, int64_t lo, int64_t hi,
                     int64_t D, float scale, float softcap, float* out, int64_t out_head_stride,
                     float* scratch) {
    const int64_t n = hi - lo + 1;
    const float* kb = k + lo * k_stride;
    const float* vb = v + lo * v_stride;
    const int64_t s_stride = n + 16;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gb = G - g0 < 4 ? G - g0 : 4;
        float mx[4], inv[4];
        const float* qg = q + g0 * q_head_stride;
        if (D == 64)
            scores512<4>(qg, q_head_stride, gb, kb, k_stride, n, D, scale, softcap, scratch, s_stride, mx);
        else if (D == 128)
            scores512<8>(qg, q_head_stride, gb, kb, k_stride, n, D, scale, softcap, scratch, s_stride, mx);
        else if (D == 256)
            scores512<16>(qg, q_head_stride, gb, kb, k_stride, n, D, scale, softcap, scratch, s_stride, mx);
        else
            scores512<0>(qg, q_head_stride, gb, kb, k_stride, n, D, scale, softcap, scratch, s_stride, mx);
        for (int64_t g = 0; g < gb; ++g) inv[g] = softmax512(scratch + g * s_stride, n, mx[g]);
        float* og = out + g0 * out_head_stride;
        switch (gb) {
            case 1: values_heads<1>(scratch, s_stride, n, vb, v_stride, D, inv, og, out_head_stride); break;
            case 2: values_heads<2>(scratch, s_stride, n, vb, v_stride, D, inv, og, out_head_stride); break;
            case 3: values_heads<3>(scratch, s_stride, n, vb, v_stride, D, inv, og, out_head_stride); break;
            default: values_heads<4>(scratch, s_stride, n, vb, v_stride, D, inv, og, out_head_stride); break;
        }
    }
}

// As the AVX2 one, 16 lanes and four independent maxima (the max pass is latency-bound).
int64_t argmax(const float* x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
    if (n >= 64) {
        __m512 a = _mm512_set1_ps(-INFINITY), b = a, c = a, d = a;
        for (; i + 64 <= n; i += 64) {
            a = _mm512_max_ps(_mm512_loadu_ps(x + i), a);
            b = _mm512_max_ps(_mm512_loadu_ps(x + i + 16), b);
            c = _mm512_max_ps(_mm512_loadu_ps(x + i + 32), c);
            d = _mm512_max_ps(_mm512_loadu_ps(x + i + 48), d);
        }
        m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a, b), _mm512_max_ps(c, d)));
    }
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    if (m == -INFINITY) return portable_table()->argmax(x, n);  // all -inf or NaN: the reference
    const __m512 target = _mm512_set1_ps(m);
    i = 0;
    for (; i + 16 <= n; i += 16) {
        const __mmask16 mask = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
        if (mask) return i + __builtin_ctz(static_cast<unsigned>(mask));
    }
    for (; i < n; ++i)
        if (x[i] == m) return i;
    return 0;
}

}  // namespace

const KernelTable* avx512_table() {
    static const KernelTable table = {"avx512", linear_rows, avx2_table()->rms_norm_rows, attention_group,
                                      argmax};
    return &table;
}

}  // namespace specdec
