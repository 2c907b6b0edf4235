// 8-bit activation kernels (AVX-512 VNNI): the activation rows are quantized to int8 per block of
// 32 (as llama.cpp's q8 activations), and each weight block's integer dot product runs on
// vpdpbusd (64 multiply-adds per instruction, 4x what a 16-lane float FMA does).  Compiled on its
// own with the AVX-512 flags plus -mavx512vnni; only called after ops.cpp has checked the CPU.
//
// Weights are repacked once at load time (repack_a8 in ops.cpp) into tiles of 16 output rows x 32
// inputs, lane j of every vector holding output row j, so a tile's 16 results accumulate in one
// float vector with no horizontal sums:
//   [16 x f16 d][16 x f16 m, Q4_1 only][quants]  (a8_head_bytes: 32 or 64 bytes before the quants)
//   quants, 4-bit formats: 4 x 64 bytes; byte (p, j, i) holds input 4p+i of row j in its low
//     nibble and input 4(p+4)+i in its high nibble.
//   quants, 8-bit formats: 8 x 64 bytes; byte (t, j, i) holds input 4t+i of row j.
// Weight values are unsigned codes u with w = d * u + m (Q4_1) or w = d * (u - o) (Q4_0: o = 8,
// u the nibble; Q8_0: o = 128, u = q + 128).
//
// Arithmetic per output (row m, column n), the same for every batch size, tile and thread:
//   for each block b in order:  s = sum_i u_i * xq_i (exact int32)
//     offset formats: s -= o * sum_i xq_i (exact);  acc = fma(float(s) * dx_b, d, acc)
//     Q4_1:                                         acc = fma(float(s) * dx_b, d, acc);
//                                                   acc = fma(m, dx_b * sum_i xq_i, acc)
//   then + bias.  Integer sums are exact, so the two vpdpbusd chains below may be added in any
//   order; every float operation is in a fixed order per output.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "kernels.h"
#include "vnni.h"

namespace specdec {
namespace {

// One block of 32 activations xb -> 32 int8 codes at dst, its scale d = amax / 127 and the sum s
// of the codes.
inline void quantize_block(const float* xb, int8_t* dst, float* d_out, int32_t* s_out) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const __m512 a = _mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign));
    const float amax = _mm512_reduce_max_ps(a);
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512 idv = _mm512_set1_ps(id);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, idv));  // round to nearest even
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, idv));
    const __m128i c0 = _mm512_cvtsepi32_epi8(q0), c1 = _mm512_cvtsepi32_epi8(q1);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), c0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), c1);
    // The sum of the stored (saturated) codes.
    const __m512i s0 = _mm512_cvtepi8_epi32(c0), s1 = _mm512_cvtepi8_epi32(c1);
    *d_out = d;
    *s_out = _mm512_reduce_add_epi32(_mm512_add_epi32(s0, s1));
}

// The tree's steps for float and integer lanes (the same shuffles).
template <int IMM> inline __m512 shuf4(__m512 a, __m512 b) { return _mm512_shuffle_f32x4(a, b, IMM); }
template <int IMM> inline __m512i shuf4(__m512i a, __m512i b) { return _mm512_shuffle_i32x4(a, b, IMM); }
inline __m512 unpack_lo(__m512 a, __m512 b) { return _mm512_unpacklo_ps(a, b); }
inline __m512i unpack_lo(__m512i a, __m512i b) { return _mm512_unpacklo_epi32(a, b); }
inline __m512 unpack_hi(__m512 a, __m512 b) { return _mm512_unpackhi_ps(a, b); }
inline __m512i unpack_hi(__m512i a, __m512i b) { return _mm512_unpackhi_epi32(a, b); }

// Lane i of the result = op over the 16 lanes of v[i] (a transposing tree of shuffles: 15
// operations for 16 vectors where one horizontal reduction each takes 4 and a dependent chain).
template <typename V, typename Op>
inline V reduce16(const V* v, Op op) {
    V w[8], y[4], z[2];
    for (int i = 0; i < 8; ++i) w[i] = op(shuf4<0x44>(v[i], v[i + 8]), shuf4<0xEE>(v[i], v[i + 8]));
    for (int i = 0; i < 4; ++i) y[i] = op(shuf4<0x88>(w[i], w[i + 4]), shuf4<0xDD>(w[i], w[i + 4]));
    for (int i = 0; i < 2; ++i) z[i] = op(unpack_lo(y[i], y[i + 2]), unpack_hi(y[i], y[i + 2]));
    const V r = op(unpack_lo(z[0], z[1]), unpack_hi(z[0], z[1]));  // 128-bit lanes: rows 0-3, 8-11, 4-7, 12-15
    return shuf4<0xD8>(r, r);
}

// quantize_block for n <= 16 blocks at once (block i at xb + i * ldx), block i's codes at
// dst + 32 * i * os and its d, d * s and -offset * s at d_out / ds_out / os_out [i * os]: the same
// values as quantize_block's for finite inputs (max and the integer sums are exact in any order;
// the divisions, the test d != 0 and the products are the same IEEE operations in vector lanes).
inline void quantize_blocks16(const float* xb, int64_t ldx, int64_t n, int32_t offset, int8_t* dst, float* d_out,
                              float* ds_out, int32_t* os_out, int64_t os = 1) {
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 a[16];
    for (int i = 0; i < 16; ++i)
        a[i] = i < n ? _mm512_max_ps(_mm512_and_ps(_mm512_loadu_ps(xb + i * ldx), sign),
                                     _mm512_and_ps(_mm512_loadu_ps(xb + i * ldx + 16), sign))
                     : _mm512_setzero_ps();
    const __m512 d = _mm512_div_ps(reduce16(a, [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); }),
                                   _mm512_set1_ps(127.0f));
    const __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ),
                                          _mm512_set1_ps(1.0f), d);
    alignas(64) float ids[16];
    _mm512_store_ps(ids, id);
    __m512i sums[16];
    for (int i = 0; i < 16; ++i) {
        if (i >= n) {
            sums[i] = _mm512_setzero_si512();
            continue;
        }
        const __m512 idv = _mm512_set1_ps(ids[i]);
        const __m128i c0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i * ldx), idv)));
        const __m128i c1 =
            _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i * ldx + 16), idv)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * i * os), c0);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32 * i * os + 16), c1);
        sums[i] = _mm512_add_epi32(_mm512_cvtepi8_epi32(c0), _mm512_cvtepi8_epi32(c1));
    }
    const __m512i sv = reduce16(sums, [](__m512i x, __m512i y) { return _mm512_add_epi32(x, y); });
    const __m512 ds = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sv));
    const __m512i osv = _mm512_mullo_epi32(sv, _mm512_set1_epi32(-offset));
    if (os == 1) {
        const __mmask16 m = n >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << n) - 1u);
        _mm512_mask_storeu_ps(d_out, m, d);
        _mm512_mask_storeu_ps(ds_out, m, ds);
        _mm512_mask_storeu_epi32(os_out, m, osv);
        return;
    }
    alignas(64) float dv[16], dsv[16];
    alignas(64) int32_t ov[16];
    _mm512_store_ps(dv, d);
    _mm512_store_ps(dsv, ds);
    _mm512_store_si512(ov, osv);
    for (int64_t i = 0; i < n; ++i) {
        d_out[i * os] = dv[i];
        ds_out[i * os] = dsv[i];
        os_out[i * os] = ov[i];
    }
}

// Activation quantization: rows [m0, m1) of x [M, K] -> xq int8 [M, K], per block of 32: dx (the
// scale amax / 127), sx (sum of the int8 codes) and dxs = dx * sx.
void quantize_rows(const float* x, int64_t K, int8_t* xq, float* dx, int32_t* sx, float* dxs,
                   int64_t m0, int64_t m1) {
    const int64_t nb = K / 32;
    for (int64_t m = m0; m < m1; ++m) {
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t i = m * nb + b;
            quantize_block(x + m * K + b * 32, xq + m * K + b * 32, &dx[i], &sx[i]);
            dxs[i] = dx[i] * static_cast<float>(sx[i]);
        }
    }
}

// The 4 bytes at p broadcast to every 32-bit lane.
inline __m512i bcast4(const void* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// A 32-bit value broadcast from memory into a register: a load-port operation only (for the
// chains' start values; a zeroing idiom the compiler would turn into register copies).
inline __m512i bcast_load(const int32_t* p) {
    __m512i v;
    __asm__("vpbroadcastd %1, %0" : "=v"(v) : "m"(*p));
    return v;
}
alignas(64) const int32_t kZero32 = 0;

// Every activation row m and group g: lo[g][m] += wlo[g] . (the 4 int8 at x + m * ldx) and
// hi[g][m] += whi[g] . (the 4 at x + m * ldx + 16), exact int32 (vpdpbusd); each activation quad
// is broadcast once and feeds all NG groups.  lo and hi may be the same sums.
template <int NG, int MR>
inline void dpbusd_rows(__m512i (&lo)[NG][MR], __m512i (&hi)[NG][MR], const __m512i (&wlo)[NG],
                        const __m512i (&whi)[NG], const int8_t* x, int64_t ldx) {
    for (int m = 0; m < MR; ++m) {
        const __m512i xlo = bcast4(x + m * ldx), xhi = bcast4(x + m * ldx + 16);
        for (int g = 0; g < NG; ++g) {
            lo[g][m] = _mm512_dpbusd_epi32(lo[g][m], wlo[g], xlo);
            hi[g][m] = _mm512_dpbusd_epi32(hi[g][m], whi[g], xhi);
        }
    }
}

// NG consecutive 16-row weight groups (their tiles nb * TB bytes apart) against MR activation
// rows, all K blocks.  Each broadcast activation quad feeds NG vpdpbusd.
template <int KIND, int NG, int MR>
inline void group_tile(const int8_t* xq, const float* dx, const int32_t* sx, const float* dxs,
                       int64_t K, const uint8_t* tiles, const float* bias, float* y, int64_t ldy) {
    const int64_t nb = K / 32;
    constexpr int64_t TB = a8_tile_bytes(KIND), H = a8_head_bytes(KIND);
    constexpr int32_t kOffset = KIND == A8_Q8 ? 128 : KIND == A8_Q4_0 ? 8 : 0;
    constexpr bool kStart = KIND == A8_Q4_0;  // sx holds -o * sum(xq) instead of sum(xq)
    const int64_t gstride = nb * TB;
    __m512 acc[NG][MR];
    for (int g = 0; g < NG; ++g)
        for (int m = 0; m < MR; ++m) acc[g][m] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        // Q4_0: each sum starts at -o * sum(xq) (sx holds that, kStart), so no correction follows
        // (exact integers; measured 5-10% faster for 2-4 rows, slower for the other formats).
        __m512i s[NG][MR];
        for (int g = 0; g < NG; ++g)
            for (int m = 0; m < MR; ++m)
                s[g][m] = kStart ? _mm512_set1_epi32(sx[m * nb + b]) : _mm512_setzero_si512();
        for (int g = 0; g < NG; ++g) {
            const char* pf = reinterpret_cast<const char*>(tiles + g * gstride + (b + 4) * TB);
            for (int64_t o = 0; o < TB; o += 64) _mm_prefetch(pf + o, _MM_HINT_T0);
        }
        // Weights of every group first, then each activation quad is broadcast once and feeds
        // all NG groups (a broadcast is a load: one per vpdpbusd before).
        if (KIND == A8_Q8) {
            for (int t = 0; t < 8; ++t) {
                __m512i w[NG];
                for (int g = 0; g < NG; ++g)
                    w[g] = _mm512_loadu_si512(tiles + g * gstride + b * TB + H + 64 * t);
                for (int m = 0; m < MR; ++m) {
                    const __m512i xv = bcast4(xq + m * K + b * 32 + 4 * t);
                    for (int g = 0; g < NG; ++g) s[g][m] = _mm512_dpbusd_epi32(s[g][m], w[g], xv);
                }
            }
        } else {
            for (int p = 0; p < 4; ++p) {
                __m512i wlo[NG], whi[NG];
                for (int g = 0; g < NG; ++g) {
                    const __m512i packed = _mm512_loadu_si512(tiles + g * gstride + b * TB + H + 64 * p);
                    wlo[g] = _mm512_and_si512(packed, lo4);
                    whi[g] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), lo4);
                }
                dpbusd_rows<NG, MR>(s, s, wlo, whi, xq + b * 32 + 4 * p, K);
            }
        }
        for (int g = 0; g < NG; ++g) {
            const uint8_t* t = tiles + g * gstride + b * TB;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
            __m512 mv = _mm512_setzero_ps();
            if (KIND == A8_Q4_1)
                mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
            for (int m = 0; m < MR; ++m) {
                const int64_t mb = m * nb + b;
                __m512i si = s[g][m];
                if (kOffset && !kStart) si = _mm512_sub_epi32(si, _mm512_set1_epi32(kOffset * sx[mb]));
                const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(si), _mm512_set1_ps(dx[mb]));
                acc[g][m] = _mm512_fmadd_ps(f, d, acc[g][m]);
                if (KIND == A8_Q4_1) acc[g][m] = _mm512_fmadd_ps(mv, _mm512_set1_ps(dxs[mb]), acc[g][m]);
            }
        }
    }
    for (int g = 0; g < NG; ++g) {
        const __m512 bv = bias ? _mm512_loadu_ps(bias + g * kA8TileRows) : _mm512_setzero_ps();
        for (int m = 0; m < MR; ++m) {
            const __m512 r = bias ? _mm512_add_ps(acc[g][m], bv) : acc[g][m];
            _mm512_storeu_ps(y + m * ldy + g * kA8TileRows, r);
        }
    }
}

// One group width NG over all M rows, MR rows at a time (the remainder with smaller tiles).
template <int KIND, int NG, int MR>
void rows_for_groups(const int8_t* xq, const float* dx, const int32_t* sx, const float* dxs,
                     int64_t M, int64_t K, const uint8_t* tiles, const float* bias, float* y,
                     int64_t N) {
    const int64_t nb = K / 32;
    int64_t m0 = 0;
    for (; m0 + MR <= M; m0 += MR)
        group_tile<KIND, NG, MR>(xq + m0 * K, dx + m0 * nb, sx + m0 * nb, dxs + m0 * nb, K, tiles,
                                 bias, y + m0 * N, N);
    const int64_t r = M - m0;
    const int8_t* xm = xq + m0 * K;
    const float* dxm = dx + m0 * nb;
    const int32_t* sxm = sx + m0 * nb;
    const float* dxsm = dxs + m0 * nb;
    float* ym = y + m0 * N;
    static_assert(MR <= 4, "remainders up to 3 rows");
    switch (r) {
        case 1: group_tile<KIND, NG, 1>(xm, dxm, sxm, dxsm, K, tiles, bias, ym, N); break;
        case 2: group_tile<KIND, NG, 2>(xm, dxm, sxm, dxsm, K, tiles, bias, ym, N); break;
        case 3: group_tile<KIND, NG, 3>(xm, dxm, sxm, dxsm, K, tiles, bias, ym, N); break;
        default: break;
    }
}

// Several activation rows: one 16-row group at a time, weight-stationary.  Each 32-block's
// weights are unpacked once into 8 registers (inputs 4t..4t+3 of the 16 rows in vector t), then
// every row of the tile runs through them: its offset-corrected start value and its quads come
// from memory as broadcasts (load ports, not vector ALU), so per row and block the vector ALU
// does the 8 vpdpbusd and the float rescale only (3 operations, 4 for Q4_1).  Same arithmetic
// as group_tile: s starts at -o * sum(xq) and the integer sum is exact.
constexpr int kWsMaxRows = 16;
// Fewer rows than this take group_tile (two groups x up to 4 rows per pass): measured faster
// there, where the weight unpack is shared by few rows either way.
constexpr int64_t kWsMinRows = 5;
// Up to this many rows, pairs of groups go through ws2_tile (two weight streams).
constexpr int64_t kWs2MaxRows = 8;


// Blocks [b, b + BB) of MR rows against one 16-row group: each (block, row) sum runs as CH
// vpdpbusd chains (chain c takes the quads q with q % CH == c... see below), BB * MR * CH of
// them side by side so the two vpdpbusd ports never wait on one chain's latency.  The blocks'
// rescales then follow in block order, so every row's float operations are the same sequence
// whatever BB, CH or MR.
template <int KIND, int MR, int BB, int CH, bool kRegAcc>
inline void ws_blocks(int64_t b, const int8_t* xt, const float* dxt, const int32_t* osxt,
                      const float* dxst, const uint8_t* tiles, __m512* racc, float* macc) {
    constexpr int64_t TB = a8_tile_bytes(KIND), H = a8_head_bytes(KIND);
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < BB; ++k) {
        const char* pf = reinterpret_cast<const char*>(tiles + (b + k + 4) * TB);
        for (int64_t o = 0; o < TB; o += 64) _mm_prefetch(pf + o, _MM_HINT_T0);
    }
    __m512i si[BB][CH][MR];
#pragma GCC unroll 16
    for (int k = 0; k < BB; ++k)
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
            si[k][0][r] = bcast_load(KIND == A8_Q4_1 ? &kZero32 : osxt + (b + k) * MR + r);
            for (int c = 1; c < CH; ++c) si[k][c][r] = bcast_load(&kZero32);
        }
    // Step p: quads p (inputs 4p..4p+3, low nibbles) and p + 4 (inputs 16 + 4p.., high nibbles)
    // of every row; the weights are unpacked just before use.  CH = 2: low and high halves in
    // separate chains.
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
#pragma GCC unroll 8
        for (int k = 0; k < BB; ++k) {
            const uint8_t* t = tiles + (b + k) * TB;
            __m512i wl, wh;
            if (KIND == A8_Q8) {
                wl = _mm512_loadu_si512(t + H + 64 * p);
                wh = _mm512_loadu_si512(t + H + 64 * (p + 4));
            } else {
                const __m512i packed = _mm512_loadu_si512(t + H + 64 * p);
                wl = _mm512_and_si512(packed, lo4);
                wh = _mm512_and_si512(_mm512_srli_epi16(packed, 4), lo4);
            }
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r) {
                const int8_t* xb = xt + ((b + k) * MR + r) * 32;
                si[k][0][r] = dpbusd_bcast(si[k][0][r], wl, xb + 4 * p);
                si[k][CH - 1][r] = dpbusd_bcast(si[k][CH - 1][r], wh, xb + 16 + 4 * p);
            }
        }
    }
#pragma GCC unroll 8
    for (int k = 0; k < BB; ++k) {
        const uint8_t* t = tiles + (b + k) * TB;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
        __m512 mv = _mm512_setzero_ps();
        if (KIND == A8_Q4_1) mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
            __m512i sr = si[k][0][r];
            if (CH == 2) sr = _mm512_add_epi32(sr, si[k][CH - 1][r]);
            const int64_t mb = (b + k) * MR + r;
            const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(dxt[mb]));
            __m512 a = kRegAcc ? racc[r] : _mm512_load_ps(macc + 16 * r);
            a = _mm512_fmadd_ps(f, d, a);
            if (KIND == A8_Q4_1) a = _mm512_fmadd_ps(mv, _mm512_set1_ps(dxst[mb]), a);
            if (kRegAcc) racc[r] = a;
            else _mm512_store_ps(macc + 16 * r, a);
        }
    }
}

// MR activation rows (block-major here, ws_pack: block b holds xt[b][r][32], dxt / osxt /
// dxst[b][r]) against one 16-row group, weight-stationary: each weight vector is unpacked once
// and feeds all MR rows; a row's quads, start value and scales come from memory as broadcasts
// (load ports), so per row and block the vector ALU does 8 vpdpbusd and the rescale (3
// operations, 4 for Q4_1, + 1 when CH = 2).  Same arithmetic as group_tile.
// STATIONARY (kernels.h A8_WALK_STATIONARY): up to 9 rows a block at a time as two chains a row.
template <int KIND, int MR, bool STATIONARY>
inline void ws_tile(const int8_t* xt, const float* dxt, const int32_t* osxt, const float* dxst, int64_t nb,
                    const uint8_t* tiles, const float* bias, float* y, int64_t ldy) {
    // Independent chains: 10-16 rows x 1 block; 5-9 rows x 2 blocks (10-18 chains) in the groups
    // walk, 1-9 rows x 1 block x 2 chains (2-18) in the stationary one.
    constexpr int BB = MR >= 10 || STATIONARY ? 1 : 2;
    constexpr int CH = STATIONARY && MR <= 9 ? 2 : 1;
    constexpr bool kRegAcc = MR <= 8;
    __m512 racc[kRegAcc ? MR : 1];
    alignas(64) float macc[kRegAcc ? 16 : MR * 16];
    for (int m = 0; m < (kRegAcc ? MR : 0); ++m) racc[m] = _mm512_setzero_ps();
    for (int m = 0; m < (kRegAcc ? 0 : MR); ++m) _mm512_store_ps(macc + 16 * m, _mm512_setzero_ps());
    int64_t b = 0;
    for (; b + BB <= nb; b += BB) ws_blocks<KIND, MR, BB, CH, kRegAcc>(b, xt, dxt, osxt, dxst, tiles, racc, macc);
    for (; b < nb; ++b) ws_blocks<KIND, MR, 1, 2, kRegAcc>(b, xt, dxt, osxt, dxst, tiles, racc, macc);
    const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
        const __m512 a = kRegAcc ? racc[kRegAcc ? m : 0] : _mm512_load_ps(macc + 16 * m);
        _mm512_storeu_ps(y + m * ldy, bias ? _mm512_add_ps(a, bv) : a);
    }
}

// 5-8 rows: two 16-row groups at once, one block at a time.  Each activation quad is broadcast
// into a register once for both groups (half the loads of ws_tile) and the two groups' tiles
// are two weight streams.  Slower than ws_tile on cache-resident weights (47-52% of the roof at
// 8 rows against 52-62%), faster when they stream from memory as in a forward pass (26-29%
// against 22-27% at 6-8 rows, weights of 8192 x 2048, benchmarks/gemm_roof.cpp's arithmetic
// on 40 copies); from 9 rows on ws_tile is faster either way.  Accumulators in L1; the same
// arithmetic as group_tile.
template <int KIND, int MR>
inline void ws2_tile(const int8_t* xt, const float* dxt, const int32_t* osxt, const float* dxst, int64_t nb,
                     const uint8_t* tiles, int64_t gstride, const float* bias, float* y, int64_t ldy) {
    constexpr int64_t TB = a8_tile_bytes(KIND), H = a8_head_bytes(KIND);
    constexpr int NG = 2;
    alignas(64) float macc[NG * MR * 16];
    for (int i = 0; i < NG * MR; ++i) _mm512_store_ps(macc + 16 * i, _mm512_setzero_ps());
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        for (int g = 0; g < NG; ++g) {
            const char* pf = reinterpret_cast<const char*>(tiles + g * gstride + (b + 4) * TB);
            for (int64_t o = 0; o < TB; o += 64) _mm_prefetch(pf + o, _MM_HINT_T0);
        }
        __m512i si[NG][MR];
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
            const __m512i s0 = bcast_load(KIND == A8_Q4_1 ? &kZero32 : osxt + b * MR + r);
            for (int g = 0; g < NG; ++g) si[g][r] = s0;
        }
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
            __m512i wl[NG], wh[NG];
            for (int g = 0; g < NG; ++g) {
                const uint8_t* t = tiles + g * gstride + b * TB;
                if (KIND == A8_Q8) {
                    wl[g] = _mm512_loadu_si512(t + H + 64 * p);
                    wh[g] = _mm512_loadu_si512(t + H + 64 * (p + 4));
                } else {
                    const __m512i packed = _mm512_loadu_si512(t + H + 64 * p);
                    wl[g] = _mm512_and_si512(packed, lo4);
                    wh[g] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), lo4);
                }
            }
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r) {
                const int8_t* xb = xt + (b * MR + r) * 32;
                const __m512i xl = bcast_load(reinterpret_cast<const int32_t*>(xb + 4 * p));
                const __m512i xh = bcast_load(reinterpret_cast<const int32_t*>(xb + 16 + 4 * p));
                for (int g = 0; g < NG; ++g) {
                    si[g][r] = _mm512_dpbusd_epi32(si[g][r], wl[g], xl);
                    si[g][r] = _mm512_dpbusd_epi32(si[g][r], wh[g], xh);
                }
            }
        }
        for (int g = 0; g < NG; ++g) {
            const uint8_t* t = tiles + g * gstride + b * TB;
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
            __m512 mv = _mm512_setzero_ps();
            if (KIND == A8_Q4_1) mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
#pragma GCC unroll 16
            for (int r = 0; r < MR; ++r) {
                const int64_t mb = b * MR + r;
                const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(si[g][r]), _mm512_set1_ps(dxt[mb]));
                float* ap = macc + 16 * (g * MR + r);
                __m512 a = _mm512_fmadd_ps(f, d, _mm512_load_ps(ap));
                if (KIND == A8_Q4_1) a = _mm512_fmadd_ps(mv, _mm512_set1_ps(dxst[mb]), a);
                _mm512_store_ps(ap, a);
            }
        }
    }
    for (int g = 0; g < NG; ++g) {
        const __m512 bv = bias ? _mm512_loadu_ps(bias + 16 * g) : _mm512_setzero_ps();
        for (int r = 0; r < MR; ++r) {
            const __m512 a = _mm512_load_ps(macc + 16 * (g * MR + r));
            _mm512_storeu_ps(y + r * ldy + 16 * g, bias ? _mm512_add_ps(a, bv) : a);
        }
    }
}

template <int KIND, bool STATIONARY, int MR = STATIONARY ? 1 : kWsMinRows>
inline void ws_rows(int64_t rows, const int8_t* xt, const float* dxt, const int32_t* osxt,
                    const float* dxst, int64_t nb, const uint8_t* tiles, const float* bias, float* y,
                    int64_t ldy) {
    if constexpr (MR < kWsMaxRows) {
        if (rows > MR) {
            ws_rows<KIND, STATIONARY, MR + 1>(rows, xt, dxt, osxt, dxst, nb, tiles, bias, y, ldy);
            return;
        }
    }
    ws_tile<KIND, MR, STATIONARY>(xt, dxt, osxt, dxst, nb, tiles, bias, y, ldy);
}

// The activations of several rows laid out for ws_tile / ws2_tile: row tiles of at most
// kWsMaxRows rows, as even as possible (17 rows: 9 + 8), each block-major (per block of 32, the
// tile's rows one after another), with the offset-corrected start values -o * sum(xq).  Built once
// per product in the calling thread's storage (ws_alloc) by the tasks that quantize the rows
// (quantize_layout) and read by every task of the product.
struct WsLayout {
    const int8_t* xt;
    const float* dxt;
    const int32_t* osxt;
    const float* dxst;
};

inline int64_t ws_row_tiles(int64_t M) { return (M + kWsMaxRows - 1) / kWsMaxRows; }

// The layout's storage for M rows of K inputs: the calling thread's, until its next call.
const WsLayout* ws_alloc(int64_t M, int64_t K) {
    thread_local std::vector<int8_t> xt_buf;
    thread_local std::vector<float> dxt_buf, dxst_buf;
    thread_local std::vector<int32_t> osxt_buf;
    thread_local WsLayout lay;
    const int64_t nb = K / 32;
    if (static_cast<int64_t>(xt_buf.size()) < M * K) xt_buf.resize(static_cast<size_t>(M * K));
    if (static_cast<int64_t>(dxt_buf.size()) < M * nb) {
        dxt_buf.resize(static_cast<size_t>(M * nb));
        dxst_buf.resize(static_cast<size_t>(M * nb));
        osxt_buf.resize(static_cast<size_t>(M * nb));
    }
    lay = {xt_buf.data(), dxt_buf.data(), osxt_buf.data(), dxst_buf.data()};
    return &lay;
}

// Offset-corrected start values take -offset * sum(xq) (ws_tile's kStart).
constexpr int32_t ws_offset(int kind) { return kind == A8_Q8 ? 128 : kind == A8_Q4_0 ? 8 : 0; }

template <int KIND>
void groups_rows(const int8_t* xq, const float* dx, const int32_t* sx, const float* dxs, int64_t M,
                 int64_t K, const uint8_t* w, const float* bias, float* y, int64_t N, int64_t g0,
                 int64_t g1, const void* prep) {
    constexpr int64_t TB = a8_tile_bytes(KIND);
    const int64_t nb = K / 32;
    int64_t g = g0;
    constexpr int32_t kOffset = KIND == A8_Q8 ? 128 : KIND == A8_Q4_0 ? 8 : 0;
    const bool stationary = a8_walk() == A8_WALK_STATIONARY;
    if (!stationary && M < kWsMinRows) {
        // Few rows (decode, short drafts): two groups per pass share each activation broadcast,
        // and the weights stream from memory at M = 1.
        // Q4_0's kernels take -8 * sum(xq) in place of sum(xq) (group_tile's kStart).
        int32_t osx_small[(kWsMinRows - 1) * 64];
        thread_local std::vector<int32_t> osx_buf;
        const int32_t* osx = sx;
        if (KIND == A8_Q4_0) {
            int32_t* o = osx_small;
            if (M * nb > static_cast<int64_t>(sizeof(osx_small) / sizeof(int32_t))) {
                if (static_cast<int64_t>(osx_buf.size()) < M * nb) osx_buf.resize(static_cast<size_t>(M * nb));
                o = osx_buf.data();
            }
            for (int64_t i = 0; i < M * nb; ++i) o[i] = -kOffset * sx[i];
            osx = o;
        }
        for (; g + 2 <= g1; g += 2)
            rows_for_groups<KIND, 2, 4>(xq, dx, osx, dxs, M, K, w + g * nb * TB,
                                        bias ? bias + g * kA8TileRows : nullptr, y + g * kA8TileRows, N);
        if (g < g1)
            rows_for_groups<KIND, 1, 4>(xq, dx, osx, dxs, M, K, w + g * nb * TB,
                                        bias ? bias + g * kA8TileRows : nullptr, y + g * kA8TileRows, N);
        return;
    }
    const WsLayout* lay = static_cast<const WsLayout*>(prep);  // layout_alloc's, never null here
    const int64_t ntiles = ws_row_tiles(M);
    if (!stationary && M <= kWs2MaxRows) {  // one row tile (ntiles == 1): pairs of groups through ws2_tile
        const int8_t* xt = lay->xt;
        const float *dxt = lay->dxt, *dxst = lay->dxst;
        const int32_t* osxt = lay->osxt;
        for (; g + 2 <= g1; g += 2) {
            const uint8_t* tiles = w + g * nb * TB;
            const float* bg = bias ? bias + g * kA8TileRows : nullptr;
            float* yg = y + g * kA8TileRows;
            switch (M) {
                case 5: ws2_tile<KIND, 5>(xt, dxt, osxt, dxst, nb, tiles, nb * TB, bg, yg, N); break;
                case 6: ws2_tile<KIND, 6>(xt, dxt, osxt, dxst, nb, tiles, nb * TB, bg, yg, N); break;
                case 7: ws2_tile<KIND, 7>(xt, dxt, osxt, dxst, nb, tiles, nb * TB, bg, yg, N); break;
                default: ws2_tile<KIND, 8>(xt, dxt, osxt, dxst, nb, tiles, nb * TB, bg, yg, N); break;
            }
        }
    }
    for (; g < g1; ++g) {
        const uint8_t* tiles = w + g * nb * TB;
        const float* bg = bias ? bias + g * kA8TileRows : nullptr;
        int64_t m0 = 0;
        for (int64_t i = 0; i < ntiles; ++i) {
            const int64_t rows = (M - m0) / (ntiles - i);
            if (stationary)
                ws_rows<KIND, true>(rows, lay->xt + m0 * K, lay->dxt + m0 * nb, lay->osxt + m0 * nb,
                                    lay->dxst + m0 * nb, nb, tiles, bg, y + m0 * N + g * kA8TileRows, N);
            else
                ws_rows<KIND, false>(rows, lay->xt + m0 * K, lay->dxt + m0 * nb, lay->osxt + m0 * nb,
                                     lay->dxst + m0 * nb, nb, tiles, bg, y + m0 * N + g * kA8TileRows, N);
            m0 += rows;
        }
    }
}

void linear_a8_groups(int kind, const int8_t* xq, const float* dx, const int32_t* sx,
                      const float* dxs, int64_t M, int64_t K, const uint8_t* w, const float* bias,
                      float* y, int64_t N, int64_t g0, int64_t g1, const void* prep) {
    switch (kind) {
        case A8_Q4_0: groups_rows<A8_Q4_0>(xq, dx, sx, dxs, M, K, w, bias, y, N, g0, g1, prep); break;
        case A8_Q4_1: groups_rows<A8_Q4_1>(xq, dx, sx, dxs, M, K, w, bias, y, N, g0, g1, prep); break;
        case A8_Q8: groups_rows<A8_Q8>(xq, dx, sx, dxs, M, K, w, bias, y, N, g0, g1, prep); break;
        default: break;
    }
}

// A8Table::layout_alloc / quantize_layout: the block-major layout (WsLayout), once per product
// (null below kWsMinRows rows in the groups walk, where no layout is used).  linear_groups reads
// only the layout then, so the rows are quantized straight into it, block by block in each row
// tile's order (quantize_block: quantize_rows' codes and scales).
const void* layout_alloc(int /*kind*/, int64_t M, int64_t K) {
    return a8_walk() == A8_WALK_GROUPS && M < kWsMinRows ? nullptr : ws_alloc(M, K);
}

// From this many rows in a tile's share, quantize_layout takes 16 rows of a block at a time.
constexpr int64_t kQuantizeRowsAcross = 8;

void quantize_layout(const void* layout, int kind, const float* x, int64_t K, int64_t M, int64_t m0, int64_t m1,
                     int8_t* /*xq*/, float* /*dx*/, int32_t* /*sx*/, float* /*dxs*/) {
    const WsLayout* lay = static_cast<const WsLayout*>(layout);
    int8_t* xt = const_cast<int8_t*>(lay->xt);
    float* dxt = const_cast<float*>(lay->dxt);
    float* dxst = const_cast<float*>(lay->dxst);
    int32_t* osxt = const_cast<int32_t*>(lay->osxt);
    const int32_t offset = ws_offset(kind);
    const int64_t nb = K / 32, ntiles = ws_row_tiles(M);
    for (int64_t i = 0, t0 = 0; i < ntiles && t0 < m1; ++i) {
        const int64_t rows = (M - t0) / (ntiles - i);
        const int64_t lo = std::max(m0, t0), hi = std::min(m1, t0 + rows);
        // block-major in its row tile (rows [lo, hi) of block b one after another): 16 rows of a
        // block at a time, or for a few rows 16 blocks of a row (rows apart in the layout)
        if (hi - lo >= kQuantizeRowsAcross) {
            for (int64_t b = 0; b < nb; ++b)
                for (int64_t m = lo; m < hi; m += 16) {
                    const int64_t dst = t0 * nb + b * rows + (m - t0);
                    quantize_blocks16(x + m * K + b * 32, K, std::min<int64_t>(16, hi - m), offset, xt + dst * 32,
                                      &dxt[dst], &dxst[dst], &osxt[dst]);
                }
        } else {
            for (int64_t m = lo; m < hi; ++m)
                for (int64_t b = 0; b < nb; b += 16) {
                    const int64_t dst = t0 * nb + b * rows + (m - t0);
                    quantize_blocks16(x + m * K + b * 32, 32, std::min<int64_t>(16, nb - b), offset, xt + dst * 32,
                                      &dxt[dst], &dxst[dst], &osxt[dst], rows);
                }
        }
        t0 += rows;
    }
}

// ---------------------------------------------------------------------------------------------
// K-quants (tiles of kquants.cpp).  Activations are quantized per block of 256 (Q8_K-like): codes
// xq, scale dk, code sums per 16 (bs16) and per 32 (bs32 = 128 * hi + lo, kernels.h).  Per output
// and block of 256, exactly:
//   Q4_K / Q5_K:  S = sum_s sc_s * (sum_i u_i * xq_i)  over the 8 sub-blocks of 32   (int32)
//                 mins = sum_s min_s * bs32_s  (as 128 * sum min * hi + sum min * lo) (int32)
//                 acc = fma(float(S) * dk, d, acc);  acc = fma(-(float(mins) * dk), dmin, acc)
//   Q6_K:         S = sum_s sc_s * (sum_i u_i * xq_i - 32 * bs16_s)  over 16 sub-blocks of 16
//                 acc = fma(float(S) * dk, d, acc)
// then + bias.  |S| < 2^28, so no integer sum overflows; the integer parts may be added in any
// order and every float operation is in a fixed order per output, whatever M, tile or thread.

void kq_quantize_rows(const float* x, int64_t K, int8_t* xq, float* dk, int16_t* bs16, int8_t* bsm,
                      int64_t m0, int64_t m1) {
    const int64_t nb = K / kKqBlock;
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t m = m0; m < m1; ++m) {
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + m * K + b * kKqBlock;
            __m512 a = _mm512_setzero_ps();
            for (int v = 0; v < 16; ++v) a = _mm512_max_ps(a, _mm512_and_ps(_mm512_loadu_ps(xb + 16 * v), sign));
            const float amax = _mm512_reduce_max_ps(a);
            const float d = amax / 127.0f;
            const __m512 idv = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
            int8_t* dst = xq + m * K + b * kKqBlock;
            int16_t* s16 = bs16 + m * (K / 16) + b * 16;
            for (int v = 0; v < 16; ++v) {
                const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * v), idv));
                const __m128i q8 = _mm512_cvtsepi32_epi8(q);  // saturated, as stored
                _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * v), q8);
                s16[v] = static_cast<int16_t>(_mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(q8)));
            }
            kq_split_pair_sums(s16, bsm + m * (K / 16) + b * 16);
            dk[m * nb + b] = d;
        }
    }
}

inline __mmask64 load_mask64(const uint8_t* p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return _cvtu64_mask64(v);
}

// Prefetch the eighth `part` (0..7) of a tile.
template <int64_t TB>
inline void prefetch_eighth(const uint8_t* tile, int part) {
    constexpr int64_t kSpan = (TB / 8 + 63) / 64 * 64;
    for (int64_t o = part * kSpan; o < (part + 1) * kSpan; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(tile + o), _MM_HINT_T0);
}

constexpr int64_t kKqPrefetchTiles = 2;

// Byte s of every 32-bit lane, zero-extended (vpshufb control, per 128-bit lane).
inline __m512i byte_of_lanes(int s) {
    const uint32_t c = 0x80808000u | static_cast<uint32_t>(s);
    return _mm512_set_epi32(c + 12, c + 8, c + 4, c, c + 12, c + 8, c + 4, c, c + 12, c + 8, c + 4, c, c + 12,
                            c + 8, c + 4, c);
}

// The 6-bit scales (sc) or minimums (mn) of sub-blocks 0-3 (lo) and 4-7 (hi) from a tile's three
// scale vectors, one byte per sub-block in each row's lane (gguf.quants.Q4_K.get_scale_min).
struct Q4kScales {
    __m512i lo, hi;
};
inline Q4kScales q4k_scales(const uint8_t* t) {
    const __m512i v0 = _mm512_loadu_si512(t + 64), v2 = _mm512_loadu_si512(t + 192);
    const __m512i top = _mm512_and_si512(_mm512_srli_epi32(v0, 2), _mm512_set1_epi8(0x30));
    return {_mm512_and_si512(v0, _mm512_set1_epi8(0x3F)),
            _mm512_ternarylogic_epi32(v2, _mm512_set1_epi8(0x0F), top, 0xEA)};  // (v2 & 0F) | top
}
inline Q4kScales q4k_mins(const uint8_t* t) {
    const __m512i v1 = _mm512_loadu_si512(t + 128), v2 = _mm512_loadu_si512(t + 192);
    const __m512i top = _mm512_and_si512(_mm512_srli_epi32(v1, 2), _mm512_set1_epi8(0x30));
    return {_mm512_and_si512(v1, _mm512_set1_epi8(0x3F)),
            _mm512_ternarylogic_epi32(_mm512_srli_epi32(v2, 4), _mm512_set1_epi8(0x0F), top, 0xEA)};
}

// Bits 2p, 2p + 1 of every byte of h moved to bits 4-5 (other bits: garbage, masked by the caller).
template <int P>
inline __m512i q6_high(__m512i h) {
    if (P == 0) return _mm512_slli_epi16(h, 4);
    if (P == 1) return _mm512_slli_epi16(h, 2);
    if (P == 2) return h;
    return _mm512_srli_epi16(h, 2);
}

// NG consecutive 16-row groups of a K-quant part against MR activation rows (the arithmetic above).
template <int FMT, int NG, int MR>
inline void kq_tile(const int8_t* xq, const float* dk, const int16_t* bs16, const int8_t* bsm,
                    int64_t K, const uint8_t* tiles, const float* bias, float* y, int64_t ldy) {
    constexpr int64_t TB = kq_tile_bytes(FMT);
    const int64_t nb = K / kKqBlock, gs = nb * TB;
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    __m512 acc[NG][MR];
    for (int g = 0; g < NG; ++g)
        for (int m = 0; m < MR; ++m) acc[g][m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const int8_t* xb = xq + b * kKqBlock;
        __m512i S[NG][MR];
        if constexpr (FMT != QT_Q6_K) {  // Q4_K / Q5_K
            const __m512i b16 = _mm512_set1_epi8(0x10);
            Q4kScales sc[NG];
            for (int g = 0; g < NG; ++g) {
                sc[g] = q4k_scales(tiles + g * gs + b * TB);
                for (int m = 0; m < MR; ++m) S[g][m] = _mm512_setzero_si512();
            }
            for (int s = 0; s < 8; ++s) {
                __m512i si[NG][MR];
                for (int g = 0; g < NG; ++g) {
                    prefetch_eighth<TB>(tiles + g * gs + (b + kKqPrefetchTiles) * TB, s);
                    for (int m = 0; m < MR; ++m) si[g][m] = _mm512_setzero_si512();
                }
                for (int p = 0; p < 4; ++p) {
                    __m512i wlo[NG], whi[NG];
                    for (int g = 0; g < NG; ++g) {
                        const uint8_t* t = tiles + g * gs + b * TB;
                        const __m512i packed = _mm512_loadu_si512(t + 256 + 256 * s + 64 * p);
                        wlo[g] = _mm512_and_si512(packed, lo4);
                        whi[g] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), lo4);
                        if (FMT == QT_Q5_K) {
                            const uint8_t* h = t + 2304 + 64 * s;
                            wlo[g] = _mm512_mask_add_epi8(wlo[g], load_mask64(h + 8 * p), wlo[g], b16);
                            whi[g] = _mm512_mask_add_epi8(whi[g], load_mask64(h + 8 * (4 + p)), whi[g], b16);
                        }
                    }
                    dpbusd_rows<NG, MR>(si, si, wlo, whi, xb + 32 * s + 4 * p, K);
                }
                for (int g = 0; g < NG; ++g) {
                    const __m512i scs = _mm512_shuffle_epi8(s < 4 ? sc[g].lo : sc[g].hi, byte_of_lanes(s % 4));
                    for (int m = 0; m < MR; ++m) S[g][m] = _mm512_add_epi32(S[g][m], _mm512_mullo_epi32(si[g][m], scs));
                }
            }
            for (int g = 0; g < NG; ++g) {
                const uint8_t* t = tiles + g * gs + b * TB;
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
                const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
                const Q4kScales mn = q4k_mins(t);
                for (int m = 0; m < MR; ++m) {
                    const int8_t* bs = bsm + m * (K / 16) + b * 16;  // 8 lo, then 8 hi
                    __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), mn.lo, bcast4(bs));
                    lo = _mm512_dpbusd_epi32(lo, mn.hi, bcast4(bs + 4));
                    __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), mn.lo, bcast4(bs + 8));
                    hi = _mm512_dpbusd_epi32(hi, mn.hi, bcast4(bs + 12));
                    const __m512i mins = _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 7));
                    const __m512 dx = _mm512_set1_ps(dk[m * nb + b]);
                    acc[g][m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(S[g][m]), dx), d, acc[g][m]);
                    acc[g][m] = _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(mins), dx), dmin, acc[g][m]);
                }
            }
        } else {
            const __m512i hi2 = _mm512_set1_epi8(0x30);
            for (int g = 0; g < NG; ++g)
                for (int m = 0; m < MR; ++m) S[g][m] = _mm512_setzero_si512();
            for (int u = 0; u < 8; ++u) {
                __m512i sa[NG][MR], sb[NG][MR], h0[NG], h1[NG];
                for (int g = 0; g < NG; ++g) {
                    const uint8_t* unit = tiles + g * gs + b * TB + 288 + 384 * u;
                    prefetch_eighth<TB>(tiles + g * gs + (b + kKqPrefetchTiles) * TB, u);
                    h0[g] = _mm512_loadu_si512(unit + 256);
                    h1[g] = _mm512_loadu_si512(unit + 320);
                    for (int m = 0; m < MR; ++m) sa[g][m] = sb[g][m] = _mm512_setzero_si512();
                }
                auto step = [&](auto pc) {
                    constexpr int p = decltype(pc)::value;
                    __m512i wlo[NG], whi[NG];
                    for (int g = 0; g < NG; ++g) {
                        const __m512i packed = _mm512_loadu_si512(tiles + g * gs + b * TB + 288 + 384 * u + 64 * p);
                        // (a & 0x0F) | (h & 0x30): two ternary-logic steps
                        const __m512i hl = _mm512_and_si512(q6_high<p>(h0[g]), hi2);
                        const __m512i hh = _mm512_and_si512(q6_high<p>(h1[g]), hi2);
                        wlo[g] = _mm512_ternarylogic_epi32(packed, lo4, hl, 0xEA);
                        whi[g] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(packed, 4), lo4, hh, 0xEA);
                    }
                    dpbusd_rows<NG, MR>(sa, sb, wlo, whi, xb + 32 * u + 4 * p, K);
                };
                step(std::integral_constant<int, 0>());
                step(std::integral_constant<int, 1>());
                step(std::integral_constant<int, 2>());
                step(std::integral_constant<int, 3>());
                for (int g = 0; g < NG; ++g) {
                    const uint8_t* sc = tiles + g * gs + b * TB + 32 + 16 * 2 * u;
                    const __m512i sca = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
                    const __m512i scb = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16)));
                    for (int m = 0; m < MR; ++m) {
                        const int16_t* bs = bs16 + m * (K / 16) + b * 16 + 2 * u;
                        const __m512i a = _mm512_sub_epi32(sa[g][m], _mm512_set1_epi32(32 * bs[0]));
                        const __m512i c = _mm512_sub_epi32(sb[g][m], _mm512_set1_epi32(32 * bs[1]));
                        S[g][m] = _mm512_add_epi32(S[g][m], _mm512_mullo_epi32(a, sca));
                        S[g][m] = _mm512_add_epi32(S[g][m], _mm512_mullo_epi32(c, scb));
                    }
                }
            }
            for (int g = 0; g < NG; ++g) {
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tiles + g * gs + b * TB)));
                for (int m = 0; m < MR; ++m) {
                    const __m512 dx = _mm512_set1_ps(dk[m * nb + b]);
                    acc[g][m] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(S[g][m]), dx), d, acc[g][m]);
                }
            }
        }
    }
    for (int g = 0; g < NG; ++g) {
        const __m512 bv = bias ? _mm512_loadu_ps(bias + g * kKqTileRows) : _mm512_setzero_ps();
        for (int m = 0; m < MR; ++m)
            _mm512_storeu_ps(y + m * ldy + g * kKqTileRows, bias ? _mm512_add_ps(acc[g][m], bv) : acc[g][m]);
    }
}

// NG groups against all M rows: 8 rows at a time, and 5-7 rows left in one pass (each unpacked
// weight vector feeds up to 16 vpdpbusd; Q6_K's four vectors a row then spill, and still win),
// then 4 at a time, then the remainder in one pass.  Qwen3-1.7B's 6144 x 2048 at 8 rows: Q4_K
// 0.28-0.31 against 0.34 ms as two passes of 4, Q6_K 0.48 against 0.55 (6 rows 0.39 against
// 0.45), benchmarks/kquant_linear.py; a verification step on the 1.7B Q4_K_M shape 1.18x (6 rows)
// and 1.26x (8 rows) faster, benchmarks/trees_ab.py.
template <int FMT, int NG>
void kq_rows(const int8_t* xq, const float* dk, const int16_t* bs16, const int8_t* bsm, int64_t M,
             int64_t K, const uint8_t* tiles, const float* bias, float* y, int64_t ldy) {
    const int64_t nb = K / kKqBlock;
    int64_t m = 0;
    if constexpr (NG == 1) {
        for (; m + 8 <= M; m += 8)
            kq_tile<FMT, NG, 8>(xq + m * K, dk + m * nb, bs16 + m * (K / 16), bsm + m * (K / 16), K, tiles, bias,
                                y + m * ldy, ldy);
        const int64_t r = M - m;
        auto rows = [&](auto mr) {
            kq_tile<FMT, NG, decltype(mr)::value>(xq + m * K, dk + m * nb, bs16 + m * (K / 16), bsm + m * (K / 16),
                                                  K, tiles, bias, y + m * ldy, ldy);
            m += decltype(mr)::value;
        };
        if (r == 5) rows(std::integral_constant<int, 5>{});
        if (r == 6) rows(std::integral_constant<int, 6>{});
        if (r == 7) rows(std::integral_constant<int, 7>{});
    }
    for (; m + 4 <= M; m += 4)
        kq_tile<FMT, NG, 4>(xq + m * K, dk + m * nb, bs16 + m * (K / 16), bsm + m * (K / 16), K, tiles, bias,
                            y + m * ldy, ldy);
    const int8_t* xm = xq + m * K;
    const float* dm = dk + m * nb;
    const int16_t* b16 = bs16 + m * (K / 16);
    const int8_t* bm = bsm + m * (K / 16);
    float* ym = y + m * ldy;
    switch (M - m) {
        case 1: kq_tile<FMT, NG, 1>(xm, dm, b16, bm, K, tiles, bias, ym, ldy); break;
        case 2: kq_tile<FMT, NG, 2>(xm, dm, b16, bm, K, tiles, bias, ym, ldy); break;
        case 3: kq_tile<FMT, NG, 3>(xm, dm, b16, bm, K, tiles, bias, ym, ldy); break;
        default: break;
    }
}

// Up to 3 activation rows (2 for Q6_K, whose 4 accumulators per row fill the registers): two
// groups per pass, two weight streams (a 1.7B Q4_K_M forward of 2-3 rows: 53 vs 60 ms with one).
// More rows: one group per pass, 4 rows at a time (each unpacked weight vector feeds 4 vpdpbusd;
// Q6_K at M = 4 to 16 ran 1.4-1.6x faster than two groups x 2 rows, Q4_K / Q5_K 1.05-1.35x).
template <int FMT>
void kq_groups(const int8_t* xq, const float* dk, const int16_t* bs16, const int8_t* bsm, int64_t M,
               int64_t K, const uint8_t* w, const float* bias, float* y, int64_t ldy, int64_t g0,
               int64_t g1) {
    constexpr int64_t TB = kq_tile_bytes(FMT);
    const int64_t gs = K / kKqBlock * TB;
    int64_t g = g0;
    if (a8_walk() == A8_WALK_GROUPS && M <= (FMT == QT_Q6_K ? 2 : 3))
        for (; g + 2 <= g1; g += 2)
            kq_rows<FMT, 2>(xq, dk, bs16, bsm, M, K, w + g * gs, bias ? bias + g * kKqTileRows : nullptr,
                            y + g * kKqTileRows, ldy);
    for (; g < g1; ++g)
        kq_rows<FMT, 1>(xq, dk, bs16, bsm, M, K, w + g * gs, bias ? bias + g * kKqTileRows : nullptr,
                        y + g * kKqTileRows, ldy);
}

void kq_linear_groups(int fmt, const int8_t* xq, const float* dk, const int16_t* bs16,
                      const int8_t* bsm, int64_t M, int64_t K, const uint8_t* w, const float* bias,
                      float* y, int64_t ldy, int64_t g0, int64_t g1) {
    switch (fmt) {
        case QT_Q4_K: kq_groups<QT_Q4_K>(xq, dk, bs16, bsm, M, K, w, bias, y, ldy, g0, g1); break;
        case QT_Q5_K: kq_groups<QT_Q5_K>(xq, dk, bs16, bsm, M, K, w, bias, y, ldy, g0, g1); break;
        case QT_Q6_K: kq_groups<QT_Q6_K>(xq, dk, bs16, bsm, M, K, w, bias, y, ldy, g0, g1); break;
        default: break;
    }
}

// ---- Float activations (kernels.h, KqTable::linear_groups_f32).  A tile is decoded exactly (the
// float32 operations of gguf.quants.dequantize, no fused ones) into W[k][16], lane j = row j, in
// L1; then each activation row runs its four FMA chains over it, the chains of all 16 rows side by
// side in the lanes, carried in memory from tile to tile.

template <int FMT>
inline void decode_tile_lanes(const uint8_t* t, float* W) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    if (FMT == QT_Q6_K) {
        const __m512i hi2 = _mm512_set1_epi8(0x30), c32 = _mm512_set1_epi32(32);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
        for (int u = 0; u < 8; ++u) {
            const uint8_t* unit = t + 288 + 384 * u;
            __m512 dl[2];
            for (int h = 0; h < 2; ++h) {
                const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + 32 + 16 * (2 * u + h)));
                dl[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
            }
            const __m512i h0 = _mm512_loadu_si512(unit + 256), h1 = _mm512_loadu_si512(unit + 320);
            auto step = [&](auto pc) {
                constexpr int p = decltype(pc)::value;
                const __m512i packed = _mm512_loadu_si512(unit + 64 * p);
                const __m512i hl = _mm512_and_si512(q6_high<p>(h0), hi2);
                const __m512i hh = _mm512_and_si512(q6_high<p>(h1), hi2);
                const __m512i codes[2] = {_mm512_ternarylogic_epi32(packed, lo4, hl, 0xEA),
                                          _mm512_ternarylogic_epi32(_mm512_srli_epi16(packed, 4), lo4, hh, 0xEA)};
                for (int h = 0; h < 2; ++h)
                    for (int i = 0; i < 4; ++i) {
                        const __m512i q = _mm512_sub_epi32(_mm512_shuffle_epi8(codes[h], byte_of_lanes(i)), c32);
                        _mm512_storeu_ps(W + 16 * (32 * u + 16 * h + 4 * p + i), _mm512_mul_ps(dl[h], _mm512_cvtepi32_ps(q)));
                    }
            };
            step(std::integral_constant<int, 0>());
            step(std::integral_constant<int, 1>());
            step(std::integral_constant<int, 2>());
            step(std::integral_constant<int, 3>());
        }
        return;
    }
    const __m512i b16 = _mm512_set1_epi8(0x10);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
    const Q4kScales sc = q4k_scales(t), mn = q4k_mins(t);
    for (int s = 0; s < 8; ++s) {
        const __m512i sel = byte_of_lanes(s % 4);
        const __m512 dl = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_shuffle_epi8(s < 4 ? sc.lo : sc.hi, sel)));
        const __m512 ml = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_shuffle_epi8(s < 4 ? mn.lo : mn.hi, sel)));
        for (int p = 0; p < 4; ++p) {
            const __m512i packed = _mm512_loadu_si512(t + 256 + 256 * s + 64 * p);
            __m512i codes[2] = {_mm512_and_si512(packed, lo4), _mm512_and_si512(_mm512_srli_epi16(packed, 4), lo4)};
            if (FMT == QT_Q5_K) {
                const uint8_t* h = t + 2304 + 64 * s;
                codes[0] = _mm512_mask_add_epi8(codes[0], load_mask64(h + 8 * p), codes[0], b16);
                codes[1] = _mm512_mask_add_epi8(codes[1], load_mask64(h + 8 * (4 + p)), codes[1], b16);
            }
            for (int h = 0; h < 2; ++h)
                for (int i = 0; i < 4; ++i) {
                    const __m512 q = _mm512_cvtepi32_ps(_mm512_shuffle_epi8(codes[h], byte_of_lanes(i)));
                    _mm512_storeu_ps(W + 16 * (32 * s + 16 * h + 4 * p + i), _mm512_sub_ps(_mm512_mul_ps(dl, q), ml));
                }
        }
    }
}

// MR activation rows (stride ldx, this tile's 256 inputs) over a decoded tile; acc [MR][4][16].
template <int MR>
inline void f32_tile_rows(const float* W, const float* x, int64_t ldx, float* acc) {
    __m512 a[MR][4];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < 4; ++c) a[r][c] = _mm512_loadu_ps(acc + 64 * r + 16 * c);
    for (int k = 0; k < kKqBlock; k += 4) {
        for (int c = 0; c < 4; ++c) {
            const __m512 wv = _mm512_loadu_ps(W + 16 * (k + c));
            for (int r = 0; r < MR; ++r) a[r][c] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[r * ldx + k + c]), a[r][c]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + 64 * r + 16 * c, a[r][c]);
}

template <int FMT>
void kq_f32_groups(const float* x, int64_t M, int64_t K, const uint8_t* w, const float* bias, float* y,
                   int64_t ldy, int64_t g0, int64_t g1, float* scratch) {
    constexpr int64_t TB = kq_tile_bytes(FMT);
    const int64_t nb = K / kKqBlock;
    float* W = scratch;
    float* acc = scratch + kKqFloatScratch;  // [M][4 chains][16 rows]
    for (int64_t g = g0; g < g1; ++g) {
        memset(acc, 0, sizeof(float) * 64 * M);
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* t = w + (g * nb + b) * TB;
            _mm_prefetch(reinterpret_cast<const char*>(t + TB), _MM_HINT_T0);
            decode_tile_lanes<FMT>(t, W);
            const float* xb = x + b * kKqBlock;
            int64_t m = 0;
            for (; m + 4 <= M; m += 4) f32_tile_rows<4>(W, xb + m * K, K, acc + 64 * m);
            switch (M - m) {
                case 1: f32_tile_rows<1>(W, xb + m * K, K, acc + 64 * m); break;
                case 2: f32_tile_rows<2>(W, xb + m * K, K, acc + 64 * m); break;
                case 3: f32_tile_rows<3>(W, xb + m * K, K, acc + 64 * m); break;
                default: break;
            }
        }
        const __m512 bv = bias ? _mm512_loadu_ps(bias + g * kKqTileRows) : _mm512_setzero_ps();
        for (int64_t m = 0; m < M; ++m) {
            const float* a = acc + 64 * m;
            const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(a + 16)),
                                           _mm512_add_ps(_mm512_loadu_ps(a + 32), _mm512_loadu_ps(a + 48)));
            _mm512_storeu_ps(y + m * ldy + g * kKqTileRows, bias ? _mm512_add_ps(s, bv) : s);
        }
    }
}

void kq_linear_groups_f32(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* w, const float* bias,
                          float* y, int64_t ldy, int64_t g0, int64_t g1, float* scratch) {
    switch (fmt) {
        case QT_Q4_K: kq_f32_groups<QT_Q4_K>(x, M, K, w, bias, y, ldy, g0, g1, scratch); break;
        case QT_Q5_K: kq_f32_groups<QT_Q5_K>(x, M, K, w, bias, y, ldy, g0, g1, scratch); break;
        case QT_Q6_K: kq_f32_groups<QT_Q6_K>(x, M, K, w, bias, y, ldy, g0, g1, scratch); break;
        default: break;
    }
}

}  // namespace

const KqTable* vnni_kq_table() {
    static const KqTable table = {kq_quantize_rows, kq_linear_groups, kq_linear_groups_f32};
    return &table;
}

const A8Table* vnni_table() {
    static const A8Table table = {"avx512vnni", quantize_rows, linear_a8_groups, layout_alloc, quantize_layout};
    return &table;
}

}  // namespace specdec
