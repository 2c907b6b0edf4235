// A mixture-of-experts feed-forward as one native call: the router, each chosen expert's SwiGLU
// and the weighted sum, for a decoder layer (layer.cpp) or on its own.
//
// In Python (specdec/model/moe.py, MoeBlock) a decode step of Qwen3-30B-A3B's shape spent ~1.5 ms a
// layer in glue around its 16 expert linears (~0.9 ms of kernels): the MoE layers ran at half the
// speed of a dense model reading the same bytes.  This class runs the same computation with the
// same arithmetic: the kernels of ops.cpp for the linears and ATen for the softmax, top-k,
// activation and sums, op for op as moe.py calls them, so the two agree bit for bit
// (tests/e2e/test_moe.py).  A row's result never depends on the other rows: the linears are
// row-invariant, SiLU runs on row blocks under ATen's serial grain (moe.py: _silu_mul), and a row's
// expert outputs are summed in the order of its top-k ranks.
#include "moe.h"

#include <algorithm>
#include <utility>

namespace specdec {
namespace {

// NOTE: torch runs an elementwise op serially below 32,768 elements (moe.py: _SERIAL_ELEMENTS).
constexpr int64_t kSerialElements = 32768;
constexpr int64_t kLanes = 64;  // moe.py: _LANES

// silu(gate) * up on row blocks whose bits never depend on the row count (moe.py: _silu_mul).
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up) {
    const int64_t M = gate.size(0);
    const int64_t rows = std::max<int64_t>(1, kSerialElements / std::max<int64_t>(1, gate.size(1)));
    if (M <= rows) return at::silu(gate) * up;
    std::vector<torch::Tensor> parts;
    for (int64_t i = 0; i < M; i += rows) {
        const int64_t n = std::min(rows, M - i);
        parts.push_back(at::silu(gate.narrow(0, i, n)) * up.narrow(0, i, n));
    }
    return at::cat(parts);
}

// sigmoid of one value per row, each on a full vector of its own (moe.py: _sigmoid_rows).
torch::Tensor sigmoid_rows(const torch::Tensor& x) {
    torch::Tensor wide = x.expand({-1, kLanes}).contiguous();
    const int64_t rows = kSerialElements / kLanes;
    std::vector<torch::Tensor> parts;
    for (int64_t i = 0; i < x.size(0); i += rows)
        parts.push_back(at::sigmoid(wide.narrow(0, i, std::min(rows, x.size(0) - i))));
    return at::cat(parts).narrow(1, 0, 1);
}

}  // namespace

MoeFfn::MoeFfn(LinearSpec router, std::vector<LinearSpec> gate_up, std::vector<LinearSpec> down, int64_t top_k,
               bool norm_topk_prob, std::optional<LinearSpec> shared_gate_up, std::optional<LinearSpec> shared_down,
               std::optional<LinearSpec> shared_gate, bool grouped_)
    : grouped(grouped_),
      router_(std::move(router)),
      gate_up_(std::move(gate_up)),
      down_(std::move(down)),
      top_k_(top_k),
      norm_(norm_topk_prob),
      shared_gate_up_(std::move(shared_gate_up)),
      shared_down_(std::move(shared_down)),
      shared_gate_(std::move(shared_gate)) {
    const int64_t E = static_cast<int64_t>(gate_up_.size());
    TORCH_CHECK(E > 0 && static_cast<int64_t>(down_.size()) == E, "MoeFfn: as many down as gate_up experts");
    TORCH_CHECK(router_.N == E, "MoeFfn: the router has ", router_.N, " outputs for ", E, " experts");
    TORCH_CHECK(top_k_ >= 1 && top_k_ <= E, "MoeFfn: top_k must be in [1, ", E, "]");
    for (int64_t e = 0; e < E; ++e) {
        TORCH_CHECK(gate_up_[e].K == router_.K && gate_up_[e].N % 2 == 0 && down_[e].K == gate_up_[e].N / 2 &&
                        down_[e].N == router_.K,
                    "MoeFfn: expert ", e, " has the wrong shapes");
    }
    const int shared = shared_gate_up_.has_value() + shared_down_.has_value() + shared_gate_.has_value();
    TORCH_CHECK(shared == 0 || shared == 3, "MoeFfn: the shared expert needs gate_up, down and its gate");
}

torch::Tensor MoeFfn::expert(const LinearSpec& gate_up, const LinearSpec& down, const torch::Tensor& x) const {
    torch::Tensor gu = gate_up(x);
    const int64_t inter = gu.size(1) / 2;
    return down(silu_mul(gu.narrow(1, 0, inter), gu.narrow(1, inter, inter)));
}

torch::Tensor MoeFfn::forward(const torch::Tensor& h) {
    TORCH_CHECK(h.dim() == 2 && h.size(1) == router_.K && h.scalar_type() == torch::kFloat32,
                "MoeFfn: h must be float32 [T, ", router_.K, "]");
    torch::Tensor probs = at::softmax(router_(h), -1);  // [T, E]
    auto [weights, ids] = at::topk(probs, top_k_, -1);
    if (norm_) weights = weights / weights.sum({-1}, true);
    last_ids_ = ids;
    // NOTE: one row (decode) has nothing to group: its experts one by one, same bits
    torch::Tensor per_rank = grouped && h.size(0) > 1 ? run_grouped(h, ids) : run_one_by_one(h, ids);
    torch::Tensor out = per_rank.select(1, 0) * weights.narrow(1, 0, 1);
    for (int64_t r = 1; r < top_k_; ++r)  // NOTE: a fixed order: the row's top-k rank
        out = out + per_rank.select(1, r) * weights.narrow(1, r, 1);
    if (shared_gate_up_.has_value())
        out = out + sigmoid_rows((*shared_gate_)(h)) * expert(*shared_gate_up_, *shared_down_, h);
    return out;
}

torch::Tensor MoeFfn::run_grouped(const torch::Tensor& h, const torch::Tensor& ids) const {
    const int64_t T = h.size(0), H = h.size(1);
    torch::Tensor per_rank = at::empty({T * top_k_, H}, h.options());
    torch::Tensor flat = ids.flatten();
    torch::Tensor order = at::argsort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    auto uc = at::unique_consecutive(flat.index_select(0, order), /*return_inverse=*/false,
                                     /*return_counts=*/true);
    torch::Tensor chosen = std::get<0>(uc).contiguous(), counts = std::get<2>(uc).contiguous();
    const int64_t* cp = chosen.data_ptr<int64_t>();
    const int64_t* np = counts.data_ptr<int64_t>();
    int64_t start = 0;
    for (int64_t i = 0; i < chosen.numel(); ++i) {  // each chosen expert once
        torch::Tensor slots = order.narrow(0, start, np[i]);
        torch::Tensor rows = h.index_select(0, at::div(slots, top_k_, "floor"));
        per_rank.index_copy_(0, slots, expert(gate_up_[cp[i]], down_[cp[i]], rows));
        start += np[i];
    }
    return per_rank.view({T, top_k_, H});
}

torch::Tensor MoeFfn::run_one_by_one(const torch::Tensor& h, const torch::Tensor& ids) const {
    const int64_t T = h.size(0);
    torch::Tensor per_rank = at::empty({T, top_k_, h.size(1)}, h.options());
    torch::Tensor chosen = ids.contiguous();
    const int64_t* ip = chosen.data_ptr<int64_t>();
    for (int64_t row = 0; row < T; ++row) {
        for (int64_t r = 0; r < top_k_; ++r) {
            const int64_t e = ip[row * top_k_ + r];
            per_rank[row][r].copy_(expert(gate_up_[e], down_[e], h.narrow(0, row, 1))[0]);
        }
    }
    return per_rank;
}

void bind_moe(py::module_& m) {
    py::class_<LinearSpec>(m, "LinearSpec")
        .def(py::init<torch::Tensor, int64_t, int64_t, c10::optional<torch::Tensor>, std::vector<int64_t>>(),
             py::arg("w"), py::arg("qtype"), py::arg("K"), py::arg("bias") = c10::optional<torch::Tensor>(),
             py::arg("parts") = std::vector<int64_t>{})
        .def_readonly("N", &LinearSpec::N)
        .def_readonly("K", &LinearSpec::K);
    py::class_<MoeFfn, std::shared_ptr<MoeFfn>>(m, "MoeFfn")
        .def(py::init<LinearSpec, std::vector<LinearSpec>, std::vector<LinearSpec>, int64_t, bool,
                      std::optional<LinearSpec>, std::optional<LinearSpec>, std::optional<LinearSpec>, bool>(),
             py::arg("router"), py::arg("gate_up"), py::arg("down"), py::arg("top_k"), py::arg("norm_topk_prob"),
             py::arg("shared_gate_up") = std::optional<LinearSpec>(),
             py::arg("shared_down") = std::optional<LinearSpec>(),
             py::arg("shared_gate") = std::optional<LinearSpec>(), py::arg("grouped") = true)
        .def("forward", &MoeFfn::forward, py::arg("h"), py::call_guard<py::gil_scoped_release>())
        .def("last_ids", &MoeFfn::last_ids)
        .def_readwrite("grouped", &MoeFfn::grouped);
}

}  // namespace specdec
