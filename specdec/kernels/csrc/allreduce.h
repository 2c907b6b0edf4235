// The shared-memory all-reduce of tensor-parallel ranks on one host (allreduce.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>

namespace specdec {

// Each rank writes its float32 tensor into its slot of a shared file and publishes a sequence
// number; once every rank's number has reached this round's, each sums the slots in rank order
// (slot 0 + slot 1 + ...), so every rank gets the same bits whatever the batch.  Two buffers
// alternate: a rank that passed round s + 1's wait knows every peer finished reading round s,
// whose buffer round s + 2 reuses.  Tensors larger than a slot go round by round, in slot-sized
// chunks.  One object per rank owns the round counter: the Python layers and the fused native
// stack (layer.cpp) share it.
class ShmReducer {
   public:
    // flags: int64 [size, 8] (one 64-byte line per rank); data: float32 [2, size, cap]; both views
    // of the same shared mapping, kept alive by the caller.  watch() is called (with the GIL) about
    // every 50 ms of waiting: it returns None while the peers live, else a one-line reason.
    ShmReducer(torch::Tensor flags, torch::Tensor data, int64_t rank, int64_t size, py::object watch,
               double timeout_s);
    ~ShmReducer();

    // x float32 [T, H] (any shape, contiguous) -> the sum over ranks, a new tensor.  Throws
    // std::runtime_error("tensor-parallel ...") when a peer stops answering.
    torch::Tensor reduce(const torch::Tensor& x);

    int64_t rank() const { return rank_; }
    int64_t size() const { return size_; }

   private:
    void wait_round(int64_t seq);

    torch::Tensor flags_t_, data_t_;
    int64_t* flags_;
    float* data_;
    int64_t rank_, size_, cap_, seq_ = 0;
    py::object watch_;
    double timeout_s_;
};

}  // namespace specdec
