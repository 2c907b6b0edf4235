// Portable kernels: plain C++ the compiler may auto-vectorise, compiled without ISA flags and with
// -ffp-contract=off.  Used when the CPU lacks AVX2/FMA/F16C (or when forced for testing).
//
// Same batch-invariance rule as the AVX2 path: a dot product is 8 lane accumulators over
// k = 0, 8, 16, ... (multiply then add, two roundings), then a fixed horizontal sum.  Results
// differ from the AVX2 path (no fused multiply-add) but not between batch sizes.
#include <cmath>
#include <cstdint>
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

// q . k_j for a blocked key cache as kernels.h defines it (std::fma: one rounding, as vfmadd).
template <typename KV>
inline float blocked_score(const float* q, const KV* kt, int64_t j, int64_t D) {
    const KV* kb = kt + (j / kKeyBlock) * D * kKeyBlock + j % kKeyBlock;
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t d = 0; d < 4 && d < D; ++d) c[d] = q[d] * load1(kb + d * kKeyBlock);
    for (int64_t d = 4; d < D; ++d) c[d % 4] = std::fma(q[d], load1(kb + d * kKeyBlock), c[d % 4]);
    return (c[0] + c[1]) + (c[2] + c[3]);
}

template <typename KV>
void attention_row(const float* q, const KV* kt, const KV* v, int64_t v_stride, int64_t lo,
                   int64_t hi, int64_t D, float scale, float softcap, float* out, float* scratch) {
    const int64_t n = hi - lo + 1;
    float* s = scratch;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
        float sj = blocked_score(q, kt, lo + j, D) * scale;
        if (softcap > 0.0f) sj = softcap * std::tanh(sj / softcap);
        s[j] = sj;
        mx = sj > mx ? sj : mx;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
        s[j] = std::exp(s[j] - mx);
        sum += s[j];
    }
    const float inv = 1.0f / sum;
    const KV* vb = v + lo * v_stride;
    for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
        const float p = s[j];
        const KV* vj = vb + j * v_stride;
        for (int64_t d = 0; d < D; ++d) out[d] += p * load1(vj + d);
    }
    for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

template <typename KV>
void attention_rows(const float* q, int64_t q_head_stride, int64_t G, const KV* kt, const KV* v,
                    int64_t v_stride, int64_t lo, int64_t hi, int64_t D, float scale, float softcap,
                    float* out, int64_t out_head_stride, float* scratch) {
    for (int64_t g = 0; g < G; ++g)
        attention_row(q + g * q_head_stride, kt, v, v_stride, lo, hi, D, scale, softcap,
                      out + g * out_head_stride, scratch);
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
    if (kind == A8_Q8) return tile[64 + t * 64 + j * 4 + r];
    const uint8_t byte = tile[64 + (t % 4) * 64 + j * 4 + r];
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

const KernelTable kTable = {"portable", linear_rows, rms_norm_rows, attention_rows<float>, argmax,
                            attention_rows<uint16_t>};
const A8Table kA8Table = {"portable", a8_quantize_rows, a8_linear_groups, nullptr};

}  // namespace

const KernelTable* portable_table() { return &kTable; }
const A8Table* portable_a8_table() { return &kA8Table; }

}  // namespace specdec
