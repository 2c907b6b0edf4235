// What the AVX2 table's 8-bit activation kernels share, whichever instruction takes their
// integer sums (kernels_avx2_a8.cpp and kernels_avx2_kq.cpp: vpmaddubsw; a8_vnni256.h and
// kq_vnni256.h: vpdpbusd): for Q8_0 / Q4_0 / Q4_1 tiles the row passes and the float steps after
// the sums, so that both forms give the same results by construction, and the loads and code
// unpacking of both the 4-bit and the K-quant tiles.
// Included by units compiled with the AVX2 flags.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "kernels.h"
#include "prefetch.h"

namespace specdec {
namespace {
namespace avx2_tiles {

template <int R, class F>
inline void rest_pass(int64_t n, int64_t m, F& f) {
    if constexpr (R >= 1) {
        if (n == R) f(std::integral_constant<int, R>{}, m);
        else rest_pass<R - 1>(n, m, f);
    }
}

// f(std::integral_constant<int, R>{}, m) for activation rows [m, m + R) covering [0, M): passes of
// Pass rows, then one pass of the rest (a row's result never depends on which rows share its
// pass: every lane's arithmetic is its own).
template <int Pass, class F>
inline void in_passes(int64_t M, F&& f) {
    int64_t m = 0;
    for (; m + Pass <= M; m += Pass) f(std::integral_constant<int, Pass>{}, m);
    rest_pass<Pass - 1>(M - m, m, f);
}

inline __m256 f16x8(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The 4 bytes at p in every 32-bit lane.
inline __m256i bcast4(const void* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// 32 bits -> 32 bytes: byte i is 0x10 where bit i is set (Q5_K's fifth bit).
inline __m256i bits_to_0x10(const uint8_t* p) {
    int32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits), _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                     0x0303030303030303LL));
    const __m256i sel = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel), _mm256_set1_epi8(0x10));
}

// Q6_K: bits 2p, 2p + 1 of every byte of h moved to bits 4-5 (other bits: garbage, masked after).
template <int P>
inline __m256i q6_high(__m256i h) {
    if constexpr (P == 0) return _mm256_slli_epi16(h, 4);
    if constexpr (P == 1) return _mm256_slli_epi16(h, 2);
    if constexpr (P == 2) return h;
    return _mm256_srli_epi16(h, 2);
}

// Q6_K: step p's codes for one tile half: packed (4 low bits, two codes a byte) and the high bit
// pairs of h0 / h1 -> wl (inputs 0-15 of the unit's step) and wh (16-31), 6-bit unsigned.
template <int P>
__attribute__((always_inline)) inline void q6_codes(__m256i packed, __m256i h0, __m256i h1, __m256i& wl, __m256i& wh) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), hi2 = _mm256_set1_epi8(0x30);
    wl = _mm256_or_si256(_mm256_and_si256(packed, lo4), _mm256_and_si256(q6_high<P>(h0), hi2));
    wh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), lo4), _mm256_and_si256(q6_high<P>(h1), hi2));
}

// Q4_K / Q5_K: the sub-block scales of one tile half h (rows 8h .. 8h + 7), row lanes, one byte
// per sub-block: sc[0] sub-blocks 0-3, sc[1] 4-7.
__attribute__((always_inline)) inline void kq4_scales(const uint8_t* t, int h, __m256i (&sc)[2]) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), m6 = _mm256_set1_epi8(0x3F), top = _mm256_set1_epi8(0x30);
    const __m256i v0 = load32(t + 64 + 32 * h), v2 = load32(t + 192 + 32 * h);
    sc[0] = _mm256_and_si256(v0, m6);
    sc[1] = _mm256_or_si256(_mm256_and_si256(v2, lo4), _mm256_and_si256(_mm256_srli_epi32(v0, 2), top));
}

// Q4_K / Q5_K: the sub-block minimums of tile half h, the same way: mn[0] sub-blocks 0-3, mn[1] 4-7.
__attribute__((always_inline)) inline void kq4_mins(const uint8_t* t, int h, __m256i (&mn)[2]) {
    const __m256i lo4 = _mm256_set1_epi8(0x0F), m6 = _mm256_set1_epi8(0x3F), top = _mm256_set1_epi8(0x30);
    const __m256i v1 = load32(t + 128 + 32 * h), v2 = load32(t + 192 + 32 * h);
    mn[0] = _mm256_and_si256(v1, m6);
    mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(v2, 4), lo4), _mm256_and_si256(_mm256_srli_epi32(v1, 2), top));
}

// A 4-bit Q8_0 / Q4_0 / Q4_1 tile's step p (kernels_vnni.cpp layout: byte (p, j, i) holds input
// 4p + i of row j in its low nibble and input 4(p + 4) + i in its high nibble): rows 0-7 in w0l /
// w0h, rows 8-15 in w1l / w1h, low and high nibbles.
__attribute__((always_inline)) inline void q4_codes(const uint8_t* quants, int p, __m256i& w0l, __m256i& w0h, __m256i& w1l, __m256i& w1h) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const __m256i w0 = load32(quants + p * 64), w1 = load32(quants + p * 64 + 32);
    w0l = _mm256_and_si256(w0, mask);
    w0h = _mm256_and_si256(_mm256_srli_epi16(w0, 4), mask);
    w1l = _mm256_and_si256(w1, mask);
    w1h = _mm256_and_si256(_mm256_srli_epi16(w1, 4), mask);
}

// A K-quant product's activations (KqTable::quantize_rows' output) and inputs.
struct KqRows {
    const int8_t* xq;
    const float* dk;
    const int16_t* bs16;
    const int8_t* bsm;
    int64_t K;
};

// Outputs of tile group g (tiles wg) for activation rows [m, m + R) of a Q8_0 / Q4_0 / Q4_1
// product: per block, sums.template block<R, kind>(quants, m, b, s_lo, s_hi) gives each row's
// exact int32 sums (lanes: rows 0-7 in s_lo, 8-15 in s_hi), then each row's float steps in the
// twins' order (kernels_portable.cpp), in the lanes of its two accumulators.
template <int R, int kind, class Sums>
void group_rows(const Sums& sums, const float* dx, const int32_t* sx, const float* dxs, int64_t m, int64_t K,
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
        __m256i s_lo[R], s_hi[R];
        sums.template block<R, kind>(tile + H, m, b, s_lo, s_hi);
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

// Tile groups [g0, g1) of a Q8_0 / Q4_0 / Q4_1 weight w for all M rows, Pass rows a pass.
template <int Pass, int kind, class Sums>
void groups_of(const Sums& sums, const float* dx, const int32_t* sx, const float* dxs, int64_t M, int64_t K,
               const uint8_t* w, const float* bias, float* y, int64_t N, int64_t g0, int64_t g1) {
    const int64_t group_bytes = K / 32 * a8_tile_bytes(kind);
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* wg = w + g * group_bytes;
        in_passes<Pass>(M, [&](auto rc, int64_t m) {
            group_rows<decltype(rc)::value, kind>(sums, dx, sx, dxs, m, K, wg, bias, y, N, g);
        });
    }
}

}  // namespace avx2_tiles
}  // namespace
}  // namespace specdec
