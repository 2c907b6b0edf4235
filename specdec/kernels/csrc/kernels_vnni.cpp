// 8-bit activation kernels (AVX-512 VNNI): the activation rows are quantized to int8 per block of
// 32 (as llama.cpp's q8 activations), and each weight block's integer dot product runs on
// vpdpbusd (64 multiply-adds per instruction, 4x what a 16-lane float FMA does).  Compiled on its
// own with the AVX-512 flags plus -mavx512vnni; only called after ops.cpp has checked the CPU.
//
// Weights are repacked once at load time (repack_a8 in ops.cpp) into tiles of 16 output rows x 32
// inputs, lane j of every vector holding output row j, so a tile's 16 results accumulate in one
// float vector with no horizontal sums:
//   [16 x f16 d][16 x f16 m][quants]
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

#include "kernels.h"

namespace specdec {
namespace {

// Activation quantization: rows [m0, m1) of x [M, K] -> xq int8 [M, K], per block of 32: dx (the
// scale amax / 127), sx (sum of the int8 codes) and dxs = dx * sx.
void quantize_rows(const float* x, int64_t K, int8_t* xq, float* dx, int32_t* sx, float* dxs,
                   int64_t m0, int64_t m1) {
    const int64_t nb = K / 32;
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t m = m0; m < m1; ++m) {
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + m * K + b * 32;
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const __m512 a = _mm512_max_ps(_mm512_and_ps(v0, sign), _mm512_and_ps(v1, sign));
            const float amax = _mm512_reduce_max_ps(a);
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            const __m512 idv = _mm512_set1_ps(id);
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, idv));  // round to nearest even
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, idv));
            int8_t* dst = xq + m * K + b * 32;
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(q1));
            // The sum of the stored (saturated) codes.
            const __m512i s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dst)));
            const __m512i s1 =
                _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dst + 16)));
            const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(s0, s1));
            dx[m * nb + b] = d;
            sx[m * nb + b] = s;
            dxs[m * nb + b] = d * static_cast<float>(s);
        }
    }
}

inline __m512i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// NG consecutive 16-row weight groups (their tiles nb * TB bytes apart) against MR activation
// rows, all K blocks.  Each broadcast activation quad feeds NG vpdpbusd.
template <int KIND, int NG, int MR>
inline void group_tile(const int8_t* xq, const float* dx, const int32_t* sx, const float* dxs,
                       int64_t K, const uint8_t* tiles, const float* bias, float* y, int64_t ldy) {
    const int64_t nb = K / 32;
    constexpr int64_t TB = a8_tile_bytes(KIND);
    constexpr int32_t kOffset = KIND == A8_Q8 ? 128 : KIND == A8_Q4_0 ? 8 : 0;
    const int64_t gstride = nb * TB;
    __m512 acc[NG][MR];
    for (int g = 0; g < NG; ++g)
        for (int m = 0; m < MR; ++m) acc[g][m] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        __m512i s[NG][MR];
        for (int g = 0; g < NG; ++g)
            for (int m = 0; m < MR; ++m) s[g][m] = _mm512_setzero_si512();
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
                    w[g] = _mm512_loadu_si512(tiles + g * gstride + b * TB + 64 + 64 * t);
                for (int m = 0; m < MR; ++m) {
                    const __m512i xv = bcast4(xq + m * K + b * 32 + 4 * t);
                    for (int g = 0; g < NG; ++g) s[g][m] = _mm512_dpbusd_epi32(s[g][m], w[g], xv);
                }
            }
        } else {
            for (int p = 0; p < 4; ++p) {
                __m512i wlo[NG], whi[NG];
                for (int g = 0; g < NG; ++g) {
                    const __m512i packed = _mm512_loadu_si512(tiles + g * gstride + b * TB + 64 + 64 * p);
                    wlo[g] = _mm512_and_si512(packed, lo4);
                    whi[g] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), lo4);
                }
                for (int m = 0; m < MR; ++m) {
                    const int8_t* xb = xq + m * K + b * 32;
                    const __m512i xlo = bcast4(xb + 4 * p), xhi = bcast4(xb + 4 * p + 16);
                    for (int g = 0; g < NG; ++g) {
                        s[g][m] = _mm512_dpbusd_epi32(s[g][m], wlo[g], xlo);
                        s[g][m] = _mm512_dpbusd_epi32(s[g][m], whi[g], xhi);
                    }
                }
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
                if (kOffset) si = _mm512_sub_epi32(si, _mm512_set1_epi32(kOffset * sx[mb]));
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

template <int KIND>
void groups_rows(const int8_t* xq, const float* dx, const int32_t* sx, const float* dxs, int64_t M,
                 int64_t K, const uint8_t* w, const float* bias, float* y, int64_t N, int64_t g0,
                 int64_t g1) {
    constexpr int64_t TB = a8_tile_bytes(KIND);
    const int64_t nb = K / 32;
    int64_t g = g0;
    for (; g + 2 <= g1; g += 2)
        rows_for_groups<KIND, 2, 4>(xq, dx, sx, dxs, M, K, w + g * nb * TB,
                                    bias ? bias + g * kA8TileRows : nullptr, y + g * kA8TileRows, N);
    if (g < g1)
        rows_for_groups<KIND, 1, 4>(xq, dx, sx, dxs, M, K, w + g * nb * TB,
                                    bias ? bias + g * kA8TileRows : nullptr, y + g * kA8TileRows, N);
}

void linear_a8_groups(int kind, const int8_t* xq, const float* dx, const int32_t* sx,
                      const float* dxs, int64_t M, int64_t K, const uint8_t* w, const float* bias,
                      float* y, int64_t N, int64_t g0, int64_t g1) {
    switch (kind) {
        case A8_Q4_0: groups_rows<A8_Q4_0>(xq, dx, sx, dxs, M, K, w, bias, y, N, g0, g1); break;
        case A8_Q4_1: groups_rows<A8_Q4_1>(xq, dx, sx, dxs, M, K, w, bias, y, N, g0, g1); break;
        case A8_Q8: groups_rows<A8_Q8>(xq, dx, sx, dxs, M, K, w, bias, y, N, g0, g1); break;
        default: break;
    }
}

}  // namespace

const A8Table* vnni_table() {
    static const A8Table table = {"avx512vnni", quantize_rows, linear_a8_groups};
    return &table;
}

}  // namespace specdec
