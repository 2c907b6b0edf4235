// One linear layer as the native kernels take it (layer.cpp, moe.cpp).
#pragma once

#include <torch/extension.h>

#include <utility>
#include <vector>

#include "ops.h"

namespace specdec {

struct LinearSpec {
    torch::Tensor w;  // f32 [N, K], uint8 [N, row_bytes], or K-quant / bf16x2 tiles (uint8, flat)
    int64_t qtype;
    int64_t K;
    c10::optional<torch::Tensor> bias;
    std::vector<int64_t> parts;  // K-quants, bf16x2 tiles: [format, rows, ...] (kernels.h); else empty
    int64_t N;

    LinearSpec(torch::Tensor w_, int64_t qtype_, int64_t K_, c10::optional<torch::Tensor> bias_,
               std::vector<int64_t> parts_)
        : w(std::move(w_)), qtype(qtype_), K(K_), bias(std::move(bias_)), parts(std::move(parts_)), N(0) {
        if (parts.empty()) {
            N = w.dim() > 0 ? w.size(0) : 0;
        } else {
            for (size_t i = 1; i < parts.size(); i += 2) N += parts[i];
        }
    }

    torch::Tensor operator()(const torch::Tensor& x) const { return linear(x, w, qtype, N, K, bias, parts); }
};

}  // namespace specdec
