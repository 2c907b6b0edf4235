// One decoder layer (Llama family, Qwen2, Gemma 3) as a single native call.
//
// The Python forward (specdec/model/llama.py, LlamaModel._layer) issues ~40 small torch ops per
// layer; at one token per step that glue cost more than a third of the step.  This class runs the
// same computation with the same arithmetic: the kernels of ops.cpp for linear / rms_norm /
// attention, ATen for the GELU (the op Python calls), ATen's own SiLU arithmetic (silu_mul_row),
// and plain loops for the rotary embedding, the KV-cache writes, the residual adds and the
// gate-times-up product that do exactly torch's elementwise float32 operations (compiled with
// -ffp-contract=off; their rows split over the kernels' threads, rows_parallel); the rotary
// embedding and the cache writes in the kernel table's vector forms where it has them (the same
// operations in lanes: kernels.h rope_head ... q8_head).  The two
// forwards therefore agree bit for bit, which tests/unit/model/test_tiny_model.py checks.
#include <dlfcn.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "allreduce.h"
#include "linear_spec.h"
#include "moe.h"
#include "ops.h"
#include "parallel.h"
#include "timeline.h"

namespace specdec {
namespace {

// f(begin, end) over [0, n) rows on the kernels' worker pool (grain_for: item_ns a row; 0: one
// range, on the calling thread): the glue between the kernels runs on every core, as the kernels
// do, not on the calling thread alone while the others wait.  Each element's operations are the
// same whatever the split.
template <class F>
void rows_parallel(int64_t n, double item_ns, const F& f) {
    parallel_range(n, grain_for(item_ns), f);
}

// A float stored into a cache element: as is, or rounded to the nearest half (ties to even, as
// torch's .to(torch.float16)).
inline void put(float* dst, float x) { *dst = x; }
inline void put(uint16_t* dst, float x) { *dst = c10::Half(x).x; }

// dst[j * dst_stride] = src[j] * cos[j] + rot[j] * sin[j] with rot = cat(-src[h:], src[:h])
// (rotate_half), one head of D floats; the same two products and one sum per element as the torch
// expression.  dst_stride: 1 for queries, kKeyBlock for a key written into the blocked cache.
template <typename T>
inline void rotate_head(const float* src, const float* cos, const float* sin, int64_t D, T* dst,
                        int64_t dst_stride = 1) {
    const int64_t h = D / 2;
    for (int64_t j = 0; j < h; ++j) {
        const float a = src[j] * cos[j];
        const float b = (-src[j + h]) * sin[j];
        put(dst + j * dst_stride, a + b);
    }
    for (int64_t j = h; j < D; ++j) {
        const float a = src[j] * cos[j];
        const float b = src[j - h] * sin[j];
        put(dst + j * dst_stride, a + b);
    }
}

// One head's D floats into an 8-bit cache block (kernels.h kQ8Header): scale = max |x| / 127,
// entry d = round-half-even(x[d] / scale) (0 for an all-zero head) at q[d * q_stride]; the scale
// at *scale.  The same operations as KVCache.store's (specdec/kv_cache/pool.py).
inline void put_q8(const float* x, int64_t D, int8_t* q, int64_t q_stride, float* scale) {
    float amax = 0.0f;
    for (int64_t d = 0; d < D; ++d) amax = std::fabs(x[d]) > amax ? std::fabs(x[d]) : amax;
    const float sc = amax / 127.0f;
    for (int64_t d = 0; d < D; ++d) {
        float r = sc > 0.0f ? std::nearbyint(x[d] / sc) : 0.0f;
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        q[d * q_stride] = static_cast<int8_t>(r);
    }
    std::memcpy(scale, &sc, sizeof sc);
}

// a + b for two contiguous float32 tensors of one shape, as a new tensor: the same single float
// additions as torch's a + b (so the same bits), without an ATen call's dispatch and iterator set-up,
// which at one token a step cost more than the add.  Other operands go through ATen.
torch::Tensor add_rows(const torch::Tensor& a, const torch::Tensor& b) {
    if (!(a.is_contiguous() && b.is_contiguous() && a.scalar_type() == torch::kFloat32 &&
          b.scalar_type() == torch::kFloat32 && a.sizes() == b.sizes()))
        return a + b;
    torch::Tensor y = torch::empty_like(a);
    const float* ap = a.data_ptr<float>();
    const float* bp = b.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t rows = a.dim() > 1 ? a.size(0) : 1, width = a.numel() / std::max<int64_t>(rows, 1);
    rows_parallel(rows, 0.3 * static_cast<double>(width), [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0 * width; i < r1 * width; ++i) yp[i] = ap[i] + bp[i];
    });
    return y;
}

// out[i] = silu(g[i]) * u[i] for one row of n, bit for bit as at::silu(g) then torch's float
// product with u: ATen's vectorized SiLU computes x / (1 + exp(-x)) with Sleef's 1-ulp expf over
// each row's whole steps of two vectors and std::exp over the rest (ATen's vectorized_loop), and
// these do the same operations in the same lanes.  Which lanes ATen uses follows its dispatch
// (at::get_cpu_capability(): AVX512 16, AVX2 8); silu_mul_row() is nullptr for any other, or where
// the Sleef function is not found, and the caller then runs at::silu itself.
using SiluMulRow = void (*)(const float* g, const float* u, float* out, int64_t n);

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq")
using SleefExp16 = __m512 (*)(__m512);
SleefExp16 g_exp16 = nullptr;
void silu_mul_row16(const float* g, const float* u, float* out, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f), neg = _mm512_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int64_t j = i; j < i + 32; j += 16) {
            const __m512 x = _mm512_loadu_ps(g + j);
            const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, g_exp16(_mm512_xor_ps(neg, x))));
            _mm512_storeu_ps(out + j, _mm512_mul_ps(s, _mm512_loadu_ps(u + j)));
        }
    for (; i < n; ++i) out[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2")
using SleefExp8 = __m256 (*)(__m256);
SleefExp8 g_exp8 = nullptr;
void silu_mul_row8(const float* g, const float* u, float* out, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int64_t j = i; j < i + 16; j += 8) {
            const __m256 x = _mm256_loadu_ps(g + j);
            const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, g_exp8(_mm256_xor_ps(neg, x))));
            _mm256_storeu_ps(out + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
        }
    for (; i < n; ++i) out[i] = (g[i] / (1.0f + std::exp(-g[i]))) * u[i];
}
#pragma GCC pop_options

// ATen's own copy of a Sleef function (libtorch_cpu exports them), or nullptr.
void* aten_symbol(const char* name) {
    if (void* f = dlsym(RTLD_DEFAULT, name)) return f;
    void* lib = dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD);  // loaded as a dependency, not global
    return lib != nullptr ? dlsym(lib, name) : nullptr;
}

SiluMulRow silu_mul_row() {
    static const SiluMulRow fn = []() -> SiluMulRow {
        const std::string cap = at::get_cpu_capability();
        if (cap == "AVX512") {
            g_exp16 = reinterpret_cast<SleefExp16>(aten_symbol("Sleef_expf16_u10"));
            return g_exp16 != nullptr ? silu_mul_row16 : nullptr;
        }
        if (cap == "AVX2") {
            g_exp8 = reinterpret_cast<SleefExp8>(aten_symbol("Sleef_expf8_u10"));
            return g_exp8 != nullptr ? silu_mul_row8 : nullptr;
        }
        return nullptr;
    }();
    return fn;
}

class DecoderLayer {
   public:
    DecoderLayer(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden,
                 int64_t intermediate, double eps, double attn_scale, int64_t sliding_window,
                 double softcap, const std::string& activation, torch::Tensor input_norm,
                 torch::Tensor post_attn_norm, torch::Tensor qkv_w, int64_t qkv_qt,
                 c10::optional<torch::Tensor> qkv_bias, torch::Tensor o_w, int64_t o_qt,
                 c10::optional<torch::Tensor> o_bias, torch::Tensor gate_up_w, int64_t gate_up_qt,
                 c10::optional<torch::Tensor> gate_up_bias, torch::Tensor down_w, int64_t down_qt,
                 c10::optional<torch::Tensor> down_bias, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, c10::optional<torch::Tensor> post_attn_out_norm,
                 c10::optional<torch::Tensor> post_ffw_norm, std::vector<int64_t> qkv_parts,
                 std::vector<int64_t> o_parts, std::vector<int64_t> gate_up_parts,
                 std::vector<int64_t> down_parts)
        : H_(num_heads),
          Hkv_(num_kv_heads),
          D_(head_dim),
          I_(intermediate),
          eps_(eps),
          scale_(attn_scale),
          window_(sliding_window),
          softcap_(softcap),
          gelu_(activation == "gelu_tanh"),
          input_norm_(input_norm),
          post_attn_norm_(post_attn_norm),
          qkv_(qkv_w, qkv_qt, hidden, qkv_bias, std::move(qkv_parts)),
          o_(o_w, o_qt, num_heads * head_dim, o_bias, std::move(o_parts)),
          gate_up_(gate_up_w, gate_up_qt, hidden, gate_up_bias, std::move(gate_up_parts)),
          down_(down_w, down_qt, intermediate, down_bias, std::move(down_parts)),
          q_norm_(q_norm),
          k_norm_(k_norm),
          post_attn_out_norm_(post_attn_out_norm),
          post_ffw_norm_(post_ffw_norm) {
        TORCH_CHECK(activation == "silu" || activation == "gelu_tanh",
                    "DecoderLayer: activation must be silu or gelu_tanh, got ", activation);
        TORCH_CHECK(head_dim % 2 == 0, "DecoderLayer: head_dim must be even");
    }

    // x [T, hidden]; cos / sin [T, D] (each token's rotary row); this layer's v_cache
    // [slots, Hkv, max_len, D] and k_cache [slots, Hkv, max_len / kKeyBlock, D, kKeyBlock] (blocked,
    // kernels.h).  Sequence s owns tokens [sum(counts[:s]), +counts[s]) of x, at positions
    // starts[s]... of KV slot slots[s]; prefix_slots / prefix_lens as attention_seqs takes them (a
    // shared prefix each, or empty).  Returns the layer's output [T, hidden].
    torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                          torch::Tensor k_cache, torch::Tensor v_cache, const std::vector<int64_t>& slots,
                          const std::vector<int64_t>& starts, const std::vector<int64_t>& counts,
                          ShmReducer* reducer = nullptr, const std::vector<int64_t>& prefix_slots = {},
                          const std::vector<int64_t>& prefix_lens = {}) {
        // NOTE: no op here is differentiated: below autograd, each ATen call skips its autograd and
        // view-tracking dispatch (measured: ~2 us an op, ~15 ops a layer).
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        Timeline::mark(kMarkLayer);
        const int64_t T = x.size(0), D = D_;
        TORCH_CHECK(slots.size() == starts.size() && slots.size() == counts.size(),
                    "DecoderLayer: slots, starts and counts differ in length");
        TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T && cos.size(1) == D &&
                        sin.sizes() == cos.sizes() && cos.scalar_type() == torch::kFloat32 &&
                        sin.scalar_type() == torch::kFloat32,
                    "DecoderLayer: cos / sin must be contiguous float32 [T, head_dim]");
        const bool half = v_cache.scalar_type() == torch::kHalf, q8 = v_cache.scalar_type() == torch::kInt8;
        if (q8) {
            TORCH_CHECK(v_cache.dim() == 4 && contiguous_per_slot(v_cache) && v_cache.size(1) == Hkv_ &&
                            v_cache.size(3) == q8_block_bytes(D) && k_cache.sizes() == v_cache.sizes() &&
                            contiguous_per_slot(k_cache) && k_cache.scalar_type() == torch::kInt8,
                        "DecoderLayer: an int8 cache's k_cache and v_cache must be contiguous per slot [slots, Hkv, "
                        "max_len / ",
                        kKeyBlock, ", ", q8_block_bytes(D), "]");
        } else {
            TORCH_CHECK(v_cache.dim() == 4 && contiguous_per_slot(v_cache) && v_cache.size(1) == Hkv_ &&
                            v_cache.size(3) == D && (half || v_cache.scalar_type() == torch::kFloat32),
                        "DecoderLayer: v_cache must be float32 or float16 [slots, Hkv, max_len, D], contiguous per "
                        "slot");
            TORCH_CHECK(k_cache.dim() == 5 && contiguous_per_slot(k_cache) && k_cache.size(0) == v_cache.size(0) &&
                            k_cache.size(1) == Hkv_ && k_cache.size(2) * kKeyBlock >= v_cache.size(2) &&
                            k_cache.size(3) == D && k_cache.size(4) == kKeyBlock &&
                            k_cache.scalar_type() == v_cache.scalar_type(),
                        "DecoderLayer: k_cache must be contiguous per slot [slots, Hkv, max_len / ", kKeyBlock, ", D, ",
                        kKeyBlock, "] (blocked), of v_cache's dtype");
        }
        const int64_t max_len = q8 ? v_cache.size(2) * kKeyBlock : v_cache.size(2);
        check_seq_ranges("DecoderLayer", slots, starts, counts, k_cache.size(0), max_len, T, "the cache", "x");

        // ---- attention block
        torch::Tensor h = rms_norm(x, input_norm_, eps_);
        torch::Tensor qkv = qkv_(h);  // [T, (H + 2 Hkv) D]
        const int64_t nq = H_ * D, nkv = Hkv_ * D;
        // q, k and v: column ranges of qkv's rows (each row's q, then k, then v), or their per-head
        // norms (Qwen3).
        TORCH_CHECK(qkv.is_contiguous() && qkv.size(1) == nq + 2 * nkv, "DecoderLayer: qkv projection shape");
        const float* qp = qkv.data_ptr<float>();
        const float* kp = qp + nq;
        const float* vp = qp + nq + nkv;
        int64_t q_stride = qkv.stride(0), k_stride = q_stride;
        const int64_t v_stride = q_stride;
        torch::Tensor q, k;
        if (q_norm_.has_value()) {
            q = rms_norm(qkv.narrow(1, 0, nq).reshape({-1, D}), *q_norm_, eps_);
            k = rms_norm(qkv.narrow(1, nq, nkv).reshape({-1, D}), *k_norm_, eps_);
            qp = q.data_ptr<float>(), kp = k.data_ptr<float>();
            q_stride = nq, k_stride = nkv;
        }
        const float* cp = cos.data_ptr<float>();
        const float* sp = sin.data_ptr<float>();
        torch::Tensor qr = torch::empty({T, H_, D}, x.options());
        float* qrp = qr.data_ptr<float>();
        const int64_t slot_stride = v_cache.stride(0), head_stride = v_cache.stride(1);
        const int64_t k_slot_stride = k_cache.stride(0), k_head_stride = k_cache.stride(1);
        // Rotate the queries; rotate each key into the cache and put its value there, through
        // store(slot, kv head, position, key row, cos, sin, value row) in the cache's format.
        // Rows run in parallel: each writes its own positions. With the 8-bit cache's key
        // transform, each query row is then multiplied by the queries' side of the scale.
        const float* qscale = q8 && query_scale_.has_value() ? query_scale_->data_ptr<float>() : nullptr;
        // NOTE: two sequences naming one slot (not made by the engine) keep the serial order of
        // their writes: the later row's wins, as before.
        bool distinct = true;
        if (slots.size() > 1) {
            std::vector<int64_t> sorted(slots);
            std::sort(sorted.begin(), sorted.end());
            distinct = std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
        }
        const double row_ns = distinct ? 3.0 * static_cast<double>((H_ + 2 * Hkv_) * D) : 0.0;  // 0: one range
        // The table's vector forms of the rotation and the cache entries (nullptr: these loops).
        const KernelTable* kt = active_table();
        auto rope = [&](const float* src, const float* c, const float* sn, float* dst, int64_t stride) {
            if (kt->rope_head != nullptr) kt->rope_head(src, c, sn, D, dst, stride);
            else rotate_head(src, c, sn, D, dst, stride);
        };
        auto write = [&](auto store) {
            rows_parallel(T, row_ns, [&](int64_t t0, int64_t t1) {
                size_t s = 0;  // row t's sequence, and its index i there
                int64_t i = t0;
                for (int64_t t = t0; t < t1; ++t, ++i) {
                    while (i >= counts[s]) i -= counts[s++];
                    const float* c = cp + t * D;
                    const float* sn = sp + t * D;
                    for (int64_t hd = 0; hd < H_; ++hd)
                        rope(qp + t * q_stride + hd * D, c, sn, qrp + (t * H_ + hd) * D, 1);
                    for (int64_t hd = 0; hd < Hkv_; ++hd)
                        store(slots[s], hd, starts[s] + i, kp + t * k_stride + hd * D, c, sn, vp + t * v_stride + hd * D);
                    if (qscale != nullptr) {  // set_key_transform: the queries' side of the scale
                        const int64_t group = H_ / Hkv_;
                        for (int64_t hd = 0; hd < H_; ++hd) {
                            const float* m = qscale + (hd / group) * D;
                            float* qh = qrp + (t * H_ + hd) * D;
                            for (int64_t d = 0; d < D; ++d) qh[d] *= m[d];
                        }
                    }
                }
            });
        };
        // A float or half cache: keys rotated straight into it, in its element type.
        auto write_float = [&](auto* kc, auto* vc) {
            write([&](int64_t slot, int64_t hd, int64_t pos, const float* ks, const float* c, const float* sn,
                      const float* vs) {
                // key pos: element d at block pos / kKeyBlock, row d, lane pos % kKeyBlock
                auto* kdst = kc + slot * k_slot_stride + hd * k_head_stride + (pos / kKeyBlock) * D * kKeyBlock +
                             pos % kKeyBlock;
                auto* vdst = vc + slot * slot_stride + hd * head_stride + pos * D;
                if constexpr (std::is_same_v<std::remove_pointer_t<decltype(kdst)>, uint16_t>) {
                    if (kt->rope_head_half != nullptr) {
                        kt->rope_head_half(ks, c, sn, D, kdst, kKeyBlock);
                        kt->to_half(vs, D, vdst);
                    } else {
                        rotate_head(ks, c, sn, D, kdst, kKeyBlock);
                        for (int64_t d = 0; d < D; ++d) put(vdst + d, vs[d]);
                    }
                } else {
                    rope(ks, c, sn, kdst, kKeyBlock);
                    std::memcpy(vdst, vs, sizeof(float) * D);
                }
            });
        };
        if (q8) {
            // The 8-bit cache: each key rotated into a float row first, then quantized into its block.
            uint8_t* kc = reinterpret_cast<uint8_t*>(k_cache.data_ptr<int8_t>());
            uint8_t* vc = reinterpret_cast<uint8_t*>(v_cache.data_ptr<int8_t>());
            const int64_t bb = q8_block_bytes(D), blocks = max_len / kKeyBlock;
            const float* shift = key_shift_.has_value() ? key_shift_->data_ptr<float>() : nullptr;
            const float* kscale = shift != nullptr ? key_scale_->data_ptr<float>() : nullptr;
            write([&](int64_t slot, int64_t hd, int64_t pos, const float* ks, const float* c, const float* sn,
                      const float* vs) {
                const int64_t blk = (hd * blocks + pos / kKeyBlock) * bb, lane = pos % kKeyBlock;
                uint8_t* kb = kc + slot * k_slot_stride + blk;
                uint8_t* vb = vc + slot * slot_stride + blk;
                thread_local std::vector<float> key;  // each task's own row
                key.resize(static_cast<size_t>(D));
                rope(ks, c, sn, key.data(), 1);
                if (shift != nullptr)  // KVCache._store_q8's (k - shift) * scale
                    for (int64_t d = 0; d < D; ++d) key[d] = (key[d] - shift[hd * D + d]) * kscale[hd * D + d];
                const auto q8 = kt->q8_head != nullptr ? kt->q8_head : put_q8;
                q8(key.data(), D, reinterpret_cast<int8_t*>(kb + kQ8Header) + lane, kKeyBlock,
                   reinterpret_cast<float*>(kb) + lane);
                q8(vs, D, reinterpret_cast<int8_t*>(vb + kQ8Header) + lane * D, 1, reinterpret_cast<float*>(vb) + lane);
            });
        } else if (half) {
            write_float(reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::Half>()),
                        reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::Half>()));
        } else {
            write_float(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
        }
        Timeline::mark(kMarkAttention);
        torch::Tensor attn = attention_seqs(qr, k_cache, v_cache, slots, starts, counts, scale_, window_, softcap_,
                                            prefix_slots, prefix_lens);
        Timeline::mark(kMarkAttentionEnd);
        torch::Tensor o = o_(attn.view({T, nq}));
        if (reducer != nullptr) o = reducer->reduce(o);  // tensor parallel: the ranks' partial sums
        if (post_attn_out_norm_.has_value()) o = rms_norm(o, *post_attn_out_norm_, eps_);
        x = add_rows(x, o);

        // ---- MLP block
        h = rms_norm(x, post_attn_norm_, eps_);
        if (moe_) return add_rows(x, moe_->forward(h));  // a mixture-of-experts layer (moe.cpp)
        torch::Tensor gu = gate_up_(h);
        torch::Tensor act;
        const SiluMulRow silu_mul = gelu_ ? nullptr : silu_mul_row();
        if (silu_mul != nullptr && gu.dim() == 2 && gu.size(1) == 2 * I_ && gu.stride(1) == 1) {
            // silu(gate) * up a row at a time, the rows over the kernels' threads: the same bits
            // as ATen's SiLU and the product below, without its call (NOTE: at eight rows ATen's
            // SiLU ran on the calling thread alone, 7.7 us of a SmolLM2 layer's 17 us between its
            // gate_up and down products; now the whole stretch takes 6-13 us, at one row 5.8 -> 2.4)
            act = torch::empty({T, I_}, gu.options());
            float* ap = act.data_ptr<float>();
            const float* gp = gu.data_ptr<float>();
            const int64_t ld = gu.stride(0), I = I_;
            rows_parallel(T, static_cast<double>(I), [&](int64_t t0, int64_t t1) {
                for (int64_t t = t0; t < t1; ++t) silu_mul(gp + t * ld, gp + t * ld + I, ap + t * I, I);
            });
        } else {
            torch::Tensor gate = gu.narrow(1, 0, I_), up = gu.narrow(1, I_, I_);
            act = gelu_ ? at::gelu(gate, "tanh") : at::silu(gate);
            if (!act.is_contiguous()) act = act.contiguous();
            // act * up in place: torch's single float products, so the same bits
            float* ap = act.data_ptr<float>();
            const float* upp = up.data_ptr<float>();
            const int64_t up_stride = up.stride(0);
            rows_parallel(T, 0.3 * static_cast<double>(I_), [&](int64_t t0, int64_t t1) {
                for (int64_t t = t0; t < t1; ++t)
                    for (int64_t i = 0; i < I_; ++i) ap[t * I_ + i] *= upp[t * up_stride + i];
            });
        }
        torch::Tensor mlp = down_(act);
        if (reducer != nullptr) mlp = reducer->reduce(mlp);
        if (post_ffw_norm_.has_value()) mlp = rms_norm(mlp, *post_ffw_norm_, eps_);
        return add_rows(x, mlp);
    }

    // Makes this a mixture-of-experts layer: its feed-forward is moe's (gate_up / down unused).
    void set_moe(std::shared_ptr<MoeFfn> moe) { moe_ = std::move(moe); }

    // How an 8-bit cache holds this layer's keys (llama.py measure_key_transform; both None: as
    // they are): each rotated key becomes (key - shift) * scale before it is quantized, and each
    // rotated query is multiplied by 1 / scale (KVCache.query_scale's division), all [Hkv, D]
    // float32.  A query's scores all move by one constant, which the softmax cancels, and q . k is
    // the same product channel by channel; the rounding of the 8-bit keys and queries is what
    // changes.
    void set_key_transform(c10::optional<torch::Tensor> shift, c10::optional<torch::Tensor> scale) {
        TORCH_CHECK(shift.has_value() == scale.has_value(), "DecoderLayer: a key shift needs its scale");
        if (!shift.has_value()) {
            key_shift_.reset(), key_scale_.reset(), query_scale_.reset();
            return;
        }
        for (const torch::Tensor* t : {&*shift, &*scale})
            TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->dim() == 2 && t->size(0) == Hkv_ &&
                            t->size(1) == D_,
                        "DecoderLayer: a key transform's tensors must be float32 [num_kv_heads, head_dim]");
        key_shift_ = shift->contiguous();
        key_scale_ = scale->contiguous();
        query_scale_ = 1.0 / *key_scale_;
    }

    // The experts [T, top_k] the rows of the latest forward chose; None for a dense layer.
    c10::optional<torch::Tensor> moe_last_ids() const {
        if (!moe_ || !moe_->last_ids().defined()) return c10::nullopt;
        return moe_->last_ids();
    }

   private:
    int64_t H_, Hkv_, D_, I_;
    double eps_, scale_;
    int64_t window_;
    double softcap_;
    bool gelu_;
    torch::Tensor input_norm_, post_attn_norm_;
    LinearSpec qkv_, o_, gate_up_, down_;
    c10::optional<torch::Tensor> q_norm_, k_norm_, post_attn_out_norm_, post_ffw_norm_;
    std::shared_ptr<MoeFfn> moe_;
    c10::optional<torch::Tensor> key_shift_, key_scale_, query_scale_;
};

// Layers 0..n-1 in order, exactly as n calls of DecoderLayer::forward run them (the same ops on
// the same tensors, so the same bits), in one call from Python instead of n: on SmolLM2-135M the
// per-layer Python loop cost 2-6% of a decode step (benchmarks/layer_loop_ab.py).  Every argument
// is checked before the first layer writes its cache.  rope[i] picks layer i's
// cos / sin pair; k_caches / v_caches hold every layer's cache along dim 0.  Returns the last
// layer's output and, for each index in capture, the residual stream entering that layer.  Under
// tensor parallelism, reducer sums the ranks' o_proj and down_proj outputs inside each layer (every
// rank runs this same call on its shard, in lockstep).  With positions (int64 [T]), cos / sin are
// whole tables [rows, D] and each token's rows are copied out here (the same floats as indexing
// them in Python, without two ATen calls a table per step).
std::tuple<torch::Tensor, std::vector<torch::Tensor>> forward_layers(
    const std::vector<DecoderLayer*>& layers, torch::Tensor x, std::vector<torch::Tensor> cos,
    std::vector<torch::Tensor> sin, const std::vector<int64_t>& rope, const torch::Tensor& k_caches,
    const torch::Tensor& v_caches, const std::vector<int64_t>& slots, const std::vector<int64_t>& starts,
    const std::vector<int64_t>& counts, const std::vector<int64_t>& capture, ShmReducer* reducer,
    const std::vector<int64_t>& prefix_slots, const std::vector<int64_t>& prefix_lens,
    const c10::optional<torch::Tensor>& positions) {
    const int64_t n = static_cast<int64_t>(layers.size());
    TORCH_CHECK(static_cast<int64_t>(rope.size()) == n, "forward_layers: one rope index per layer");
    TORCH_CHECK(cos.size() == sin.size(), "forward_layers: as many cos as sin tables");
    if (positions.has_value()) {
        const torch::Tensor& pos = *positions;
        TORCH_CHECK(pos.dim() == 1 && pos.scalar_type() == torch::kLong && pos.is_cpu() && pos.size(0) == x.size(0),
                    "forward_layers: positions must be int64 [T], one per row of x");
        const int64_t T = pos.size(0);
        const auto pp = pos.accessor<int64_t, 1>();
        for (std::vector<torch::Tensor>* tables : {&cos, &sin}) {
            for (torch::Tensor& table : *tables) {
                TORCH_CHECK(table.dim() == 2 && table.is_contiguous() && table.scalar_type() == torch::kFloat32,
                            "forward_layers: cos / sin tables must be contiguous float32 [rows, head_dim]");
                const int64_t rows = table.size(0), D = table.size(1);
                torch::Tensor out = torch::empty({T, D}, table.options());
                const float* tp = table.data_ptr<float>();
                float* op = out.data_ptr<float>();
                for (int64_t t = 0; t < T; ++t) {
                    TORCH_CHECK(pp[t] >= 0 && pp[t] < rows, "forward_layers: position ", pp[t],
                                " is outside the rotary table's ", rows, " rows");
                    std::memcpy(op + t * D, tp + pp[t] * D, sizeof(float) * D);
                }
                table = out;
            }
        }
    }
    TORCH_CHECK(k_caches.size(0) >= n && v_caches.size(0) >= n, "forward_layers: a cache per layer");
    for (size_t c = 0; c < capture.size(); ++c)
        TORCH_CHECK(capture[c] >= 0 && capture[c] < n, "forward_layers: capture index out of range");
    for (int64_t i = 0; i < n; ++i) {
        TORCH_CHECK(layers[i] != nullptr, "forward_layers: layer ", i, " is None");
        TORCH_CHECK(rope[i] >= 0 && rope[i] < static_cast<int64_t>(cos.size()), "forward_layers: rope index");
    }
    std::vector<torch::Tensor> taken(capture.size());
    for (int64_t i = 0; i < n; ++i) {
        for (size_t c = 0; c < capture.size(); ++c)
            if (capture[c] == i) taken[c] = x;
        x = layers[i]->forward(x, cos[rope[i]], sin[rope[i]], k_caches[i], v_caches[i], slots, starts, counts,
                               reducer, prefix_slots, prefix_lens);
    }
    return {x, taken};
}

}  // namespace

void bind_decoder_layer(py::module_& m) {
    m.def("forward_layers", &forward_layers, py::arg("layers"), py::arg("x"), py::arg("cos"),
          py::arg("sin"), py::arg("rope"), py::arg("k_caches"), py::arg("v_caches"), py::arg("slots"),
          py::arg("starts"), py::arg("counts"), py::arg("capture"),
          py::arg("reducer") = static_cast<ShmReducer*>(nullptr), py::arg("prefix_slots") = std::vector<int64_t>{},
          py::arg("prefix_lens") = std::vector<int64_t>{}, py::arg("positions") = py::none(),
          py::call_guard<py::gil_scoped_release>());
    py::class_<DecoderLayer>(m, "DecoderLayer")
        .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, int64_t, double,
                      const std::string&, torch::Tensor, torch::Tensor, torch::Tensor, int64_t,
                      c10::optional<torch::Tensor>, torch::Tensor, int64_t, c10::optional<torch::Tensor>,
                      torch::Tensor, int64_t, c10::optional<torch::Tensor>, torch::Tensor, int64_t,
                      c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                      c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                      c10::optional<torch::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                      std::vector<int64_t>, std::vector<int64_t>>(),
             py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("hidden"),
             py::arg("intermediate"), py::arg("eps"), py::arg("attn_scale"), py::arg("sliding_window"),
             py::arg("softcap"), py::arg("activation"), py::arg("input_norm"), py::arg("post_attn_norm"),
             py::arg("qkv_w"), py::arg("qkv_qt"), py::arg("qkv_bias"), py::arg("o_w"), py::arg("o_qt"),
             py::arg("o_bias"), py::arg("gate_up_w"), py::arg("gate_up_qt"), py::arg("gate_up_bias"),
             py::arg("down_w"), py::arg("down_qt"), py::arg("down_bias"), py::arg("q_norm"),
             py::arg("k_norm"), py::arg("post_attn_out_norm"), py::arg("post_ffw_norm"),
             py::arg("qkv_parts") = std::vector<int64_t>{}, py::arg("o_parts") = std::vector<int64_t>{},
             py::arg("gate_up_parts") = std::vector<int64_t>{},
             py::arg("down_parts") = std::vector<int64_t>{})
        .def("set_moe", &DecoderLayer::set_moe, py::arg("moe"))
        .def("set_key_transform", &DecoderLayer::set_key_transform, py::arg("shift"), py::arg("scale"))
        .def("moe_last_ids", &DecoderLayer::moe_last_ids)
        .def("forward", &DecoderLayer::forward, py::arg("x"), py::arg("cos"), py::arg("sin"),
             py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("starts"),
             py::arg("counts"), py::arg("reducer") = static_cast<ShmReducer*>(nullptr),
             py::arg("prefix_slots") = std::vector<int64_t>{}, py::arg("prefix_lens") = std::vector<int64_t>{},
             py::call_guard<py::gil_scoped_release>());
}

}  // namespace specdec
