// EAGLE-3's draft head (specdec/spec_decode/eagle3.py) as native calls.
//
// Drafting runs the head's one decoder layer once per draft at batch 1; in Python that was ~40
// small torch ops and 10 linear calls a step, so glue cost more than the head's GEMMs.  Eagle3Head
// runs a step (fc for the target's states, the two input norms, the layer over [embedding; hidden]
// of width 2 H with q/k/v fused and gate/up fused, the head's KV cache written in place), the
// draft-vocabulary logits, and a whole greedy chain of k drafts (argmax, d2t, the draft's
// embedding, the next step) in one call.  The linear layers are the kernels of ops.cpp (Q8_0 with
// 8-bit activations where the target uses them); attention is attention_seqs.  A head's numerics
// only change how often drafts are right, never the output (verification decides).
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "ops.h"

namespace specdec {
namespace {

struct HeadLin {
    torch::Tensor w;  // as _C.linear takes it (f32 [N, K], or a repacked / GGUF weight)
    int64_t qt, N, K;
    std::vector<int64_t> parts;
    torch::Tensor operator()(const torch::Tensor& x) const { return linear(x, w, qt, N, K, c10::nullopt, parts); }
};

// dst[j] = src[j] * cos[j] + rotate_half(src)[j] * sin[j], one head of D floats, with the two
// products and one sum of the torch expression (Rotary.__call__).
inline void rotate(const float* src, const float* cos, const float* sin, int64_t D, float* dst, int64_t stride) {
    const int64_t h = D / 2;
    for (int64_t j = 0; j < h; ++j) dst[j * stride] = src[j] * cos[j] + (-src[j + h]) * sin[j];
    for (int64_t j = h; j < D; ++j) dst[j * stride] = src[j] * cos[j] + src[j - h] * sin[j];
}

class Eagle3Head {
   public:
    Eagle3Head(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
               double eps, bool norm_before_residual, torch::Tensor fc_w, int64_t fc_qt, int64_t fc_k,
               torch::Tensor qkv_w, int64_t qkv_qt, torch::Tensor o_w, int64_t o_qt, torch::Tensor gate_up_w,
               int64_t gate_up_qt, torch::Tensor down_w, int64_t down_qt, torch::Tensor lm_w, int64_t lm_qt,
               int64_t draft_vocab, torch::Tensor input_norm, torch::Tensor hidden_norm, torch::Tensor post_norm,
               torch::Tensor norm, torch::Tensor draft_embed, torch::Tensor target_ids, torch::Tensor cos,
               torch::Tensor sin)
        : H_(hidden),
          Hq_(num_heads),
          Hkv_(num_kv_heads),
          D_(head_dim),
          I_(intermediate),
          eps_(eps),
          nbr_(norm_before_residual),
          fc_{fc_w, fc_qt, hidden, fc_k, {}},
          qkv_{qkv_w, qkv_qt, (num_heads + 2 * num_kv_heads) * head_dim, 2 * hidden, {}},
          o_{o_w, o_qt, hidden, num_heads * head_dim, {}},
          gate_up_{gate_up_w, gate_up_qt, 2 * intermediate, hidden, {}},
          down_{down_w, down_qt, hidden, intermediate, {}},
          lm_{lm_w, lm_qt, draft_vocab, hidden, {}},
          input_norm_(input_norm),
          hidden_norm_(hidden_norm),
          post_norm_(post_norm),
          norm_(norm),
          embed_(draft_embed.contiguous()),
          target_ids_(target_ids.contiguous()),
          cos_(cos.contiguous()),
          sin_(sin.contiguous()) {
        TORCH_CHECK(head_dim % 2 == 0, "Eagle3Head: head_dim must be even");
        TORCH_CHECK(num_heads % num_kv_heads == 0, "Eagle3Head: num_heads must be a multiple of num_kv_heads");
        TORCH_CHECK(embed_.dim() == 2 && embed_.size(0) == draft_vocab && embed_.size(1) == hidden &&
                        embed_.scalar_type() == torch::kFloat32,
                    "Eagle3Head: draft_embed must be float32 [draft_vocab, hidden]");
        TORCH_CHECK(target_ids_.dim() == 1 && target_ids_.size(0) == draft_vocab &&
                        target_ids_.scalar_type() == torch::kLong,
                    "Eagle3Head: target_ids must be int64 [draft_vocab]");
        TORCH_CHECK(cos_.dim() == 2 && cos_.size(1) == head_dim && cos_.sizes() == sin_.sizes() &&
                        cos_.scalar_type() == torch::kFloat32 && sin_.scalar_type() == torch::kFloat32,
                    "Eagle3Head: cos / sin must be float32 [max_len, head_dim]");
    }

    // One step over T positions: emb [T, H] the embeddings of the tokens after each position
    // (not normed), feats [T, fc_k] the target's states (from_target) or [T, H] the head's own
    // outputs; positions[t] the rotary position; sequence s owns rows [sum(counts[:s]), +counts[s])
    // at KV indices starts[s]... of slot slots[s] of k_cache [S, Hkv, L / kKeyBlock, D, kKeyBlock]
    // and v_cache [S, Hkv, L, D] (float32).  Returns the head's outputs [T, H] (before the norm).
    torch::Tensor step(torch::Tensor emb, torch::Tensor feats, bool from_target, const std::vector<int64_t>& positions,
                       torch::Tensor k_cache, torch::Tensor v_cache, const std::vector<int64_t>& slots,
                       const std::vector<int64_t>& starts, const std::vector<int64_t>& counts) const {
        const int64_t T = emb.size(0);
        TORCH_CHECK(emb.dim() == 2 && emb.size(1) == H_ && feats.dim() == 2 && feats.size(0) == T &&
                        feats.size(1) == (from_target ? fc_.K : H_) && static_cast<int64_t>(positions.size()) == T,
                    "Eagle3Head.step: emb [T, hidden], feats [T, ", from_target ? fc_.K : H_,
                    "] and T positions expected");
        TORCH_CHECK(slots.size() == starts.size() && slots.size() == counts.size(),
                    "Eagle3Head.step: slots, starts and counts differ in length");
        TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32 &&
                        k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.dim() == 4 &&
                        k_cache.dim() == 5 && v_cache.size(1) == Hkv_ && v_cache.size(3) == D_ &&
                        k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == Hkv_ && k_cache.size(3) == D_ &&
                        k_cache.size(4) == kKeyBlock && k_cache.size(2) * kKeyBlock >= v_cache.size(2),
                    "Eagle3Head.step: float32 k_cache [S, Hkv, L / ", kKeyBlock, ", D, ", kKeyBlock,
                    "] and v_cache [S, Hkv, L, D] expected");
        const int64_t max_len = v_cache.size(2);
        check_seq_ranges("Eagle3Head.step", slots, starts, counts, k_cache.size(0), max_len, T, "the head's cache",
                         "emb");
        for (int64_t p : positions)
            TORCH_CHECK(p >= 0 && p < cos_.size(0), "Eagle3Head.step: position ", p, " beyond the rotary table");

        torch::Tensor f = from_target ? fc_(feats.contiguous()) : feats.contiguous();
        torch::Tensor hidden = rms_norm(f, hidden_norm_, eps_);
        torch::Tensor e = rms_norm(emb.contiguous(), input_norm_, eps_);
        torch::Tensor qkv = qkv_(torch::cat({e, hidden}, 1));  // [T, (Hq + 2 Hkv) D]
        const int64_t D = D_, nq = Hq_ * D, nkv = Hkv_ * D, row = qkv.stride(0);
        const float* qp = qkv.data_ptr<float>();
        torch::Tensor qr = torch::empty({T, Hq_, D}, emb.options());
        float* qrp = qr.data_ptr<float>();
        float* kc = k_cache.data_ptr<float>();
        float* vc = v_cache.data_ptr<float>();
        const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1);
        const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
        int64_t t = 0;
        for (size_t s = 0; s < slots.size(); ++s) {
            for (int64_t i = 0; i < counts[s]; ++i, ++t) {
                const float* c = cos_.data_ptr<float>() + positions[t] * D;
                const float* sn = sin_.data_ptr<float>() + positions[t] * D;
                const float* src = qp + t * row;
                for (int64_t hd = 0; hd < Hq_; ++hd) rotate(src + hd * D, c, sn, D, qrp + (t * Hq_ + hd) * D, 1);
                const int64_t pos = starts[s] + i;
                for (int64_t hd = 0; hd < Hkv_; ++hd) {
                    float* kdst = kc + slots[s] * ks0 + hd * ks1 + (pos / kKeyBlock) * D * kKeyBlock + pos % kKeyBlock;
                    rotate(src + nq + hd * D, c, sn, D, kdst, kKeyBlock);
                    std::memcpy(vc + slots[s] * vs0 + hd * vs1 + pos * D, src + nq + nkv + hd * D, D * sizeof(float));
                }
            }
        }
        torch::Tensor attn = attention_seqs(qr, k_cache, v_cache, slots, starts, counts,
                                            std::pow(static_cast<double>(D), -0.5), 0, 0.0);
        torch::Tensor x = (nbr_ ? hidden : f) + o_(attn.view({T, nq}));
        torch::Tensor h = rms_norm(x, post_norm_, eps_);
        torch::Tensor gu = gate_up_(h);
        return x + down_(at::silu(gu.narrow(1, 0, I_)) * gu.narrow(1, I_, I_));
    }

    // out [R, H] -> logits over the draft vocabulary [R, draft_vocab].
    torch::Tensor logits(torch::Tensor out) const { return lm_(rms_norm(out.contiguous(), norm_, eps_)); }

    // A greedy chain of k drafts for R sequences from the head's outputs at their last fed
    // position, out [R, H]: draft 0 is the argmax of out's logits; draft j > 0 feeds draft j - 1
    // (its embedding, the previous output) at rotary position positions[r] + j - 1 and KV index
    // starts[r] + j - 1 of slot slots[r].  Returns target token ids [R, k] (first maximum on ties,
    // as argmax over the target's vocabulary with -inf outside the draft vocabulary).
    torch::Tensor greedy_chain(torch::Tensor out, int64_t k, const std::vector<int64_t>& positions,
                               torch::Tensor k_cache, torch::Tensor v_cache, const std::vector<int64_t>& slots,
                               const std::vector<int64_t>& starts) const {
        const int64_t R = out.size(0), V = lm_.N;
        TORCH_CHECK(k >= 1 && static_cast<int64_t>(positions.size()) == R &&
                        static_cast<int64_t>(slots.size()) == R && static_cast<int64_t>(starts.size()) == R,
                    "Eagle3Head.greedy_chain: k >= 1 and one position, slot and start per row expected");
        torch::Tensor drafts = torch::empty({R, k}, torch::dtype(torch::kLong));
        int64_t* dp = drafts.data_ptr<int64_t>();
        const int64_t* tid = target_ids_.data_ptr<int64_t>();
        std::vector<int64_t> ids(R), pos(positions), st(starts), counts(R, 1);
        for (int64_t j = 0; j < k; ++j) {
            torch::Tensor z = logits(out);
            const float* zp = z.data_ptr<float>();
            for (int64_t r = 0; r < R; ++r) {
                const float* zr = zp + r * V;
                int64_t best = 0;
                for (int64_t v = 1; v < V; ++v)
                    if (zr[v] > zr[best]) best = v;
                ids[r] = best;
                dp[r * k + j] = tid[best];
            }
            if (j + 1 == k) break;
            torch::Tensor emb = embed_.index_select(0, torch::tensor(ids, torch::dtype(torch::kLong)));
            out = step(emb, out, false, pos, k_cache, v_cache, slots, st, counts);
            for (int64_t r = 0; r < R; ++r) ++pos[r], ++st[r];
        }
        return drafts;
    }

   private:
    int64_t H_, Hq_, Hkv_, D_, I_;
    double eps_;
    bool nbr_;
    HeadLin fc_, qkv_, o_, gate_up_, down_, lm_;
    torch::Tensor input_norm_, hidden_norm_, post_norm_, norm_, embed_, target_ids_, cos_, sin_;
};

}  // namespace

void bind_eagle3_head(py::module_& m) {
    const auto nogil = py::call_guard<py::gil_scoped_release>();
    py::class_<Eagle3Head>(m, "Eagle3Head")
        .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, bool, torch::Tensor, int64_t, int64_t,
                      torch::Tensor, int64_t, torch::Tensor, int64_t, torch::Tensor, int64_t, torch::Tensor,
                      int64_t, torch::Tensor, int64_t, int64_t, torch::Tensor, torch::Tensor, torch::Tensor,
                      torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>(),
             py::arg("hidden"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
             py::arg("intermediate"), py::arg("eps"), py::arg("norm_before_residual"), py::arg("fc_w"),
             py::arg("fc_qt"), py::arg("fc_k"), py::arg("qkv_w"), py::arg("qkv_qt"), py::arg("o_w"),
             py::arg("o_qt"), py::arg("gate_up_w"), py::arg("gate_up_qt"), py::arg("down_w"), py::arg("down_qt"),
             py::arg("lm_w"), py::arg("lm_qt"), py::arg("draft_vocab"), py::arg("input_norm"),
             py::arg("hidden_norm"), py::arg("post_norm"), py::arg("norm"), py::arg("draft_embed"),
             py::arg("target_ids"), py::arg("cos"), py::arg("sin"))
        .def("step", &Eagle3Head::step, py::arg("emb"), py::arg("feats"), py::arg("from_target"),
             py::arg("positions"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("starts"),
             py::arg("counts"), nogil)
        .def("logits", &Eagle3Head::logits, py::arg("out"), nogil)
        .def("greedy_chain", &Eagle3Head::greedy_chain, py::arg("out"), py::arg("k"), py::arg("positions"),
             py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("starts"), nogil);
}

}  // namespace specdec
