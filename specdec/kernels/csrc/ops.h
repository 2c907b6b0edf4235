// The torch-facing ops of ops.cpp, for other translation units of the extension (layer.cpp).
#pragma once

#include <torch/extension.h>

#include <functional>
#include <vector>

#include "kernels.h"

namespace specdec {

// y = x @ W.T (+ bias): x float32 [M, K]; w f32 [N, K], GGUF blocks (uint8 [N, row_bytes]), the
// 8-bit activation repack (qtype kA8QtypeBase + format) or K-quant tiles (qtype QT_KQUANT, or
// kA8QtypeBase + QT_KQUANT for 8-bit activations; parts = [format, rows, ...], kernels.h).
torch::Tensor linear(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t N, int64_t K,
                     c10::optional<torch::Tensor> bias, const std::vector<int64_t>& parts = {});

// fn(i) for i in [0, n) spread over the kernels' threads, each call on one thread with the kernels
// it calls run inline there (a kernel's result never depends on its thread count).  For many
// small independent kernel calls (a step's experts): one wake-up of the pool instead of one per
// call.  The first exception a call throws is rethrown here once all calls have ended.
void parallel_tasks(int64_t n, const std::function<void(int64_t)>& fn);

// Items per parallel_range task so that a task holds at least ~3 us of single-core work, item_ns
// an item (0: all items in one task).
int64_t grain_for(double item_ns);

// The kernel table set_isa chose (the CPU's best unless a test or SPECDEC_KERNELS_ISA chose another).
const KernelTable* active_table();

// RMS norm over the last dimension.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);

// q [T, H, D] attends to cache positions [0, start_pos + t] (or the sliding window) of
// k_cache [Hkv, L / kKeyBlock, D, kKeyBlock] (blocked, kernels.h) and v_cache [Hkv, L, D].
torch::Tensor attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                        int64_t start_pos, double scale, int64_t sliding_window, double softcap);

// The same over several sequences at once: sequence s owns rows [sum(counts[:s]), +counts[s]) of
// q, at positions starts[s]... of slot slots[s] of k_cache [S, Hkv, L / kKeyBlock, D, kKeyBlock]
// and v_cache [S, Hkv, L, D] (both float32 or both float16); one parallel loop over every row.
// prefix_slots / prefix_lens (empty, or one per sequence): positions [0, prefix_lens[s]) come
// from slot prefix_slots[s] (a shared prefix; a multiple of kAttnBlock, 0 for none).
torch::Tensor attention_seqs(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             const std::vector<int64_t>& slots, const std::vector<int64_t>& starts,
                             const std::vector<int64_t>& counts, double scale, int64_t sliding_window,
                             double softcap, const std::vector<int64_t>& prefix_slots = {},
                             const std::vector<int64_t>& prefix_lens = {});

// Registers the LinearSpec and MoeFfn classes (moe.cpp).
void bind_moe(py::module_& m);

// Registers the DecoderLayer class (layer.cpp).
void bind_decoder_layer(py::module_& m);

// Registers the ShmReducer class (allreduce.cpp).
void bind_allreduce(py::module_& m);

// Registers the Eagle3Head class (head.cpp).
void bind_eagle3_head(py::module_& m);

// A slotted cache t [slots, ...] laid out contiguously within each slot, slots any distance apart
// (the KV pool keeps each slot's layers together: kv_cache/pool.py).
inline bool contiguous_per_slot(const torch::Tensor& t) {
    int64_t expect = 1;
    for (int64_t d = t.dim() - 1; d >= 1; --d) {
        if (t.size(d) != 1 && t.stride(d) != expect) return false;
        expect *= t.size(d);
    }
    return t.dim() == 0 || t.size(0) <= 1 || t.stride(0) >= expect;
}

// The sequences of a call over a slotted cache (DecoderLayer, Eagle3Head.step): every slot in
// [0, num_slots), every [starts[s], starts[s] + counts[s]) within [0, max_len), the counts summing
// to the call's T rows.  ``who``, ``cache`` and ``rows`` name the call, its cache and the tensor
// holding the rows in the messages.
inline void check_seq_ranges(const char* who, const std::vector<int64_t>& slots,
                             const std::vector<int64_t>& starts, const std::vector<int64_t>& counts,
                             int64_t num_slots, int64_t max_len, int64_t T, const char* cache,
                             const char* rows) {
    int64_t total = 0;
    for (size_t s = 0; s < slots.size(); ++s) {
        TORCH_CHECK(slots[s] >= 0 && slots[s] < num_slots, who, ": slot out of range");
        TORCH_CHECK(starts[s] >= 0 && counts[s] >= 0 && starts[s] + counts[s] <= max_len, who,
                    ": positions beyond ", cache);
        total += counts[s];
    }
    TORCH_CHECK(total == T, who, ": counts sum to ", total, " but ", rows, " has ", T, " rows");
}

}  // namespace specdec
