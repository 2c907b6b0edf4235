// A mixture-of-experts feed-forward as one native call: the router, each chosen expert's SwiGLU
// and the weighted sum, for a decoder layer (layer.cpp) or on its own.
//
// In Python (specdec/model/moe.py, MoeBlock) a decode step of Qwen3-30B-A3B's shape spent ~1.5 ms a
// layer in glue around its 16 expert linears (~0.9 ms of kernels): the MoE layers ran at half the
// speed of a dense model reading the same bytes.  This class runs the same computation with the
// same arithmetic: the kernels of ops.cpp for the linears and ATen for the softmax, top-k,
// activation and sums, op for op as moe.py calls them, so the two agree bit for bit
// (tests/e2e/llm/test_moe.py).  A row's result never depends on the other rows: the linears are
// row-invariant, SiLU runs on row blocks under ATen's serial grain (moe.py: _silu_mul), and a row's
// expert outputs are summed in the order of its top-k ranks.  A decode or verify step runs its
// experts side by side, each on one thread (parallel_tasks), and sums their outputs in place.
#include "moe.h"

#include <algorithm>
#include <utility>

namespace specdec {
namespace {

// NOTE: torch runs an elementwise op serially below 32,768 elements (moe.py: _SERIAL_ELEMENTS).
constexpr int64_t kSerialElements = 32768;
constexpr int64_t kLanes = 64;  // moe.py: _LANES
// NOTE: steps of up to this many rows (decode, verification) run their experts side by side, one
// expert's kernels on one thread (parallel_tasks): a one-row step's 2 x top-k small linears cost
// a pool wake-up each otherwise.  Larger steps (prefill) run each expert on every thread.
constexpr int64_t kSideBySideRows = 16;

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

torch::Tensor MoeFfn::forward(const torch::Tensor& h_in) {
    TORCH_CHECK(h_in.dim() == 2 && h_in.size(1) == router_.K && h_in.scalar_type() == torch::kFloat32,
                "MoeFfn: h must be float32 [T, ", router_.K, "]");
    const torch::Tensor h = h_in.contiguous();
    const int64_t T = h.size(0), H = h.size(1), k = top_k_;
    torch::Tensor probs = at::softmax(router_(h), -1);  // [T, E]
    auto [weights, ids] = at::topk(probs, k, -1);
    if (norm_) weights = weights / weights.sum({-1}, true);
    weights = weights.contiguous();
    last_ids_ = ids.contiguous();
    std::vector<torch::Tensor> outs;  // the experts' outputs, kept alive for src
    std::vector<const float*> src(static_cast<size_t>(T * k));  // row t's rank-r output: src[t k + r]
    // NOTE: one row (decode) has nothing to group: its experts one by one, same bits
    if (grouped && T > 1)
        run_grouped(h, last_ids_, outs, src);
    else
        run_one_by_one(h, last_ids_, outs, src);
    // out = p_0 w_0, then out = out + p_r w_r for r = 1.. (moe.py's order: the row's top-k rank).
    // NOTE: each product and sum rounded on its own (-ffp-contract=off), as ATen's mul and add.
    torch::Tensor out = at::empty({T, H}, h.options());
    const float* wp = weights.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
        float* o = op + t * H;
        const float* p0 = src[t * k];
        const float w0 = wp[t * k];
        for (int64_t j = 0; j < H; ++j) o[j] = p0[j] * w0;
        for (int64_t r = 1; r < k; ++r) {
            const float* p = src[t * k + r];
            const float w = wp[t * k + r];
            for (int64_t j = 0; j < H; ++j) o[j] = o[j] + p[j] * w;
        }
    }
    if (shared_gate_up_.has_value())
        out = out + sigmoid_rows((*shared_gate_)(h)) * expert(*shared_gate_up_, *shared_down_, h);
    return out;
}

void MoeFfn::run_grouped(const torch::Tensor& h, const torch::Tensor& ids, std::vector<torch::Tensor>& outs,
                         std::vector<const float*>& src) const {
    const int64_t H = h.size(1);
    torch::Tensor flat = ids.flatten();
    torch::Tensor order = at::argsort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false).contiguous();
    auto uc = at::unique_consecutive(flat.index_select(0, order), /*return_inverse=*/false,
                                     /*return_counts=*/true);
    torch::Tensor chosen = std::get<0>(uc).contiguous(), counts = std::get<2>(uc).contiguous();
    const int64_t n = chosen.numel();
    const int64_t* cp = chosen.data_ptr<int64_t>();
    const int64_t* np = counts.data_ptr<int64_t>();
    const int64_t* slot = order.data_ptr<int64_t>();  // (row, rank) slots row * k + rank, by expert
    std::vector<int64_t> first(static_cast<size_t>(n + 1), 0);
    for (int64_t i = 0; i < n; ++i) first[i + 1] = first[i] + np[i];
    outs.assign(static_cast<size_t>(n), torch::Tensor());
    auto one = [&](int64_t i) {  // each chosen expert once, over all the rows routed to it
        torch::Tensor rows = h.index_select(0, at::div(order.narrow(0, first[i], np[i]), top_k_, "floor"));
        outs[i] = expert(gate_up_[cp[i]], down_[cp[i]], rows);
    };
    if (h.size(0) <= kSideBySideRows)
        parallel_tasks(n, one);
    else
        for (int64_t i = 0; i < n; ++i) one(i);
    for (int64_t i = 0; i < n; ++i) {
        const float* y = outs[i].data_ptr<float>();
        for (int64_t j = 0; j < np[i]; ++j) src[slot[first[i] + j]] = y + j * H;
    }
}

void MoeFfn::run_one_by_one(const torch::Tensor& h, const torch::Tensor& ids, std::vector<torch::Tensor>& outs,
                            std::vector<const float*>& src) const {
    const int64_t n = ids.numel(), k = top_k_;
    const int64_t* ip = ids.data_ptr<int64_t>();
    outs.assign(static_cast<size_t>(n), torch::Tensor());
    auto one = [&](int64_t i) { outs[i] = expert(gate_up_[ip[i]], down_[ip[i]], h.narrow(0, i / k, 1)); };
    if (h.size(0) <= kSideBySideRows)
        parallel_tasks(n, one);
    else
        for (int64_t i = 0; i < n; ++i) one(i);
    for (int64_t i = 0; i < n; ++i) src[i] = outs[i].data_ptr<float>();
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
