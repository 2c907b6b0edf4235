// AVX-512 linear kernels (16-lane FMA).  Compiled on its own with -mavx512f -mavx512dq
// -mavx512bw -mavx512vl -mavx2 -mfma -mf16c -O3 -ffp-contract=off; only called after ops.cpp has
// checked the CPU supports those instruction sets.  rms_norm and the attention merge come from the
// AVX2 table; the attention blocks from attention_avx512.cpp (the AVX2 table's arithmetic).
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
#include "simd512.h"

namespace specdec {
namespace {

constexpr int64_t kPrefetchBytes = 8192;

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
        fma_rows(acc, wv, x, ldx, k);
    }
    if (k < K) f32_tail(acc, x, ldx, w, ldw, k, K);
    store_tile<hsum16, 16>(acc, y, ldy, bias);
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
    store_tile<hsum16, 16>(acc, y, ldy, bias);
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
    // The AVX2 table's rms_norm, attention merge and the layer's per-token writes (a head is 64-256
    // floats: a few vectors either way), with this unit's products and argmax.  NOTE: the attention
    // blocks compute what the AVX2 table's compute, bit for bit, on 16 lanes.
    static const KernelTable table = [] {
        KernelTable t = *avx2_table();
        t.name = "avx512";
        t.linear_rows = linear_rows;
        t.argmax = argmax;
#ifdef SPECDEC_HAVE_AVX512ATTN
        t.attention_block = avx512_attention_block;
#endif
        return t;
    }();
    return &table;
}

}  // namespace specdec
