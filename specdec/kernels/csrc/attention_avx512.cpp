// AVX-512 flash-decoding attention (kernels.h, AttnRows): the AVX2 kernel's arithmetic, element for
// element, on 16 lanes.  Compiled on its own with the AVX-512 F/DQ/BW/VL flags; only called after
// ops.cpp has checked the CPU supports them.
//
// A key block (kKeyBlock = 16 keys, transposed) is one vector per element d, so a score tile's
// chain for 16 keys is one FMA with the query element broadcast from memory: a quarter of the
// AVX2 kernel's instructions per multiply-add for the scores and half for the values.  Every
// score, softmax weight, sum and value product is computed with the same float32 operations in
// the same order as kernels_avx2.cpp (four chains over d, (c0 + c1) + (c2 + c3), then the scale;
// exps summed in 8-lane vectors in key order and hsum8; one FMA chain per output element in key
// order), so the two tables' attention is bit-identical and a row's result is the same alone or
// in any batch, on any thread split.
//
// Same linkage rule as the other ISA units: everything has internal linkage except the entry.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "attn_common.h"
#include "head_chunks.h"
#include "kernels.h"
#include "vnni.h"

namespace specdec {
namespace {

inline float hsum8(__m256 v) {  // kernels_avx2.cpp's, operation for operation
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

// exp(x) for x <= 0: kernels_avx2.cpp exp256's operations on 16 lanes (floor as roundscale).
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

// Sixteen cache elements as floats (exact for half and the 8-bit cache's entries); masked: the
// first lanes of m, zeros elsewhere.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
inline __m512 load16(const int8_t* p, __mmask16 m) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

inline __mmask16 first_lanes(int64_t r) { return static_cast<__mmask16>((1u << r) - 1u); }

// n elements of a cache into floats (n % 16 == 0).
template <typename KV>
inline const float* widen(const KV* src, int64_t n, float* dst) {
    for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
    return dst;
}

// Value rows [0, n) (v_stride apart, D each) into floats, dst_stride apart.
template <typename KV>
inline const float* widen_rows(const KV* v, int64_t v_stride, int64_t n, int64_t D, float* dst, int64_t dst_stride) {
    for (int64_t j = 0; j < n; ++j) {
        const KV* src = v + j * v_stride;
        float* out = dst + j * dst_stride;
        int64_t c = 0;
        for (; c + 16 <= D; c += 16) _mm512_storeu_ps(out + c, load16(src + c));
        if (c < D) _mm512_mask_storeu_ps(out + c, first_lanes(D - c), load16(src + c, first_lanes(D - c)));
    }
    return dst;
}

// Keeps a loaded vector in its register: without it GCC 12 folds the load into each FMA that reads
// it, so a value vector shared by GB heads is read from L1 GB times (on Zen 4 the loads, not the
// FMAs, then set the value tile's pace).
inline void pin(__m512& v) { asm("" : "+v"(v)); }

struct Q8 {};  // the 8-bit cache (kernels.h kQ8Header), as in kernels_avx2.cpp

inline const int8_t* q8_value_row(const uint8_t* v, int64_t j, int64_t D) {
    return reinterpret_cast<const int8_t*>(v + (j / kKeyBlock) * q8_block_bytes(D) + kQ8Header + (j % kKeyBlock) * D);
}

// Value rows [k0, k1) of an 8-bit cache into exact floats, dst_stride apart.
inline const float* widen_q8_rows(const uint8_t* v, int64_t k0, int64_t k1, int64_t D, float* dst,
                                  int64_t dst_stride) {
    for (int64_t j = k0; j < k1; ++j) widen_rows(q8_value_row(v, j, D), D, 1, D, dst + (j - k0) * dst_stride, 0);
    return dst;
}

// Most queries per score tile: 4 chains x 6 queries = 24 accumulators and four key vectors.
constexpr int kScoreTile = 6;
constexpr int64_t kWidenValueRows = 4;

// s[t * ss + i] = (q_t . key i) * vs[i] for QT queries and the 16 keys of one key block (kb: D x 16
// elements, transposed): chain c over d = c, c + 4, ... (a multiply, then FMAs in order), then
// (c0 + c1) + (c2 + c3), as kernels.h defines it.  All four chains run at once, the queries side
// by side, the query element broadcast into the FMA.
template <int QT, typename KV>
inline void score_tile(const float* const* qp, const KV* kb, int64_t D, __m512 vs, float* s, int64_t ss) {
    static_assert(kKeyBlock == 16, "one 16-lane vector per key block element");
    __m512 acc[4][QT];
    for (int c = 0; c < 4; ++c) {
        if (c >= D) {
            for (int t = 0; t < QT; ++t) acc[c][t] = _mm512_setzero_ps();
            continue;
        }
        const __m512 k = load16(kb + c * kKeyBlock);
        for (int t = 0; t < QT; ++t) acc[c][t] = _mm512_mul_ps(_mm512_set1_ps(qp[t][c]), k);
    }
    int64_t d = 4;
    for (; d + 4 <= D; d += 4) {
        __m512 k[4];
        for (int c = 0; c < 4; ++c) k[c] = load16(kb + (d + c) * kKeyBlock);
        for (int c = 0; c < 4; ++c)
            for (int t = 0; t < QT; ++t) acc[c][t] = _mm512_fmadd_ps(_mm512_set1_ps(qp[t][d + c]), k[c], acc[c][t]);
    }
    // NOTE: a fixed trip count, so that every acc index is a constant: with `d + c < D` as the loop's
    // condition GCC 12 kept all 24 accumulators on the stack through the whole tile
    for (int c = 0; c < 3; ++c) {
        if (d + c >= D) break;
        const __m512 k = load16(kb + (d + c) * kKeyBlock);
        for (int t = 0; t < QT; ++t) acc[c][t] = _mm512_fmadd_ps(_mm512_set1_ps(qp[t][d + c]), k, acc[c][t]);
    }
    for (int t = 0; t < QT; ++t) {
        const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0][t], acc[1][t]), _mm512_add_ps(acc[2][t], acc[3][t]));
        _mm512_storeu_ps(s + t * ss, _mm512_mul_ps(sum, vs));
    }
}

// score_tile over Q queries in tiles of at most kScoreTile, as even as possible.
template <typename KV>
inline void score_queries(const float* const* qp, int64_t Q, const KV* kb, int64_t D, __m512 vs, float* s,
                          int64_t ss) {
    const int64_t ntiles = (Q + kScoreTile - 1) / kScoreTile;
    for (int64_t i = 0, t = 0; i < ntiles; ++i) {
        const int64_t qt = Q / ntiles + (i < Q % ntiles ? 1 : 0);
        switch (qt) {
            case 1: score_tile<1, KV>(qp + t, kb, D, vs, s + t * ss, ss); break;
            case 2: score_tile<2, KV>(qp + t, kb, D, vs, s + t * ss, ss); break;
            case 3: score_tile<3, KV>(qp + t, kb, D, vs, s + t * ss, ss); break;
            case 4: score_tile<4, KV>(qp + t, kb, D, vs, s + t * ss, ss); break;
            case 5: score_tile<5, KV>(qp + t, kb, D, vs, s + t * ss, ss); break;
            default: score_tile<6, KV>(qp + t, kb, D, vs, s + t * ss, ss); break;
        }
        t += qt;
    }
}

// Scores of the Q queries against key blocks [sb0, sb1) into s (s[q * ss + j - j0] for key j); a
// half block widened once when several tiles read it; the keys kAttnPrefetchKeys ahead fetched
// into L2, and with fetch_values (more queries than one tile, or value rows to be widened) each
// block's value rows too (v, v_stride apart).
// NOTE: the only prefetches the AVX-512 kernels issue are these, the 8-bit cache's value blocks
// into L2 as their keys are scored and its keys ahead the same way (kAttnPrefetchKeys; 8 rows at
// 2,000 cached 1.08x, attention alone): the rest (keys into L1, values into L1 while they are
// summed) were calls that GCC 12 deleted (prefetch.h's NOTE).  Issued, they paid nothing on a 2-core
// Zen 4 EPYC (SmolLM2, 200 and 2,000 cached, one and eight rows, alternated in one process: one
// row 0.93-0.98x, eight rows 0.94-1.06x).  The value rows into L2 paid at eight rows of a half
// cache at 2,000 cached (1.03x, 1.04x and 1.07x in three runs; 1.02x at 200) and cost one row
// 0.94x at 2,000 cached, so they are fetched for several tiles' queries, or where the rows widen
// them (two rows waited 43% of the kernel's samples on the widening's loads without the fetch).
template <typename KV>
inline void score_keys(const float* const* qp, int64_t Q, const KV* kt, int64_t sb0, int64_t sb1, int64_t j0,
                       int64_t kend, int64_t D, __m512 vscale, float* s, int64_t ss, float* kf, const KV* v, int64_t v_stride,
                       bool fetch_values) {
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
            score_queries<float>(qp, Q, widen(kb, D * kKeyBlock, kf), D, vscale, sd, ss);
        else
            score_queries<KV>(qp, Q, kb, D, vscale, sd, ss);
    }
}

// score_keys over an 8-bit cache: each key's score times (its scale * the attention scale).
inline void score_keys_q8(const float* const* qp, int64_t Q, const uint8_t* kt, int64_t sb0, int64_t sb1, int64_t j0,
                          int64_t kend, int64_t D, __m512 vscale, float* s, int64_t ss, float* kf,
                          const uint8_t* vq) {
    const int64_t bb = q8_block_bytes(D);
    for (int64_t sb = sb0; sb < sb1; ++sb) {
        const uint8_t* kb = kt + sb * bb;
        if (sb * kKeyBlock < kend) prefetch_span_l2(vq + sb * bb, bb);
        const __m512 vs = _mm512_mul_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(kb)), vscale);
        const int8_t* entries = reinterpret_cast<const int8_t*>(kb + kQ8Header);
        float* sd = s + (sb * kKeyBlock - j0);
        if (Q > kScoreTile) score_queries<float>(qp, Q, widen(entries, D * kKeyBlock, kf), D, vs, sd, ss);
        else score_queries<int8_t>(qp, Q, entries, D, vs, sd, ss);
    }
}

// Soft cap (in place) and the maximum m of s[0, n), then s <- exp(s - m); returns the sum: the
// exps added in 8-lane vectors in key order (a 16-lane vector's low half, then its high half),
// then hsum8, as kernels_avx2.cpp.
inline float block_softmax(float* s, int64_t n, float softcap, float* m_out) {
    if (softcap > 0.0f)
        for (int64_t j = 0; j < n; ++j) s[j] = softcap * tanhf(s[j] / softcap);
    // NOTE: _mm512_max_ps(x, m) keeps m where x is NaN: NaNs are never the maximum, in any order
    __m512 vm = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(_mm512_loadu_ps(s + i), vm);
    if (i < n) vm = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first_lanes(n - i), s + i), vm);
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, vm);
    float m = -INFINITY;
    for (float x : lanes) m = x > m ? x : m;
    *m_out = m;
    const __m512 vmx = _mm512_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmx));
        _mm512_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
        sum = _mm256_add_ps(sum, _mm512_extractf32x8_ps(e, 1));
    }
    if (j < n) {
        const __mmask16 mask = first_lanes(n - j);
        const __m512 e = _mm512_maskz_mov_ps(mask, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), vmx)));
        _mm512_mask_storeu_ps(s + j, mask, e);
        sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
        if (n - j > 8) sum = _mm256_add_ps(sum, _mm512_extractf32x8_ps(e, 1));
    }
    return hsum8(sum);
}

// acc_g[c, c + 16 NV) += sum_j p_g[j] v_j[c, c + 16 NV) for j in [0, n), GB heads sharing each
// value load; per element one FMA chain in key order.  `tail` > 0: one vector of its first lanes
// (NV = 1).  Q8: v holds row jq of an 8-bit cache's head, kQ8Header bytes between blocks.
template <int GB, int NV, typename KV, bool Q8 = false>
inline void value_tile(const float* p, int64_t p_stride, const KV* v, int64_t v_stride, int64_t n, float* acc,
                       int64_t acc_stride, int64_t jq, __mmask16 tail) {
    __m512 a[GB][NV];
    for (int g = 0; g < GB; ++g)
        for (int i = 0; i < NV; ++i)
            a[g][i] = tail ? _mm512_maskz_loadu_ps(tail, acc + g * acc_stride) : _mm512_loadu_ps(acc + g * acc_stride + 16 * i);
    for (int64_t j = 0; j < n; ++j) {
        const KV* vj = v + j * v_stride;
        if constexpr (Q8) vj += ((jq + j) / kKeyBlock - jq / kKeyBlock) * kQ8Header;
        for (int i = 0; i < NV; ++i) {
            __m512 vv = tail ? load16(vj, tail) : load16(vj + 16 * i);
            if constexpr (std::is_same_v<KV, float> && GB > 1) pin(vv);
            for (int g = 0; g < GB; ++g) a[g][i] = _mm512_fmadd_ps(_mm512_set1_ps(p[g * p_stride + j]), vv, a[g][i]);
        }
    }
    for (int g = 0; g < GB; ++g)
        for (int i = 0; i < NV; ++i) {
            if (tail) _mm512_mask_storeu_ps(acc + g * acc_stride, tail, a[g][i]);
            else _mm512_storeu_ps(acc + g * acc_stride + 16 * i, a[g][i]);
        }
}

template <int GB, typename KV, bool Q8 = false>
inline void value_heads(const float* p, int64_t p_stride, const KV* v, int64_t v_stride, int64_t n, int64_t D,
                        float* acc, int64_t acc_stride, int64_t jq = 0) {
    constexpr int NV = GB <= 2 ? 8 : 4;  // <= 16 accumulators
    int64_t c = 0;
    for (; c + 16 * NV <= D; c += 16 * NV)
        value_tile<GB, NV, KV, Q8>(p, p_stride, v + c, v_stride, n, acc + c, acc_stride, jq, 0);
    if (NV > 4 && c + 64 <= D) {
        value_tile<GB, 4, KV, Q8>(p, p_stride, v + c, v_stride, n, acc + c, acc_stride, jq, 0);
        c += 64;
    }
    if (c + 32 <= D) {
        value_tile<GB, 2, KV, Q8>(p, p_stride, v + c, v_stride, n, acc + c, acc_stride, jq, 0);
        c += 32;
    }
    if (c + 16 <= D) {
        value_tile<GB, 1, KV, Q8>(p, p_stride, v + c, v_stride, n, acc + c, acc_stride, jq, 0);
        c += 16;
    }
    if (c < D) value_tile<GB, 1, KV, Q8>(p, p_stride, v + c, v_stride, n, acc + c, acc_stride, jq, first_lanes(D - c));
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
        const int8_t* v0 = q8_value_row(vq, a0, D);
        for_head_chunks(G, [&](auto gb, int64_t g0) {
            const int64_t qi = r * G + g0;
            value_heads<decltype(gb)::value, int8_t, true>(s + qi * kAttnBlock + (a0 - j0), kAttnBlock, v0, D, a1 - a0,
                                                           D, part + qi * P + kAttnOut, P, a0);
        });
    }
}

// Each softmax weight of keys [b, e) times its value row's scale (the 8-bit cache).
inline void scale_by_value_scales(float* p, const uint8_t* vq, int64_t D, uint64_t j, uint64_t e) {
    const uint64_t bb = static_cast<uint64_t>(q8_block_bytes(D));
    while (j < e) {
        const float* vs = reinterpret_cast<const float*>(vq + (j / kKeyBlock) * bb);
        const uint64_t o = j % kKeyBlock, n = e - j < kKeyBlock - o ? e - j : kKeyBlock - o;
        const __mmask16 m = first_lanes(static_cast<int64_t>(n));
        _mm512_mask_storeu_ps(p + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + j), _mm512_maskz_loadu_ps(m, vs + o)));
        j += n;
    }
}

// Value rows taken at a time (the same positions as kernels_avx2.cpp, so the same partial sums).
constexpr int64_t kValueKeys = kAttnValueKeys;

template <typename KV>
void attention_block_kv(const AttnRows& a, int64_t j0, float* part, float* scratch) {
    const int64_t D = a.D, G = a.G, R = a.R, Q = R * G, P = attn_part_floats(D);
    const BlockRows rows(a, j0);
    const int64_t *beg = rows.beg, *end = rows.end, jmin = rows.jmin, jmax = rows.jmax;
    const int64_t active = rows.active, kend = rows.kend;
    if (active == 0) return;
    const int64_t Dp = (D + 7) / 8 * 8;
    float* kf = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));
    float* vf = kf + kKeyBlock * Dp;
    float* s = vf + kValueKeys * Dp;  // s[(r * G + g) * kAttnBlock + j - j0]
    const float** qp = reinterpret_cast<const float**>(s + Q * kAttnBlock);
    for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < G; ++g) qp[r * G + g] = a.q + r * a.q_row_stride + g * a.q_head_stride;
    const KV* kt = static_cast<const KV*>(a.kt);
    const KV* v = static_cast<const KV*>(a.v);
    // A half cache's value rows widened to float once for the block when more than 4 rows read
    // them; up to 4 read the halves in place (2-4 rows at 2,000 cached: 1.05-1.1x, attention alone).
    const bool widen_v = sizeof(KV) == 2 && active > kWidenValueRows;
    const int64_t sb0 = jmin / kKeyBlock, sb1 = (jmax - 1) / kKeyBlock + 1;
    if constexpr (std::is_same_v<KV, Q8>)
        score_keys_q8(qp, Q, static_cast<const uint8_t*>(a.kt), sb0, sb1, j0, kend, D, _mm512_set1_ps(a.scale), s,
                      kAttnBlock, kf, static_cast<const uint8_t*>(a.v));
    else
        score_keys<KV>(qp, Q, kt, sb0, sb1, j0, kend, D, _mm512_set1_ps(a.scale), s, kAttnBlock, kf, v, a.v_stride,
                       Q > kScoreTile || widen_v);
    for (int64_t r = 0; r < R; ++r) {
        if (beg[r] >= end[r]) continue;
        for (int64_t g = 0; g < G; ++g) {
            float* rec = part + (r * G + g) * P;
            rec[1] = block_softmax(s + (r * G + g) * kAttnBlock + (beg[r] - j0), end[r] - beg[r], a.softcap, rec);
            for (int64_t c = 0; c < D; ++c) rec[kAttnOut + c] = 0.0f;
            if constexpr (std::is_same_v<KV, Q8>)
                scale_by_value_scales(s + (r * G + g) * kAttnBlock - j0, static_cast<const uint8_t*>(a.v), D,
                                      static_cast<uint64_t>(beg[r]), static_cast<uint64_t>(end[r]));
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

// ---------------------------------------------------------------------------------------------
// Integer attention over the 8-bit cache (AVX-512 VNNI + VBMI; kernels.h "Integer attention").
// Each query (row, head) is quantised to int8 with one scale (its largest magnitude / 127,
// rounded to nearest even); a score is the exact int32 dot product of the query's and the key's
// entries (vpdpbusd: the key bytes offset by 128 as the unsigned operand, the query's sum times
// 128 taken off) times (the key's scale * (scale * the query's scale)).  The softmax stays in
// float32 (softmax_scaled below).  Each weight times its value row's scale, x = w * 255 / (the
// row's largest in the block), is written as two bytes, hi = floor(x) and lo = round((x - hi) *
// 255), and the value product is (sum hi * v + (sum lo * v) / 255) * largest / 255 with exact
// int32 sums: a 16-bit weight (one byte alone cost as much accuracy as the 8-bit query).  Integer sums are exact
// and every quantisation reads only its own row's data, so a row's result is the same alone or
// in any batch, on any thread split.
#define SPECDEC_VNNI __attribute__((target("avx512vnni,avx512vbmi")))

inline int32_t load_i32(const void* p) {
    int32_t x;
    memcpy(&x, p, sizeof x);
    return x;
}

// Per query, its quantised state (q8_query_bytes apart): q8[nch * 64] (zero padded), the weights'
// hi bytes of the block's 256 keys, their lo bytes (each region kQ8ProbRegion bytes, zero padded),
// then {scale, 128 * sum of q8, weight scale}.
inline int64_t q8_chunks(int64_t D) { return (D + 63) / 64; }
inline int64_t q8_query_bytes(int64_t D) { return q8_chunks(D) * 64 + 2 * kQ8ProbRegion + 64; }
struct QState {
    float qscale;
    int32_t corr;
    float pscale;
};
inline QState* qstate(uint8_t* q, int64_t D) { return reinterpret_cast<QState*>(q + q8_chunks(D) * 64 + 2 * kQ8ProbRegion); }
inline uint8_t* qprobs(uint8_t* q, int64_t D) { return q + q8_chunks(D) * 64; }

SPECDEC_VNNI inline void quantize_query(const float* x, int64_t D, uint8_t* q) {
    __m512 vmax = _mm512_setzero_ps();
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t c = 0; c < D; c += 16) {
        const __mmask16 m = D - c >= 16 ? __mmask16(0xffff) : first_lanes(D - c);
        vmax = _mm512_max_ps(_mm512_and_ps(_mm512_maskz_loadu_ps(m, x + c), absmask), vmax);
    }
    const float amax = _mm512_reduce_max_ps(vmax);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512i sum = _mm512_setzero_si512();
    memset(q, 0, q8_chunks(D) * 64);
    for (int64_t c = 0; c < D; c += 16) {
        const __mmask16 m = D - c >= 16 ? __mmask16(0xffff) : first_lanes(D - c);
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + c), _mm512_set1_ps(inv)));
        const __m512i clamped = _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        sum = _mm512_add_epi32(sum, clamped);
        _mm_mask_storeu_epi8(q + c, m, _mm512_cvtepi32_epi8(clamped));
    }
    QState* st = qstate(q, D);
    st->qscale = amax / 127.0f;
    st->corr = 128 * _mm512_reduce_add_epi32(sum);
}

// The key block's entries ([D, 16] int8) as D / 4 vectors of 16 lanes, lane i the bytes of key i
// at d .. d + 3, offset by 128 (unsigned).
SPECDEC_VNNI inline void transpose_keys(const int8_t* kb, int64_t D, __m512i* kT) {
    alignas(64) static const uint8_t idx[64] = {
        0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
        6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
        12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
    const __m512i perm = _mm512_load_si512(idx);
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t g = 0; g < D / 4; ++g)
        kT[g] = _mm512_xor_si512(_mm512_permutexvar_epi8(perm, _mm512_loadu_si512(kb + g * 64)), bias);
}

// transpose_keys' vector g, made where it is used (one score tile takes the block: no scratch).
SPECDEC_VNNI inline __m512i key_vector(const int8_t* kb, int64_t g) {
    const __m512i perm = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27,
                                         11, 58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22,
                                         6, 53, 37, 21, 5, 52, 36, 20, 4, 51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1,
                                         48, 32, 16, 0);
    return _mm512_xor_si512(_mm512_permutexvar_epi8(perm, _mm512_loadu_si512(kb + g * 64)),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
}

// 16 keys' scores from a query's exact sums (acc): (sum - corr) * (key scale * (scale * query
// scale)), the one float step of every score path (VNNI tiles, AMX sums).
SPECDEC_VNNI inline __m512 score_out(__m512i acc, const QState* st, __m512 ks, float scale) {
    const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_set1_epi32(st->corr)));
    return _mm512_mul_ps(dot, _mm512_mul_ps(ks, _mm512_set1_ps(scale * st->qscale)));
}

// Scores of QT queries (q: their states, qb apart) against one key block (kT, or with Direct
// the block's entries kb): s[t * ss + i].
template <int QT, bool Direct = false>
SPECDEC_VNNI inline void score_tile_i8(uint8_t* q, int64_t qb, const __m512i* kT, int64_t D, __m512 ks, float scale,
                                       float* s, int64_t ss, const int8_t* kb = nullptr) {
    __m512i acc[QT];
    for (int t = 0; t < QT; ++t) acc[t] = _mm512_setzero_si512();
    for (int64_t g = 0; g < D / 4; ++g) {
        const __m512i k = Direct ? key_vector(kb, g) : _mm512_load_si512(kT + g);
        for (int t = 0; t < QT; ++t)
            acc[t] = dpbusd_bcast(acc[t], k, q + t * qb + 4 * g);
    }
    for (int t = 0; t < QT; ++t) _mm512_storeu_ps(s + t * ss, score_out(acc[t], qstate(q + t * qb, D), ks, scale));
}

// Value rows of groups [g0, g1) (4 keys each) of an 8-bit cache head, transposed for vpdpbusd:
// per group and 64-column chunk, four vectors; vector k's lane 4 a + e holds the bytes of columns
// 16 a + 4 k + e of the group's four rows.
SPECDEC_VNNI inline void value_vectors(const uint8_t* vq, int64_t g, int64_t ch, int64_t D, __m512i* o) {
    const int8_t* row = q8_value_row(vq, 4 * g, D);
    const int64_t c = ch * 64, n = D - c < 64 ? D - c : 64;
    const __mmask64 m = n == 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1;
    const __m512i r0 = _mm512_maskz_loadu_epi8(m, row + c), r1 = _mm512_maskz_loadu_epi8(m, row + D + c);
    const __m512i r2 = _mm512_maskz_loadu_epi8(m, row + 2 * D + c), r3 = _mm512_maskz_loadu_epi8(m, row + 3 * D + c);
    const __m512i t0 = _mm512_unpacklo_epi8(r0, r1), t1 = _mm512_unpackhi_epi8(r0, r1);
    const __m512i t2 = _mm512_unpacklo_epi8(r2, r3), t3 = _mm512_unpackhi_epi8(r2, r3);
    o[0] = _mm512_unpacklo_epi16(t0, t2);
    o[1] = _mm512_unpackhi_epi16(t0, t2);
    o[2] = _mm512_unpacklo_epi16(t1, t3);
    o[3] = _mm512_unpackhi_epi16(t1, t3);
}

SPECDEC_VNNI inline void transpose_values(const uint8_t* vq, int64_t g0, int64_t g1, int64_t D, __m512i* vt) {
    const int64_t nch = q8_chunks(D);
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t ch = 0; ch < nch; ++ch) value_vectors(vq, g, ch, D, vt + ((g - g0) * nch + ch) * 4);
}

// One query's value chunk (columns c.. c + 63) from its exact sums: (hi + lo / 255) * pscale,
// the lanes of vector k holding columns 16 a + 4 k + e at lane 4 a + e (value_vectors).
SPECDEC_VNNI inline void value_out(const __m512i* acc, const __m512i* lo, float pscale, float* out, int64_t c,
                                   int64_t D) {
    const __m512 inv255 = _mm512_set1_ps(1.0f / 255.0f);
    const __m512 ps = _mm512_set1_ps(pscale);
    __m512 f[4];
    for (int k = 0; k < 4; ++k)
        f[k] = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(acc[k]), _mm512_mul_ps(_mm512_cvtepi32_ps(lo[k]), inv255)),
                             ps);
    // 4 x 4 transpose of 128-bit lanes: column group a = lane a of f[0..3]
    const __m512 a0 = _mm512_shuffle_f32x4(f[0], f[1], 0x44), a1 = _mm512_shuffle_f32x4(f[0], f[1], 0xEE);
    const __m512 a2 = _mm512_shuffle_f32x4(f[2], f[3], 0x44), a3 = _mm512_shuffle_f32x4(f[2], f[3], 0xEE);
    const __m512 o[4] = {_mm512_shuffle_f32x4(a0, a2, 0x88), _mm512_shuffle_f32x4(a0, a2, 0xDD),
                         _mm512_shuffle_f32x4(a1, a3, 0x88), _mm512_shuffle_f32x4(a1, a3, 0xDD)};
    for (int a = 0; a < 4 && c + 16 * a < D; ++a) {
        const int64_t n = D - c - 16 * a;
        if (n >= 16) _mm512_storeu_ps(out + c + 16 * a, o[a]);
        else _mm512_mask_storeu_ps(out + c + 16 * a, first_lanes(n), o[a]);
    }
}

// out[t][chunk ch's columns] = pscale_t * sum over groups of weight bytes . value bytes, for QT
// queries (q, qb apart; weight bytes of key j at qprobs + j - j0) and groups [g0, g1), each
// group's value rows read from the cache (vq) and transposed in registers where they are used.
// NOTE: every tile transposes its own (were transposed once into scratch for several tiles: at
// 2,000 cached, attention alone, two threads, one / two / four rows 28-29 / 41-43 / 69-70 -> 25-26 /
// 37-39 / 66-67 us a layer, eight and more rows the same or 2-3% faster).
template <int QT>
SPECDEC_VNNI inline void value_tile_i8(uint8_t* q, int64_t qb, int64_t g0, int64_t g1, int64_t ch, int64_t D,
                                       int64_t j0, float* const* out, const uint8_t* vq) {
    __m512i acc[QT][4], lo[QT][4];
    for (int t = 0; t < QT; ++t)
        for (int k = 0; k < 4; ++k) acc[t][k] = lo[t][k] = _mm512_setzero_si512();
    for (int64_t g = g0; g < g1; ++g) {
        __m512i vv[4];
        value_vectors(vq, g, ch, D, vv);
        const __m512i v0 = vv[0], v1 = vv[1], v2 = vv[2], v3 = vv[3];
        for (int t = 0; t < QT; ++t) {
            const uint8_t* pb = qprobs(q + t * qb, D) + 4 * g - j0;
            const __m512i p = _mm512_set1_epi32(load_i32(pb)), pl = _mm512_set1_epi32(load_i32(pb + kQ8ProbRegion));
            acc[t][0] = dpbusd(acc[t][0], p, v0);
            acc[t][1] = dpbusd(acc[t][1], p, v1);
            acc[t][2] = dpbusd(acc[t][2], p, v2);
            acc[t][3] = dpbusd(acc[t][3], p, v3);
            lo[t][0] = dpbusd(lo[t][0], pl, v0);
            lo[t][1] = dpbusd(lo[t][1], pl, v1);
            lo[t][2] = dpbusd(lo[t][2], pl, v2);
            lo[t][3] = dpbusd(lo[t][3], pl, v3);
        }
    }
    for (int t = 0; t < QT; ++t)
        if (out[t]) value_out(acc[t], lo[t], qstate(q + t * qb, D)->pscale, out[t], ch * 64, D);
}

// exp(x) for x <= 0, within 1e-7 relative (exp512's accuracy): 2^n e^r with n = round(x / ln 2)
// and r = x - n ln 2 (two steps, Cody and Waite), e^r by its degree-7 Taylor polynomial
// (|r| <= ln 2 / 2), and 2^n applied by vscalefps (no exponent arithmetic; the tiniest results
// come out subnormal).  x below -88 is taken as -88 (e^-88 is below the float
// weights' resolution); NaN stays NaN.
SPECDEC_VNNI inline __m512 exp_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// The integer attention's softmax of one row's scores s (key j at s + j - j0) over keys [b, e):
// the soft cap (in place), the maximum m (*m_out), each weight w = exp(s - m), and in s each
// weight times its value row's scale.  Returns l = the sum of the weights (16 lanes, one lane per
// key position mod 16, added in key order, then reduced) and *pmax = the largest scaled weight.
// One pass after the maximum's, in the cache's 16-key blocks; depends only on the row's own keys.
// NOTE: one pass and exp_neg (12 vector operations to exp512's 19) in place of block_softmax and
// a pass of its own for the value scales: 16 rows at 2,000 cached 1.07x (attention alone, one
// thread, 2-core Zen 4 EPYC).
SPECDEC_VNNI inline float softmax_scaled(float* s, int64_t j0, int64_t b, int64_t e, float softcap, const uint8_t* vq,
                                         int64_t D, float* m_out, float* pmax) {
    if (softcap > 0.0f)
        for (int64_t j = b; j < e; ++j) s[j - j0] = softcap * tanhf(s[j - j0] / softcap);
    __m512 vm = _mm512_set1_ps(-INFINITY);
    int64_t i = b;
    for (; i + 16 <= e; i += 16) vm = _mm512_max_ps(_mm512_loadu_ps(s + i - j0), vm);
    if (i < e) vm = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), first_lanes(e - i), s + i - j0), vm);
    const float m = _mm512_reduce_max_ps(vm);
    *m_out = m;
    const __m512 vmx = _mm512_set1_ps(m);
    const uint64_t bb = static_cast<uint64_t>(q8_block_bytes(D));
    __m512 sum = _mm512_setzero_ps(), vmax = _mm512_setzero_ps();
    for (int64_t jb = b & ~(kKeyBlock - 1); jb < e; jb += kKeyBlock) {
        const int64_t lo = b > jb ? b - jb : 0, hi = e - jb < kKeyBlock ? e - jb : kKeyBlock;
        const __mmask16 mask = static_cast<__mmask16>(first_lanes(hi) & ~first_lanes(lo));
        const __m512 w = _mm512_maskz_mov_ps(mask, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + jb - j0), vmx)));
        sum = _mm512_add_ps(sum, w);
        const float* vs = reinterpret_cast<const float*>(vq + static_cast<uint64_t>(jb / kKeyBlock) * bb);
        const __m512 x = _mm512_mul_ps(w, _mm512_maskz_loadu_ps(mask, vs));
        _mm512_mask_storeu_ps(s + jb - j0, mask, x);
        vmax = _mm512_max_ps(x, vmax);  // masked lanes are 0, and the weights are >= 0
    }
    *pmax = _mm512_reduce_max_ps(vmax);
    return _mm512_reduce_add_ps(sum);
}

// Each weight of keys [b, e) (p, already times its value row's scale) as two bytes, hi at
// pb + j - j0 and lo kQ8ProbRegion further (x = p * 255 / largest: floor(x), round((x - hi) * 255));
// returns the scale (largest / 255).
// pmax: the largest weight of [b, e) (softmax_scaled).
SPECDEC_VNNI inline float quantize_probs(const float* p, int64_t j0, int64_t b, int64_t e, uint8_t* pb, float pmax) {
    const float inv = pmax > 0.0f ? 255.0f / pmax : 0.0f;
    for (int64_t j = b; j < e; j += 16) {
        const __mmask16 m = e - j >= 16 ? __mmask16(0xffff) : first_lanes(e - j);
        const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + j - j0), _mm512_set1_ps(inv));
        const __m512 hi = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        const __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(x, hi), _mm512_set1_ps(255.0f)));
        const __m512i zero = _mm512_setzero_si512();
        _mm_mask_storeu_epi8(pb + j - j0, m, _mm512_cvtusepi32_epi8(_mm512_max_epi32(_mm512_cvtps_epi32(hi), zero)));
        _mm_mask_storeu_epi8(pb + kQ8ProbRegion + j - j0, m, _mm512_cvtusepi32_epi8(_mm512_max_epi32(lo, zero)));
    }
    return pmax / 255.0f;
}

constexpr int kScoreTileI8 = 12;
constexpr int kValueTileI8 = 2;
// From this many queries (rows x heads of a kv head) the score and value sums go to the tile unit
// when ops.cpp has set it (set_attention_amx).
constexpr int64_t kAmxMinQueries = 8;
std::atomic<AmxValueSumsFn> g_attention_amx{nullptr};
std::atomic<AmxScoreSumsFn> g_attention_amx_scores{nullptr};

SPECDEC_VNNI void attention_block_q8_int(const AttnRows& a, int64_t j0, float* part, float* scratch) {
    const int64_t D = a.D, G = a.G, R = a.R, Q = R * G, P = attn_part_floats(D);
    const BlockRows rows(a, j0);
    const int64_t *beg = rows.beg, *end = rows.end, jmin = rows.jmin, jmax = rows.jmax, kend = rows.kend;
    if (rows.active == 0) return;
    const int64_t nch = q8_chunks(D), qb = q8_query_bytes(D), bb = q8_block_bytes(D);
    uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~uintptr_t(63));
    __m512i* kT = reinterpret_cast<__m512i*>(base);                         // D / 4 vectors
    __m512i* vt = kT + (D + 63) / 64 * 16;                                   // 64 groups x nch x 4
    float* s = reinterpret_cast<float*>(vt + (kAttnBlock / 4) * nch * 4);   // Q x kAttnBlock
    uint8_t* qs = reinterpret_cast<uint8_t*>(s + Q * kAttnBlock);           // Q x qb
    const uint8_t* kq = static_cast<const uint8_t*>(a.kt);
    const uint8_t* vq = static_cast<const uint8_t*>(a.v);
    for (int64_t r = 0; r < R; ++r)
        for (int64_t g = 0; g < G; ++g) {
            uint8_t* q = qs + (r * G + g) * qb;
            quantize_query(a.q + r * a.q_row_stride + g * a.q_head_stride, D, q);
            memset(qprobs(q, D), 0, 2 * kQ8ProbRegion);
        }
    // scores, block by block
    const int64_t sb0 = jmin / kKeyBlock, sb1 = (jmax - 1) / kKeyBlock + 1;
    const AmxScoreSumsFn amx_scores = Q >= kAmxMinQueries ? g_attention_amx_scores.load(std::memory_order_relaxed) : nullptr;
    if (amx_scores != nullptr) {
        // every block's keys transposed (into the values' scratch, free until the value products),
        // their exact sums on the tile unit into the scores' rows, then score_tile_i8's float steps
        uint8_t* kall = reinterpret_cast<uint8_t*>(vt);
        for (int64_t sb = sb0; sb < sb1; ++sb) {
            const uint8_t* kb = kq + sb * bb;
            if (sb * kKeyBlock < kend) prefetch_span_l2(vq + sb * bb, bb);
            transpose_keys(reinterpret_cast<const int8_t*>(kb + kQ8Header), D,
                           reinterpret_cast<__m512i*>(kall + (sb - sb0) * nch * 1024));
        }
        int32_t* si = reinterpret_cast<int32_t*>(s + (sb0 * kKeyBlock - j0));
        amx_scores(qs, qb, Q, kall, nch, sb1 - sb0, si, kAttnBlock);
        for (int64_t t = 0; t < Q; ++t) {
            const QState* st = qstate(qs + t * qb, D);
            for (int64_t sb = sb0; sb < sb1; ++sb) {
                const __m512 ks = _mm512_loadu_ps(reinterpret_cast<const float*>(kq + sb * bb));
                float* sd = s + t * kAttnBlock + (sb * kKeyBlock - j0);
                _mm512_storeu_ps(sd, score_out(_mm512_loadu_si512(sd), st, ks, a.scale));
            }
        }
    }
    for (int64_t sb = amx_scores != nullptr ? sb1 : sb0; sb < sb1; ++sb) {
        const uint8_t* kb = kq + sb * bb;
        if (sb * kKeyBlock < kend) prefetch_span_l2(vq + sb * bb, bb);
        if ((sb + 1) * kKeyBlock + kAttnPrefetchKeys <= kend)
            prefetch_span_l2(kb + kAttnPrefetchKeys / kKeyBlock * bb, bb);
        const int8_t* ke = reinterpret_cast<const int8_t*>(kb + kQ8Header);
        const __m512 ks = _mm512_loadu_ps(reinterpret_cast<const float*>(kb));
        float* sd = s + (sb * kKeyBlock - j0);
        const int64_t ntiles = (Q + kScoreTileI8 - 1) / kScoreTileI8;
        if (ntiles == 1) {  // one tile: the keys transposed in registers
            switch (Q) {
                case 1: score_tile_i8<1, true>(qs, qb, kT, D, ks, a.scale, sd, kAttnBlock, ke); break;
                case 2: score_tile_i8<2, true>(qs, qb, kT, D, ks, a.scale, sd, kAttnBlock, ke); break;
                case 3: score_tile_i8<3, true>(qs, qb, kT, D, ks, a.scale, sd, kAttnBlock, ke); break;
                case 4: score_tile_i8<4, true>(qs, qb, kT, D, ks, a.scale, sd, kAttnBlock, ke); break;
                case 5: score_tile_i8<5, true>(qs, qb, kT, D, ks, a.scale, sd, kAttnBlock, ke); break;
                case 6: score_tile_i8<6, true>(qs, qb, kT, D, ks, a.scale, sd, kAttnBlock, ke); break;
                case 7: score_tile_i8<7, true>(qs, qb, kT, D, ks, a.scale, sd, kAttnBlock, ke); break;
                case 8: score_tile_i8<8, true>(qs, qb, kT, D, ks, a.scale, sd, kAttnBlock, ke); break;
                case 9: score_tile_i8<9, true>(qs, qb, kT, D, ks, a.scale, sd, kAttnBlock, ke); break;
                case 10: score_tile_i8<10, true>(qs, qb, kT, D, ks, a.scale, sd, kAttnBlock, ke); break;
                case 11: score_tile_i8<11, true>(qs, qb, kT, D, ks, a.scale, sd, kAttnBlock, ke); break;
                default: score_tile_i8<12, true>(qs, qb, kT, D, ks, a.scale, sd, kAttnBlock, ke); break;
            }
            continue;
        }
        transpose_keys(ke, D, kT);
        for (int64_t i = 0, t = 0; i < ntiles; ++i) {
            const int64_t qt = Q / ntiles + (i < Q % ntiles ? 1 : 0);
            uint8_t* q = qs + t * qb;
            float* st = sd + t * kAttnBlock;
            switch (qt) {
                case 1: score_tile_i8<1>(q, qb, kT, D, ks, a.scale, st, kAttnBlock); break;
                case 2: score_tile_i8<2>(q, qb, kT, D, ks, a.scale, st, kAttnBlock); break;
                case 3: score_tile_i8<3>(q, qb, kT, D, ks, a.scale, st, kAttnBlock); break;
                case 4: score_tile_i8<4>(q, qb, kT, D, ks, a.scale, st, kAttnBlock); break;
                case 5: score_tile_i8<5>(q, qb, kT, D, ks, a.scale, st, kAttnBlock); break;
                case 6: score_tile_i8<6>(q, qb, kT, D, ks, a.scale, st, kAttnBlock); break;
                case 7: score_tile_i8<7>(q, qb, kT, D, ks, a.scale, st, kAttnBlock); break;
                case 8: score_tile_i8<8>(q, qb, kT, D, ks, a.scale, st, kAttnBlock); break;
                case 9: score_tile_i8<9>(q, qb, kT, D, ks, a.scale, st, kAttnBlock); break;
                case 10: score_tile_i8<10>(q, qb, kT, D, ks, a.scale, st, kAttnBlock); break;
                case 11: score_tile_i8<11>(q, qb, kT, D, ks, a.scale, st, kAttnBlock); break;
                default: score_tile_i8<12>(q, qb, kT, D, ks, a.scale, st, kAttnBlock); break;
            }
            t += qt;
        }
    }
    // softmax in float, then the weights times their value scales, as bytes
    for (int64_t r = 0; r < R; ++r) {
        if (beg[r] >= end[r]) continue;
        for (int64_t g = 0; g < G; ++g) {
            const int64_t i = r * G + g;
            float* rec = part + i * P;
            float* si = s + i * kAttnBlock;
            float pmax;
            rec[1] = softmax_scaled(si, j0, beg[r], end[r], a.softcap, vq, D, rec, &pmax);
            uint8_t* q = qs + i * qb;
            qstate(q, D)->pscale = quantize_probs(si, j0, beg[r], end[r], qprobs(q, D), pmax);
        }
    }
    // values: groups of 4 keys covering every row's range
    const int64_t g0 = jmin / 4, g1 = (jmax + 3) / 4;
    const AmxValueSumsFn amx = Q >= kAmxMinQueries ? g_attention_amx.load(std::memory_order_relaxed) : nullptr;
    if (amx != nullptr) {
        // the same exact sums on the tile unit, then value_tile_i8's float steps
        transpose_values(vq, g0, g1, D, vt);
        int32_t* sums = reinterpret_cast<int32_t*>(qs + Q * qb);  // Q x nch x 128
        amx(qprobs(qs, D) + 4 * g0 - j0, qb, Q, reinterpret_cast<const uint8_t*>(vt), nch, g1 - g0, sums);
        for (int64_t t = 0; t < Q; ++t) {
            if (beg[t / G] >= end[t / G]) continue;
            const float ps = qstate(qs + t * qb, D)->pscale;
            for (int64_t ch = 0; ch < nch; ++ch) {
                const int32_t* st = sums + (t * nch + ch) * 128;
                __m512i acc[4], lo[4];
                for (int k = 0; k < 4; ++k) {
                    acc[k] = _mm512_loadu_si512(st + 16 * k);
                    lo[k] = _mm512_loadu_si512(st + 64 + 16 * k);
                }
                value_out(acc, lo, ps, part + t * P + kAttnOut, ch * 64, D);
            }
        }
        return;
    }
    const int64_t ntiles = (Q + kValueTileI8 - 1) / kValueTileI8;
    float* outs[kValueTileI8];
    for (int64_t ch = 0; ch < nch; ++ch)
        for (int64_t i = 0, t = 0; i < ntiles; ++i) {
            const int64_t qt = Q / ntiles + (i < Q % ntiles ? 1 : 0);
            for (int64_t k = 0; k < qt; ++k) {
                const int64_t r = (t + k) / G;
                outs[k] = beg[r] < end[r] ? part + (t + k) * P + kAttnOut : nullptr;
            }
            uint8_t* q = qs + t * qb;
            if (qt == 1) value_tile_i8<1>(q, qb, g0, g1, ch, D, j0, outs, vq);
            else value_tile_i8<2>(q, qb, g0, g1, ch, D, j0, outs, vq);
            t += qt;
        }
}

bool q8_int_cpu() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
}

std::atomic<bool> g_q8_int{[] {
    const char* env = std::getenv("SPECDEC_INT8_ATTENTION");
    return q8_int_cpu() && !(env && std::string(env) == "0");
}()};

}  // namespace

// NOTE: a float32 cache stays on the AVX2 kernel (the same results): on 16 lanes it ran 0.75x at
// one row and 0.9x at eight (2,000 cached, one kv head, 2-core Xeon with AMX), where the half and
// 8-bit caches ran 1.3x and 1.15x.
void avx512_attention_block(const AttnRows& a, int64_t j0, float* part, float* scratch) {
    if (a.q8 && a.D % 4 == 0 && g_q8_int.load(std::memory_order_relaxed)) attention_block_q8_int(a, j0, part, scratch);
    else if (a.q8) attention_block_kv<Q8>(a, j0, part, scratch);
    else if (a.half) attention_block_kv<uint16_t>(a, j0, part, scratch);
    else avx2_table()->attention_block(a, j0, part, scratch);
}

}  // namespace specdec

namespace specdec {
void set_attention_amx(AmxValueSumsFn values, AmxScoreSumsFn scores) {
    g_attention_amx.store(values, std::memory_order_relaxed);
    g_attention_amx_scores.store(scores, std::memory_order_relaxed);
}

bool avx512_q8_int_attention(int on) {
    if (on >= 0) g_q8_int.store(on != 0 && q8_int_cpu());
    return g_q8_int.load();
}
}  // namespace specdec
