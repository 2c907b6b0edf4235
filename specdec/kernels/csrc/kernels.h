// Raw-pointer kernel interface shared by the ISA-specific translation units.
//
// kernels_avx2.cpp is compiled with -mavx2 -mfma -mf16c and kernels_portable.cpp without; ops.cpp
// (the torch binding, compiled without ISA flags) picks one table at runtime.  Nothing in this
// header generates code, so no inline function compiled with AVX2 flags can leak into the portable
// path through the linker.
//
// Every kernel computes each output element with a fixed sequence of floating-point operations
// that depends only on that element's own inputs (its activation row, its weight row, its cache
// entries), never on how many rows are in the call, on the tile it lands in, or on threading.
// That is what makes the results batch-invariant.
#pragma once

#include <stdint.h>

namespace specdec {

enum QType : int {
    QT_F32 = 0,
    QT_Q8_0 = 1,
    QT_Q4_0 = 2,
    QT_Q4_1 = 3,
    // GGUF K-quants, stored as the tiles of kquants.cpp (never as GGUF blocks).  These three are
    // the formats of a weight's parts; linear() takes a K-quant weight as QT_KQUANT plus its parts.
    QT_Q4_K = 4,
    QT_Q5_K = 5,
    QT_Q6_K = 6,
    QT_KQUANT = 8,
    // 16-bit weights, [N, K] elements: IEEE half and bfloat16 (widened exactly to float).
    QT_F16 = 9,
    QT_BF16 = 10,
    // The same 16-bit weights with "bf16x2" activations on AMX-BF16 tiles (kernels_amx16.cpp).
    QT_F16_X2 = 11,
    QT_BF16_X2 = 12,
};

// Rows of activations processed together; each weight block is read once per chunk.
constexpr int64_t kChunkRows = 16;
// Keys per block of the blocked (transposed) key cache attention reads.
constexpr int64_t kKeyBlock = 16;
// Largest number of weight rows a linear kernel dequantizes into its scratch buffer at once.
constexpr int64_t kMaxScratchRows = 8;

// ---------------------------------------------------------------------------------------------
// Attention (flash-decoding, arXiv:2307.08691 / Dao et al. 2023).  Keys are split into blocks of
// kAttnBlock positions, fixed in absolute position; a row's result is a partial softmax per
// block (attention_block) merged in block order (attention_merge).  The block size, the block
// order and the merge order depend on nothing but the row's own key range, and every arithmetic
// step of a row reads only its own query, its own keys and its own partials, so a row's result is
// bit-identical alone or among any rows, whatever the thread split.
//
// q . k_j: four chains, chain c over d = c, c + 4, c + 8, ..., each a multiply then one FMA per
// d in order, summed (c0 + c1) + (c2 + c3), then * scale (one chain of
// 256, Gemma's head size, took its logits from 1.3e-3 to 4.2e-3 off float64 transformers; four
// chains: 1.8e-3); softcap > 0 then maps s to softcap * tanh(s / softcap).  Values: per output
// element one FMA chain over the row's keys of the block in order, from zero.
// NOTE: 256, not 128: 4-10% less time per step at one row (per-block costs: the softmax's setup,
// the partials, the merge), and still 8 items a kv head at 2,000 positions for two threads.
constexpr int64_t kAttnBlock = 256;
// Most rows of one sequence that share a pass over a block (a verification step's 1 + drafts, a
// prefill chunk's rows).  NOTE: 32, not 16: a half block's keys and values are read and widened
// once for twice the rows; a step of 24 rows at 2,000 cached 1.04-1.08x, of 64 rows 1.0-1.07x
// (SmolLM2, float16 and int8 KV, 2-core Zen 4); 16 rows or fewer are one unit either way.
constexpr int64_t kAttnRows = 32;

// R consecutive query rows of one sequence and the G query heads of one kv head.
struct AttnRows {
    const float* q;  // row r, head g at q + r * q_row_stride + g * q_head_stride (D floats)
    int64_t q_row_stride, q_head_stride;
    int64_t R, G, D;
    const int64_t* lo;  // [R]: the first key row r sees
    const int64_t* hi;  // [R]: its last key (inclusive)
    // Keys blocked (kKeyBlock keys per block, transposed): element d of key j at
    // kt[(j / kKeyBlock) * D * kKeyBlock + d * kKeyBlock + j % kKeyBlock]; value j at v + j * v_stride.
    // float32, or IEEE half when `half` (converted exactly on load: the same results as a float
    // cache holding the rounded values).
    // An 8-bit cache (`q8`, kv_cache_dtype int8): kt and v point at the head's first q8 block
    // (below), v_stride unused.
    const void* kt;
    const void* v;
    int64_t v_stride;
    bool half;
    float scale, softcap;
    bool q8 = false;
};

// The 8-bit KV cache (kv_cache_dtype int8): positions in blocks of kKeyBlock, each block
// kQ8Header bytes of kKeyBlock float32 scales (one a position) and then the int8 entries, keys
// transposed ([D, kKeyBlock], as the float layout) and values row-major ([kKeyBlock, D]).  The
// entries are read as exact floats, and the scales enter once: a score is q . k_int8 (the float
// chains above) times (its key's scale * scale), and each softmax weight is multiplied by its
// value row's scale before the value products (l sums the weights before that).  The same
// operations in every ISA and every split, so rows stay batch-invariant.  On a CPU with AVX-512
// VNNI and VBMI the AVX-512 table instead multiplies in integers (attention_avx512.cpp, "Integer
// attention"): the query quantized per row and head, exact int32 scores and value sums; close to
// these float products, not equal, and batch-invariant in the same way.
constexpr int64_t kQ8Header = kKeyBlock * 4;
inline int64_t q8_block_bytes(int64_t D) { return kQ8Header + kKeyBlock * D; }

// The integer attention's weight bytes per query (attention_avx512.cpp): a hi and a lo region of
// this many bytes each, the block's keys and 64 zero bytes after (a 64-key tile read from any
// group of the block stays inside its region).
constexpr int64_t kQ8ProbRegion = kAttnBlock + 64;
// A partial's record: m, l, six unused floats, then o[D] (32-byte aligned when the record is),
// padded to a multiple of 8 floats.
constexpr int64_t kAttnOut = 8;
inline int64_t attn_part_floats(int64_t D) { return kAttnOut + (D + 7) / 8 * 8; }
// Value rows a value tile takes at a time (kernels_avx2.cpp).
constexpr int64_t kAttnValueKeys = 64;
// A key block and kAttnValueKeys value rows of floats, R * G rows of scores and R * G query pointers, and
// room to align them.
inline int64_t attn_scratch_floats(int64_t R, int64_t G, int64_t D) {
    const int64_t floats = (kKeyBlock + kAttnValueKeys) * ((D + 7) / 8 * 8) + R * G * (kAttnBlock + 2) + 32;
    // integer attention (attention_avx512.cpp): transposed keys and values, scores, query states
    const int64_t nch = (D + 63) / 64, Q = R * G;
    // (per query: scores, q8, the weight bytes' two regions, its state, AMX value sums)
    const int64_t bytes = 64 + nch * (1024 + 16384) + Q * (4 * kAttnBlock + nch * 64 + 2 * kQ8ProbRegion + 64 + nch * 512);
    return floats > bytes / 4 + 16 ? floats : bytes / 4 + 16;
}

struct KernelTable {
    const char* name;

    // y[m * N + n] = dot(x[m, :], W[n, :]) (+ bias[n]) for m in [0, M), n in [n0, n1).
    // x: float32 [M, K] contiguous.  w: f32 rows ([N, K] floats) or GGUF blocks, w_row_bytes per
    // row.  scratch: at least kMaxScratchRows * K floats, private to the calling thread.
    void (*linear_rows)(int qtype, const float* x, int64_t M, int64_t K, const uint8_t* w,
                        int64_t w_row_bytes, const float* bias, float* y, int64_t N, int64_t n0,
                        int64_t n1, float* scratch);

    // y[m, :] = x[m, :] * (1 / sqrt(mean(x[m, :]^2) + eps)) * w, rows [m0, m1), contiguous [M, K].
    void (*rms_norm_rows)(const float* x, const float* w, float* y, int64_t K, float eps,
                          int64_t m0, int64_t m1);

    // Index of the first maximum of x[0, n) (n >= 1; NaNs are never chosen unless all are NaN,
    // then 0).  Exact: any implementation returns the same index.
    int64_t (*argmax)(const float* x, int64_t n);

    // Flash-decoding attention (AttnRows): the partial softmax of every row of `a` against keys
    // [j0, j0 + kAttnBlock) (j0 a multiple of kAttnBlock), restricted to each row's own range.
    // part: R * G records of attn_part_floats(D) floats, record r * G + g = (m, l, o): the
    // maximum scaled score m, l = sum_j exp(s_j - m) and o = sum_j exp(s_j - m) v_j over the
    // row's keys in the block (rows without any: untouched).  scratch: attn_scratch_floats.
    void (*attention_block)(const AttnRows& a, int64_t j0, float* part, float* scratch);

    // Every row's output from its partials of blocks [b0, b1) (part: consecutive blocks, each
    // R * G records): M = the maximum m, w_b = exp(m_b - M) (exactly 1 where m_b == M), then
    // L = sum_b l_b w_b and O = sum_b w_b o_b in block order, out = O * (1 / L); row r head g at
    // out + r * out_row_stride + g * D.
    void (*attention_merge)(const AttnRows& a, int64_t b0, int64_t b1, const float* part, float* out,
                            int64_t out_row_stride);

    // What a decoder layer writes for each token (layer.cpp), in vector lanes with the same float
    // operations as layer.cpp's scalar loops, so the same bits; nullptr (the portable table): the
    // layer runs those loops itself.
    // One rotary head of D floats: dst[j * stride] = src[j] * cos[j] + rot[j] * sin[j] with
    // rot = cat(-src[D/2:], src[:D/2]), each product rounded, then the sum.
    void (*rope_head)(const float* src, const float* cos, const float* sin, int64_t D, float* dst,
                      int64_t stride);
    // The same, each result rounded to half (nearest, ties to even): a key into the half cache.
    void (*rope_head_half)(const float* src, const float* cos, const float* sin, int64_t D, uint16_t* dst,
                           int64_t stride);
    // dst[j] = half(src[j]) for j < n (nearest, ties to even).
    void (*to_half)(const float* src, int64_t n, uint16_t* dst);
    // One head of D floats into 8-bit entries: scale = max |x| / 127 (NaNs skipped), entry
    // q[j * q_stride] = round-half-even(x[j] / scale) clamped to [-127, 127] (0 for an all-zero
    // head), converted as C converts a float to int8 on x86; *scale stored.
    void (*q8_head)(const float* x, int64_t D, int8_t* q, int64_t q_stride, float* scale);
};

// 8-bit activation path (kernels_vnni.cpp).  Weight formats it takes (the GGUF format the weight
// was repacked from); the values match QType's codes.
enum A8Kind : int { A8_Q8 = 1, A8_Q4_0 = 2, A8_Q4_1 = 3 };
// Output rows per repacked tile, and bytes per tile of 16 rows x 32 inputs (kernels_vnni.cpp).
constexpr int64_t kA8TileRows = 16;
// linear()'s qtype for a repacked weight: kA8QtypeBase + its A8Kind.
constexpr int64_t kA8QtypeBase = 16;
// A tile's header: the 16 rows' f16 scales d (32 bytes), then Q4_1's f16 minimums m (32 more);
// the codes follow it.  NOTE: Q4_0 and Q8_0 tiles carried Q4_1's 64-byte header until commit 3c6029b
// (32 bytes of padding a tile: 0.625 bytes a Q4_0 weight instead of the file's 0.5625).
constexpr int64_t a8_head_bytes(int kind) { return kind == A8_Q4_1 ? 64 : 32; }
constexpr int64_t a8_tile_bytes(int kind) { return a8_head_bytes(kind) + (kind == A8_Q8 ? 512 : 256); }

// How the VNNI kernels walk a product (kernels_vnni.cpp).  Every output's arithmetic is the same
// in both walks, so results are bit for bit the same; only the speed differs, by microarchitecture:
//   A8_WALK_GROUPS: 1-4 rows through group_tile (two 16-row groups a pass, software prefetch),
//     5-8 rows through ws2_tile (two weight streams), 9-16 rows through ws_tile; K-quants of 1-3
//     rows (Q6_K: 1-2) two groups a pass.  Measured best on the Intel Xeons (Sapphire Rapids class).
//   A8_WALK_STATIONARY: every row count through ws_tile, weight-stationary, a block at a time as
//     two vpdpbusd chains (low and high nibbles) up to 9 rows; K-quants one group a pass.  On a
//     Zen 4 EPYC a whole SmolLM2 step ran 1.21x faster at 1 row and 1.25x at 8 rows than the
//     groups walk, a Qwen3-1.7B-shaped Q4_K_M step 1.16x at 1 and 3 rows.
// The walk in use is read once per call (ops.cpp: a8_walk, set_a8_walk, SPECDEC_A8_WALK).
enum A8Walk : int { A8_WALK_GROUPS = 1, A8_WALK_STATIONARY = 2 };
int a8_walk();

struct A8Table {
    const char* name;

    // Quantize activation rows [m0, m1) of x [M, K] (K % 32 == 0): xq int8 [M, K]; per block of
    // 32 (index m * K / 32 + b): dx = amax / 127, sx = sum of the codes, dxs = dx * sx.
    void (*quantize_rows)(const float* x, int64_t K, int8_t* xq, float* dx, int32_t* sx,
                          float* dxs, int64_t m0, int64_t m1);

    // y[m * N + n] for all M rows and n in tile groups [g0, g1) (16 rows each) of the repacked
    // weight w (kind = its A8Kind), + bias[n] when bias is not null.  prep: what
    // layout_alloc returned for (kind, M, K), filled by quantize_layout (null where it returned
    // null; xq / dx / sx / dxs hold quantize_rows' output then).
    void (*linear_groups)(int kind, const int8_t* xq, const float* dx, const int32_t* sx,
                          const float* dxs, int64_t M, int64_t K, const uint8_t* w,
                          const float* bias, float* y, int64_t N, int64_t g0, int64_t g1,
                          const void* prep);

    // Optional (null when a table needs none): the quantized activations laid out once for every
    // linear_groups call of one product (the tasks of a parallel call share it), in two parts so
    // that it is built in parallel.  layout_alloc, on the calling thread before the product, gives
    // the layout for M rows (null: none for these rows); it lives in that thread's storage until
    // its next layout_alloc.  quantize_layout quantizes rows [m0, m1) of x as quantize_rows does
    // (the same codes and scales) into what linear_groups reads with that layout: the layout, and
    // xq / dx / sx / dxs where it reads those too.  It changes no output.
    const void* (*layout_alloc)(int kind, int64_t M, int64_t K);
    void (*quantize_layout)(const void* layout, int kind, const float* x, int64_t K, int64_t M, int64_t m0,
                            int64_t m1, int8_t* xq, float* dx, int32_t* sx, float* dxs);
};

// ---------------------------------------------------------------------------------------------
// K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 inputs).  A weight is stored as tiles of 16
// output rows x 256 inputs, each tile replacing the 16 rows' GGUF blocks in as many bytes
// (layouts in kquants.cpp); the tiles of a 16-row group are consecutive, groups follow each other.
// A fused weight may mix formats part by part (Q4_K_M's q|k|v with v in Q6_K): its parts are
// listed as (format, rows) pairs, rows % 16 == 0, and their tiles follow each other.
constexpr int64_t kKqBlock = 256;
constexpr int64_t kKqTileRows = 16;
constexpr int64_t kq_tile_bytes(int fmt) {
    return fmt == QT_Q4_K ? 2304 : fmt == QT_Q5_K ? 2816 : fmt == QT_Q6_K ? 3360 : 0;
}
// GGUF's bytes per block of 256 (what the tiles replace).
constexpr int64_t kq_gguf_block_bytes(int fmt) {
    return fmt == QT_Q4_K ? 144 : fmt == QT_Q5_K ? 176 : fmt == QT_Q6_K ? 210 : 0;
}

// kernels_portable.cpp: one GGUF q8_0 / q4_0 / q4_1 row of K elements to floats, the same float32
// operations as gguf.quants and kernels/__init__.py _dequantize (bit-exact).
void gguf_decode_row(int qtype, const uint8_t* row, int64_t K, float* out);

// kquants.cpp (plain C++, no ISA flags).  repack: rows [0, N) of GGUF blocks (row_bytes = K / 256
// * kq_gguf_block_bytes) -> N / 16 groups of tiles.  decode: rows [r0, r1) of the tiles to float
// rows of K, the same float32 operations as gguf.quants.dequantize (bit-exact).
void kq_repack(int fmt, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst);
void kq_decode_rows(int fmt, const uint8_t* tiles, int64_t K, int64_t r0, int64_t r1, float* out);

// 8-bit activation path for K-quants.  Activations are quantized like llama.cpp's Q8_K: one scale
// per block of 256 (dk = amax / 127, codes round(x / dk) to nearest even), plus the sums of the codes
// per 16 (bs16, which Q6_K's offset multiplies) and per 32, split as 128 * hi + lo with lo in
// [0, 128) (bsm: per block 8 lo then 8 hi, int8 operands for the vpdpbusd that Q4_K / Q5_K's
// minimums multiply).
// One block's 16 sums per 16 codes (s16) -> its 16 bsm bytes: the sums per 32 as 128 * hi + lo,
// 8 lo (in [0, 128)) then 8 hi.
inline void kq_split_pair_sums(const int16_t* s16, int8_t* bsm) {
    for (int k = 0; k < 8; ++k) {
        const int32_t s32 = s16[2 * k] + s16[2 * k + 1];  // in [-4096, 4064]
        const int32_t hi = s32 >= 0 ? s32 / 128 : -((-s32 + 127) / 128);  // floor
        bsm[k] = static_cast<int8_t>(s32 - 128 * hi);
        bsm[8 + k] = static_cast<int8_t>(hi);
    }
}

struct KqTable {
    // Rows [m0, m1) of x [M, K] (K % 256 == 0): xq int8 [M, K], dk [M, K / 256],
    // bs16 [M, K / 16], bsm [M, K / 16].
    void (*quantize_rows)(const float* x, int64_t K, int8_t* xq, float* dk, int16_t* bs16,
                          int8_t* bsm, int64_t m0, int64_t m1);
    // y[m * ldy + n] for all M rows and the rows n of tile groups [g0, g1) of one part (format
    // fmt, tiles w), + bias[n] when bias is not null.
    void (*linear_groups)(int fmt, const int8_t* xq, const float* dk, const int16_t* bs16,
                          const int8_t* bsm, int64_t M, int64_t K, const uint8_t* w,
                          const float* bias, float* y, int64_t ldy, int64_t g0, int64_t g1);
    // Float activations: y[m * ldy + n] as linear_groups (x float32 [M, K]).  Per output, the
    // exactly dequantized weights (as gguf.quants) w_k go through four FMA chains, chain c over
    // k = c, c + 4, c + 8, ... in order, then (c0 + c1) + (c2 + c3), then + bias; the same in
    // every table (the VNNI one keeps 16 rows in the lanes of a vector, tile by tile).  scratch:
    // at least kKqFloatScratch + K + 64 * M floats, private to the calling thread.
    void (*linear_groups_f32)(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* w,
                              const float* bias, float* y, int64_t ldy, int64_t g0, int64_t g1,
                              float* scratch);
};
constexpr int64_t kKqFloatScratch = kKqBlock * kKqTileRows;

const KernelTable* portable_table();
// Scalar 8-bit activation kernels: bit-identical to the VNNI ones, for CPUs without VNNI and tests.
const A8Table* portable_a8_table();
const KqTable* portable_kq_table();
#ifdef SPECDEC_HAVE_AVX2
const KernelTable* avx2_table();
#endif
#ifdef SPECDEC_HAVE_AVX2A8
// The 8-bit activation kernels on AVX2 (kernels_avx2_a8.cpp): bit-identical to the VNNI ones.
const A8Table* avx2_a8_table();
#endif
#ifdef SPECDEC_HAVE_AVXVNNI
// The AVX2 table's 8-bit activation kernels on AVX-VNNI's vpdpbusd (kernels_avxvnni.cpp,
// a8_vnni256.h): bit-identical to avx2_a8_table's.
const A8Table* avxvnni_a8_table();
// The AVX2 table's K-quant kernels on AVX-VNNI (kq_vnni256.h): bit-identical to avx2_kq_table's.
const KqTable* avxvnni_kq_table();
#endif
#ifdef SPECDEC_HAVE_VNNI256EVEX
// The same kernels in the EVEX form (AVX-512 VNNI + VL; kernels_avx2_vnni_evex.cpp).
const A8Table* avx2_vnni_evex_a8_table();
const KqTable* avx2_vnni_evex_kq_table();
#endif
#ifdef SPECDEC_HAVE_AVX2KQ
// The K-quant 8-bit activation kernels on AVX2 (kernels_avx2_kq.cpp): bit-identical to the VNNI
// ones and the scalar twins; their float-activation entry is the scalar twin's.
const KqTable* avx2_kq_table();
#endif
#ifdef SPECDEC_HAVE_AVX512ATTN
// KernelTable::attention_block on 16 lanes (attention_avx512.cpp): bit for bit the AVX2 table's.
void avx512_attention_block(const AttnRows& a, int64_t j0, float* part, float* scratch);
// Whether avx512_attention_block takes the 8-bit cache with integer products (a CPU with AVX-512
// VNNI and VBMI; SPECDEC_INT8_ATTENTION=0 turns it off): on >= 0 sets it first (on such a CPU).
bool avx512_q8_int_attention(int on);
#endif
// The integer attention's value sums on AMX-INT8 tiles (kernels_amx.cpp amx_value_sums), set by
// ops.cpp before each attention call while the AMX kernels are in use (nullptr: VNNI only); in
// attention_avx512.cpp.  Its sums are the VNNI kernel's exact int32 sums: results do not change.
using AmxValueSumsFn = void (*)(const uint8_t* probs, int64_t qb, int64_t Q, const uint8_t* vt, int64_t nch,
                                int64_t ngroups, int32_t* sums);
// The scores' integer sums on the tile unit (kernels_amx.cpp amx_score_sums): Q query states
// (q8 bytes, signed, zero padded to nch * 64; qb apart) against nblocks blocks of 16 keys
// transposed as attention_avx512.cpp transpose_keys makes them (unsigned, block b's chunk ch at
// kt + (b * nch + ch) * 1024): out[t * out_stride + 16 * b + i] = the int32 sum for key i of
// block b (before the query's correction), as the VNNI score tiles' sums.
using AmxScoreSumsFn = void (*)(const uint8_t* q8, int64_t qb, int64_t Q, const uint8_t* kt, int64_t nch,
                                int64_t nblocks, int32_t* out, int64_t out_stride);
void set_attention_amx(AmxValueSumsFn values, AmxScoreSumsFn scores);
#ifdef SPECDEC_HAVE_AMX
// For Q queries (rows qb bytes apart from probs: their weight bytes of the block's keys from the
// first group on, hi bytes, and the lo bytes kQ8ProbRegion further, both zero past the last
// key), and the value groups transposed in vt (attention_avx512.cpp transpose_values, nch * 256
// bytes a group, 64 groups readable): sums[(t * nch + ch) * 128 + h * 64 + k * 16 + lane] =
// the int32 sum over the groups of weight bytes (h = 0 hi, 1 lo) times value bytes, lane as
// the VNNI value vectors' (value_tile_i8's acc and lo).
void amx_value_sums(const uint8_t* probs, int64_t qb, int64_t Q, const uint8_t* vt, int64_t nch, int64_t ngroups,
                    int32_t* sums);
void amx_score_sums(const uint8_t* q8, int64_t qb, int64_t Q, const uint8_t* kt, int64_t nch, int64_t nblocks,
                    int32_t* out, int64_t out_stride);
#endif
#ifdef SPECDEC_HAVE_AVX512
// 16-lane linear and attention kernels; rms_norm and the attention merge are the AVX2 ones (needs
// SPECDEC_HAVE_AVX2).
const KernelTable* avx512_table();
#endif

// 16-bit weights (kernels_bf16.cpp, AVX-512): y rows [n0, n1) of x [M, K] against w ([N, K] of
// QT_F16 or QT_BF16), bit for bit what the AVX-512 table's linear_rows gives for the weights
// widened to float32.  scratch: kHalfScratchFloats floats, private to the calling thread.
constexpr int64_t kHalfScratchFloats = int64_t(1) << 17;
#ifdef SPECDEC_HAVE_HALF512
void half512_linear_rows(int qtype, const float* x, int64_t M, int64_t K, const uint16_t* w,
                         const float* bias, float* y, int64_t N, int64_t n0, int64_t n1, float* scratch);
#endif

// 16-bit weights on AMX-BF16 tiles with activations split into bfloat16 hi + lo
// (kernels_amx16.cpp; numbers and layouts there).  amx16_pack_x writes activation groups
// [g0, g1) (16 rows each) of x [M, K] into xp (amx16_packed_x_elems(M, K) elements);
// amx16_linear_rows then gives y rows' outputs [n0, n1) (n0 a multiple of 16) against w (the tiles
// of a QT_F16 or QT_BF16 weight [N, K], amx16_weight_bytes long).
// scratch: kAmx16ScratchBytes, private to the calling thread.  Only after ops.cpp has confirmed
// AMX-BF16 and the tile-data permission.
// The weights as tiles (ops.cpp repack_x2): per 16 weight rows, per 32 inputs, 16 x 32 elements,
// zero-padded past N and K.
inline int64_t amx16_weight_bytes(int64_t N, int64_t K) { return (N + 15) / 16 * 16 * ((K + 31) / 32) * 32 * 2; }
constexpr int64_t kAmx16WeightScratchBytes = 4 * 16 * 2 * 512 * 2;
constexpr int64_t kAmx16ScratchBytes = kAmx16WeightScratchBytes + 4 * 16 * 256 * 4;
#ifdef SPECDEC_HAVE_AMX16
int64_t amx16_packed_x_elems(int64_t M, int64_t K);
void amx16_pack_x(const float* x, int64_t M, int64_t K, uint16_t* xp, int64_t g0, int64_t g1);
void amx16_linear_rows(int qtype, const uint16_t* xp, int64_t M, int64_t K, const uint16_t* w, const float* bias,
                       float* y, int64_t ldy, int64_t n0, int64_t n1, void* scratch);
#endif

#ifdef SPECDEC_HAVE_VNNI
const A8Table* vnni_table();
const KqTable* vnni_kq_table();
#endif

#ifdef SPECDEC_HAVE_AMX
// The 8-bit activation kernels on AMX-INT8 tiles (kernels_amx.cpp): the same results as
// vnni_table(), bit for bit; calls with fewer rows than a per-format threshold go to it.  Only
// after the CPU's AMX-TILE / AMX-INT8 and the kernel's tile-data permission are confirmed (ops.cpp).
const A8Table* amx_table();
// rows > 0: every format takes the tile unit from this many rows (tests, benchmarks); 0: the
// measured per-format thresholds.  Process-wide; not for concurrent use with running kernels.
void amx_set_min_rows(int64_t rows);
#endif

}  // namespace specdec
