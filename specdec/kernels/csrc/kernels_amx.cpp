// 8-bit activation kernels on AMX-INT8 (Intel Sapphire Rapids and later): the integer sums of
// kernels_vnni.cpp's tiles computed by the tile unit, with the VNNI kernels' float arithmetic.
// Compiled on its own with the AVX-512 flags plus -mamx-tile -mamx-int8; only called after
// ops.cpp has checked the CPU (CPUID) and obtained the kernel's permission for the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM).
//
// The repacked weight tiles of kernels_vnni.cpp feed the tile unit as they are.  Per block of 32
// inputs and 16 weight rows j, the 8-bit tile's quants are 8 rows of 64 bytes: row t holds inputs
// 4t..4t+3 of every weight row j at bytes 4j..4j+3, which is AMX's "B" layout for a 32-deep dot
// product (K = 8 quads, N = 16 columns).  The activation rows are the "A" tile: R rows of the
// block's 32 int8 codes, straight from xq with stride K.  TDPBSUD (signed A, unsigned B) then
// gives, for every activation row r and weight row j, the block's exact int32 sum
// sum_i xq_i * u_i; a second product against a constant tile of -o (TDPBSSD) adds -o * sum_i xq_i
// (Q8_0: o = 128, Q4_0: o = 8).  The 4-bit tiles are unpacked (nibbles to bytes, 8 x 64) into a
// scratch tile first: low nibbles of quants vector p are inputs 4p.., high nibbles 16 + 4p...
//
// The result tile (R x 16 int32, lane j = weight row j, as the VNNI kernels' vectors) is stored
// and every row then takes exactly group_tile's float steps, block by block in order:
//   acc = fma(float(s) * dx_b, d, acc);  Q4_1: acc = fma(m, dxs_b, acc);  then + bias.
// Integer sums are exact whatever the instruction, so every output is bit-identical to the VNNI
// kernels' and the scalar twin's, for any row count, row tile, thread or task split.
//
// The tile configuration is loaded at the start of every call (each thread, the pool's workers
// included, configures its own tiles, and nothing assumes another library left them alone) and
// released at the end (no tile state for the kernel to save at context switches between calls).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "amx_tiles.h"
#include "kernels.h"

namespace specdec {
namespace {

// GCC's tile intrinsics are asm statements that tell the compiler nothing about the memory they
// touch: these take the tile register as a literal and name the scratch memory they read or write
// (the unpacked weights, the stored sums), so that the compiler orders the vector code around
// them without a blanket memory clobber (which would also push the accumulators to memory).
#define SPECDEC_TILE_LOAD(T, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #T ::"r"(base), "r"(static_cast<long>(stride)))
#define SPECDEC_TILE_LOAD_SCRATCH(T, base) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #T ::"r"(base), "r"(64L), "m"(*(const uint8_t(*)[512])(base)))
#define SPECDEC_TILE_STORE(T, base)                                                            \
    __asm__ volatile("tilestored %%tmm" #T ", (%1,%2,1)" : "=m"(*(int32_t(*)[256])(base)) \
                     : "r"(base), "r"(64L))
// C += A (signed) . B (unsigned), and A (signed) . B (signed).
#define SPECDEC_TDPBSUD(C, A, B) __asm__ volatile("tdpbsud %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::)
#define SPECDEC_TDPBSSD(C, A, B) __asm__ volatile("tdpbssd %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::)

// Tile registers: 0 the activations (R rows x 32 bytes), 1-3 the weights of up to three 16-row
// groups (8 rows x 64 bytes), 4-6 their sums (R rows x 16 int32), 7 the offset tile (8 x 64
// bytes of -o).  Measured on this project's Sapphire Rapids-class VM (benchmarks/gemm_roof.py and
// the run of 2026-11-24 in `git show 5196d6d:BENCHMARKS.md`): tile loads cost about a cycle per row, a tile store ~18 cycles
// whatever R, one block's tile sequence ~32-40 cycles, and the tile work hardly overlaps the rescale
// (deeper software pipelines over four sum tiles measured no faster), so one activation tile
// feeds up to three groups and each block's products run just before its rescale.
void configure(int R, int kind) {
    TileConfig c = tile_config();
    c.rows[0] = static_cast<uint8_t>(R);
    c.colsb[0] = 32;
    for (int t = 1; t < 4; ++t) {
        c.rows[t] = 8;
        c.colsb[t] = 64;
        c.rows[3 + t] = static_cast<uint8_t>(R);
        c.colsb[3 + t] = 64;
    }
    c.rows[7] = 8;
    c.colsb[7] = 64;
    load_tile_config(c);
    if (kind != A8_Q4_1) {
        alignas(64) int8_t neg[512];
        memset(neg, kind == A8_Q8 ? -128 : -8, sizeof(neg));
        __asm__ volatile("tileloadd (%0,%1,1), %%tmm7" ::"r"(neg), "r"(64L), "m"(*(const int8_t(*)[512])neg));
    }
}

// A 4-bit tile's quants (4 x 64 bytes of nibble pairs) as the 8 x 64 bytes of a weight tile.
template <int KIND>
inline void unpack4(const uint8_t* t, uint8_t* bs) {
    constexpr int64_t H = a8_head_bytes(KIND);
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int p = 0; p < 4; ++p) {
        const __m512i packed = _mm512_loadu_si512(t + H + 64 * p);
        __m512i lo = _mm512_and_si512(packed, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), lo4);
        _mm512_store_si512(bs + 64 * p, lo);
        _mm512_store_si512(bs + 256 + 64 * p, hi);
    }
}

// 4-bit weights are unpacked this many blocks ahead of the tile load that reads them (a tile
// load right after the vector stores that feed it stalls: measured ~5x slower).  The tile loads
// run a block ahead of the rescale (amx_pass), so 3 blocks ahead is 2 ahead of their load.
constexpr int64_t kUnpackAhead = 3;
constexpr int64_t kUnpackSlots = 4;

// Block b's sums of NG groups (weights wq[g]) into cb[g]: sum xq * u (+ -o * sum xq for Q8_0 and
// Q4_0, against the offset tile; measured faster than adding it in the rescale).  The groups'
// loads, products and stores are issued kind by kind (independent products side by side).
template <int KIND, int NG>
inline void block_sums(const int8_t* xb, int64_t K, const uint8_t* const* wq, int32_t (*cb)[256]) {
    SPECDEC_TILE_LOAD(0, xb, K);
#define SPECDEC_LOAD_B(T, p)                                       \
    if (KIND == A8_Q8) SPECDEC_TILE_LOAD(T, p, 64);                \
    else SPECDEC_TILE_LOAD_SCRATCH(T, p)
    SPECDEC_LOAD_B(1, wq[0]);
    if constexpr (NG > 1) SPECDEC_LOAD_B(2, wq[1]);
    if constexpr (NG > 2) SPECDEC_LOAD_B(3, wq[2]);
#undef SPECDEC_LOAD_B
    SPECDEC_TILE_ZERO(4);
    if constexpr (NG > 1) SPECDEC_TILE_ZERO(5);
    if constexpr (NG > 2) SPECDEC_TILE_ZERO(6);
    SPECDEC_TDPBSUD(4, 0, 1);
    if constexpr (NG > 1) SPECDEC_TDPBSUD(5, 0, 2);
    if constexpr (NG > 2) SPECDEC_TDPBSUD(6, 0, 3);
    if constexpr (KIND != A8_Q4_1) {
        SPECDEC_TDPBSSD(4, 0, 7);
        if constexpr (NG > 1) SPECDEC_TDPBSSD(5, 0, 7);
        if constexpr (NG > 2) SPECDEC_TDPBSSD(6, 0, 7);
    }
    SPECDEC_TILE_STORE(4, cb[0]);
    if constexpr (NG > 1) SPECDEC_TILE_STORE(5, cb[1]);
    if constexpr (NG > 2) SPECDEC_TILE_STORE(6, cb[2]);
}

// R activation rows (xq, dx, dxs at the row tile's first row) against NG consecutive 16-row
// groups (their tiles gstride bytes apart): all K blocks, then + bias.
template <int KIND, int R, int NG>
void amx_pass(const int8_t* xq, const float* dx, const float* dxs, int64_t K, const uint8_t* tiles,
              int64_t gstride, const float* bias, float* y, int64_t ldy) {
    constexpr int64_t TB = a8_tile_bytes(KIND);
    constexpr bool kQ4 = KIND != A8_Q8;
    const int64_t nb = K / 32;
    alignas(64) uint8_t bs[kQ4 ? kUnpackSlots : 1][NG][512];
    alignas(64) int32_t cb[2][NG][16 * 16];  // the stored sums of blocks b (b & 1) and b + 1
    // NOTE: every loop over g and r is unrolled, so that the accumulators stay in registers.
    __m512 acc[NG][R];
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g)
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
    if (kQ4)
        for (int64_t b = 0; b < std::min(nb, kUnpackAhead); ++b)
            for (int g = 0; g < NG; ++g) unpack4<KIND>(tiles + g * gstride + b * TB, bs[b % kUnpackSlots][g]);
    auto sums = [&](int64_t b) {
        const uint8_t* wq[NG];
        for (int g = 0; g < NG; ++g) wq[g] = kQ4 ? bs[b % kUnpackSlots][g] : tiles + g * gstride + b * TB + a8_head_bytes(KIND);
        block_sums<KIND, NG>(xq + b * 32, K, wq, cb[b & 1]);
    };
    // Two stages: block b + 1's tile products are issued before block b's rescale reads its
    // stored sums, so the tile unit's latency (products, then the store) runs beside the vector
    // work instead of before it.
    sums(0);
    for (int64_t b = 0; b < nb; ++b) {
        for (int g = 0; g < NG; ++g) {
            const char* pf = reinterpret_cast<const char*>(tiles + g * gstride + (b + 4) * TB);
            for (int64_t o = 0; o < TB; o += 64) _mm_prefetch(pf + o, _MM_HINT_T0);
        }
        if (kQ4 && b + kUnpackAhead < nb)
            for (int g = 0; g < NG; ++g)
                unpack4<KIND>(tiles + g * gstride + (b + kUnpackAhead) * TB, bs[(b + kUnpackAhead) % kUnpackSlots][g]);
        if (b + 1 < nb) sums(b + 1);
        // group_tile's rescale, block by block in order.
        __m512 d[NG], mv[NG];
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) {
            const uint8_t* t = tiles + g * gstride + b * TB;
            d[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t)));
            if (KIND == A8_Q4_1) mv[g] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + 32)));
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
            const __m512 dxr = _mm512_set1_ps(dx[r * nb + b]);
            __m512 dxsr = _mm512_setzero_ps();
            if (KIND == A8_Q4_1) dxsr = _mm512_set1_ps(dxs[r * nb + b]);
#pragma GCC unroll 4
            for (int g = 0; g < NG; ++g) {
                const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb[b & 1][g] + 16 * r)), dxr);
                acc[g][r] = _mm512_fmadd_ps(f, d[g], acc[g][r]);
                if (KIND == A8_Q4_1) acc[g][r] = _mm512_fmadd_ps(mv[g], dxsr, acc[g][r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < NG; ++g) {
        const __m512 bv = bias ? _mm512_loadu_ps(bias + g * kA8TileRows) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
            _mm512_storeu_ps(y + r * ldy + g * kA8TileRows, bias ? _mm512_add_ps(acc[g][r], bv) : acc[g][r]);
    }
}

// Groups per pass: as many as the accumulators (NG x R vectors) leave registers for.
template <int KIND, int R>
void amx_row_tile(const int8_t* xq, const float* dx, const float* dxs, int64_t K, const uint8_t* w,
                  const float* bias, float* y, int64_t ldy, int64_t g0, int64_t g1) {
    constexpr int64_t TB = a8_tile_bytes(KIND);
    constexpr int NG = R <= 6 ? 3 : R <= 10 ? 2 : 1;
    const int64_t nb = K / 32, gstride = nb * TB;
    int64_t g = g0;
    auto at = [&](int64_t gg) { return w + gg * gstride; };
    auto bg = [&](int64_t gg) { return bias ? bias + gg * kA8TileRows : nullptr; };
    for (; g + NG <= g1; g += NG)
        amx_pass<KIND, R, NG>(xq, dx, dxs, K, at(g), gstride, bg(g), y + g * kA8TileRows, ldy);
    if constexpr (NG > 2) {
        if (g + 2 <= g1) {
            amx_pass<KIND, R, 2>(xq, dx, dxs, K, at(g), gstride, bg(g), y + g * kA8TileRows, ldy);
            g += 2;
        }
    }
    if constexpr (NG > 1) {
        if (g < g1) amx_pass<KIND, R, 1>(xq, dx, dxs, K, at(g), gstride, bg(g), y + g * kA8TileRows, ldy);
    }
}

template <int KIND, int R = 1>
void amx_rows(int64_t rows, const int8_t* xq, const float* dx, const float* dxs, int64_t K, const uint8_t* w,
              const float* bias, float* y, int64_t ldy, int64_t g0, int64_t g1) {
    if constexpr (R < 16) {
        if (rows > R) {
            amx_rows<KIND, R + 1>(rows, xq, dx, dxs, K, w, bias, y, ldy, g0, g1);
            return;
        }
    }
    amx_row_tile<KIND, R>(xq, dx, dxs, K, w, bias, y, ldy, g0, g1);
}

template <int KIND>
void amx_groups(const int8_t* xq, const float* dx, const float* dxs, int64_t M, int64_t K, const uint8_t* w,
                const float* bias, float* y, int64_t N, int64_t g0, int64_t g1) {
    const int64_t nb = K / 32;
    // Row tiles of at most 16 rows, as even as possible (17 rows: 9 + 8).
    const int64_t ntiles = (M + 15) / 16;
    int configured = 0;
    for (int64_t i = 0, m0 = 0; i < ntiles; ++i) {
        const int64_t rows = (M - m0) / (ntiles - i);
        if (rows != configured) {
            configure(static_cast<int>(rows), KIND);
            configured = static_cast<int>(rows);
        }
        amx_rows<KIND>(rows, xq + m0 * K, dx + m0 * nb, dxs + m0 * nb, K, w, bias, y + m0 * N, N, g0, g1);
        m0 += rows;
    }
    release_tiles();
}

// Rows from which each format goes to the tile unit; fewer go to the VNNI kernels.  Measured with
// benchmarks/gemm_roof.py --tables vnni amx1 (weights streaming from memory, one core): the tile
// unit's Q8_0 passes VNNI's from 12 rows (+5-19%), Q4_0 from 14-16 (+5-15%), and Q4_1 (whose extra
// per-block FMA keeps the vector side busy) never does, so it stays on VNNI by default.  In a
// forward pass on two threads (SmolLM2-135M's Q8_0 output layer, 49,152 x 576, 8 rows:
// benchmarks/verify_rows.py linear, 2 rounds) Q8_0 already passes VNNI at 8 rows (571-610
// against 625-630 us), so it goes to the tile unit from 8.  (Q4_1 on the tile unit from 8 rows ran
// some forward passes 3-6% faster, others 1% slower, and 6, 9 or 16 rows slower: left on VNNI.)
constexpr int64_t kNever = int64_t(1) << 40;
int64_t default_min_rows(int kind) { return kind == A8_Q8 ? 8 : kind == A8_Q4_0 ? 14 : kNever; }
int64_t g_min_rows_override = 0;  // > 0: every format from this many rows (tests, benchmarks)

int64_t min_rows(int kind) { return g_min_rows_override > 0 ? g_min_rows_override : default_min_rows(kind); }

void amx_linear_groups(int kind, const int8_t* xq, const float* dx, const int32_t* sx, const float* dxs,
                       int64_t M, int64_t K, const uint8_t* w, const float* bias, float* y, int64_t N,
                       int64_t g0, int64_t g1, const void* prep) {
    if (M < min_rows(kind)) {
        vnni_table()->linear_groups(kind, xq, dx, sx, dxs, M, K, w, bias, y, N, g0, g1, prep);
        return;
    }
    switch (kind) {
        case A8_Q4_0: amx_groups<A8_Q4_0>(xq, dx, dxs, M, K, w, bias, y, N, g0, g1); break;
        case A8_Q4_1: amx_groups<A8_Q4_1>(xq, dx, dxs, M, K, w, bias, y, N, g0, g1); break;
        case A8_Q8: amx_groups<A8_Q8>(xq, dx, dxs, M, K, w, bias, y, N, g0, g1); break;
        default: break;
    }
}

// The VNNI kernels' layout for the rows they take; none for the tile unit's.
const void* amx_layout_alloc(int kind, int64_t M, int64_t K) {
    if (M >= min_rows(kind)) return nullptr;
    const A8Table* v = vnni_table();
    return v->layout_alloc ? v->layout_alloc(kind, M, K) : nullptr;
}

void amx_quantize_layout(const void* layout, int kind, const float* x, int64_t K, int64_t M, int64_t m0, int64_t m1,
                         int8_t* xq, float* dx, int32_t* sx, float* dxs) {
    vnni_table()->quantize_layout(layout, kind, x, K, M, m0, m1, xq, dx, sx, dxs);
}

void amx_quantize_rows(const float* x, int64_t K, int8_t* xq, float* dx, int32_t* sx, float* dxs, int64_t m0,
                       int64_t m1) {
    vnni_table()->quantize_rows(x, K, xq, dx, sx, dxs, m0, m1);
}

// ---- integer attention's value sums (attention_avx512.cpp, kernels.h amx_value_sums) ----------
// A tile (weights, unsigned): R queries x 64 keys (16 groups of 4) of hi bytes (tile 0) and lo
// bytes (tile 1), rows qb apart.  B tile (values, signed): 16 groups, each the 64 bytes of one
// transposed value vector (lane = a column, its 4 bytes the group's 4 keys): AMX's B layout for a
// 64-deep product over 16 columns.  Two vectors k, k + 1 of a chunk at a time (tiles 2, 3), each
// with a hi and a lo sum tile (4-7) accumulated over every group of the block, stored once.
void configure_values(int R) {
    TileConfig c = tile_config();
    for (int t : {0, 1, 4, 5, 6, 7}) {
        c.rows[t] = static_cast<uint8_t>(R);
        c.colsb[t] = 64;
    }
    for (int t : {2, 3}) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    load_tile_config(c);
}

// C += A (unsigned) . B (signed)
#define SPECDEC_TDPBUSD(C, A, B) __asm__ volatile("tdpbusd %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::)
// The scores' products (query states and transposed keys, amx_score_sums) use the same
// configuration: A R x 64 bytes (tile 0), B 16 x 64 (tiles 2, 3), sums R x 16 int32 (4-7).

}  // namespace

void amx_score_sums(const uint8_t* q8, int64_t qb, int64_t Q, const uint8_t* kt, int64_t nch, int64_t nblocks,
                    int32_t* out, int64_t out_stride) {
    // Row tiles of R rows each (the last one ends at Q, overlapping the one before where R does
    // not divide Q: its rows are computed twice, the same sums), so one configuration serves.
    const int64_t ntiles = (Q + 15) / 16, R = (Q + ntiles - 1) / ntiles, ld = out_stride * 4;
    configure_values(static_cast<int>(R));
    for (int64_t i = 0; i < ntiles; ++i) {
        const int64_t t0 = std::min(i * R, Q - R);
        const uint8_t* a = q8 + t0 * qb;
        int32_t* o = out + t0 * out_stride;
        int64_t b = 0;
        for (; b + 4 <= nblocks; b += 4) {  // four blocks' sums in flight (tiles 4-7)
            SPECDEC_TILE_ZERO(4);
            SPECDEC_TILE_ZERO(5);
            SPECDEC_TILE_ZERO(6);
            SPECDEC_TILE_ZERO(7);
            for (int64_t ch = 0; ch < nch; ++ch) {
                const uint8_t* k = kt + (b * nch + ch) * 1024;
                SPECDEC_TILE_LOADD(0, a + 64 * ch, qb);
                SPECDEC_TILE_LOADD(2, k, 64);
                SPECDEC_TILE_LOADD(3, k + nch * 1024, 64);
                SPECDEC_TDPBSUD(4, 0, 2);
                SPECDEC_TDPBSUD(5, 0, 3);
                SPECDEC_TILE_LOADD(2, k + 2 * nch * 1024, 64);
                SPECDEC_TILE_LOADD(3, k + 3 * nch * 1024, 64);
                SPECDEC_TDPBSUD(6, 0, 2);
                SPECDEC_TDPBSUD(7, 0, 3);
            }
            SPECDEC_TILE_STORED(4, o + 16 * b, ld);
            SPECDEC_TILE_STORED(5, o + 16 * (b + 1), ld);
            SPECDEC_TILE_STORED(6, o + 16 * (b + 2), ld);
            SPECDEC_TILE_STORED(7, o + 16 * (b + 3), ld);
        }
        for (; b < nblocks; ++b) {
            SPECDEC_TILE_ZERO(4);
            for (int64_t ch = 0; ch < nch; ++ch) {
                SPECDEC_TILE_LOADD(0, a + 64 * ch, qb);
                SPECDEC_TILE_LOADD(2, kt + (b * nch + ch) * 1024, 64);
                SPECDEC_TDPBSUD(4, 0, 2);
            }
            SPECDEC_TILE_STORED(4, o + 16 * b, ld);
        }
    }
    release_tiles();
}

void amx_value_sums(const uint8_t* probs, int64_t qb, int64_t Q, const uint8_t* vt, int64_t nch, int64_t ngroups,
                    int32_t* sums) {
    const int64_t nchunks = (ngroups + 15) / 16, vstride = nch * 256, sstride = nch * 128 * 4;
    const int64_t ntiles = (Q + 15) / 16;
    int configured = 0;
    for (int64_t i = 0, t0 = 0; i < ntiles; ++i) {
        const int64_t R = (Q - t0) / (ntiles - i);
        if (R != configured) {
            configure_values(static_cast<int>(R));
            configured = static_cast<int>(R);
        }
        const uint8_t* a = probs + t0 * qb;
        for (int64_t ch = 0; ch < nch; ++ch)
            for (int k = 0; k < 4; k += 2) {
                SPECDEC_TILE_ZERO(4);
                SPECDEC_TILE_ZERO(5);
                SPECDEC_TILE_ZERO(6);
                SPECDEC_TILE_ZERO(7);
                for (int64_t c = 0; c < nchunks; ++c) {
                    const uint8_t* b = vt + c * 16 * vstride + ch * 256 + k * 64;
                    SPECDEC_TILE_LOADD(0, a + 64 * c, qb);
                    SPECDEC_TILE_LOADD(1, a + kQ8ProbRegion + 64 * c, qb);
                    SPECDEC_TILE_LOADD(2, b, vstride);
                    SPECDEC_TILE_LOADD(3, b + 64, vstride);
                    SPECDEC_TDPBUSD(4, 0, 2);
                    SPECDEC_TDPBUSD(5, 1, 2);
                    SPECDEC_TDPBUSD(6, 0, 3);
                    SPECDEC_TDPBUSD(7, 1, 3);
                }
                int32_t* s = sums + (t0 * nch + ch) * 128;
                SPECDEC_TILE_STORED(4, s + 16 * k, sstride);
                SPECDEC_TILE_STORED(5, s + 64 + 16 * k, sstride);
                SPECDEC_TILE_STORED(6, s + 16 * (k + 1), sstride);
                SPECDEC_TILE_STORED(7, s + 64 + 16 * (k + 1), sstride);
            }
        t0 += R;
    }
    release_tiles();
}

const A8Table* amx_table() {
    static const A8Table table = {"amx-int8", amx_quantize_rows, amx_linear_groups, amx_layout_alloc,
                                   amx_quantize_layout};
    return &table;
}

void amx_set_min_rows(int64_t rows) { g_min_rows_override = rows > 0 ? rows : 0; }

}  // namespace specdec
