// AVX2 + FMA + F16C kernels.  Compiled on its own with -mavx2 -mfma -mf16c -O3 -ffp-contract=off;
// only called after ops.cpp has checked the CPU supports those instruction sets.
//
// Deliberately uses no C++ standard library templates or inline library code that other
// translation units could also instantiate: everything here has internal linkage except the
// table accessor, so the linker cannot hand AVX2 code to the portable path.
//
// Reduction order (what makes every kernel batch-invariant): a dot product of length K is one
// 8-lane float accumulator updated with FMA over k = 0, 8, 16, ... in order (a masked partial
// vector last when K % 8 != 0), then the fixed horizontal sum hsum8().  Tiles of several rows
// and columns only run several such independent chains side by side.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "attn_common.h"
#include "head_chunks.h"
#include "half.h"
#include "kernels.h"
#include "prefetch.h"
#include "tile_store.h"

namespace specdec {
namespace {

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

alignas(32) const int32_t kMaskTable[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

// Mask with the first r lanes set (0 <= r <= 8).
inline __m256i lane_mask(int64_t r) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kMaskTable + 8 - r));
}

// Prefetch distance (prefetch.h): quantized tiles prefetch kPrefetchBytes ahead of each block; f32
// tiles prefetch the same position of the next tile (NR rows further), at least 8 KiB ahead -- a
// fixed 8 KiB fell inside the current tile for wide rows and lost 20-30% at M = 1 (measured on the
// development machine).
inline int64_t f32_prefetch_distance(int64_t tile_bytes) {
    return tile_bytes > kPrefetchBytes ? tile_bytes : kPrefetchBytes;
}

inline float load_f16(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// ---------------------------------------------------------------------------------------------
// GGUF block decoding: one 32-element block -> 4 vectors holding elements 0-7, 8-15, 16-23, 24-31.
// The values equal gguf.quants.dequantize exactly (same float32 operations).

template <int QT>
struct Block;

template <>
struct Block<QT_Q8_0> {
    static constexpr int64_t kBytes = 34;  // f16 d, 32 x int8
    static inline void decode(const uint8_t* b, __m256 out[4]) {
        const __m256 d = _mm256_set1_ps(load_f16(b));
        for (int i = 0; i < 4; ++i) {
            __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
            out[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
        }
    }
};

// Nibble bytes 0-7 / 8-15 zero-extended to 32-bit lanes: the low nibbles are elements 0-7 / 8-15
// and the high nibbles (lane >> 4) elements 16-23 / 24-31.
inline void nibbles_i32(const uint8_t* qs, __m256i out[4]) {
    const __m256i m4 = _mm256_set1_epi32(0x0F);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
    out[0] = _mm256_and_si256(a, m4);
    out[1] = _mm256_and_si256(b, m4);
    out[2] = _mm256_srli_epi32(a, 4);
    out[3] = _mm256_srli_epi32(b, 4);
}

template <>
struct Block<QT_Q4_0> {
    static constexpr int64_t kBytes = 18;  // f16 d, 16 bytes of nibbles; value (q - 8) * d
    static inline void decode(const uint8_t* b, __m256 out[4]) {
        // fma(q, d, -8d) rounds the exact (q - 8) * d once (-8d is exact): same as (q - 8) * d.
        const __m256 d = _mm256_set1_ps(load_f16(b));
        const __m256 c = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        __m256i q[4];
        nibbles_i32(b + 2, q);
        for (int i = 0; i < 4; ++i) out[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[i]), d, c);
    }
};

template <>
struct Block<QT_Q4_1> {
    static constexpr int64_t kBytes = 20;  // f16 d, f16 m, 16 bytes of nibbles; value q * d + m
    static inline void decode(const uint8_t* b, __m256 out[4]) {
        // d and m converted together: [d, m, 0, 0] -> broadcasts.
        int32_t dm;
        memcpy(&dm, b, 4);
        const __m128 dm4 = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        const __m256 d = _mm256_broadcastss_ps(dm4);
        const __m256 m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm4));
        __m256i q[4];
        nibbles_i32(b + 4, q);
        // Two roundings, like gguf's (d * q) + m.
        for (int i = 0; i < 4; ++i) out[i] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q[i]), d), m);
    }
};

// ---------------------------------------------------------------------------------------------
// Linear layers.

// MR activation rows (stride K) x NR float weight rows (stride ldw).
template <int MR, int NR, bool kPrefetch = true>
inline void f32_tile(const float* x, int64_t K, const float* w, int64_t ldw, float* y,
                     int64_t ldy, const float* bias) {
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
    const int64_t pf = f32_prefetch_distance(NR * ldw * 4);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv[MR];
        for (int m = 0; m < MR; ++m) xv[m] = _mm256_loadu_ps(x + m * K + k);
        for (int n = 0; n < NR; ++n) {
            const __m256 wv = _mm256_loadu_ps(w + n * ldw + k);
            if (kPrefetch) prefetch(reinterpret_cast<const char*>(w + n * ldw + k) + pf);
            for (int m = 0; m < MR; ++m) acc[m][n] = _mm256_fmadd_ps(wv, xv[m], acc[m][n]);
        }
    }
    if (k < K) {
        const __m256i mask = lane_mask(K - k);
        __m256 xv[MR];
        for (int m = 0; m < MR; ++m) xv[m] = _mm256_maskload_ps(x + m * K + k, mask);
        for (int n = 0; n < NR; ++n) {
            const __m256 wv = _mm256_maskload_ps(w + n * ldw + k, mask);
            for (int m = 0; m < MR; ++m) acc[m][n] = _mm256_fmadd_ps(wv, xv[m], acc[m][n]);
        }
    }
    store_tile<hsum8, 8>(acc, y, ldy, bias);
}

// MR activation rows x NR quantized weight rows, decoding each block in registers once for the
// MR rows.  Same FMA sequence per output as f32_tile on the decoded weights.
template <int QT, int MR, int NR>
inline void quant_tile(const float* x, int64_t K, const uint8_t* w, int64_t ldw, float* y,
                       int64_t ldy, const float* bias) {
    using B = Block<QT>;
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
    const int64_t nb = K / 32;
    for (int64_t b = 0; b < nb; ++b) {
        for (int n = 0; n < NR; ++n) {
            __m256 wv[4];
            B::decode(w + n * ldw + b * B::kBytes, wv);
            prefetch(w + n * ldw + b * B::kBytes + kPrefetchBytes);
            for (int j = 0; j < 4; ++j) {
                for (int m = 0; m < MR; ++m) {
                    acc[m][n] =
                        _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x + m * K + b * 32 + 8 * j), acc[m][n]);
                }
            }
        }
    }
    store_tile<hsum8, 8>(acc, y, ldy, bias);
}

// All rows of a chunk (mc <= kChunkRows) against float weight rows [n0, n1) (stride ldw).
// Weight tiles of NR rows stay in L1 while the chunk's activation rows stream past in MR-row tiles.
template <int NR, bool PF = true, int MR = 4>
inline void f32_rows(const float* x, int64_t mc, int64_t K, const float* w, int64_t ldw,
                     const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    static_assert(MR >= 1 && MR <= 4, "the remainder switch below handles up to 3 rows");
    int64_t n = n0;
    for (; n + NR <= n1; n += NR) {
        const float* wn = w + (n - n0) * ldw;
        const float* bn = bias ? bias + n : nullptr;
        int64_t m = 0;
        for (; m + MR <= mc; m += MR) f32_tile<MR, NR, PF>(x + m * K, K, wn, ldw, y + m * ldy + n, ldy, bn);
        switch (mc - m) {
            case 3: f32_tile<3, NR, PF>(x + m * K, K, wn, ldw, y + m * ldy + n, ldy, bn); break;
            case 2: f32_tile<2, NR, PF>(x + m * K, K, wn, ldw, y + m * ldy + n, ldy, bn); break;
            case 1: f32_tile<1, NR, PF>(x + m * K, K, wn, ldw, y + m * ldy + n, ldy, bn); break;
            default: break;
        }
    }
    for (; n < n1; ++n) {
        const float* wn = w + (n - n0) * ldw;
        const float* bn = bias ? bias + n : nullptr;
        int64_t m = 0;
        for (; m + MR <= mc; m += MR) f32_tile<MR, 1, PF>(x + m * K, K, wn, ldw, y + m * ldy + n, ldy, bn);
        for (; m < mc; ++m) f32_tile<1, 1, PF>(x + m * K, K, wn, ldw, y + m * ldy + n, ldy, bn);
    }
}

// Small chunks of a quantized weight: decode in registers, all mc rows at once.
template <int QT, int MR, int NR>
inline void quant_rows_direct(const float* x, int64_t K, const uint8_t* w, int64_t ldw,
                              const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + NR <= n1; n += NR)
        quant_tile<QT, MR, NR>(x, K, w + n * ldw, ldw, y + n, ldy, bias ? bias + n : nullptr);
    for (; n < n1; ++n)
        quant_tile<QT, MR, 1>(x, K, w + n * ldw, ldw, y + n, ldy, bias ? bias + n : nullptr);
}

// Larger chunks: decode a few weight rows into scratch (L1) and run the float tiles over them.
template <int QT>
inline void quant_rows_scratch(const float* x, int64_t mc, int64_t K, const uint8_t* w,
                               int64_t ldw, const float* bias, float* y, int64_t ldy, int64_t n0,
                               int64_t n1, float* scratch) {
    using B = Block<QT>;
    constexpr int NR = 3;
    constexpr int64_t kRows = 6;  // rows decoded per pass (<= kMaxScratchRows), multiple of NR
    const int64_t nb = K / 32;
    for (int64_t r0 = n0; r0 < n1; r0 += kRows) {
        const int64_t r1 = r0 + kRows < n1 ? r0 + kRows : n1;
        for (int64_t r = r0; r < r1; ++r) {
            const uint8_t* src = w + r * ldw;
            float* dst = scratch + (r - r0) * K;
            for (int64_t b = 0; b < nb; ++b) {
                __m256 wv[4];
                B::decode(src + b * B::kBytes, wv);
                prefetch(src + b * B::kBytes + kPrefetchBytes);
                for (int j = 0; j < 4; ++j) _mm256_storeu_ps(dst + b * 32 + 8 * j, wv[j]);
            }
        }
        f32_rows<NR, false>(x, mc, K, scratch, K, bias, y, ldy, r0, r1);
    }
}

template <int QT>
void quant_chunk(const float* x, int64_t mc, int64_t K, const uint8_t* w, int64_t ldw,
                 const float* bias, float* y, int64_t ldy, int64_t n0, int64_t n1, float* scratch) {
    switch (mc) {
        case 1: quant_rows_direct<QT, 1, 4>(x, K, w, ldw, bias, y, ldy, n0, n1); return;
        case 2: quant_rows_direct<QT, 2, 4>(x, K, w, ldw, bias, y, ldy, n0, n1); return;
        case 3: quant_rows_direct<QT, 3, 2>(x, K, w, ldw, bias, y, ldy, n0, n1); return;
        case 4: quant_rows_direct<QT, 4, 2>(x, K, w, ldw, bias, y, ldy, n0, n1); return;
        default: quant_rows_scratch<QT>(x, mc, K, w, ldw, bias, y, ldy, n0, n1, scratch); return;
    }
}

void f32_chunk(const float* x, int64_t mc, int64_t K, const float* w, const float* bias, float* y,
               int64_t ldy, int64_t n0, int64_t n1) {
    const float* wn = w + n0 * K;
    switch (mc) {
        case 1: f32_rows<8>(x, mc, K, wn, K, bias, y, ldy, n0, n1); return;
        case 2: f32_rows<4>(x, mc, K, wn, K, bias, y, ldy, n0, n1); return;
        default: f32_rows<3>(x, mc, K, wn, K, bias, y, ldy, n0, n1); return;  // 4x3 tiles
    }
}

void linear_rows(int qtype, const float* x, int64_t M, int64_t K, const uint8_t* w,
                 int64_t w_row_bytes, const float* bias, float* y, int64_t N, int64_t n0,
                 int64_t n1, float* scratch) {
    for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
        const int64_t mc = M - m0 < kChunkRows ? M - m0 : kChunkRows;
        const float* xc = x + m0 * K;
        float* yc = y + m0 * N;
        switch (qtype) {
            case QT_F32:
                f32_chunk(xc, mc, K, reinterpret_cast<const float*>(w), bias, yc, N, n0, n1);
                break;
            case QT_Q8_0: quant_chunk<QT_Q8_0>(xc, mc, K, w, w_row_bytes, bias, yc, N, n0, n1, scratch); break;
            case QT_Q4_0: quant_chunk<QT_Q4_0>(xc, mc, K, w, w_row_bytes, bias, yc, N, n0, n1, scratch); break;
            case QT_Q4_1: quant_chunk<QT_Q4_1>(xc, mc, K, w, w_row_bytes, bias, yc, N, n0, n1, scratch); break;
            default: break;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// RMS norm.

void rms_norm_rows(const float* x, const float* w, float* y, int64_t K, float eps, int64_t m0,
                   int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
        const float* xr = x + m * K;
        float* yr = y + m * K;
        __m256 acc = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const __m256 v = _mm256_loadu_ps(xr + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const int64_t rem = K - k;
        const __m256i mask = lane_mask(rem);
        if (rem) {
            const __m256 v = _mm256_maskload_ps(xr + k, mask);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const float mean = hsum8(acc) / static_cast<float>(K);
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(mean + eps));
        for (k = 0; k + 8 <= K; k += 8) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + k), r);
            _mm256_storeu_ps(yr + k, _mm256_mul_ps(v, _mm256_loadu_ps(w + k)));
        }
        if (rem) {
            const __m256 v = _mm256_mul_ps(_mm256_maskload_ps(xr + k, mask), r);
            _mm256_maskstore_ps(yr + k, mask, _mm256_mul_ps(v, _mm256_maskload_ps(w + k, mask)));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Attention (blocked, transposed key cache: see kernels.h, AttnRows).

// exp(x) for x <= 0 (softmax after max subtraction); Cephes-style range reduction + polynomial.
inline __m256 exp256(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, one);
    __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
    e = _mm256_slli_epi32(e, 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Eight cache elements as floats: float32 as they are, IEEE half converted exactly (F16C).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) {  // the 8-bit cache's entries, exactly
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return half_to_float(*p); }
inline float load1(const int8_t* p) { return static_cast<float>(*p); }

// ---------------------------------------------------------------------------------------------
// Flash-decoding attention (kernels.h, AttnRows): scores of every (row, head) query against one
// key block at a time, the softmax of each row over its own keys, then the values.

// n elements (n % 8 == 0) of a cache into floats (exact for half).
template <typename KV>
inline const float* widen(const KV* src, int64_t n, float* dst) {
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
    return dst;
}

// Value rows [0, n) (v_stride apart, D each) into floats, dst_stride apart.
template <typename KV>
inline const float* widen_rows(const KV* v, int64_t v_stride, int64_t n, int64_t D, float* dst, int64_t dst_stride) {
    for (int64_t j = 0; j < n; ++j) {
        const KV* src = v + j * v_stride;
        float* out = dst + j * dst_stride;
        int64_t c = 0;
        for (; c + 8 <= D; c += 8) _mm256_storeu_ps(out + c, load8(src + c));
        for (; c < D; ++c) out[c] = load1(src + c);
    }
    return dst;
}

// The 8-bit cache (kernels.h kQ8Header): a tag for attention_block_kv.  Its entries are read as
// exact floats; a key's scale joins the attention scale (one product) that multiplies its score,
// a value's scale the softmax weight (one product) that multiplies its row.
struct Q8 {};

// Value rows [k0, k1) (v: the head's first block) into exact floats, dst_stride apart.
inline const float* widen_q8_rows(const uint8_t* v, int64_t k0, int64_t k1, int64_t D, float* dst,
                                  int64_t dst_stride) {
    const int64_t bb = q8_block_bytes(D);
    for (int64_t j = k0; j < k1; ++j) {
        const int8_t* src =
            reinterpret_cast<const int8_t*>(v + (j / kKeyBlock) * bb + kQ8Header + (j % kKeyBlock) * D);
        float* out = dst + (j - k0) * dst_stride;
        int64_t c = 0;
        for (; c + 8 <= D; c += 8) _mm256_storeu_ps(out + c, load8(src + c));
        for (; c < D; ++c) out[c] = load1(src + c);
    }
    return dst;
}

// Most queries per score tile: 2 * 6 accumulators, two key vectors and a broadcast.
constexpr int kScoreTile = 6;

// s[t * ss + i] = scale * q_t . key i for QT queries and the 16 keys of one key block (kb: D x 16
// elements, transposed), as kernels.h defines it: chain c over d = c, c + 4, ... in order.  CH
// chains run at a time, the queries side by side (2 * QT * CH accumulators: 8 to 12, enough
// independent FMAs to hide their latency, one stream of key loads).
template <int QT, int CH, typename KV>
inline void score_tile(const float* const* qp, const KV* kb, int64_t D, __m256 vs0, __m256 vs1, float* s,
                       int64_t ss) {
    static_assert(kKeyBlock == 16, "two 8-lane vectors per key block");
    alignas(32) float ch[4][QT][16];
    for (int c0 = 0; c0 < 4; c0 += CH) {
        __m256 acc[CH][QT][2];
        for (int i = 0; i < CH; ++i) {
            const int64_t d = c0 + i;
            if (d >= D) {
                for (int t = 0; t < QT; ++t) acc[i][t][0] = acc[i][t][1] = _mm256_setzero_ps();
                continue;
            }
            const __m256 k0 = load8(kb + d * kKeyBlock), k1 = load8(kb + d * kKeyBlock + 8);
            for (int t = 0; t < QT; ++t) {
                const __m256 qd = _mm256_broadcast_ss(qp[t] + d);
                acc[i][t][0] = _mm256_mul_ps(qd, k0);
                acc[i][t][1] = _mm256_mul_ps(qd, k1);
            }
        }
        for (int64_t d0 = 4; d0 < D; d0 += 4)
            for (int i = 0; i < CH; ++i) {
                const int64_t d = d0 + c0 + i;
                if (d >= D) break;
                const __m256 k0 = load8(kb + d * kKeyBlock), k1 = load8(kb + d * kKeyBlock + 8);
                for (int t = 0; t < QT; ++t) {
                    const __m256 qd = _mm256_broadcast_ss(qp[t] + d);
                    acc[i][t][0] = _mm256_fmadd_ps(qd, k0, acc[i][t][0]);
                    acc[i][t][1] = _mm256_fmadd_ps(qd, k1, acc[i][t][1]);
                }
            }
        for (int i = 0; i < CH; ++i)
            for (int t = 0; t < QT; ++t) {
                _mm256_store_ps(ch[c0 + i][t], acc[i][t][0]);
                _mm256_store_ps(ch[c0 + i][t] + 8, acc[i][t][1]);
            }
    }
    for (int t = 0; t < QT; ++t)
        for (int h = 0; h < 2; ++h) {
            const __m256 sum = _mm256_add_ps(_mm256_add_ps(_mm256_load_ps(ch[0][t] + 8 * h), _mm256_load_ps(ch[1][t] + 8 * h)),
                                             _mm256_add_ps(_mm256_load_ps(ch[2][t] + 8 * h), _mm256_load_ps(ch[3][t] + 8 * h)));
            _mm256_storeu_ps(s + t * ss + 8 * h, _mm256_mul_ps(sum, h ? vs1 : vs0));
        }
}

// score_tile over Q queries in tiles of at most kScoreTile, as even as possible (a tile of 2 next
// to one of 6 would leave the FMA units waiting); small tiles run several chains at once.
template <typename KV>
inline void score_queries(const float* const* qp, int64_t Q, const KV* kb, int64_t D, __m256 vs0, __m256 vs1,
                          float* s, int64_t ss) {
    const int64_t ntiles = (Q + kScoreTile - 1) / kScoreTile;
    for (int64_t i = 0, t = 0; i < ntiles; ++i) {
        const int64_t qt = Q / ntiles + (i < Q % ntiles ? 1 : 0);
        switch (qt) {
            case 1: score_tile<1, 4, KV>(qp + t, kb, D, vs0, vs1, s + t * ss, ss); break;
            case 2: score_tile<2, 2, KV>(qp + t, kb, D, vs0, vs1, s + t * ss, ss); break;
            case 3: score_tile<3, 2, KV>(qp + t, kb, D, vs0, vs1, s + t * ss, ss); break;
            case 4: score_tile<4, 1, KV>(qp + t, kb, D, vs0, vs1, s + t * ss, ss); break;
            case 5: score_tile<5, 1, KV>(qp + t, kb, D, vs0, vs1, s + t * ss, ss); break;
            default: score_tile<6, 1, KV>(qp + t, kb, D, vs0, vs1, s + t * ss, ss); break;
        }
        t += qt;
    }
}

// Scores of the Q queries against key blocks [sb0, sb1) into s (s[q * ss + j - j0] for key j).
// A half cache is widened once per key block when several tiles read it.  The keys
// kAttnPrefetchKeys ahead are fetched into L2 as the scores are taken, and with fetch_values each
// block's value rows too (attention_avx512.cpp score_keys: the same fetches, the same reasons).
template <typename KV>
inline void score_keys(const float* const* qp, int64_t Q, const KV* kt, int64_t sb0, int64_t sb1, int64_t j0,
                       int64_t kend, int64_t D, __m256 vscale, float* s, int64_t ss, float* kf, const KV* v,
                       int64_t v_stride, bool fetch_values) {
    for (int64_t sb = sb0; sb < sb1; ++sb) {
        const KV* kb = kt + sb * D * kKeyBlock;
        if (fetch_values) {
            const int64_t vend = (sb + 1) * kKeyBlock < kend ? (sb + 1) * kKeyBlock : kend;
            for (int64_t j = sb * kKeyBlock; j < vend; ++j) prefetch_span_l2(v + j * v_stride, D * int64_t(sizeof(KV)));
        }
        if ((sb + 1) * kKeyBlock + kAttnPrefetchKeys <= kend)
            prefetch_span_l2(kb + kAttnPrefetchKeys * D, kKeyBlock * D * int64_t(sizeof(KV)));
        float* sd = s + (sb * kKeyBlock - j0);
        if (sizeof(KV) == 2 && Q > kScoreTile)
            score_queries<float>(qp, Q, widen(kb, D * kKeyBlock, kf), D, vscale, vscale, sd, ss);
        else
            score_queries<KV>(qp, Q, kb, D, vscale, vscale, sd, ss);
    }
}

// score_keys over an 8-bit cache: a block's entries read in place by one query tile, widened
// (exactly) once for several; each key's score times (its scale * the attention scale). Each
// block's values (vq's block of the same positions) are fetched into L2 meanwhile, and the keys
// kAttnPrefetchKeys ahead.
inline void score_keys_q8(const float* const* qp, int64_t Q, const uint8_t* kt, int64_t sb0, int64_t sb1, int64_t j0,
                          int64_t kend, int64_t D, __m256 vscale, float* s, int64_t ss, float* kf,
                          const uint8_t* vq) {
    const int64_t bb = q8_block_bytes(D);
    for (int64_t sb = sb0; sb < sb1; ++sb) {
        const uint8_t* kb = kt + sb * bb;
        if (sb * kKeyBlock < kend) prefetch_span_l2(vq + sb * bb, bb);
        if ((sb + 1) * kKeyBlock + kAttnPrefetchKeys <= kend)
            prefetch_span_l2(kb + kAttnPrefetchKeys / kKeyBlock * bb, bb);
        const float* ks = reinterpret_cast<const float*>(kb);
        const __m256 vs0 = _mm256_mul_ps(_mm256_loadu_ps(ks), vscale), vs1 = _mm256_mul_ps(_mm256_loadu_ps(ks + 8), vscale);
        const int8_t* entries = reinterpret_cast<const int8_t*>(kb + kQ8Header);
        float* sd = s + (sb * kKeyBlock - j0);
        if (Q > kScoreTile) score_queries<float>(qp, Q, widen(entries, D * kKeyBlock, kf), D, vs0, vs1, sd, ss);
        else score_queries<int8_t>(qp, Q, entries, D, vs0, vs1, sd, ss);
    }
}

// Soft cap (in place) and the maximum m of s[0, n), then s <- exp(s - m); returns the sum (8-lane
// sums in key order, then hsum8).
inline float block_softmax(float* s, int64_t n, float softcap, float* m_out) {
    if (softcap > 0.0f)
        for (int64_t j = 0; j < n; ++j) s[j] = softcap * tanhf(s[j] / softcap);
    // NOTE: _mm256_max_ps(x, m) keeps m where x is NaN, as the scalar `x > m ? x : m` does
    __m256 vm = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(_mm256_loadu_ps(s + i), vm);
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    float m = -INFINITY;
    for (float x : lanes) m = x > m ? x : m;
    for (; i < n; ++i) m = s[i] > m ? s[i] : m;
    *m_out = m;
    const __m256 vmx = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (j < n) {
        const __m256i mask = lane_mask(n - j);
        const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_maskload_ps(s + j, mask), vmx)),
                                       _mm256_castsi256_ps(mask));
        _mm256_maskstore_ps(s + j, mask, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum8(sum);
}

// acc_g[c, c + 8 NV) += sum_j p_g[j] v_j[c, c + 8 NV) for j in [0, n), GB heads sharing each value
// load (p_g = p + g * p_stride, acc_g = acc + g * acc_stride).  Per element one FMA chain in key order.
// Q8: v holds row jq of an 8-bit cache's head (kernels.h kQ8Header), rows of a block back to back
// and kQ8Header bytes between blocks.
template <int GB, int NV, typename KV, bool Q8 = false>
inline void value_tile(const float* p, int64_t p_stride, const KV* v, int64_t v_stride, int64_t n, float* acc,
                       int64_t acc_stride, int64_t jq = 0) {
    __m256 a[GB][NV];
    for (int g = 0; g < GB; ++g)
        for (int i = 0; i < NV; ++i) a[g][i] = _mm256_loadu_ps(acc + g * acc_stride + 8 * i);
    for (int64_t j = 0; j < n; ++j) {
        const KV* vj = v + j * v_stride;
        if constexpr (Q8) vj += ((jq + j) / kKeyBlock - jq / kKeyBlock) * kQ8Header;
        __m256 pj[GB];
        for (int g = 0; g < GB; ++g) pj[g] = _mm256_broadcast_ss(p + g * p_stride + j);
        for (int i = 0; i < NV; ++i) {
            const __m256 vv = load8(vj + 8 * i);
            for (int g = 0; g < GB; ++g) a[g][i] = _mm256_fmadd_ps(pj[g], vv, a[g][i]);
        }
    }
    for (int g = 0; g < GB; ++g)
        for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + g * acc_stride + 8 * i, a[g][i]);
}

template <int GB, typename KV, bool Q8 = false>
inline void value_heads(const float* p, int64_t p_stride, const KV* v, int64_t v_stride, int64_t n, int64_t D,
                        float* acc, int64_t acc_stride, int64_t jq = 0) {
    constexpr int NV = GB == 1 ? 8 : GB == 4 ? 2 : 4;  // <= 12 accumulators
    int64_t c = 0;
    for (; c + 8 * NV <= D; c += 8 * NV)
        value_tile<GB, NV, KV, Q8>(p, p_stride, v + c, v_stride, n, acc + c, acc_stride, jq);
    for (; c + 8 <= D; c += 8) value_tile<GB, 1, KV, Q8>(p, p_stride, v + c, v_stride, n, acc + c, acc_stride, jq);
    for (; c < D; ++c)  // D % 8 columns: scalar, the same chain
        for (int g = 0; g < GB; ++g) {
            float x = acc[g * acc_stride + c];
            for (int64_t j = 0; j < n; ++j) {
                const int64_t gap = Q8 ? ((jq + j) / kKeyBlock - jq / kKeyBlock) * kQ8Header : 0;
                x = fmaf(p[g * p_stride + j], load1(v + j * v_stride + gap + c), x);
            }
            acc[g * acc_stride + c] = x;
        }
}

// The rows' values against value rows [k0, k1) (vb: row k0, vs apart) into their partials.
template <typename KV>
inline void block_values(const AttnRows& a, const int64_t* beg, const int64_t* end, int64_t j0, int64_t k0,
                         int64_t k1, const KV* vb, int64_t vs, const float* s, float* part) {
    const int64_t G = a.G, P = attn_part_floats(a.D);
    for (int64_t r = 0; r < a.R; ++r) {
        const int64_t a0 = beg[r] > k0 ? beg[r] : k0, a1 = end[r] < k1 ? end[r] : k1;
        if (a0 >= a1) continue;
        for_head_chunks(G, [&](auto gb, int64_t g0) {
            const int64_t qi = r * G + g0;
            value_heads<decltype(gb)::value, KV>(s + qi * kAttnBlock + (a0 - j0), kAttnBlock, vb + (a0 - k0) * vs, vs,
                                                 a1 - a0, a.D, part + qi * P + kAttnOut, P);
        });
    }
}

// block_values over an 8-bit cache read in place (vq: the head's first block).
inline void block_values_q8(const AttnRows& a, const int64_t* beg, const int64_t* end, int64_t j0, int64_t k0,
                            int64_t k1, const uint8_t* vq, const float* s, float* part) {
    const int64_t G = a.G, D = a.D, P = attn_part_floats(D);
    for (int64_t r = 0; r < a.R; ++r) {
        const int64_t a0 = beg[r] > k0 ? beg[r] : k0, a1 = end[r] < k1 ? end[r] : k1;
        if (a0 >= a1) continue;
        const int8_t* v0 = reinterpret_cast<const int8_t*>(vq + (a0 / kKeyBlock) * q8_block_bytes(D) + kQ8Header +
                                                           (a0 % kKeyBlock) * D);
        for_head_chunks(G, [&](auto gb, int64_t g0) {
            const int64_t qi = r * G + g0;
            value_heads<decltype(gb)::value, int8_t, true>(s + qi * kAttnBlock + (a0 - j0), kAttnBlock, v0, D, a1 - a0,
                                                           D, part + qi * P + kAttnOut, P, a0);
        });
    }
}

// Values are taken this many positions at a time (aligned): each value tile runs over them with
// its accumulators in registers (16 at a time spent a third of the values' time on the tiles'
// loads, stores and loop set-up at 8 rows).
constexpr int64_t kValueKeys = kAttnValueKeys;

// NOTE: a half cache is widened into scratch once per key block when several query tiles (keys)
// or rows (values) read it, else read in place (F16C on load): the same floats either way.
// (the partials' D values of a row start as zero: the same chain from the first key on)
template <typename KV>
void attention_block_kv(const AttnRows& a, int64_t j0, float* part, float* scratch) {
    const int64_t D = a.D, G = a.G, R = a.R, Q = R * G, P = attn_part_floats(D);
    const BlockRows rows(a, j0);
    const int64_t *beg = rows.beg, *end = rows.end, jmin = rows.jmin, jmax = rows.jmax;
    const int64_t active = rows.active, kend = rows.kend;
    if (active == 0) return;
    // NOTE: 64-byte aligned (a 32-byte load across two cache lines costs two)
    const int64_t Dp = (D + 7) / 8 * 8;
    float* kf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));
    float* vf = kf + kKeyBlock * Dp;
    float* s = vf + kValueKeys * Dp;  // s[(r * G + g) * kAttnBlock + j - j0]
    const float** qp = reinterpret_cast<const float**>(s + Q * kAttnBlock);
    for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < G; ++g) qp[r * G + g] = a.q + r * a.q_row_stride + g * a.q_head_stride;
    const KV* kt = static_cast<const KV*>(a.kt);
    const KV* v = static_cast<const KV*>(a.v);
    const bool widen_v = sizeof(KV) == 2 && active > 1;
    const int64_t sb0 = jmin / kKeyBlock, sb1 = (jmax - 1) / kKeyBlock + 1;
    if constexpr (std::is_same_v<KV, Q8>)
        score_keys_q8(qp, Q, static_cast<const uint8_t*>(a.kt), sb0, sb1, j0, kend, D, _mm256_set1_ps(a.scale), s,
                      kAttnBlock, kf, static_cast<const uint8_t*>(a.v));
    else
        // NOTE: every row count fetches the value rows here (one row at 2,000 cached, attention alone:
        // 1.4x; the AVX-512 kernel's one row gained nothing from it), spelled as a condition: passed
        // as the constant, GCC 12 compiled the two-row path 10% slower
        score_keys<KV>(qp, Q, kt, sb0, sb1, j0, kend, D, _mm256_set1_ps(a.scale), s, kAttnBlock, kf, v, a.v_stride,
                       Q > kScoreTile || widen_v || active == 1);
    for (int64_t r = 0; r < R; ++r) {
        if (beg[r] >= end[r]) continue;
        for (int64_t g = 0; g < G; ++g) {
            float* rec = part + (r * G + g) * P;
            rec[1] = block_softmax(s + (r * G + g) * kAttnBlock + (beg[r] - j0), end[r] - beg[r], a.softcap, rec);
            for (int64_t c = 0; c < D; ++c) rec[kAttnOut + c] = 0.0f;
            if constexpr (std::is_same_v<KV, Q8>) {  // each weight times its value row's scale
                const uint8_t* vq = static_cast<const uint8_t*>(a.v);
                float* p = s + (r * G + g) * kAttnBlock - j0;
                const uint64_t bb = static_cast<uint64_t>(q8_block_bytes(D));
                for (uint64_t j = static_cast<uint64_t>(beg[r]), e = static_cast<uint64_t>(end[r]); j < e;) {
                    const float* vs = reinterpret_cast<const float*>(vq + (j / kKeyBlock) * bb);
                    if (j % kKeyBlock == 0 && j + kKeyBlock <= e) {  // a whole block: its 16 scales
                        _mm256_storeu_ps(p + j, _mm256_mul_ps(_mm256_loadu_ps(p + j), _mm256_loadu_ps(vs)));
                        _mm256_storeu_ps(p + j + 8, _mm256_mul_ps(_mm256_loadu_ps(p + j + 8), _mm256_loadu_ps(vs + 8)));
                        j += kKeyBlock;
                    } else {
                        p[j] *= vs[j % kKeyBlock];
                        ++j;
                    }
                }
            }
        }
    }
    for (int64_t k0 = jmin, k1; k0 < jmax; k0 = k1) {
        k1 = (k0 / kValueKeys + 1) * kValueKeys < jmax ? (k0 / kValueKeys + 1) * kValueKeys : jmax;
        if constexpr (std::is_same_v<KV, Q8>) {
            const uint8_t* vq = static_cast<const uint8_t*>(a.v);
            if (active > 1)
                block_values<float>(a, beg, end, j0, k0, k1, widen_q8_rows(vq, k0, k1, D, vf, Dp), Dp, s, part);
            else
                block_values_q8(a, beg, end, j0, k0, k1, vq, s, part);
        } else {
            if (widen_v)
                block_values<float>(a, beg, end, j0, k0, k1,
                                    widen_rows(v + k0 * a.v_stride, a.v_stride, k1 - k0, D, vf, Dp), Dp, s, part);
            else
                block_values<KV>(a, beg, end, j0, k0, k1, v + k0 * a.v_stride, a.v_stride, s, part);
        }
    }
}

void attention_block(const AttnRows& a, int64_t j0, float* part, float* scratch) {
    if (a.q8) attention_block_kv<Q8>(a, j0, part, scratch);
    else if (a.half) attention_block_kv<uint16_t>(a, j0, part, scratch);
    else attention_block_kv<float>(a, j0, part, scratch);
}

inline float exp1(float x) { return _mm256_cvtss_f32(exp256(_mm256_set1_ps(x))); }

void attention_merge(const AttnRows& a, int64_t b0, int64_t b1, const float* part, float* out,
                     int64_t out_row_stride) {
    const int64_t D = a.D, G = a.G, P = attn_part_floats(D), bstride = a.R * G * P;
    for (int64_t r = 0; r < a.R; ++r) {
        const int64_t bl = a.lo[r] / kAttnBlock > b0 ? a.lo[r] / kAttnBlock : b0;
        const int64_t bh = a.hi[r] / kAttnBlock < b1 - 1 ? a.hi[r] / kAttnBlock : b1 - 1;
        for (int64_t g = 0; g < G; ++g) {
            const float* rec0 = part + (r * G + g) * P;
            float M = -INFINITY;
            for (int64_t b = bl; b <= bh; ++b) {
                const float m = rec0[(b - b0) * bstride];
                M = m > M ? m : M;
            }
            float* o = out + r * out_row_stride + g * D;
            for (int64_t c = 0; c < D; ++c) o[c] = 0.0f;
            float L = 0.0f;
            for (int64_t b = bl; b <= bh; ++b) {
                const float* rec = rec0 + (b - b0) * bstride;
                const float w = rec[0] == M ? 1.0f : exp1(rec[0] - M);
                L += rec[1] * w;
                const __m256 vw = _mm256_set1_ps(w);
                int64_t c = 0;
                for (; c + 8 <= D; c += 8)
                    _mm256_storeu_ps(o + c, _mm256_fmadd_ps(_mm256_loadu_ps(rec + kAttnOut + c), vw, _mm256_loadu_ps(o + c)));
                for (; c < D; ++c) o[c] = fmaf(rec[kAttnOut + c], w, o[c]);
            }
            const float inv = 1.0f / L;
            for (int64_t c = 0; c < D; ++c) o[c] *= inv;
        }
    }
}

// Two passes: the maximum (NaN-free lanes: _mm256_max_ps returns its second operand when either
// is NaN, so a NaN in x never replaces a number), then the first index holding it.
int64_t argmax(const float* x, int64_t n) {
    int64_t i = 0;
    float m = -INFINITY;
    if (n >= 8) {
        __m256 vm = _mm256_set1_ps(-INFINITY);
        for (; i + 8 <= n; i += 8) vm = _mm256_max_ps(_mm256_loadu_ps(x + i), vm);
        float lanes[8];
        _mm256_storeu_ps(lanes, vm);
        for (float v : lanes) m = v > m ? v : m;
    }
    for (; i < n; ++i) m = x[i] > m ? x[i] : m;
    if (m == -INFINITY) return portable_table()->argmax(x, n);  // all -inf or NaN: the reference
    const __m256 target = _mm256_set1_ps(m);
    i = 0;
    for (; i + 8 <= n; i += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
        if (mask) return i + __builtin_ctz(mask);
    }
    for (; i < n; ++i)
        if (x[i] == m) return i;
    return 0;
}

// ---- What a decoder layer writes for each token (KernelTable::rope_head and the three after it):
// layer.cpp's scalar loops on 8 lanes, the same operations element by element (so the same bits),
// the rest of each run of elements scalar.

// The rotation of one head, each result (8 lanes, or 1) handed to out(j, value): elements [0, h)
// are src[j] * cos[j] + (-src[j + h]) * sin[j], elements [h, D) src[j] * cos[j] + src[j - h] * sin[j].
template <class Out8, class Out1>
inline void rope_lanes(const float* src, const float* cos, const float* sin, int64_t D, const Out8& out8,
                       const Out1& out1) {
    const int64_t h = D / 2;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int half = 0; half < 2; ++half) {
        const int64_t j0 = half * h, j1 = j0 + h, off = half ? -h : h;
        int64_t j = j0;
        for (; j + 8 <= j1; j += 8) {
            __m256 other = _mm256_loadu_ps(src + j + off);
            if (!half) other = _mm256_xor_ps(other, sign);
            const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(src + j), _mm256_loadu_ps(cos + j));
            const __m256 b = _mm256_mul_ps(other, _mm256_loadu_ps(sin + j));
            out8(j, _mm256_add_ps(a, b));
        }
        for (; j < j1; ++j) {
            const float a = src[j] * cos[j];
            const float b = (half ? src[j + off] : -src[j + off]) * sin[j];
            out1(j, a + b);
        }
    }
}

// Round to nearest, ties to even (the default MXCSR mode), without raising exceptions.
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

void rope_head(const float* src, const float* cos, const float* sin, int64_t D, float* dst, int64_t stride) {
    if (stride == 1) {
        rope_lanes(src, cos, sin, D, [&](int64_t j, __m256 v) { _mm256_storeu_ps(dst + j, v); },
                   [&](int64_t j, float v) { dst[j] = v; });
        return;
    }
    rope_lanes(
        src, cos, sin, D,
        [&](int64_t j, __m256 v) {
            alignas(32) float t[8];
            _mm256_store_ps(t, v);
            for (int i = 0; i < 8; ++i) dst[(j + i) * stride] = t[i];
        },
        [&](int64_t j, float v) { dst[j * stride] = v; });
}

void rope_head_half(const float* src, const float* cos, const float* sin, int64_t D, uint16_t* dst,
                    int64_t stride) {
    rope_lanes(
        src, cos, sin, D,
        [&](int64_t j, __m256 v) {
            alignas(16) uint16_t t[8];
            _mm_store_si128(reinterpret_cast<__m128i*>(t), _mm256_cvtps_ph(v, kNearest));
            for (int i = 0; i < 8; ++i) dst[(j + i) * stride] = t[i];
        },
        [&](int64_t j, float v) { dst[j * stride] = _cvtss_sh(v, kNearest); });
}

void to_half(const float* src, int64_t n, uint16_t* dst) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), kNearest));
    for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], kNearest);
}

void q8_head(const float* x, int64_t D, int8_t* q, int64_t q_stride, float* scale) {
    // max |x|: each lane keeps its largest (a NaN never compares greater), then the lanes and the
    // rest in order; a maximum is the same whatever the order
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + d), abs_mask);
        m = _mm256_blendv_ps(m, a, _mm256_cmp_ps(a, m, _CMP_GT_OQ));
    }
    alignas(32) float lane[8];
    _mm256_store_ps(lane, m);
    float amax = 0.0f;
    for (int i = 0; i < 8; ++i) amax = lane[i] > amax ? lane[i] : amax;
    for (; d < D; ++d) amax = fabsf(x[d]) > amax ? fabsf(x[d]) : amax;
    const float sc = amax / 127.0f;
    const __m256 scv = _mm256_set1_ps(sc), hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    for (d = 0; d + 8 <= D; d += 8) {
        alignas(32) int32_t t[8];
        if (sc > 0.0f) {
            __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + d), scv), kNearest);
            r = _mm256_blendv_ps(r, hi, _mm256_cmp_ps(r, hi, _CMP_GT_OQ));
            r = _mm256_blendv_ps(r, lo, _mm256_cmp_ps(r, lo, _CMP_LT_OQ));
            // truncating conversion to int32, then its low byte: what (int8_t) of a float compiles to
            _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm256_cvttps_epi32(r));
        } else {
            _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm256_setzero_si256());
        }
        for (int i = 0; i < 8; ++i) q[(d + i) * q_stride] = static_cast<int8_t>(t[i]);
    }
    for (; d < D; ++d) {
        float r = sc > 0.0f ? nearbyintf(x[d] / sc) : 0.0f;
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        q[d * q_stride] = static_cast<int8_t>(r);
    }
    memcpy(scale, &sc, sizeof sc);
}

const KernelTable kTable = {"avx2",          linear_rows, rms_norm_rows,  argmax,  attention_block,
                            attention_merge, rope_head,   rope_head_half, to_half, q8_head};

}  // namespace

const KernelTable* avx2_table() { return &kTable; }

}  // namespace specdec
