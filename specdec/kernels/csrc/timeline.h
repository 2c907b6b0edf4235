// When a forward's parts begin and end, for benchmarks/layer_timeline.py: off unless
// set_timeline(true) turned it on; each mark is three doubles (kind, steady-clock microseconds,
// bytes the part reads: a linear's weight bytes, else 0).  Off, a mark is one relaxed load.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <vector>

namespace specdec {

enum TimelineMark : int {
    kMarkLayer = 0,         // a decoder layer begins
    kMarkLinear = 1,        // a linear product begins (bytes: its weights)
    kMarkLinearEnd = 2,     // ... and ends
    kMarkAttention = 3,     // a layer's attention begins
    kMarkAttentionEnd = 4,  // ... and ends
};

class Timeline {
  public:
    static std::atomic<bool>& on() {
        static std::atomic<bool> flag{false};
        return flag;
    }

    static void mark(int kind, double bytes = 0.0) {
        if (!on().load(std::memory_order_relaxed)) return;
        const double us =
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
        std::lock_guard<std::mutex> lk(mu());
        std::vector<double>& m = marks();
        if (m.size() < kMaxMarks) m.insert(m.end(), {static_cast<double>(kind), us, bytes});
    }

    // The marks so far, cleared.
    static std::vector<double> take() {
        std::lock_guard<std::mutex> lk(mu());
        std::vector<double> out;
        out.swap(marks());
        return out;
    }

  private:
    static constexpr size_t kMaxMarks = size_t(3) << 22;  // 4 M marks (100 MB); later ones dropped
    static std::mutex& mu() {
        static std::mutex m;
        return m;
    }
    static std::vector<double>& marks() {
        static std::vector<double> m;
        return m;
    }
};

}  // namespace specdec
