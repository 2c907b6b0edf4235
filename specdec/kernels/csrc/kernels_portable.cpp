// Portable kernels: plain C++ the compiler may auto-vectorise, compiled without ISA flags and with
// -ffp-contract=off.  Used when the CPU lacks AVX2/FMA/F16C (or when forced for testing).
//
// Same batch-invariance rule as the AVX2 path: a dot product is 8 lane accumulators over
// k = 0, 8, 16, ... (multiply then add, two roundings), then a fixed horizontal sum.  Results
// differ from the AVX2 path (no fused multiply-add) but not between batch sizes.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>

#include "half.h"
#include "kernels.h"

namespace specdec {
namespace {

float f16_to_f32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t mant = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (mant << 13);  // inf / nan
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {  // subnormal half -> normal float
        exp = 113;
        while ((mant & 0x400u) == 0) {
            mant <<= 1;
            --exp;
        }
        mant &= 0x3FFu;
        bits = sign | (exp << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float load_f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return f16_to_f32(h);
}

inline float hsum8(const float* a) {
    const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
    return (s0 + s2) + (s1 + s3);
}

inline float dot(const float* a, const float* b, int64_t K) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
        for (int l = 0; l < 8; ++l) acc[l] += a[k + l] * b[k + l];
    for (int l = 0; k + l < K; ++l) acc[l] += a[k + l] * b[k + l];
    return hsum8(acc);
}

// Decode one GGUF row of K elements into floats (the same float32 operations as gguf.quants).
void decode_row(int qtype, const uint8_t* row, int64_t K, float* out) {
    const int64_t nb = K / 32;
    for (int64_t b = 0; b < nb; ++b) {
        float* o = out + b * 32;
        if (qtype == QT_Q8_0) {
            const uint8_t* blk = row + b * 34;
            const float d = load_f16(blk);
            for (int i = 0; i < 32; ++i) o[i] = static_cast<float>(static_cast<int8_t>(blk[2 + i])) * d;
        } else if (qtype == QT_Q4_0) {
            const uint8_t* blk = row + b * 18;
            const float d = load_f16(blk);
            for (int i = 0; i < 16; ++i) {
                o[i] = static_cast<float>((blk[2 + i] & 0x0F) - 8) * d;
                o[i + 16] = static_cast<float>((blk[2 + i] >> 4) - 8) * d;
            }
        } else {  // QT_Q4_1
            const uint8_t* blk = row + b * 20;
            const float d = load_f16(blk);
            const float m = load_f16(blk + 2);
            for (int i = 0; i < 16; ++i) {
                o[i] = static_cast<float>(blk[4 + i] & 0x0F) * d + m;
                o[i + 16] = static_cast<float>(blk[4 + i] >> 4) * d + m;
            }
        }
    }
}

void linear_rows(int qtype, const float* x, int64_t M, int64_t K, const uint8_t* w,
                 int64_t w_row_bytes, const float* bias, float* y, int64_t N, int64_t n0,
                 int64_t n1, float* scratch) {
    for (int64_t m0 = 0; m0 < M; m0 += kChunkRows) {
        const int64_t mc = M - m0 < kChunkRows ? M - m0 : kChunkRows;
        for (int64_t n = n0; n < n1; ++n) {
            const float* wr;
            if (qtype == QT_F32) {
                wr = reinterpret_cast<const float*>(w) + n * K;
            } else {
                decode_row(qtype, w + n * w_row_bytes, K, scratch);
                wr = scratch;
            }
            for (int64_t m = m0; m < m0 + mc; ++m) {
                float s = dot(x + m * K, wr, K);
                if (bias) s += bias[n];
                y[m * N + n] = s;
            }
        }
    }
}

void rms_norm_rows(const float* x, const float* w, float* y, int64_t K, float eps, int64_t m0,
                   int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
        const float* xr = x + m * K;
        float* yr = y + m * K;
        const float mean = dot(xr, xr, K) / static_cast<float>(K);
        const float r = 1.0f / std::sqrt(mean + eps);
        for (int64_t k = 0; k < K; ++k) yr[k] = (xr[k] * r) * w[k];
    }
}

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return half_to_float(*p); }

// One kv head's cache as block_query reads it: entry d of key or value j as an exact float, the
// factor that multiplies key j's score sum, and value j's softmax weight.  A float or half cache
// (kernels.h AttnRows; the factor is the attention scale, the weight as it is) ...
template <typename KV>
struct FloatHead {
    const KV* kt;
    const KV* v;
    int64_t v_stride, D;
    float key(int64_t j, int64_t d) const {
        return load1(kt + (j / kKeyBlock) * D * kKeyBlock + d * kKeyBlock + j % kKeyBlock);
    }
    float value(int64_t j, int64_t d) const { return load1(v + j * v_stride + d); }
    float score_factor(int64_t, float scale) const { return scale; }
    float weight(int64_t, float p) const { return p; }
};

// ... and an 8-bit one (kernels.h kQ8Header): the key's scale joins the attention scale, the value
// row's scale multiplies the weight (kernels_avx2.cpp, the same operations).
struct Q8Head {
    const uint8_t* kt;
    const uint8_t* v;
    int64_t D;
    static float scale_of(const uint8_t* head, int64_t j, int64_t D) {
        float sc;
        std::memcpy(&sc, head + (j / kKeyBlock) * q8_block_bytes(D) + (j % kKeyBlock) * 4, sizeof sc);
        return sc;
    }
    static const int8_t* entries(const uint8_t* head, int64_t j, int64_t D) {
        return reinterpret_cast<const int8_t*>(head + (j / kKeyBlock) * q8_block_bytes(D) + kQ8Header);
    }
    float key(int64_t j, int64_t d) const {
        return static_cast<float>(entries(kt, j, D)[d * kKeyBlock + j % kKeyBlock]);
    }
    float value(int64_t j, int64_t d) const { return static_cast<float>(entries(v, j, D)[(j % kKeyBlock) * D + d]); }
    float score_factor(int64_t j, float scale) const { return scale_of(kt, j, D) * scale; }
    float weight(int64_t j, float p) const { return p * scale_of(v, j, D); }
};

// The partial softmax of one (row, head) over keys [b, e): rec = (m, l, o[D]).  q . k_j in four
// chains as kernels.h defines it (std::fma: one rounding, as vfmadd).
template <typename Head>
void block_query(const float* q, const Head& kv, int64_t b, int64_t e, int64_t D, float scale, float softcap,
                 float* rec, float* s) {
    float m = -INFINITY;
    for (int64_t j = b; j < e; ++j) {
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t d = 0; d < 4 && d < D; ++d) c[d] = q[d] * kv.key(j, d);
        for (int64_t d = 4; d < D; ++d) c[d % 4] = std::fma(q[d], kv.key(j, d), c[d % 4]);
        float sj = ((c[0] + c[1]) + (c[2] + c[3])) * kv.score_factor(j, scale);
        if (softcap > 0.0f) sj = softcap * std::tanh(sj / softcap);
        s[j - b] = sj;
        m = sj > m ? sj : m;
    }
    float l = 0.0f;
    for (int64_t j = b; j < e; ++j) {
        s[j - b] = std::exp(s[j - b] - m);
        l += s[j - b];
    }
    rec[0] = m;
    rec[1] = l;
    float* o = rec + kAttnOut;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    for (int64_t j = b; j < e; ++j) {
        const float p = kv.weight(j, s[j - b]);
        for (int64_t d = 0; d < D; ++d) o[d] = std::fma(p, kv.value(j, d), o[d]);
    }
}

template <typename Head>
void attention_block_head(const AttnRows& a, const Head& kv, int64_t j0, float* part, float* scratch) {
    const int64_t P = attn_part_floats(a.D);
    for (int64_t r = 0; r < a.R; ++r) {
        const int64_t b = std::max(a.lo[r], j0), e = std::min(a.hi[r] + 1, j0 + kAttnBlock);
        if (b >= e) continue;
        for (int64_t g = 0; g < a.G; ++g)
            block_query(a.q + r * a.q_row_stride + g * a.q_head_stride, kv, b, e, a.D, a.scale, a.softcap,
                        part + (r * a.G + g) * P, scratch);
    }
}

void attention_block(const AttnRows& a, int64_t j0, float* part, float* scratch) {
    if (a.q8) {
        attention_block_head(a, Q8Head{static_cast<const uint8_t*>(a.kt), static_cast<const uint8_t*>(a.v), a.D}, j0,
                             part, scratch);
    } else if (a.half) {
        attention_block_head(a, FloatHead<uint16_t>{static_cast<const uint16_t*>(a.kt),
                                                    static_cast<const uint16_t*>(a.v), a.v_stride, a.D},
                             j0, part, scratch);
    } else {
        attention_block_head(
            a, FloatHead<float>{static_cast<const float*>(a.kt), static_cast<const float*>(a.v), a.v_stride, a.D}, j0,
            part, scratch);
    }
}

void attention_merge(const AttnRows& a, int64_t b0, int64_t b1, const float* part, float* out,
                     int64_t out_row_stride) {
    const int64_t D = a.D, G = a.G, P = attn_part_floats(D), bstride = a.R * G * P;
    for (int64_t r = 0; r < a.R; ++r) {
        const int64_t bl = std::max(b0, a.lo[r] / kAttnBlock), bh = std::min(b1 - 1, a.hi[r] / kAttnBlock);
        for (int64_t g = 0; g < G; ++g) {
            const float* rec0 = part + (r * G + g) * P;
            float M = -INFINITY;
            for (int64_t b = bl; b <= bh; ++b) M = rec0[(b - b0) * bstride] > M ? rec0[(b - b0) * bstride] : M;
            float* o = out + r * out_row_stride + g * D;
            for (int64_t c = 0; c < D; ++c) o[c] = 0.0f;
            float L = 0.0f;
            for (int64_t b = bl; b <= bh; ++b) {
                const float* rec = rec0 + (b - b0) * bstride;
                const float w = rec[0] == M ? 1.0f : std::exp(rec[0] - M);
                L += rec[1] * w;
                for (int64_t c = 0; c < D; ++c) o[c] = std::fma(rec[kAttnOut + c], w, o[c]);
            }
            const float inv = 1.0f / L;
            for (int64_t c = 0; c < D; ++c) o[c] *= inv;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 8-bit activation path: the same arithmetic as kernels_vnni.cpp, one output at a time.  Integer
// sums are exact and every float step is the same single operation (std::fma is one rounding,
// like vfmadd), so the results equal the VNNI kernels bit for bit.

void a8_quantize_rows(const float* x, int64_t K, int8_t* xq, float* dx, int32_t* sx, float* dxs,
                      int64_t m0, int64_t m1) {
    const int64_t nb = K / 32;
    for (int64_t m = m0; m < m1; ++m) {
        for (int64_t b = 0; b < nb; ++b) {
            const float* xb = x + m * K + b * 32;
            float amax = 0.0f;
            for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
            const float d = amax / 127.0f;
            const float id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t s = 0;
            for (int i = 0; i < 32; ++i) {
                float r = std::nearbyint(xb[i] * id);  // round to nearest even, as cvtps2dq
                r = r > 127.0f ? 127.0f : (r < -128.0f ? -128.0f : r);
                const int8_t q = static_cast<int8_t>(r);
                xq[m * K + b * 32 + i] = q;
                s += q;
            }
            dx[m * nb + b] = d;
            sx[m * nb + b] = s;
            dxs[m * nb + b] = d * static_cast<float>(s);
        }
    }
}

// Code u of input i (0..31) of row j (0..15) in a repacked tile (layout in kernels_vnni.cpp).
inline int32_t a8_code(int kind, const uint8_t* tile, int64_t j, int i) {
    const int t = i / 4, r = i % 4;
    const int64_t h = a8_head_bytes(kind);
    if (kind == A8_Q8) return tile[h + t * 64 + j * 4 + r];
    const uint8_t byte = tile[h + (t % 4) * 64 + j * 4 + r];
    return t < 4 ? (byte & 0x0F) : (byte >> 4);
}

inline float tile_f16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return f16_to_f32(h);
}

void a8_linear_groups(int kind, const int8_t* xq, const float* dx, const int32_t* sx,
                      const float* dxs, int64_t M, int64_t K, const uint8_t* w, const float* bias,
                      float* y, int64_t N, int64_t g0, int64_t g1, const void* /*prep*/) {
    const int64_t nb = K / 32, TB = a8_tile_bytes(kind);
    const int32_t offset = kind == A8_Q8 ? 128 : kind == A8_Q4_0 ? 8 : 0;
    for (int64_t g = g0; g < g1; ++g) {
        for (int64_t j = 0; j < kA8TileRows; ++j) {
            const int64_t n = g * kA8TileRows + j;
            for (int64_t m = 0; m < M; ++m) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; ++b) {
                    const uint8_t* tile = w + (g * nb + b) * TB;
                    const int8_t* xb = xq + m * K + b * 32;
                    int32_t s = 0;
                    for (int i = 0; i < 32; ++i) s += a8_code(kind, tile, j, i) * xb[i];
                    s -= offset * sx[m * nb + b];
                    const float f = static_cast<float>(s) * dx[m * nb + b];
                    acc = std::fma(f, tile_f16(tile + 2 * j), acc);
                    if (kind == A8_Q4_1) acc = std::fma(tile_f16(tile + 32 + 2 * j), dxs[m * nb + b], acc);
                }
                y[m * N + n] = bias ? acc + bias[n] : acc;
            }
        }
    }
}

int64_t argmax(const float* x, int64_t n) {
    int64_t best = 0;
    float m = x[0];
    for (int64_t i = 1; i < n; ++i) {
        if (x[i] > m || (m != m && x[i] == x[i])) {  // NOTE: a NaN start gives way to any number
            m = x[i];
            best = i;
        }
    }
    return best;
}

// No per-token write kernels: the decoder layer runs its own scalar loops (layer.cpp).
const KernelTable kTable = {"portable",      linear_rows, rms_norm_rows, argmax, attention_block,
                            attention_merge, nullptr,     nullptr,       nullptr, nullptr};
const A8Table kA8Table = {"portable", a8_quantize_rows, a8_linear_groups, nullptr, nullptr};

}  // namespace

const KernelTable* portable_table() { return &kTable; }
void gguf_decode_row(int qtype, const uint8_t* row, int64_t K, float* out) { decode_row(qtype, row, K, out); }
const A8Table* portable_a8_table() { return &kA8Table; }

}  // namespace specdec
