// GGUF K-quants (Q4_K, Q5_K, Q6_K) in tiles of 16 output rows x 256 inputs: the repack from GGUF
// blocks and the exact decode to floats.  Plain C++, compiled without ISA flags and with
// -ffp-contract=off (decode must do gguf.quants.dequantize's float32 operations, no fused ones).
//
// A tile holds exactly what the 16 rows' GGUF blocks hold, in as many bytes, laid out for the VNNI
// kernels (kernels_vnni.cpp): lane j of a 64-byte vector is row j, four consecutive inputs per
// lane, so a vpdpbusd adds 4 products for each of the 16 rows and a tile's results need no
// horizontal sums.
//
// Q4_K, 2304 bytes:
//   [0, 32)       d     16 x f16 (row j at 2j)
//   [32, 64)      dmin  16 x f16
//   [64, 256)     the rows' 12 GGUF scale bytes (6-bit scales and minimums of the 8 sub-blocks,
//                 packed as gguf.quants.Q4_K.get_scale_min reads them): 3 vectors, lane j of
//                 vector k = bytes 4k .. 4k + 3 of row j
//   [256, 2304)   q     [8 sub-blocks][4 p][16 rows][4 i]: low nibble = code of input 32s + 4p + i,
//                       high nibble = code of input 32s + 16 + 4p + i
//   value = (d * sc) * q - dmin * min
// Q5_K, 2816 bytes: Q4_K's tile (nibbles = the codes' low 4 bits), then
//   [2304, 2816)  qh    [8 sub-blocks][8 vectors] 64-bit masks: bit 4j + i of vector v is bit 4 of
//                       the code in byte (j, i) of the sub-block's v-th nibble vector (v < 4: the
//                       low nibbles of p = v; v >= 4: the high nibbles of p = v - 4)
// Q6_K, 3360 bytes:
//   [0, 32)       d     16 x f16
//   [32, 288)     sc    [16 sub-blocks of 16 inputs][16 rows] int8
//   [288, 3360)   8 units of 32 inputs, 384 bytes each:
//                   [4 p][16 rows][4 i] low 4 bits (low nibble: input 32u + 4p + i, high nibble:
//                   input 32u + 16 + 4p + i), then [2 halves][16 rows][4 i] high 2 bits: bits
//                   2p, 2p + 1 of byte (h, j, i) = bits 4-5 of the code of input 32u + 16h + 4p + i
//   value = (d * sc) * (code - 32)
#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "kernels.h"

namespace specdec {
namespace {

constexpr int64_t kQ4kScales = 64, kQ4kQuants = 256, kQ5kHigh = 2304;
constexpr int64_t kQ6kScales = 32, kQ6kUnits = 288, kQ6kUnitBytes = 384;

inline float f16_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return half_to_float(h);
}

// gguf.quants.Q4_K.get_scale_min: 6-bit scales and minimums of 8 sub-blocks packed in 12 bytes.
void scale_min(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
    for (int j = 0; j < 4; ++j) {
        sc[j] = s[j] & 63;
        mn[j] = s[4 + j] & 63;
        sc[4 + j] = static_cast<uint8_t>((s[8 + j] & 0x0F) | ((s[j] >> 6) << 4));
        mn[4 + j] = static_cast<uint8_t>((s[8 + j] >> 4) | ((s[4 + j] >> 6) << 4));
    }
}

// Byte of the nibble vectors holding input i (0..31) of a 32-input unit for row j, and whether
// it is the high nibble.
inline int64_t nibble_byte(int64_t j, int i) { return 64 * ((i % 16) / 4) + 4 * j + i % 4; }

// The 6-bit scales and minimums of row j's 8 sub-blocks in a Q4_K / Q5_K tile.
inline void tile_scale_min(const uint8_t* t, int64_t j, uint8_t* sc, uint8_t* mn) {
    uint8_t packed[12];
    for (int k = 0; k < 3; ++k) std::memcpy(packed + 4 * k, t + kQ4kScales + 64 * k + 4 * j, 4);
    scale_min(packed, sc, mn);
}

// Code of input e (0..255) of row j in a tile.
inline int code_at(int fmt, const uint8_t* t, int64_t j, int e) {
    const int i = e % 32, half = i / 16;
    if (fmt == QT_Q6_K) {
        const uint8_t* unit = t + kQ6kUnits + kQ6kUnitBytes * (e / 32);
        const int lo = (unit[nibble_byte(j, i)] >> (4 * half)) & 0x0F;
        const int hi = (unit[256 + 64 * half + 4 * j + i % 4] >> (2 * ((i % 16) / 4))) & 0x03;
        return lo | (hi << 4);
    }
    const int s = e / 32;
    int q = (t[kQ4kQuants + 256 * s + nibble_byte(j, i)] >> (4 * half)) & 0x0F;
    if (fmt == QT_Q5_K) {
        const int v = 4 * half + (i % 16) / 4;
        const int bit = static_cast<int>(4 * j + i % 4);
        q |= ((t[kQ5kHigh + 64 * s + 8 * v + bit / 8] >> (bit % 8)) & 1) << 4;
    }
    return q;
}


// One GGUF block straight into row j of its tile. NOTE: unpack_block + write_row did this
// element by element at ~110 MB/s (8 s of a 1.7B Q4_K_M load); here each target byte is
// assembled once from the bytes it draws on (2.4x faster under load, 640 MB/s on one core).
void repack_block(int fmt, const uint8_t* b, int64_t j, uint8_t* t) {
    if (fmt == QT_Q6_K) {  // ql[128], qh[64], scales[16], d
        std::memcpy(t + 2 * j, b + 208, 2);
        for (int s = 0; s < 16; ++s) t[kQ6kScales + 16 * s + j] = b[192 + s];
        for (int u = 0; u < 8; ++u) {  // units of 32 inputs: e = 32 u + i
            const int h = u / 4, lo_shift = 4 * ((u % 4) / 2), hi_shift = 2 * (u % 4);
            const uint8_t* ql = b + 64 * h + 32 * (u % 2);
            const uint8_t* qh = b + 128 + 32 * h;
            uint8_t* unit = t + kQ6kUnits + kQ6kUnitBytes * u;
            for (int p = 0; p < 4; ++p) {
                for (int i4 = 0; i4 < 4; ++i4) {
                    const int x = 4 * p + i4;
                    const int lo0 = (ql[x] >> lo_shift) & 0x0F, lo1 = (ql[16 + x] >> lo_shift) & 0x0F;
                    unit[64 * p + 4 * j + i4] = static_cast<uint8_t>(lo0 | (lo1 << 4));
                }
            }
            for (int half = 0; half < 2; ++half) {
                for (int i4 = 0; i4 < 4; ++i4) {
                    int v = 0;
                    for (int p = 0; p < 4; ++p) v |= ((qh[16 * half + 4 * p + i4] >> hi_shift) & 0x03) << (2 * p);
                    unit[256 + 64 * half + 4 * j + i4] = static_cast<uint8_t>(v);
                }
            }
        }
        return;
    }
    // Q4_K: d, dmin, scales[12], qs[128]; Q5_K: d, dmin, scales[12], qh[32], qs[128]
    std::memcpy(t + 2 * j, b, 2);
    std::memcpy(t + 32 + 2 * j, b + 2, 2);
    for (int k = 0; k < 3; ++k) std::memcpy(t + kQ4kScales + 64 * k + 4 * j, b + 4 + 4 * k, 4);
    const uint8_t* qs = b + (fmt == QT_Q5_K ? 48 : 16);
    for (int s = 0; s < 8; ++s) {  // sub-blocks of 32: e = 32 s + i
        const uint8_t* src = qs + 32 * (s / 2);
        const int shift = 4 * (s % 2);
        uint8_t* dst = t + kQ4kQuants + 256 * s + 4 * j;
        for (int p = 0; p < 4; ++p) {
            for (int i4 = 0; i4 < 4; ++i4) {
                const int x = 4 * p + i4;
                const int lo = (src[x] >> shift) & 0x0F, hi = (src[16 + x] >> shift) & 0x0F;
                dst[64 * p + i4] = static_cast<uint8_t>(lo | (hi << 4));
            }
        }
        if (fmt == QT_Q5_K) {  // input i's 5th bit: bit s of qh[i]; 4 rows' bits share a byte
            const uint8_t* qh = b + 16;
            for (int half = 0; half < 2; ++half) {
                for (int p = 0; p < 4; ++p) {
                    int nib = 0;
                    for (int i4 = 0; i4 < 4; ++i4) nib |= ((qh[16 * half + 4 * p + i4] >> s) & 1) << i4;
                    t[kQ5kHigh + 64 * s + 8 * (4 * half + p) + j / 2] |= static_cast<uint8_t>(nib << (4 * (j % 2)));
                }
            }
        }
    }
}

}  // namespace

void kq_repack(int fmt, const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
    const int64_t nb = K / kKqBlock, bb = kq_gguf_block_bytes(fmt), tb = kq_tile_bytes(fmt);
    std::memset(dst, 0, static_cast<size_t>(N / kKqTileRows * nb * tb));
    for (int64_t n = 0; n < N; ++n) {
        const int64_t g = n / kKqTileRows, j = n % kKqTileRows;
        for (int64_t b = 0; b < nb; ++b) repack_block(fmt, src + n * nb * bb + b * bb, j, dst + (g * nb + b) * tb);
    }
}

void kq_decode_rows(int fmt, const uint8_t* tiles, int64_t K, int64_t r0, int64_t r1, float* out) {
    const int64_t nb = K / kKqBlock, tb = kq_tile_bytes(fmt);
    for (int64_t n = r0; n < r1; ++n) {
        const int64_t g = n / kKqTileRows, j = n % kKqTileRows;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* t = tiles + (g * nb + b) * tb;
            float* o = out + (n - r0) * K + b * kKqBlock;
            const float d = f16_at(t + 2 * j);
            if (fmt == QT_Q6_K) {
                for (int u = 0; u < 8; ++u) {
                    const uint8_t* unit = t + kQ6kUnits + kQ6kUnitBytes * u;
                    for (int half = 0; half < 2; ++half) {
                        const int8_t sc = static_cast<int8_t>(t[kQ6kScales + 16 * (2 * u + half) + j]);
                        const float dl = d * static_cast<float>(sc);
                        for (int p = 0; p < 4; ++p) {
                            for (int i = 0; i < 4; ++i) {
                                const int lo = (unit[64 * p + 4 * j + i] >> (4 * half)) & 0x0F;
                                const int hi = (unit[256 + 64 * half + 4 * j + i] >> (2 * p)) & 0x03;
                                o[32 * u + 16 * half + 4 * p + i] = dl * static_cast<float>((lo | (hi << 4)) - 32);
                            }
                        }
                    }
                }
                continue;
            }
            const float dmin = f16_at(t + 32 + 2 * j);
            uint8_t sc[8], mn[8];
            tile_scale_min(t, j, sc, mn);
            for (int s = 0; s < 8; ++s) {
                const float dl = d * static_cast<float>(sc[s]);
                const float ml = dmin * static_cast<float>(mn[s]);
                uint64_t high[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                if (fmt == QT_Q5_K) std::memcpy(high, t + kQ5kHigh + 64 * s, 64);
                for (int p = 0; p < 4; ++p) {
                    for (int i = 0; i < 4; ++i) {
                        const uint8_t byte = t[kQ4kQuants + 256 * s + 64 * p + 4 * j + i];
                        const int bit = static_cast<int>(4 * j + i);
                        const int lo = (byte & 0x0F) | static_cast<int>(((high[p] >> bit) & 1) << 4);
                        const int hi = (byte >> 4) | static_cast<int>(((high[4 + p] >> bit) & 1) << 4);
                        o[32 * s + 4 * p + i] = dl * static_cast<float>(lo) - ml;
                        o[32 * s + 16 + 4 * p + i] = dl * static_cast<float>(hi) - ml;
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The scalar twins of kernels_vnni.cpp's K-quant kernels.  Integer sums are exact and every float
// step is the same single operation (std::fma: one rounding, like vfmadd), so the results equal
// the VNNI kernels bit for bit on any CPU.

namespace {

void a8_quantize_rows(const float* x, int64_t K, int8_t* xq, float* dk, int16_t* bs16, int8_t* bsm,
                      int64_t m0, int64_t m1) {
    const int64_t nb = K / kKqBlock;
    for (int64_t m = m0; m < m1; ++m) {
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + m * K + b * kKqBlock;
            float amax = 0.0f;
            for (int i = 0; i < 256; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            int8_t* q = xq + m * K + b * kKqBlock;
            for (int v = 0; v < 16; ++v) {
                int32_t s = 0;
                for (int i = 16 * v; i < 16 * v + 16; ++i) {
                    float r = std::nearbyint(xb[i] * id);  // round to nearest even, as cvtps2dq
                    r = r > 127.0f ? 127.0f : (r < -128.0f ? -128.0f : r);
                    q[i] = static_cast<int8_t>(r);
                    s += q[i];
                }
                bs16[m * (K / 16) + b * 16 + v] = static_cast<int16_t>(s);
            }
            kq_split_pair_sums(bs16 + m * (K / 16) + b * 16, bsm + m * (K / 16) + b * 16);
            dk[m * nb + b] = d;
        }
    }
}

// One output: row j of tile group g against activation row m, all blocks.
float a8_dot(int fmt, const uint8_t* group, int64_t j, const int8_t* xq, const float* dk,
             const int16_t* bs16, const int8_t* bsm, int64_t nb) {
    const int64_t tb = kq_tile_bytes(fmt);
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* t = group + b * tb;
        const int8_t* xb = xq + b * kKqBlock;
        int32_t S = 0;
        if (fmt == QT_Q6_K) {
            for (int s = 0; s < 16; ++s) {
                int32_t si = 0;
                for (int e = 16 * s; e < 16 * s + 16; ++e) si += code_at(fmt, t, j, e) * xb[e];
                si -= 32 * bs16[b * 16 + s];
                S += static_cast<int8_t>(t[kQ6kScales + 16 * s + j]) * si;
            }
            acc = std::fma(static_cast<float>(S) * dk[b], f16_at(t + 2 * j), acc);
            continue;
        }
        uint8_t sc[8], mn[8];
        tile_scale_min(t, j, sc, mn);
        int32_t mins = 0;
        for (int s = 0; s < 8; ++s) {
            int32_t si = 0;
            for (int e = 32 * s; e < 32 * s + 32; ++e) si += code_at(fmt, t, j, e) * xb[e];
            S += sc[s] * si;
            mins += mn[s] * (128 * bsm[b * 16 + 8 + s] + bsm[b * 16 + s]);
        }
        acc = std::fma(static_cast<float>(S) * dk[b], f16_at(t + 2 * j), acc);
        acc = std::fma(-(static_cast<float>(mins) * dk[b]), f16_at(t + 32 + 2 * j), acc);
    }
    return acc;
}

void a8_linear_groups(int fmt, const int8_t* xq, const float* dk, const int16_t* bs16,
                      const int8_t* bsm, int64_t M, int64_t K, const uint8_t* w, const float* bias,
                      float* y, int64_t ldy, int64_t g0, int64_t g1) {
    const int64_t nb = K / kKqBlock, tb = kq_tile_bytes(fmt);
    for (int64_t g = g0; g < g1; ++g) {
        for (int64_t j = 0; j < kKqTileRows; ++j) {
            const int64_t n = g * kKqTileRows + j;
            for (int64_t m = 0; m < M; ++m) {
                const float acc = a8_dot(fmt, w + g * nb * tb, j, xq + m * K, dk + m * nb,
                                         bs16 + m * (K / 16), bsm + m * (K / 16), nb);
                y[m * ldy + n] = bias ? acc + bias[n] : acc;
            }
        }
    }
}

// Float activations (kernels.h, KqTable::linear_groups_f32): one row decoded at a time.
void f32_linear_groups(int fmt, const float* x, int64_t M, int64_t K, const uint8_t* w, const float* bias,
                       float* y, int64_t ldy, int64_t g0, int64_t g1, float* scratch) {
    float* row = scratch;
    for (int64_t n = g0 * kKqTileRows; n < g1 * kKqTileRows; ++n) {
        kq_decode_rows(fmt, w, K, n, n + 1, row);
        for (int64_t m = 0; m < M; ++m) {
            const float* xm = x + m * K;
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int64_t k = 0; k < K; ++k) c[k % 4] = std::fma(row[k], xm[k], c[k % 4]);
            const float r = (c[0] + c[1]) + (c[2] + c[3]);
            y[m * ldy + n] = bias ? r + bias[n] : r;
        }
    }
}

const KqTable kPortableKq = {a8_quantize_rows, a8_linear_groups, f32_linear_groups};

}  // namespace

const KqTable* portable_kq_table() { return &kPortableKq; }

}  // namespace specdec
