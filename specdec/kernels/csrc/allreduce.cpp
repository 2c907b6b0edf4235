// ShmReducer (allreduce.h): the all-reduce of tensor-parallel ranks through shared memory.
#include "allreduce.h"

#include <sched.h>
#include <time.h>

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPECDEC_PAUSE() _mm_pause()
#else
#define SPECDEC_PAUSE() ((void)0)
#endif

namespace specdec {

ShmReducer::ShmReducer(torch::Tensor flags, torch::Tensor data, int64_t rank, int64_t size,
                       py::object watch, double timeout_s)
    : flags_t_(std::move(flags)), data_t_(std::move(data)), rank_(rank), size_(size),
      watch_(std::move(watch)), timeout_s_(timeout_s) {
    TORCH_CHECK(size_ >= 1 && rank_ >= 0 && rank_ < size_, "ShmReducer: rank out of range");
    TORCH_CHECK(flags_t_.scalar_type() == torch::kInt64 && flags_t_.is_contiguous() &&
                    flags_t_.numel() >= size_ * 8,
                "ShmReducer: flags must be contiguous int64 [size, 8]");
    TORCH_CHECK(data_t_.scalar_type() == torch::kFloat32 && data_t_.is_contiguous() && data_t_.dim() == 3 &&
                    data_t_.size(0) == 2 && data_t_.size(1) == size_,
                "ShmReducer: data must be contiguous float32 [2, size, cap]");
    flags_ = flags_t_.data_ptr<int64_t>();
    data_ = data_t_.data_ptr<float>();
    cap_ = data_t_.size(2);
    seq_ = __atomic_load_n(flags_ + rank_ * 8, __ATOMIC_ACQUIRE);  // NOTE: 0 on a fresh file
}

ShmReducer::~ShmReducer() {
    py::gil_scoped_acquire gil;  // NOTE: watch_ is a Python object
    watch_ = py::object();
}

void ShmReducer::wait_round(int64_t seq) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    auto next_watch = start + std::chrono::milliseconds(50);
    for (int64_t spins = 0;; ++spins) {
        bool all = true;
        for (int64_t r = 0; r < size_ && all; ++r) all = __atomic_load_n(flags_ + r * 8, __ATOMIC_ACQUIRE) >= seq;
        if (all) return;
        // NOTE: spin, then yield, then nap: ranks may share cores (4 ranks on 2, a loaded host),
        // where a spinning rank would steal the time of the one it waits for
        if (spins < 2000) {
            SPECDEC_PAUSE();
            continue;
        }
        if (spins < 4000) {
            sched_yield();
            continue;
        }
        struct timespec nap = {0, 20000};
        nanosleep(&nap, nullptr);
        const auto now = clock::now();
        if (now < next_watch) continue;
        next_watch = now + std::chrono::milliseconds(50);
        std::string why;
        if (watch_ && !watch_.is_none()) {
            py::gil_scoped_acquire gil;
            py::object got = watch_();
            if (!got.is_none()) why = py::str(got);
        }
        if (why.empty() && std::chrono::duration<double>(now - start).count() > timeout_s_)
            why = "a rank stopped answering";
        if (!why.empty()) throw std::runtime_error("tensor-parallel all-reduce failed: " + why);
    }
}

torch::Tensor ShmReducer::reduce(const torch::Tensor& x) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
                "ShmReducer.reduce: x must be a float32 CPU tensor");
    torch::Tensor src = x.contiguous();
    torch::Tensor out = torch::empty_like(src);
    const float* in = src.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    const int64_t n = src.numel();
    for (int64_t off = 0; off < n || (n == 0 && off == 0); off += cap_) {
        const int64_t m = std::min(cap_, n - off);
        const int64_t seq = ++seq_;
        float* buf = data_ + (seq % 2) * size_ * cap_;
        if (m > 0) std::memcpy(buf + rank_ * cap_, in + off, m * sizeof(float));
        __atomic_store_n(flags_ + rank_ * 8, seq, __ATOMIC_RELEASE);
        wait_round(seq);
        float* o = dst + off;
        const float* s0 = buf;
        for (int64_t i = 0; i < m; ++i) o[i] = s0[i];
        for (int64_t r = 1; r < size_; ++r) {
            const float* sr = buf + r * cap_;
            for (int64_t i = 0; i < m; ++i) o[i] += sr[i];
        }
        if (n == 0) break;
    }
    return out;
}

void bind_allreduce(py::module_& m) {
    py::class_<ShmReducer>(m, "ShmReducer")
        .def(py::init<torch::Tensor, torch::Tensor, int64_t, int64_t, py::object, double>(), py::arg("flags"),
             py::arg("data"), py::arg("rank"), py::arg("size"), py::arg("watch"), py::arg("timeout_s"))
        .def("reduce", &ShmReducer::reduce, py::arg("x"), py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("rank", &ShmReducer::rank)
        .def_property_readonly("size", &ShmReducer::size);
}

}  // namespace specdec
