// K-quant (Q4_K, Q5_K, Q6_K) 8-bit activation kernels for AVX2 CPUs without AVX-512 VNNI: the
// tiles of kquants.cpp, the activations of kernels_vnni.cpp's kq_quantize_rows, and the same
// results bit for bit as the VNNI kernels and kquants.cpp's scalar twins (arithmetic there).
// Compiled on its own with the AVX2 flags; only called after ops.cpp has checked the CPU.
//
// A tile's 64-byte vectors (lane j = row j) are read as two 32-byte halves: rows 0-7, rows 8-15.
// Integer sums per row and sub-block: vpmaddubsw (unsigned code x signed activation, pairs in
// int16, never saturating: at most 2 x 63 x 128 = 16,128), a few of those added in int16 while
// they cannot overflow (Q4_K: a sub-block's 8 pair sums, <= 30,720; Q5_K: 4, <= 31,744; Q6_K: 2,
// <= 32,256), then vpmaddwd by the sub-block's scale held in both int16 halves of the row's lane:
// scale x code sum in int32 in one instruction.  Integer sums are exact and wrap modulo 2^32 like
// vpdpbusd's, so their order is free; each output's float operations are the twins', in order.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "avx2_tiles.h"
#include "kernels.h"
#include "prefetch.h"

namespace specdec {
namespace {

using avx2_tiles::bcast4;
using avx2_tiles::bits_to_0x10;
using avx2_tiles::kq4_mins;
using avx2_tiles::kq4_scales;
using avx2_tiles::q6_codes;
using avx2_tiles::f16x8;
using avx2_tiles::load32;
using Rows = avx2_tiles::KqRows;

// ---- activations: kernels_vnni.cpp's kq_quantize_rows (and the scalar twin) on AVX2.

inline int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

void quantize_rows(const float* x, int64_t K, int8_t* xq, float* dk, int16_t* bs16, int8_t* bsm, int64_t m0,
                   int64_t m1) {
    const int64_t nb = K / kKqBlock;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t m = m0; m < m1; ++m) {
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + m * K + b * kKqBlock;
            __m256 a = _mm256_setzero_ps();
            for (int v = 0; v < 32; ++v) a = _mm256_max_ps(a, _mm256_and_ps(_mm256_loadu_ps(xb + 8 * v), abs_mask));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
            const float d = _mm_cvtss_f32(h) / 127.0f;
            const __m256 idv = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
            int8_t* dst = xq + m * K + b * kKqBlock;
            int16_t* s16 = bs16 + m * (K / 16) + b * 16;
            for (int v = 0; v < 8; ++v) {  // 32 inputs: two groups of 16
                __m256i q[4];
                for (int i = 0; i < 4; ++i)
                    q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 32 * v + 8 * i), idv));
                // saturating packs (the twins' clamp), then the lanes back in order
                const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
                const __m256i codes = _mm256_permutevar8x32_epi32(p, order);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * v), codes);
                const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(dst + 32 * v)));
                const __m256i w2 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(dst + 32 * v + 8)));
                const __m256i w3 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(dst + 32 * v + 16)));
                const __m256i w4 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(dst + 32 * v + 24)));
                s16[2 * v] = static_cast<int16_t>(hsum_epi32(_mm256_add_epi32(w, w2)));
                s16[2 * v + 1] = static_cast<int16_t>(hsum_epi32(_mm256_add_epi32(w3, w4)));
            }
            kq_split_pair_sums(s16, bsm + m * (K / 16) + b * 16);
            dk[m * nb + b] = d;
        }
    }
}

// ---- weights

// vpshufb control: byte s (0..3) of every 32-bit lane, zero-extended into both int16 halves.
inline __m256i byte_to_words(int s) {
    const uint32_t c = 0x80008000u | static_cast<uint32_t>(s) | (static_cast<uint32_t>(s) << 16);
    return _mm256_setr_epi32(c, c + 0x00040004, c + 0x00080008, c + 0x000C000C, c, c + 0x00040004,
                             c + 0x00080008, c + 0x000C000C);
}

// int8 values (8 rows) -> each in both int16 halves of its row's lane (sign-extended).
inline __m256i int8_to_words(const uint8_t* p) {
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}

// A tile group's 16 outputs for activation rows [m, m + R): acc[r][h] holds rows 8 h .. 8 h + 7,
// + bias when given.
template <int R>
inline void store_rows(const __m256 (&acc)[R][2], int64_t m, const float* bias, float* y, int64_t ldy) {
    for (int r = 0; r < R; ++r) {
        for (int h = 0; h < 2; ++h) {
            __m256 v = acc[r][h];
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + 8 * h));
            _mm256_storeu_ps(y + (m + r) * ldy + 8 * h, v);
        }
    }
}

// Q4_K / Q5_K: tile half h's float steps for rows [m, m + R) of block b, in the twins' order:
// acc[r][h] += S_r x dx x d, then -= mins_r x dx x dmin (S_r = S[r * stride]).
template <int R>
inline void kq4_half_out(const Rows& a, int64_t m, int64_t b, const uint8_t* t, int h, const __m256i* S,
                         int stride, __m256 (&acc)[R][2]) {
    const int64_t K = a.K, nb = K / kKqBlock;
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256i mn[2];
    kq4_mins(t, h, mn);
    const __m256i mlo = mn[0], mhi = mn[1];
    const __m256 d = f16x8(t + 16 * h), dmin = f16x8(t + 32 + 16 * h);
    for (int r = 0; r < R; ++r) {
        const int8_t* bs = a.bsm + (m + r) * (K / 16) + b * 16;  // 8 lo, then 8 hi
        // pair sums <= 2 x 2 x 63 x 127: no saturation, no int16 overflow
        const __m256i lo = _mm256_add_epi16(_mm256_maddubs_epi16(mlo, bcast4(bs)),
                                            _mm256_maddubs_epi16(mhi, bcast4(bs + 4)));
        const __m256i hi = _mm256_add_epi16(_mm256_maddubs_epi16(mlo, bcast4(bs + 8)),
                                            _mm256_maddubs_epi16(mhi, bcast4(bs + 12)));
        const __m256i mins = _mm256_add_epi32(_mm256_madd_epi16(lo, ones16),
                                              _mm256_slli_epi32(_mm256_madd_epi16(hi, ones16), 7));
        const __m256 dx = _mm256_set1_ps(a.dk[(m + r) * nb + b]);
        acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S[r * stride]), dx), d, acc[r][h]);
        acc[r][h] = _mm256_fnmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(mins), dx), dmin, acc[r][h]);
    }
}

// One 16-row tile group (wg, nb tiles) against activation rows [m, m + R): the tiles in block
// order (prefetched on the first pass), each summed one of four ways by format and row count (the
// branches below) into acc, then the outputs stored.
template <int FMT, int R>
void group_rows(const Rows& a, int64_t m, const uint8_t* wg, const float* bias, float* y, int64_t ldy) {
    constexpr int64_t TB = kq_tile_bytes(FMT);
    const int64_t K = a.K, nb = K / kKqBlock;
    const __m256i lo4 = _mm256_set1_epi8(0x0F);
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
#pragma GCC unroll 1
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* t = wg + b * TB;
        if (m == 0) prefetch_tile<TB>(t);  // NOTE: later passes find the tile cached
        if constexpr (FMT != QT_Q6_K && R <= 2) {
            // Q4_K / Q5_K, one and two rows: both halves of the tile at once (the fewest
            // instructions, and nothing spills).
            constexpr int kFlush = FMT == QT_Q5_K ? 2 : 4;  // p steps summed in int16
            __m256i sc[2][2];  // [half][sub-blocks 0-3, 4-7]
            kq4_scales(t, 0, sc[0]);
            kq4_scales(t, 1, sc[1]);
            __m256i S[R][2];
            for (int r = 0; r < R; ++r) S[r][0] = S[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
            for (int s = 0; s < 8; ++s) {
                const uint8_t* q = t + 256 + 256 * s;
                const __m256i ctrl = byte_to_words(s % 4);
                const __m256i sw0 = _mm256_shuffle_epi8(sc[0][s / 4], ctrl), sw1 = _mm256_shuffle_epi8(sc[1][s / 4], ctrl);
                __m256i p16[R][2];
                for (int r = 0; r < R; ++r) p16[r][0] = p16[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 4  // as GCC unrolled it alone in a function of its own (kFlush's test folds)
                for (int p = 0; p < 4; ++p) {
                    const __m256i w0 = load32(q + 64 * p), w1 = load32(q + 64 * p + 32);
                    __m256i w0l = _mm256_and_si256(w0, lo4), w0h = _mm256_and_si256(_mm256_srli_epi16(w0, 4), lo4);
                    __m256i w1l = _mm256_and_si256(w1, lo4), w1h = _mm256_and_si256(_mm256_srli_epi16(w1, 4), lo4);
                    if constexpr (FMT == QT_Q5_K) {
                        const uint8_t* hb = t + 2304 + 64 * s;
                        w0l = _mm256_or_si256(w0l, bits_to_0x10(hb + 8 * p));
                        w1l = _mm256_or_si256(w1l, bits_to_0x10(hb + 8 * p + 4));
                        w0h = _mm256_or_si256(w0h, bits_to_0x10(hb + 8 * (4 + p)));
                        w1h = _mm256_or_si256(w1h, bits_to_0x10(hb + 8 * (4 + p) + 4));
                    }
                    for (int r = 0; r < R; ++r) {
                        const int8_t* xs = a.xq + (m + r) * K + b * kKqBlock + 32 * s;
                        const __m256i xl = bcast4(xs + 4 * p), xh = bcast4(xs + 16 + 4 * p);
                        p16[r][0] = _mm256_add_epi16(p16[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(w0l, xl),
                                                                                 _mm256_maddubs_epi16(w0h, xh)));
                        p16[r][1] = _mm256_add_epi16(p16[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(w1l, xl),
                                                                                 _mm256_maddubs_epi16(w1h, xh)));
                    }
                    if ((p + 1) % kFlush == 0) {
                        for (int r = 0; r < R; ++r) {
                            S[r][0] = _mm256_add_epi32(S[r][0], _mm256_madd_epi16(p16[r][0], sw0));
                            S[r][1] = _mm256_add_epi32(S[r][1], _mm256_madd_epi16(p16[r][1], sw1));
                            p16[r][0] = p16[r][1] = _mm256_setzero_si256();
                        }
                    }
                }
            }
            kq4_half_out<R>(a, m, b, t, 0, &S[0][0], 2, acc);
            kq4_half_out<R>(a, m, b, t, 1, &S[0][1], 2, acc);
        } else if constexpr (FMT != QT_Q6_K) {
            // Q4_K / Q5_K, three rows and more: one half of the tile (8 rows) at a time and two p
            // steps at a time, each row's products summed as soon as they are made: with both halves
            // GCC kept every row's products of all four steps live and spilled them (one thread,
            // 8192 x 2048 Q4_K, M = 4-16, medians of 6 alternated rounds: 40-43.5 -> 59.5-60.5
            // GMAC/s); with one row this order was slower (45 -> 37 GMAC/s, the best rounds), with
            // two no faster.
#pragma GCC unroll 1
            for (int h = 0; h < 2; ++h) {  // rows 0-7, then 8-15
                __m256i sc[2];
                kq4_scales(t, h, sc);
                __m256i S[R];
                for (int r = 0; r < R; ++r) S[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
                for (int s = 0; s < 8; ++s) {
                    const uint8_t* q = t + 256 + 256 * s + 32 * h;
                    const __m256i sw = _mm256_shuffle_epi8(s < 4 ? sc[0] : sc[1], byte_to_words(s % 4));
                    // at most 4 pair sums per int16 (<= 31,744 for Q5_K, 15,360 for Q4_K)
                    for (int p = 0; p < 4; p += 2) {
                        const __m256i k0 = load32(q + 64 * p), k1 = load32(q + 64 * (p + 1));
                        __m256i wl0 = _mm256_and_si256(k0, lo4), wh0 = _mm256_and_si256(_mm256_srli_epi16(k0, 4), lo4);
                        __m256i wl1 = _mm256_and_si256(k1, lo4), wh1 = _mm256_and_si256(_mm256_srli_epi16(k1, 4), lo4);
                        if constexpr (FMT == QT_Q5_K) {
                            const uint8_t* hb = t + 2304 + 64 * s + 4 * h;
                            wl0 = _mm256_or_si256(wl0, bits_to_0x10(hb + 8 * p));
                            wl1 = _mm256_or_si256(wl1, bits_to_0x10(hb + 8 * (p + 1)));
                            wh0 = _mm256_or_si256(wh0, bits_to_0x10(hb + 8 * (4 + p)));
                            wh1 = _mm256_or_si256(wh1, bits_to_0x10(hb + 8 * (5 + p)));
                        }
                        for (int r = 0; r < R; ++r) {
                            const int8_t* xs = a.xq + (m + r) * K + b * kKqBlock + 32 * s + 4 * p;
                            const __m256i p16 = _mm256_add_epi16(
                                _mm256_add_epi16(_mm256_maddubs_epi16(wl0, bcast4(xs)), _mm256_maddubs_epi16(wh0, bcast4(xs + 16))),
                                _mm256_add_epi16(_mm256_maddubs_epi16(wl1, bcast4(xs + 4)),
                                                 _mm256_maddubs_epi16(wh1, bcast4(xs + 20))));
                            S[r] = _mm256_add_epi32(S[r], _mm256_madd_epi16(p16, sw));
                        }
                    }
                }
                kq4_half_out<R>(a, m, b, t, h, S, 1, acc);
            }
        } else if constexpr (R == 1) {
            // Q6_K, one row: S = sum_s sc_s * (u_s . x_s) - 32 * sum_s sc_s * bs16_s (the twins' sum,
            // regrouped), both halves of the tile at once (the fewest instructions).
            __m256i S[R][2], C[R][2];
            for (int r = 0; r < R; ++r) S[r][0] = S[r][1] = C[r][0] = C[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
            for (int u = 0; u < 8; ++u) {
                const uint8_t* unit = t + 288 + 384 * u;
                for (int h = 0; h < 2; ++h) {  // rows 0-7, then 8-15
                    const __m256i h0 = load32(unit + 256 + 32 * h), h1 = load32(unit + 320 + 32 * h);
                    const __m256i sa = int8_to_words(t + 32 + 16 * (2 * u) + 8 * h);
                    const __m256i sb = int8_to_words(t + 32 + 16 * (2 * u + 1) + 8 * h);
                    __m256i pa[R], pb[R];
                    for (int r = 0; r < R; ++r) pa[r] = pb[r] = _mm256_setzero_si256();
                    auto step = [&](auto pc) {
                        constexpr int p = decltype(pc)::value;
                        __m256i wl, wh;
                        q6_codes<p>(load32(unit + 64 * p + 32 * h), h0, h1, wl, wh);
                        for (int r = 0; r < R; ++r) {
                            const int8_t* xs = a.xq + (m + r) * K + b * kKqBlock + 32 * u;
                            pa[r] = _mm256_add_epi16(pa[r], _mm256_maddubs_epi16(wl, bcast4(xs + 4 * p)));
                            pb[r] = _mm256_add_epi16(pb[r], _mm256_maddubs_epi16(wh, bcast4(xs + 16 + 4 * p)));
                        }
                        if constexpr (p % 2 == 1) {  // two pair sums per int16 at most (<= 32,256)
                            for (int r = 0; r < R; ++r) {
                                S[r][h] = _mm256_add_epi32(S[r][h], _mm256_add_epi32(_mm256_madd_epi16(pa[r], sa),
                                                                                     _mm256_madd_epi16(pb[r], sb)));
                                pa[r] = pb[r] = _mm256_setzero_si256();
                            }
                        }
                    };
                    step(std::integral_constant<int, 0>());
                    step(std::integral_constant<int, 1>());
                    step(std::integral_constant<int, 2>());
                    step(std::integral_constant<int, 3>());
                    for (int r = 0; r < R; ++r) {
                        const int16_t* bs = a.bs16 + (m + r) * (K / 16) + b * 16 + 2 * u;
                        const __m256i ba = _mm256_set1_epi32(static_cast<uint16_t>(bs[0]));  // (bs, 0)
                        const __m256i bb = _mm256_set1_epi32(static_cast<uint16_t>(bs[1]));
                        C[r][h] = _mm256_add_epi32(C[r][h], _mm256_add_epi32(_mm256_madd_epi16(sa, ba),
                                                                             _mm256_madd_epi16(sb, bb)));
                    }
                }
            }
            for (int h = 0; h < 2; ++h) {
                const __m256 d = f16x8(t + 16 * h);
                for (int r = 0; r < R; ++r) {
                    const __m256i s = _mm256_sub_epi32(S[r][h], _mm256_slli_epi32(C[r][h], 5));
                    const __m256 dx = _mm256_set1_ps(a.dk[(m + r) * nb + b]);
                    acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s), dx), d, acc[r][h]);
                }
            }
        } else {
            // Q6_K, two rows and more: the second sum taken into S as it goes, two sub-blocks a
            // vpmaddwd (every integer sum is exact modulo 2^32, so the order is free), one half of
            // the tile (8 rows) at a time, two p steps at a time with each row's products summed at
            // once. The branch for one row keeps 4R accumulators and all rows' products live and GCC
            // spilled them (one thread, 8192 x 2048 Q6_K, M = 4-16, medians of 4 alternated rounds:
            // 26-32 -> 32-38.5 GMAC/s).
#pragma GCC unroll 1
            for (int h = 0; h < 2; ++h) {  // rows 0-7, then 8-15
                __m256i S[R];
                for (int r = 0; r < R; ++r) S[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
                for (int u = 0; u < 8; ++u) {
                    const uint8_t* unit = t + 288 + 384 * u;
                    const __m256i h0 = load32(unit + 256 + 32 * h), h1 = load32(unit + 320 + 32 * h);
                    const uint8_t* sc = t + 32 + 16 * (2 * u) + 8 * h;
                    const __m256i sa = int8_to_words(sc);
                    const __m256i sb = int8_to_words(sc + 16);
                    // (sc_2u, sc_2u+1) x 32 in the int16 halves of each row's lane (|value| <= 4,096)
                    const __m256i sab32 = _mm256_slli_epi16(
                        _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)),
                                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 16)))),
                        5);
                    // Two p steps at a time: their four weight vectors, then each row's whole sum
                    // (its products die at once: GCC kept every row's products of all four steps
                    // live and spilled them to the stack).
                    auto pair = [&](auto pc) {
                        constexpr int p = decltype(pc)::value;
                        __m256i wl0, wh0, wl1, wh1;
                        q6_codes<p>(load32(unit + 64 * p + 32 * h), h0, h1, wl0, wh0);
                        q6_codes<p + 1>(load32(unit + 64 * (p + 1) + 32 * h), h0, h1, wl1, wh1);
                        for (int r = 0; r < R; ++r) {
                            const int8_t* xs = a.xq + (m + r) * K + b * kKqBlock + 32 * u + 4 * p;
                            // two pair sums per int16 at most (<= 32,256)
                            const __m256i pa = _mm256_add_epi16(_mm256_maddubs_epi16(wl0, bcast4(xs)),
                                                                _mm256_maddubs_epi16(wl1, bcast4(xs + 4)));
                            const __m256i pb = _mm256_add_epi16(_mm256_maddubs_epi16(wh0, bcast4(xs + 16)),
                                                                _mm256_maddubs_epi16(wh1, bcast4(xs + 20)));
                            S[r] = _mm256_add_epi32(S[r], _mm256_add_epi32(_mm256_madd_epi16(pa, sa), _mm256_madd_epi16(pb, sb)));
                        }
                    };
                    pair(std::integral_constant<int, 0>());
                    pair(std::integral_constant<int, 2>());
                    for (int r = 0; r < R; ++r)  // bs16 of sub-blocks 2u, 2u + 1: adjacent int16s
                        S[r] = _mm256_sub_epi32(S[r], _mm256_madd_epi16(sab32, bcast4(a.bs16 + (m + r) * (K / 16) + b * 16 + 2 * u)));
                }
                const __m256 d = f16x8(t + 16 * h);
                for (int r = 0; r < R; ++r) {
                    const __m256 dx = _mm256_set1_ps(a.dk[(m + r) * nb + b]);
                    acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S[r]), dx), d, acc[r][h]);
                }
            }
        }
    }
    store_rows<R>(acc, m, bias, y, ldy);
}

// Activation rows go through a tile group kRowsPerPass at a time, the rest in one pass (a row's
// result never depends on which rows share its pass: every lane's arithmetic is its own). Eight:
// a verification step of 8 rows decodes each tile once (one thread, Q4_K, M = 8, the quiet
// rounds: 71-77 GMAC/s against 44-70 with passes of 6 + 2; 2-core AVX2 EPYC, 2026-11-28).
constexpr int64_t kRowsPerPass = 8;

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
            case 7: group_rows<FMT, 7>(a, m, wg, bg, yg, ldy); break;
            case 6: group_rows<FMT, 6>(a, m, wg, bg, yg, ldy); break;
            case 5: group_rows<FMT, 5>(a, m, wg, bg, yg, ldy); break;
            case 4: group_rows<FMT, 4>(a, m, wg, bg, yg, ldy); break;
            case 3: group_rows<FMT, 3>(a, m, wg, bg, yg, ldy); break;
            case 2: group_rows<FMT, 2>(a, m, wg, bg, yg, ldy); break;
            case 1: group_rows<FMT, 1>(a, m, wg, bg, yg, ldy); break;
            default: break;
        }
    }
}

void linear_groups(int fmt, const int8_t* xq, const float* dk, const int16_t* bs16, const int8_t* bsm, int64_t M,
                   int64_t K, const uint8_t* w, const float* bias, float* y, int64_t ldy, int64_t g0, int64_t g1) {
    const Rows a{xq, dk, bs16, bsm, K};
    switch (fmt) {
        case QT_Q4_K: groups_of<QT_Q4_K>(a, M, w, bias, y, ldy, g0, g1); break;
        case QT_Q5_K: groups_of<QT_Q5_K>(a, M, w, bias, y, ldy, g0, g1); break;
        case QT_Q6_K: groups_of<QT_Q6_K>(a, M, w, bias, y, ldy, g0, g1); break;
        default: break;
    }
}

}  // namespace

// NOTE: float activations take the scalar twin (portable_kq_table): exact but slow; on AVX2
// the loader keeps K-quants only when 8-bit activations run (kernels/__init__.py).
const KqTable* avx2_kq_table() {
    static const KqTable table = {quantize_rows, linear_groups, portable_kq_table()->linear_groups_f32};
    return &table;
}

}  // namespace specdec
