// A mixture-of-experts feed-forward (Qwen3-MoE, Qwen2-MoE, Mixtral) as one native call (moe.cpp).
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

#include "linear_spec.h"

namespace specdec {

class MoeFfn {
   public:
    // gate_up[e]: expert e's gate rows then up rows [2 I, H]; down[e]: [H, I].  shared_*: Qwen2-MoE's
    // shared expert and its [1, H] sigmoid gate (all three or none).
    MoeFfn(LinearSpec router, std::vector<LinearSpec> gate_up, std::vector<LinearSpec> down, int64_t top_k,
           bool norm_topk_prob, std::optional<LinearSpec> shared_gate_up, std::optional<LinearSpec> shared_down,
           std::optional<LinearSpec> shared_gate, bool grouped);

    // h [T, H] (the post-attention normed states) -> [T, H], what specdec/model/moe.py's
    // MoeBlock.__call__ computes, bit for bit.
    torch::Tensor forward(const torch::Tensor& h);

    // The experts [T, top_k] the rows of the latest forward chose (undefined before the first).
    torch::Tensor last_ids() const { return last_ids_; }

    bool grouped;  // false: each row's experts one by one (the baseline; same bits)

   private:
    torch::Tensor expert(const LinearSpec& gate_up, const LinearSpec& down, const torch::Tensor& x) const;
    // Fill outs with expert outputs and src[row * top_k + rank] with that row's rank-th one.
    void run_grouped(const torch::Tensor& h, const torch::Tensor& ids, std::vector<torch::Tensor>& outs,
                     std::vector<const float*>& src) const;
    void run_one_by_one(const torch::Tensor& h, const torch::Tensor& ids, std::vector<torch::Tensor>& outs,
                        std::vector<const float*>& src) const;

    LinearSpec router_;
    std::vector<LinearSpec> gate_up_, down_;
    int64_t top_k_;
    bool norm_;
    std::optional<LinearSpec> shared_gate_up_, shared_down_, shared_gate_;
    torch::Tensor last_ids_;
};

}  // namespace specdec
