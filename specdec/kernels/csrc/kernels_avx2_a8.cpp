// 8-bit activation kernels for AVX2 CPUs without AVX-512 VNNI (AMD Zen 2/3, Intel before Ice
// Lake, most laptops): the same tiles, the same arithmetic and the same results, bit for bit, as
// kernels_vnni.cpp and the scalar twins in kernels_portable.cpp (layouts and order there).
// Compiled on its own with the AVX2 flags; only called after ops.cpp has checked the CPU.
//
// Integer dot products per block of 32 inputs, 8 output rows per vector lane group:
//   4-bit formats: vpmaddubsw (unsigned nibble x signed activation, pairs summed in int16: at most
//     2 x 15 x 127, no saturation), a block's pair sums added in int16 (at most 30,480), then
//     vpmaddwd by ones into int32: 32 multiply-adds per vpmaddubsw, 4x a float FMA;
//   Q8_0: the unsigned codes (0..255) and the activations widened to int16 and multiplied by
//     vpmaddwd (exact: vpmaddubsw could saturate at 2 x 255 x 127).
// Integer sums are exact, so their order is free; every float operation per output is the twins'
// single operation in the twins' order (float(s) * dx, fma with d, Q4_1's fma of m with dx * sx,
// then + bias), in the lanes of a vector.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "avx2_tiles.h"
#include "kernels.h"

namespace specdec {
namespace {

using avx2_tiles::bcast4;

// The tree's steps for float and integer lanes (the same shuffles).
inline __m256 halves(__m256 a, __m256 b, bool low) {
    return low ? _mm256_permute2f128_ps(a, b, 0x20) : _mm256_permute2f128_ps(a, b, 0x31);
}
inline __m256i halves(__m256i a, __m256i b, bool low) {
    return low ? _mm256_permute2x128_si256(a, b, 0x20) : _mm256_permute2x128_si256(a, b, 0x31);
}
inline __m256 unpack_lo(__m256 a, __m256 b) { return _mm256_unpacklo_ps(a, b); }
inline __m256i unpack_lo(__m256i a, __m256i b) { return _mm256_unpacklo_epi32(a, b); }
inline __m256 unpack_hi(__m256 a, __m256 b) { return _mm256_unpackhi_ps(a, b); }
inline __m256i unpack_hi(__m256i a, __m256i b) { return _mm256_unpackhi_epi32(a, b); }

// Lane i of the result = op over the 8 lanes of v[i] (a transposing tree: 7 operations for 8
// vectors, where a horizontal reduction each takes 3 and a dependent chain).
template <typename V, typename Op>
inline V reduce8(const V* v, Op op) {
    V w[4], y[2];
    for (int i = 0; i < 4; ++i) w[i] = op(halves(v[i], v[i + 4], true), halves(v[i], v[i + 4], false));
    for (int i = 0; i < 2; ++i) y[i] = op(unpack_lo(w[i], w[i + 2]), unpack_hi(w[i], w[i + 2]));
    return op(unpack_lo(y[0], y[1]), unpack_hi(y[0], y[1]));  // 128-bit halves: v[0..3], v[4..7]
}

// Blocks [b, b + 8) of one row (xb: the first block): their codes, scales, sums and dx * sx, the
// same values as quantize_rows' block by block for finite inputs (max and the integer sums are
// exact in any order; the divisions, the test d != 0 and the product are the same IEEE operations
// in vector lanes).
inline void quantize_blocks8(const float* xb, int8_t* xq, float* dx, int32_t* sx, float* dxs) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    __m256 a[8];
    for (int j = 0; j < 8; ++j) {
        const float* p = xb + 32 * j;
        a[j] = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(p), abs_mask),
                                           _mm256_and_ps(_mm256_loadu_ps(p + 8), abs_mask)),
                             _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(p + 16), abs_mask),
                                           _mm256_and_ps(_mm256_loadu_ps(p + 24), abs_mask)));
    }
    const __m256 amax = reduce8(a, [](__m256 x, __m256 y) { return _mm256_max_ps(x, y); });
    const __m256 d = _mm256_div_ps(amax, _mm256_set1_ps(127.0f));
    const __m256 id = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), d),
                                    _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_NEQ_UQ));
    alignas(32) float ids[8];
    _mm256_store_ps(ids, id);
    __m256i s32[8];
    for (int j = 0; j < 8; ++j) {
        const float* p = xb + 32 * j;
        const __m256 idv = _mm256_set1_ps(ids[j]);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(p + 8 * i), idv));
        const __m256i pk = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        const __m256i codes = _mm256_permutevar8x32_epi32(pk, order);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + 32 * j), codes);
        s32[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, codes), ones16);
    }
    const __m256i sums = reduce8(s32, [](__m256i x, __m256i y) { return _mm256_add_epi32(x, y); });
    _mm256_storeu_ps(dx, d);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sx), sums);
    _mm256_storeu_ps(dxs, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sums)));
}

// Rows [m0, m1) of x [M, K] -> xq int8 [M, K] and per block of 32: dx = amax / 127, sx = the sum
// of the codes, dxs = dx * sx (as a8_quantize_rows in kernels_portable.cpp): 8 blocks at a time
// (quantize_blocks8), the rest one by one.
void quantize_rows(const float* x, int64_t K, int8_t* xq, float* dx, int32_t* sx, float* dxs,
                   int64_t m0, int64_t m1) {
    const int64_t nb = K / 32;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t m = m0; m < m1; ++m) {
        int64_t b = 0;
        for (; b + 8 <= nb; b += 8)
            quantize_blocks8(x + m * K + b * 32, xq + m * K + b * 32, dx + m * nb + b, sx + m * nb + b,
                             dxs + m * nb + b);
        for (; b < nb; ++b) {
            const float* xb = x + m * K + b * 32;
            __m256 v[4];
            for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
            __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                     _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
            const float amax = _mm_cvtss_f32(h);
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m256 idv = _mm256_set1_ps(id);
            __m256i q[4];
            for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));  // nearest even
            // saturating packs (the twins' clamp to [-128, 127]), then the lanes back in order
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            const __m256i codes = _mm256_permutevar8x32_epi32(p, order);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + b * 32), codes);
            const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, codes), ones16);
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(s32), _mm256_extracti128_si256(s32, 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
            const int32_t sum = _mm_cvtsi128_si32(s);
            dx[m * nb + b] = d;
            sx[m * nb + b] = sum;
            dxs[m * nb + b] = d * static_cast<float>(sum);
        }
    }
}

// The int32 dot products of one tile's 16 rows with R activation blocks: lo[r] lanes = rows 0-7,
// hi[r] = rows 8-15.  The weights are unpacked once for the R activation rows.  NOTE: a row's
// eight pair sums stay in int16 (each at most 2 x 15 x 128 = 3,840 in magnitude, 30,720 in all:
// no overflow) and meet vpmaddwd once per block, not once per pair.
template <int R>
inline void dot_q4(const uint8_t* quants, const int8_t* const* xb, __m256i* lo, __m256i* hi) {
    __m256i a_lo[R], a_hi[R];
    for (int r = 0; r < R; ++r) a_lo[r] = a_hi[r] = _mm256_setzero_si256();
    // NOTE: not unrolled: unrolled, GCC kept every pass's operands live and spilled ~400 times
#pragma GCC unroll 1
    for (int p = 0; p < 4; ++p) {
        __m256i w0l, w0h, w1l, w1h;
        avx2_tiles::q4_codes(quants, p, w0l, w0h, w1l, w1h);
        for (int r = 0; r < R; ++r) {
            const __m256i x_lo = bcast4(xb[r] + 4 * p), x_hi = bcast4(xb[r] + 4 * (p + 4));
            a_lo[r] = _mm256_add_epi16(a_lo[r], _mm256_add_epi16(_mm256_maddubs_epi16(w0l, x_lo),
                                                                 _mm256_maddubs_epi16(w0h, x_hi)));
            a_hi[r] = _mm256_add_epi16(a_hi[r], _mm256_add_epi16(_mm256_maddubs_epi16(w1l, x_lo),
                                                                 _mm256_maddubs_epi16(w1h, x_hi)));
        }
    }
    const __m256i ones16 = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) {
        lo[r] = _mm256_madd_epi16(a_lo[r], ones16);
        hi[r] = _mm256_madd_epi16(a_hi[r], ones16);
    }
}

// Q8_0: 8 groups of 4 inputs; 32 bytes = 8 rows x 4 codes.  The activations come widened to
// int16 (prepare_a8, once per product), a group of 4 one 8-byte broadcast per row; the codes are
// widened once for the R activation rows, and vpmaddwd gives per row two pair sums, summed over
// the 8 groups for rows 0-3 and 4-7 apart; one vphaddd per block then adds each row's pairs (lanes
// come out as rows 0 1 4 5 2 3 6 7, put back at the end).  NOTE: integer sums are exact, so adding
// the pairs once per block instead of once per group changes no bit.  Widening the activations per
// row and group instead (three shuffles a row) made SmolLM2's Q8_0 output layer (49,152 x 576)
// 8 / 16 rows 4.04-4.22 / 8.43-8.83 ms against 3.65-3.81 / 7.42-7.76 (alone, 2-core AVX2 EPYC,
// quiet, 3 alternated runs).
template <int R>
inline void dot_q8_half(const uint8_t* quants, const int16_t* const* xw, int half, __m256i* out) {
    __m256i a03[R], a47[R];
    for (int r = 0; r < R; ++r) a03[r] = a47[r] = _mm256_setzero_si256();
    // NOTE: not unrolled: unrolled, GCC hoisted the 8 x R activation broadcasts (the same for
    // both halves) out of the half loop and spilled them and the products to the stack
#pragma GCC unroll 1
    for (int t = 0; t < 8; ++t) {
        const uint8_t* q = quants + t * 64 + 32 * half;
        const __m256i w03 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
        const __m256i w47 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
        for (int r = 0; r < R; ++r) {
            int64_t x4;
            memcpy(&x4, xw[r] + 4 * t, 8);
            const __m256i x = _mm256_set1_epi64x(x4);
            a03[r] = _mm256_add_epi32(a03[r], _mm256_madd_epi16(w03, x));
            a47[r] = _mm256_add_epi32(a47[r], _mm256_madd_epi16(w47, x));
        }
    }
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for (int r = 0; r < R; ++r) out[r] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a03[r], a47[r]), order);
}

// (two calls, not a loop over the halves: each output is then plainly written, for GCC's
// uninitialized-value analysis)
template <int R>
inline void dot_q8(const uint8_t* quants, const int16_t* const* xw, __m256i* lo, __m256i* hi) {
    dot_q8_half<R>(quants, xw, 0, lo);
    dot_q8_half<R>(quants, xw, 1, hi);
}

// A block's integer sums for R activation rows: the 4-bit formats from the codes (dot_q4), Q8_0
// from the codes widened to int16 once per product (dot_q8, xw16).
struct Sums {
    const int8_t* xq;
    const int16_t* xw16;
    int64_t K;

    template <int R, int kind>
    void block(const uint8_t* quants, int64_t m, int64_t b, __m256i* lo, __m256i* hi) const {
        if constexpr (kind == A8_Q8) {
            const int16_t* xw[R];
            for (int r = 0; r < R; ++r) xw[r] = xw16 + (m + r) * K + b * 32;
            dot_q8<R>(quants, xw, lo, hi);
        } else {
            const int8_t* xb[R];
            for (int r = 0; r < R; ++r) xb[r] = xq + (m + r) * K + b * 32;
            dot_q4<R>(quants, xb, lo, hi);
        }
    }
};

// Activation rows go through a tile group four at a time (avx2_tiles.h group_rows: the float
// steps in the twins' order).
constexpr int kRowsPerPass = 4;

// A8Table::layout_alloc / quantize_layout: Q8_0's activation codes widened to int16 once per
// product (the 4-bit kinds need none); the calling thread's buffer, until its next layout_alloc.
const void* layout_alloc(int kind, int64_t M, int64_t K) {
    if (kind != A8_Q8) return nullptr;
    thread_local std::vector<int16_t> buf;
    const int64_t n = M * K;
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
    return buf.data();
}

void widen_rows(const void* layout, const int8_t* xq, int64_t K, int64_t m0, int64_t m1) {
    int16_t* out = static_cast<int16_t*>(const_cast<void*>(layout));
    for (int64_t i = m0 * K; i < m1 * K; i += 16) {  // K % 32 == 0
        const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + i));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_cvtepi8_epi16(c));
    }
}

// linear_groups reads the row-major codes and scales as well as the widened codes.
void quantize_layout(const void* layout, int /*kind*/, const float* x, int64_t K, int64_t /*M*/, int64_t m0,
                     int64_t m1, int8_t* xq, float* dx, int32_t* sx, float* dxs) {
    quantize_rows(x, K, xq, dx, sx, dxs, m0, m1);
    widen_rows(layout, xq, K, m0, m1);
}

// prep: for Q8_0, the activation codes widened to int16 [M, K] (layout_alloc / quantize_layout).
void linear_groups(int kind, const int8_t* xq, const float* dx, const int32_t* sx, const float* dxs,
                   int64_t M, int64_t K, const uint8_t* w, const float* bias, float* y, int64_t N,
                   int64_t g0, int64_t g1, const void* prep) {
    const Sums sums{xq, static_cast<const int16_t*>(prep), K};
    if (kind == A8_Q8) avx2_tiles::groups_of<kRowsPerPass, A8_Q8>(sums, dx, sx, dxs, M, K, w, bias, y, N, g0, g1);
    else if (kind == A8_Q4_0) avx2_tiles::groups_of<kRowsPerPass, A8_Q4_0>(sums, dx, sx, dxs, M, K, w, bias, y, N, g0, g1);
    else avx2_tiles::groups_of<kRowsPerPass, A8_Q4_1>(sums, dx, sx, dxs, M, K, w, bias, y, N, g0, g1);
}

const A8Table kTable = {"avx2", quantize_rows, linear_groups, layout_alloc, quantize_layout};

}  // namespace

const A8Table* avx2_a8_table() { return &kTable; }

}  // namespace specdec
