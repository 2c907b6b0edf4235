// 16-bit weights (IEEE half, bfloat16) on AMX-BF16 tiles: the "bf16x2" activation format.
// Compiled on its own with the AVX-512 flags plus -mavx512bf16 -mamx-tile -mamx-bf16; only called
// after ops.cpp has checked the CPU and obtained the tile-state permission.
//
// The numbers.  Each float32 activation x is split into two bfloat16s, hi = bf16(x) and
// lo = bf16(x - hi) (both round to nearest even), so hi + lo keeps ~16 of x's 24 significant bits
// (|x - hi - lo| <= 2^-16 |x|).  A bfloat16 weight is exact as it is; a half weight w (11
// significant bits) is split into hi (w truncated to bfloat16) and lo = w - hi (< 2^-7 |w|), and
// hi + lo == w exactly.  Every output is
//     sum over 32-input blocks b in order of [ W_hi . X_hi, W_hi . X_lo, (half only) W_lo . X_hi ]
// accumulated in float32 by TDPBF16PS (products of two bfloat16s are exact in float32; the sums
// round to nearest even).  Each product is off by at most 2^-16 of itself (bfloat16 weights) or
// 3 * 2^-16 (half weights: the dropped W_lo . X_lo too).  So the arithmetic is float32-class
// (llama.cpp rounds activations to 16 bits for these formats), and it is batch-invariant: every
// output element of a tile product depends only on its own weight row and activation row, and
// the order of the products over K is the same for every row count, row tile, thread and task
// split.  Decode uses the same tiles (its one activation row padded to a tile of 16), so
// verification rows equal decode rows bit for bit.
//
// Layouts.  The weights are the tiles' A operand, repacked once at load (ops.cpp repack_x2) into
// 1 KiB tiles of 16 weight rows x 32 inputs, zero-padded past N and K, so that each weight tile is
// one contiguous read; half weights are split into hi and lo scratch tiles before their products.
// The activations are the B operand: per group of 16 activation rows and block of 32 inputs, a
// 1 KiB tile of 16 input pairs x 16 rows (row t holds, for every activation row m, inputs 2t and
// 2t + 1 at elements 2m and 2m + 1), hi tile then lo tile (amx16_pack_x).  The result tile is
// [16 weight rows x 16 activation rows] in float32.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "amx_tiles.h"
#include "kernels.h"

namespace specdec {
namespace {

// Every tile is 16 rows x 64 bytes: 0-3 the results (weight tile i x activation group j at 2i+j),
// 4-5 two weight tiles, 6-7 two activation tiles.
void configure() {
    TileConfig c = tile_config();
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    load_tile_config(c);
}

// C += A . B
#define SPECDEC_TDPBF16PS(C, A, B) __asm__ volatile("tdpbf16ps %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::)

constexpr int64_t kTileElems = 512;  // 16 x 32 bfloat16
constexpr int64_t kChunkBlocks = 16;  // 32-input blocks per K chunk (512 inputs)
constexpr int64_t kBlockRows = 64;    // weight rows per block (4 tiles)
constexpr int64_t kMaxGroups = 16;    // activation groups (of 16 rows) per pass: 256 rows
constexpr int64_t kPrefetchBlocks = 4;  // weight tiles: blocks ahead of their prefetch
constexpr int64_t kStreamAhead = 2;     // half weights, few rows: blocks split ahead of their use
constexpr int64_t kStreamSlots = 4;     // ... into a ring of this many blocks (4 weight tiles each)

// hi and lo bfloat16 halves of 32 floats (lo = x - hi, rounded).
inline void split32(__m512 f0, __m512 f1, __m512i& hi, __m512i& lo) {
    const __m512bh h = _mm512_cvtne2ps_pbh(f1, f0);
    hi = (__m512i)h;
    const __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16));
    const __m512 h1 =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi, 1)), 16));
    lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(f1, h1), _mm512_sub_ps(f0, h0));
}

// One half weight tile (16 rows x 32, contiguous) split into its hi and lo bfloat16 tiles: hi is the
// weight truncated to bfloat16 (its top 8 significant bits: no rounding step, fewer instructions
// than split32) and lo = w - hi, at most 3 more bits, so hi + lo == w exactly.
inline void split_tile(const uint16_t* t, uint16_t* hi_t, uint16_t* lo_t) {
    const __m512 top = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    for (int r = 0; r < 16; ++r) {
        const __m512i v = _mm512_loadu_si512(t + r * 32);
        const __m512 f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(v));
        const __m512 f1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(v, 1));
        const __m512 h0 = _mm512_and_ps(f0, top), h1 = _mm512_and_ps(f1, top);
        _mm512_storeu_si512(hi_t + r * 32, (__m512i)_mm512_cvtne2ps_pbh(h1, h0));
        _mm512_storeu_si512(lo_t + r * 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(f1, h1), _mm512_sub_ps(f0, h0)));
    }
}

// Result tile 2i + j += weight tile (register 4 + i) . activation tile (register 6 + j).
template <int NW, int NG>
inline void products() {
    SPECDEC_TDPBF16PS(0, 4, 6);
    if constexpr (NG > 1) SPECDEC_TDPBF16PS(1, 4, 7);
    if constexpr (NW > 1) SPECDEC_TDPBF16PS(2, 5, 6);
    if constexpr (NW > 1 && NG > 1) SPECDEC_TDPBF16PS(3, 5, 7);
}

// Result tiles of NW weight tiles x NG activation groups, over blocks [b0, b1) of one chunk.
// a(i, b, part) -> (pointer, stride) of weight tile i's block b (part 0 hi, 1 lo);
// xg[j] the packed activations of group j.
template <int QT, int NW, int NG, class A, class P>
inline void tile_products(const A& a, const P& prep, const uint16_t* const* xg, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
        prep(b);
        const uint16_t* xh0 = xg[0] + b * 2 * kTileElems;
        const uint16_t* xh1 = NG > 1 ? xg[1] + b * 2 * kTileElems : nullptr;
        {
            SPECDEC_TILE_LOADD(4, a(0, b, 0), 64);
            if constexpr (NW > 1) SPECDEC_TILE_LOADD(5, a(1, b, 0), 64);
        }
        SPECDEC_TILE_LOADD(6, xh0, 64);
        if constexpr (NG > 1) SPECDEC_TILE_LOADD(7, xh1, 64);
        products<NW, NG>();
        SPECDEC_TILE_LOADD(6, xh0 + kTileElems, 64);
        if constexpr (NG > 1) SPECDEC_TILE_LOADD(7, xh1 + kTileElems, 64);
        products<NW, NG>();
        if constexpr (QT == QT_F16) {
            SPECDEC_TILE_LOADD(4, a(0, b, 1), 64);
            if constexpr (NW > 1) SPECDEC_TILE_LOADD(5, a(1, b, 1), 64);
            SPECDEC_TILE_LOADD(6, xh0, 64);
            if constexpr (NG > 1) SPECDEC_TILE_LOADD(7, xh1, 64);
            products<NW, NG>();
        }
    }
}

// One activation group (decode, short verification) against NW <= 4 bfloat16 weight tiles: result
// tile t for weight tile t, so that four independent accumulation chains hide the products'
// latency (with two, the tile unit waited on them: benchmarks/x2_gemm.py, one row 1.04x -> 1.09x
// the float kernels).  Per result, the same products in the same order as tile_products (bfloat16
// weights have no lo part), so the same numbers.
#define SPECDEC_W1(T, AREG)                        \
    if constexpr (NW > T) {                        \
        SPECDEC_TILE_LOADD(AREG, a(T, b, 0), 64);    \
        SPECDEC_TDPBF16PS(T, AREG, 6);             \
        SPECDEC_TDPBF16PS(T, AREG, 7);             \
    }
template <int NW, class A, class P>
inline void tile_products1(const A& a, const P& prep, const uint16_t* xg, int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
        prep(b);
        SPECDEC_TILE_LOADD(6, xg + b * 2 * kTileElems, 64);
        SPECDEC_TILE_LOADD(7, xg + b * 2 * kTileElems + kTileElems, 64);
        SPECDEC_W1(0, 4)
        SPECDEC_W1(1, 5)
        SPECDEC_W1(2, 4)
        SPECDEC_W1(3, 5)
    }
}
#undef SPECDEC_W1

template <int NW, class A, class P>
inline void chunk_pass1(const A& a, const P& prep, const uint16_t* xg, int64_t b0, int64_t b1, float* c,
                        int64_t ngmax, bool first) {
    if (first) {
        SPECDEC_TILE_ZERO(0);
        if constexpr (NW > 1) SPECDEC_TILE_ZERO(1);
        if constexpr (NW > 2) SPECDEC_TILE_ZERO(2);
        if constexpr (NW > 3) SPECDEC_TILE_ZERO(3);
    } else {
        SPECDEC_TILE_LOADD(0, c, 64);
        if constexpr (NW > 1) SPECDEC_TILE_LOADD(1, c + ngmax * 256, 64);
        if constexpr (NW > 2) SPECDEC_TILE_LOADD(2, c + 2 * ngmax * 256, 64);
        if constexpr (NW > 3) SPECDEC_TILE_LOADD(3, c + 3 * ngmax * 256, 64);
    }
    tile_products1<NW>(a, prep, xg, b0, b1);
    SPECDEC_TILE_STORED(0, c, 64);
    if constexpr (NW > 1) SPECDEC_TILE_STORED(1, c + ngmax * 256, 64);
    if constexpr (NW > 2) SPECDEC_TILE_STORED(2, c + 2 * ngmax * 256, 64);
    if constexpr (NW > 3) SPECDEC_TILE_STORED(3, c + 3 * ngmax * 256, 64);
}

// Result tiles in memory (c: per weight tile i and group j, 16 x 16 floats at (i * NGmax + j) * 256).
template <int NW, int NG>
inline void load_results(const float* c, int64_t ngmax, bool zero) {
    if (zero) {
        SPECDEC_TILE_ZERO(0);
        if constexpr (NG > 1) SPECDEC_TILE_ZERO(1);
        if constexpr (NW > 1) SPECDEC_TILE_ZERO(2);
        if constexpr (NW > 1 && NG > 1) SPECDEC_TILE_ZERO(3);
        return;
    }
    SPECDEC_TILE_LOADD(0, c, 64);
    if constexpr (NG > 1) SPECDEC_TILE_LOADD(1, c + 256, 64);
    if constexpr (NW > 1) SPECDEC_TILE_LOADD(2, c + ngmax * 256, 64);
    if constexpr (NW > 1 && NG > 1) SPECDEC_TILE_LOADD(3, c + ngmax * 256 + 256, 64);
}
template <int NW, int NG>
inline void store_results(float* c, int64_t ngmax) {
    SPECDEC_TILE_STORED(0, c, 64);
    if constexpr (NG > 1) SPECDEC_TILE_STORED(1, c + 256, 64);
    if constexpr (NW > 1) SPECDEC_TILE_STORED(2, c + ngmax * 256, 64);
    if constexpr (NW > 1 && NG > 1) SPECDEC_TILE_STORED(3, c + ngmax * 256 + 256, 64);
}

template <int QT, int NW, int NG, class A, class P>
inline void chunk_pass(const A& a, const P& prep, const uint16_t* const* xg, int64_t b0, int64_t b1, float* c,
                       int64_t ngmax, bool first) {
    load_results<NW, NG>(c, ngmax, first);
    tile_products<QT, NW, NG>(a, prep, xg, b0, b1);
    store_results<NW, NG>(c, ngmax);
}

// Weight rows [r0, r0 + nr) (r0 a multiple of 16, nr <= kBlockRows) against activation groups
// [g0, g0 + ng) (ng <= kMaxGroups): every chunk of K, then the results (transposed) + bias into y.
template <int QT>
void block_rows(const uint16_t* xp, int64_t nb, int64_t M, const uint16_t* w, const float* bias, float* y,
                int64_t ldy, int64_t r0, int64_t nr, int64_t g0, int64_t ng, uint16_t* wscratch, float* c) {
    const int64_t nw = (nr + 15) / 16;
    const uint16_t* wt = w + (r0 / 16) * nb * kTileElems;  // this block's first weight tile
    auto tile = [&](int64_t i, int64_t b) { return wt + (i * nb + b) * kTileElems; };
    // Half weights are split into wscratch: against many activation rows (prefill) a whole chunk
    // first (tile (i * kChunkBlocks + b) * 2 + part), against few (decode, verification) block by
    // block kStreamAhead blocks ahead of their use into a ring, so that the split overlaps the
    // tile products and the memory stream.  The same tiles either way, so the same numbers.
    const bool stream = QT == QT_F16 && ng <= 2;
    // Few activation rows: the result tiles stay in the tile registers over the whole of K (one
    // "chunk"), instead of a store and a load per 512 inputs; many rows: chunks of K, so that
    // the chunk's activations stay in L2 while the weight tiles pass.  Same products, same order.
    const int64_t chunk = ng <= 2 ? nb : kChunkBlocks;
    const uint16_t* xg_all[kMaxGroups];
    for (int64_t j = 0; j < ng; ++j) xg_all[j] = xp + (g0 + j) * nb * 2 * kTileElems;
    for (int64_t cb0 = 0; cb0 < nb; cb0 += chunk) {
        const int64_t cb1 = std::min(nb, cb0 + chunk);
        if (QT == QT_F16 && !stream)
            for (int64_t i = 0; i < nw; ++i)
                for (int64_t b = cb0; b < cb1; ++b) {
                    uint16_t* th = wscratch + ((i * kChunkBlocks + (b - cb0)) * 2) * kTileElems;
                    split_tile(tile(i, b), th, th + kTileElems);
                }
        // Weight tiles per pass: four for bfloat16 weights against one activation group (four
        // accumulation chains); two otherwise (half weights: splitting four tiles per block ahead
        // measured slower than the chains gain).
        const bool four = QT == QT_BF16 && ng == 1;
        const int64_t step = four ? 4 : 2;
        for (int64_t i = 0; i < nw; i += step) {
            const int nt = static_cast<int>(std::min(step, nw - i));
            auto ring = [&](int t, int64_t b) { return wscratch + (((b % kStreamSlots) * 4 + t) * 2) * kTileElems; };
            auto a = [&](int t, int64_t b, int part) -> const uint16_t* {
                if (QT == QT_BF16) return tile(i + t, b);
                if (stream) return ring(t, b) + part * kTileElems;
                return wscratch + (((i + t) * kChunkBlocks + (b - cb0)) * 2 + part) * kTileElems;
            };
            auto prep = [&](int64_t b) {
                if (QT == QT_BF16) {
                    for (int t = 0; t < nt; ++t)  // the weight stream, kPrefetchBlocks ahead
                        for (int l = 0; l < 16; ++l)
                            _mm_prefetch(reinterpret_cast<const char*>(tile(i + t, b + kPrefetchBlocks)) + 64 * l,
                                         _MM_HINT_T0);
                    return;
                }
                if (!stream) return;
                if (b == cb0)
                    for (int64_t bb = cb0; bb < std::min(cb1, cb0 + kStreamAhead); ++bb)
                        for (int t = 0; t < nt; ++t) split_tile(tile(i + t, bb), ring(t, bb), ring(t, bb) + kTileElems);
                if (b + kStreamAhead < cb1)
                    for (int t = 0; t < nt; ++t) {
                        const int64_t bb = b + kStreamAhead;
                        for (int l = 0; l < 16; ++l)
                            _mm_prefetch(reinterpret_cast<const char*>(tile(i + t, bb + kPrefetchBlocks)) + 64 * l,
                                         _MM_HINT_T0);
                        split_tile(tile(i + t, bb), ring(t, bb), ring(t, bb) + kTileElems);
                    }
            };
            if (four) {
                float* ci = c + i * kMaxGroups * 256;
                const bool first = cb0 == 0;
                switch (nt) {
                    case 4: chunk_pass1<4>(a, prep, xg_all[0], cb0, cb1, ci, kMaxGroups, first); break;
                    case 3: chunk_pass1<3>(a, prep, xg_all[0], cb0, cb1, ci, kMaxGroups, first); break;
                    case 2: chunk_pass1<2>(a, prep, xg_all[0], cb0, cb1, ci, kMaxGroups, first); break;
                    default: chunk_pass1<1>(a, prep, xg_all[0], cb0, cb1, ci, kMaxGroups, first); break;
                }
                continue;
            }
            for (int64_t j = 0; j < ng; j += 2) {
                float* cij = c + (i * kMaxGroups + j) * 256;
                const bool first = cb0 == 0;
                if (nt == 2 && j + 1 < ng) chunk_pass<QT, 2, 2>(a, prep, xg_all + j, cb0, cb1, cij, kMaxGroups, first);
                else if (nt == 2) chunk_pass<QT, 2, 1>(a, prep, xg_all + j, cb0, cb1, cij, kMaxGroups, first);
                else if (j + 1 < ng) chunk_pass<QT, 1, 2>(a, prep, xg_all + j, cb0, cb1, cij, kMaxGroups, first);
                else chunk_pass<QT, 1, 1>(a, prep, xg_all + j, cb0, cb1, cij, kMaxGroups, first);
            }
        }
    }
    // Results: tile (i, j) holds c[r][m] for weight row r0 + 16i + r, activation row 16(g0 + j) + m.
    const __m512i cols = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    for (int64_t i = 0; i < nw; ++i) {
        const int64_t rows = std::min<int64_t>(16, nr - i * 16);
        const __mmask16 rmask = rows >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(rmask, bias + r0 + i * 16) : _mm512_setzero_ps();
        for (int64_t j = 0; j < ng; ++j) {
            const float* t = c + (i * kMaxGroups + j) * 256;
            const int64_t mbase = (g0 + j) * 16;
            const int64_t mrows = std::min<int64_t>(16, M - mbase);
            for (int64_t m = 0; m < mrows; ++m) {
                __m512 v = _mm512_i32gather_ps(cols, t + m, 4);
                if (bias) v = _mm512_add_ps(v, bv);
                _mm512_mask_storeu_ps(y + (mbase + m) * ldy + r0 + i * 16, rmask, v);
            }
        }
    }
}

template <int QT>
void amx16_rows(const uint16_t* xp, int64_t M, int64_t K, const uint16_t* w, const float* bias, float* y,
                int64_t ldy, int64_t n0, int64_t n1, void* scratch) {
    const int64_t nb = (K + 31) / 32, groups = (M + 15) / 16;
    uint16_t* wscratch = static_cast<uint16_t*>(scratch);
    float* c = reinterpret_cast<float*>(static_cast<char*>(scratch) + kAmx16WeightScratchBytes);
    configure();
    for (int64_t g0 = 0; g0 < groups; g0 += kMaxGroups) {
        const int64_t ng = std::min(kMaxGroups, groups - g0);
        for (int64_t r0 = n0; r0 < n1; r0 += kBlockRows) {
            const int64_t nr = std::min(kBlockRows, n1 - r0);
            block_rows<QT>(xp, nb, M, w, bias, y, ldy, r0, nr, g0, ng, wscratch, c);
        }
    }
    release_tiles();
}

}  // namespace

int64_t amx16_packed_x_elems(int64_t M, int64_t K) { return (M + 15) / 16 * ((K + 31) / 32) * 2 * kTileElems; }

void amx16_pack_x(const float* x, int64_t M, int64_t K, uint16_t* xp, int64_t g0, int64_t g1) {
    const int64_t nb = (K + 31) / 32;
    const __m512i pairs = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(16));
    for (int64_t g = g0; g < g1; ++g) {
        uint16_t* tg = xp + g * nb * 2 * kTileElems;
        const int64_t rows = std::min<int64_t>(16, M - g * 16);
        if (rows < 16) memset(tg, 0, static_cast<size_t>(nb * 2 * kTileElems * 2));
        for (int64_t m = 0; m < rows; ++m) {
            const float* xr = x + (g * 16 + m) * K;
            for (int64_t b = 0; b < nb; ++b) {
                const int64_t kn = std::min<int64_t>(32, K - b * 32);
                __m512 f0, f1;
                if (kn == 32) {
                    f0 = _mm512_loadu_ps(xr + b * 32);
                    f1 = _mm512_loadu_ps(xr + b * 32 + 16);
                } else {
                    const int64_t k0n = std::min<int64_t>(16, kn), k1n = kn - k0n;
                    f0 = _mm512_maskz_loadu_ps(__mmask16((1u << k0n) - 1), xr + b * 32);
                    f1 = _mm512_maskz_loadu_ps(k1n > 0 ? __mmask16((1u << k1n) - 1) : __mmask16(0), xr + b * 32 + 16);
                }
                __m512i hi, lo;
                split32(f0, f1, hi, lo);
                // Pair t of this row goes to tile row t, element pair m.
                uint32_t* th = reinterpret_cast<uint32_t*>(tg + b * 2 * kTileElems) + m;
                _mm512_i32scatter_epi32(th, pairs, hi, 4);
                _mm512_i32scatter_epi32(th + kTileElems / 2, pairs, lo, 4);
            }
        }
    }
}

void amx16_linear_rows(int qtype, const uint16_t* xp, int64_t M, int64_t K, const uint16_t* w, const float* bias,
                       float* y, int64_t ldy, int64_t n0, int64_t n1, void* scratch) {
    if (qtype == QT_F16) amx16_rows<QT_F16>(xp, M, K, w, bias, y, ldy, n0, n1, scratch);
    else amx16_rows<QT_BF16>(xp, M, K, w, bias, y, ldy, n0, n1, scratch);
}

}  // namespace specdec
