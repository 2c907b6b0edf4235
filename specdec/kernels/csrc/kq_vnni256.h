// K-quant (Q4_K, Q5_K, Q6_K) 8-bit activation kernels on 256-bit VNNI: kernels_avx2_kq.cpp's
// tiles, activations and float steps, with each sub-block's code sums taken by vpdpbusd into
// int32 and multiplied by the sub-block's scale (vpmulld) instead of vpmaddubsw pair sums added
// in int16 and multiplied by vpmaddwd.  Integer sums are exact (and wrap modulo 2^32 alike), so
// the results are those of the AVX2, VNNI and scalar kernels, bit for bit (arithmetic:
// kernels.h, K-quants).
//
// Included after a8_vnni256.h by its two units, with the same SPECDEC_V256_DPBUSD, and
// SPECDEC_V256_KQ_TABLE (the table's accessor, declared in kernels.h).
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "avx2_tiles.h"
#include "kernels.h"
#include "prefetch.h"

namespace specdec {
namespace {
namespace kq256 {

using avx2_tiles::bcast4;
using avx2_tiles::bits_to_0x10;
using avx2_tiles::kq4_mins;
using avx2_tiles::kq4_scales;
using avx2_tiles::q6_codes;
using avx2_tiles::f16x8;
using avx2_tiles::load32;
using Rows = avx2_tiles::KqRows;

// vpshufb control: byte s (0..3) of every 32-bit lane, zero-extended into the lane.
inline __m256i byte_to_dword(int s) {
    const uint32_t c = 0x80808000u | static_cast<uint32_t>(s);
    return _mm256_setr_epi32(c, c + 4, c + 8, c + 12, c, c + 4, c + 8, c + 12);
}

// NOTE: kq4_half and q6_half are always inlined: otherwise what else the unit holds decided
// whether GCC inlined them (Q4_K, one thread, 6144 x 2048, 8 rows: 1.13-1.19 ms inlined,
// 1.25-1.89 not).

// Q4_K / Q5_K, tile half h (rows 8h .. 8h + 7) of tile t (block b) against rows [m, m + R):
// S_r = sum_s sc_s * (u_s . x_s), mins_r = sum_s min_s * bs32_s, then the twins' float steps.
template <int FMT, int R>
__attribute__((always_inline)) inline void kq4_half(const Rows& a, int64_t m, int64_t b, const uint8_t* t, int h, __m256 (&acc)[R][2]) {
    const int64_t K = a.K, nb = K / kKqBlock;
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    __m256i sc[2];
    kq4_scales(t, h, sc);
    __m256i S[R];
    for (int r = 0; r < R; ++r) S[r] = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {
        const uint8_t* q = t + 256 + 256 * s + 32 * h;
        __m256i si[R];
        for (int r = 0; r < R; ++r) si[r] = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
            const __m256i k = load32(q + 64 * p);
            __m256i wl = _mm256_and_si256(k, lo4), wh = _mm256_and_si256(_mm256_srli_epi16(k, 4), lo4);
            if constexpr (FMT == QT_Q5_K) {
                const uint8_t* hb = t + 2304 + 64 * s + 4 * h;
                wl = _mm256_or_si256(wl, bits_to_0x10(hb + 8 * p));
                wh = _mm256_or_si256(wh, bits_to_0x10(hb + 8 * (4 + p)));
            }
            for (int r = 0; r < R; ++r) {
                const int8_t* xs = a.xq + (m + r) * K + b * kKqBlock + 32 * s + 4 * p;
                si[r] = SPECDEC_V256_DPBUSD(si[r], wl, bcast4(xs));
                si[r] = SPECDEC_V256_DPBUSD(si[r], wh, bcast4(xs + 16));
            }
        }
        const __m256i scs = _mm256_shuffle_epi8(sc[s / 4], byte_to_dword(s % 4));
        for (int r = 0; r < R; ++r) S[r] = _mm256_add_epi32(S[r], _mm256_mullo_epi32(si[r], scs));
    }
    __m256i mn[2];
    kq4_mins(t, h, mn);
    const __m256i mlo = mn[0], mhi = mn[1];
    const __m256 d = f16x8(t + 16 * h), dmin = f16x8(t + 32 + 16 * h);
    for (int r = 0; r < R; ++r) {
        const int8_t* bs = a.bsm + (m + r) * (K / 16) + b * 16;  // 8 lo, then 8 hi
        __m256i lo = SPECDEC_V256_DPBUSD(_mm256_setzero_si256(), mlo, bcast4(bs));
        lo = SPECDEC_V256_DPBUSD(lo, mhi, bcast4(bs + 4));
        __m256i hi = SPECDEC_V256_DPBUSD(_mm256_setzero_si256(), mlo, bcast4(bs + 8));
        hi = SPECDEC_V256_DPBUSD(hi, mhi, bcast4(bs + 12));
        const __m256i mins = _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 7));
        const __m256 dx = _mm256_set1_ps(a.dk[(m + r) * nb + b]);
        acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S[r]), dx), d, acc[r][h]);
        acc[r][h] = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(mins), dx), dmin, acc[r][h]);
    }
}

// Q6_K, tile half h of tile t (block b) against rows [m, m + R): S_r = sum_s sc_s * (u_s . x_s)
// - 32 * sum_s sc_s * bs16_s (the twins' sum, regrouped), then the twins' float step.
template <int R>
__attribute__((always_inline)) inline void q6_half(const Rows& a, int64_t m, int64_t b, const uint8_t* t, int h, __m256 (&acc)[R][2]) {
    const int64_t K = a.K, nb = K / kKqBlock;
    __m256i S[R];
    for (int r = 0; r < R; ++r) S[r] = _mm256_setzero_si256();
    for (int u = 0; u < 8; ++u) {
        const uint8_t* unit = t + 288 + 384 * u;
        const __m256i h0 = load32(unit + 256 + 32 * h), h1 = load32(unit + 320 + 32 * h);
        const uint8_t* sc = t + 32 + 16 * (2 * u) + 8 * h;
        __m256i sa[R], sb[R];
        for (int r = 0; r < R; ++r) sa[r] = sb[r] = _mm256_setzero_si256();
        auto step = [&](auto pc) {
            constexpr int p = decltype(pc)::value;
            __m256i wl, wh;
            q6_codes<p>(load32(unit + 64 * p + 32 * h), h0, h1, wl, wh);
            for (int r = 0; r < R; ++r) {
                const int8_t* xs = a.xq + (m + r) * K + b * kKqBlock + 32 * u + 4 * p;
                sa[r] = SPECDEC_V256_DPBUSD(sa[r], wl, bcast4(xs));
                sb[r] = SPECDEC_V256_DPBUSD(sb[r], wh, bcast4(xs + 16));
            }
        };
        step(std::integral_constant<int, 0>());
        step(std::integral_constant<int, 1>());
        step(std::integral_constant<int, 2>());
        step(std::integral_constant<int, 3>());
        const __m256i sca = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
        const __m256i scb = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16)));
        // (sc_2u, sc_2u+1) x 32 in the int16 halves of each row's lane (|value| <= 4,096), against
        // bs16 of sub-blocks 2u, 2u + 1 (adjacent int16s)
        const __m256i sab32 = _mm256_slli_epi16(
            _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)),
                                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16)))),
            5);
        for (int r = 0; r < R; ++r) {
            S[r] = _mm256_add_epi32(S[r], _mm256_add_epi32(_mm256_mullo_epi32(sa[r], sca), _mm256_mullo_epi32(sb[r], scb)));
            S[r] = _mm256_sub_epi32(S[r], _mm256_madd_epi16(sab32, bcast4(a.bs16 + (m + r) * (K / 16) + b * 16 + 2 * u)));
        }
    }
    const __m256 d = f16x8(t + 16 * h);
    for (int r = 0; r < R; ++r) {
        const __m256 dx = _mm256_set1_ps(a.dk[(m + r) * nb + b]);
        acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S[r]), dx), d, acc[r][h]);
    }
}

// One 16-row tile group (wg, nb tiles) against activation rows [m, m + R), the tiles in block
// order (prefetched on the first pass), one half (8 rows) at a time.
template <int FMT, int R>
void group_rows(const Rows& a, int64_t m, const uint8_t* wg, const float* bias, float* y, int64_t ldy) {
    constexpr int64_t TB = kq_tile_bytes(FMT);
    const int64_t nb = a.K / kKqBlock;
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 1
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* t = wg + b * TB;
        if (m == 0) prefetch_tile<TB>(t);  // NOTE: later passes find the tile cached
#pragma GCC unroll 1
        for (int h = 0; h < 2; ++h) {
            if constexpr (FMT == QT_Q6_K) q6_half<R>(a, m, b, t, h, acc);
            else kq4_half<FMT, R>(a, m, b, t, h, acc);
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int h = 0; h < 2; ++h) {
            __m256 v = acc[r][h];
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
            _mm256_storeu_ps(y + (m + r) * ldy + 8 * h, v);
        }
    }
}

// Activation rows go through a tile group four at a time (a row's result never depends on which
// rows share its pass: every lane's arithmetic is its own); 16 vector registers.
constexpr int64_t kRowsPerPass = 4;

// NOTE: its own pass loop, not avx2_tiles.h in_passes: called through that loop's lambda, GCC
// compiled these passes 1.5x slower (Q4_K, 8 rows: 1.04-1.11 -> 1.68-1.75 ms; one thread,
// 6144 x 2048, 2-core Zen 4 EPYC).
template <int FMT>
void groups_of(const Rows& a, int64_t M, const uint8_t* w, const float* bias, float* y, int64_t ldy, int64_t g0,
               int64_t g1) {
    const int64_t gs = a.K / kKqBlock * kq_tile_bytes(FMT);
    for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* wg = w + g * gs;
        const float* bg = bias ? bias + g * kKqTileRows : nullptr;
        float* yg = y + g * kKqTileRows;
        int64_t m = 0;
        for (; m + kRowsPerPass <= M; m += kRowsPerPass) group_rows<FMT, kRowsPerPass>(a, m, wg, bg, yg, ldy);
        switch (M - m) {
            case 3: group_rows<FMT, 3>(a, m, wg, bg, yg, ldy); break;
            case 2: group_rows<FMT, 2>(a, m, wg, bg, yg, ldy); break;
            case 1: group_rows<FMT, 1>(a, m, wg, bg, yg, ldy); break;
            default: break;
        }
    }
}

// Q4_K / Q5_K calls of this many rows or fewer take the AVX2 kernels (the same results): their
// one- and two-row passes read both halves of a tile at once, and their int16 pair sums cost
// less than a vpmulld per sub-block until four rows share it (one thread, 6144 x 2048, cold,
// 2-core Zen 4 EPYC running the EVEX form: Q4_K 1 / 3 / 8 / 16 rows 0.36-0.46 / 0.61-1.13 /
// 1.12-1.16 / 2.01-2.27 ms here against 0.33-0.42 / 0.55-0.56 / 1.44-1.45 / 2.48-2.50; Q5_K
// 3 / 8 / 16 rows 1.45-1.51 / 2.12-2.20 / 3.28-3.36 against 1.02-1.07 / 2.20-2.25 / 3.54-3.57;
// Q6_K here from one row: 0.73-0.77 against 0.95-0.96 ms at one row, 2.85-2.90 against
// 3.31-3.34 at 16).
constexpr int64_t kAvx2MaxRows = 3;

void linear_groups(int fmt, const int8_t* xq, const float* dk, const int16_t* bs16, const int8_t* bsm, int64_t M,
                   int64_t K, const uint8_t* w, const float* bias, float* y, int64_t ldy, int64_t g0, int64_t g1) {
    if (fmt != QT_Q6_K && M <= kAvx2MaxRows) {
        avx2_kq_table()->linear_groups(fmt, xq, dk, bs16, bsm, M, K, w, bias, y, ldy, g0, g1);
        return;
    }
    const Rows a{xq, dk, bs16, bsm, K};
    switch (fmt) {
        case QT_Q4_K: groups_of<QT_Q4_K>(a, M, w, bias, y, ldy, g0, g1); break;
        case QT_Q5_K: groups_of<QT_Q5_K>(a, M, w, bias, y, ldy, g0, g1); break;
        case QT_Q6_K: groups_of<QT_Q6_K>(a, M, w, bias, y, ldy, g0, g1); break;
        default: break;
    }
}

}  // namespace kq256
}  // namespace

// The activations and the float-activation entry are the AVX2 table's (the same codes).
const KqTable* SPECDEC_V256_KQ_TABLE() {
    static const KqTable table = {avx2_kq_table()->quantize_rows, kq256::linear_groups,
                                  avx2_kq_table()->linear_groups_f32};
    return &table;
}

}  // namespace specdec
