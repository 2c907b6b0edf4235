// A small work-claiming thread pool for the kernels (included by ops.cpp only).
//
// Why not at::parallel_for: it is an OpenMP fork-join, and the join waits for every thread of the
// team.  On a machine whose cores are busy with other processes, a sleeping worker woken for a
// 10-100 us kernel call often cannot run until the next scheduler tick, so each call took 4-16 ms
// instead (measured on the 2-core development machine, for our kernels and for torch's own ops).
// Here the caller and the workers claim tasks from a shared counter and the caller only waits for
// tasks that a worker has actually started: a worker that wakes late finds nothing left to do, and
// a call never takes longer than running it on the caller's thread alone.
//
// The thread count follows at::get_num_threads() (torch.set_num_threads).  Which thread runs which
// task never changes a result: every task computes its own outputs with fixed arithmetic.
#pragma once

#include <ATen/Parallel.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPECDEC_CPU_RELAX() _mm_pause()
#else
#define SPECDEC_CPU_RELAX() std::this_thread::yield()
#endif

namespace specdec {

class WorkerPool {
  public:
    using TaskFn = void (*)(void* ctx, int64_t task);

    // Run fn(ctx, t) for t in [0, ntasks) on up to `threads` threads, the caller included.
    void run(int64_t ntasks, int threads, TaskFn fn, void* ctx) {
        std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
        if (!busy.owns_lock() || threads <= 1 || ntasks <= 1) {  // pool in use: run inline
            for (int64_t t = 0; t < ntasks; ++t) fn(ctx, t);
            return;
        }
        const int helpers = std::min<int64_t>(threads - 1, ntasks - 1);
        ensure_workers(helpers);
        uint32_t gen;
        {
            std::lock_guard<std::mutex> lk(mu_);
            gen = ++gen_;
            gen_pub_.store(gen, std::memory_order_release);
            fn_ = fn;
            ctx_ = ctx;
            ntasks_ = ntasks;
            wanted_ = helpers;
            done_.store(0, std::memory_order_relaxed);
            claim_.store(static_cast<uint64_t>(gen) << 32, std::memory_order_release);
        }
        cv_.notify_all();
        work(gen, ntasks, fn, ctx);
        // Only tasks a running worker has claimed can be outstanding: wait for those.
        for (int spins = 0; done_.load(std::memory_order_acquire) < ntasks; ++spins) {
            if (spins < 4096) {
                SPECDEC_CPU_RELAX();
            } else {
                std::this_thread::yield();
            }
        }
    }

    static WorkerPool& instance() {
        // Leaked on purpose (no destructor at exit); replaced in a forked child, whose copy has no
        // worker threads and possibly a locked mutex.
        static std::atomic<WorkerPool*> pool{nullptr};
        static std::atomic<bool> forked{false};
        static const int registered = pthread_atfork(nullptr, nullptr, [] { forked.store(true); });
        (void)registered;
        WorkerPool* p = pool.load(std::memory_order_acquire);
        if (p == nullptr || forked.load(std::memory_order_relaxed)) {
            static std::mutex mu;
            std::lock_guard<std::mutex> lk(mu);
            p = pool.load(std::memory_order_acquire);
            if (p == nullptr || p->pid_ != getpid()) {
                p = new WorkerPool();
                pool.store(p, std::memory_order_release);
            }
            forked.store(false);
        }
        return *p;
    }

    static bool in_worker() { return in_worker_flag(); }

    // While alive, kernels called on this thread run inline, as they do on a worker: for a task
    // that runs whole kernel calls (parallel_tasks, ops.cpp), on the caller's thread too.
    class InlineScope {
      public:
        InlineScope() : was_(in_worker_flag()) { in_worker_flag() = true; }
        ~InlineScope() { in_worker_flag() = was_; }
        InlineScope(const InlineScope&) = delete;
        InlineScope& operator=(const InlineScope&) = delete;

      private:
        bool was_;
    };

    // How long an idle worker polls for the next call before sleeping (SPECDEC_POOL_SPIN_US).
    static int64_t spin_us() {
        static const int64_t us = [] {
            const char* e = std::getenv("SPECDEC_POOL_SPIN_US");
            return e && *e ? std::max<int64_t>(0, std::atoll(e)) : int64_t(50);
        }();
        return us;
    }

  private:
    WorkerPool() : pid_(getpid()) {}

    static bool& in_worker_flag() {
        thread_local bool flag = false;
        return flag;
    }

    bool claim(uint32_t gen, int64_t ntasks, int64_t* task) {
        uint64_t s = claim_.load(std::memory_order_acquire);
        for (;;) {
            if (static_cast<uint32_t>(s >> 32) != gen) return false;
            const int64_t t = static_cast<int64_t>(s & 0xFFFFFFFFu);
            if (t >= ntasks) return false;
            if (claim_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
                *task = t;
                return true;
            }
        }
    }

    void work(uint32_t gen, int64_t ntasks, TaskFn fn, void* ctx) {
        int64_t t;
        while (claim(gen, ntasks, &t)) {
            fn(ctx, t);
            done_.fetch_add(1, std::memory_order_acq_rel);
        }
    }

    void ensure_workers(int n) {
        while (static_cast<int>(threads_) < n) {
            const int index = static_cast<int>(threads_++);
            std::thread([this, index] { worker_loop(index); }).detach();
        }
    }

    void worker_loop(int index) {
        in_worker_flag() = true;
        uint32_t seen = 0;
        for (;;) {
            TaskFn fn;
            void* ctx;
            int64_t ntasks;
            bool participate;
            // Kernel calls come back to back during a forward pass: poll briefly before sleeping,
            // so the next call does not pay a wake-up.  Yielding between polls hands the core to
            // any other runnable thread (the caller, when both landed on one busy core).
            const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us());
            while (gen_pub_.load(std::memory_order_acquire) == seen &&
                   std::chrono::steady_clock::now() < until) {
                for (int i = 0; i < 32; ++i) SPECDEC_CPU_RELAX();
                std::this_thread::yield();
            }
            {
                std::unique_lock<std::mutex> lk(mu_);
                cv_.wait(lk, [&] { return gen_ != seen; });
                seen = gen_;
                fn = fn_;
                ctx = ctx_;
                ntasks = ntasks_;
                participate = index < wanted_;
            }
            if (participate) work(seen, ntasks, fn, ctx);
        }
    }

    const pid_t pid_;
    std::mutex run_mu_;  // one parallel call at a time; concurrent callers run inline
    std::mutex mu_;
    std::condition_variable cv_;
    uint32_t gen_ = 0;  // job generation (guarded by mu_, like the job fields below)
    std::atomic<uint32_t> gen_pub_{0};  // gen_, readable without the lock (polling)
    TaskFn fn_ = nullptr;
    void* ctx_ = nullptr;
    int64_t ntasks_ = 0;
    int wanted_ = 0;
    size_t threads_ = 0;
    std::atomic<uint64_t> claim_{0};  // (generation << 32) | next unclaimed task
    std::atomic<int64_t> done_{0};
};

// Threads a parallel call made on this thread may use: 1 inside a pool task or a torch parallel
// region (the call then runs inline), else torch's thread count.
inline int pool_threads() {
    return WorkerPool::in_worker() || at::in_parallel_region() ? 1 : at::get_num_threads();
}

// f(begin, end) over [0, n) in contiguous ranges of at least `grain` items.  Up to 4 ranges per
// thread, of equal size; where the work allows 4 per thread, ranges that shrink instead (guided:
// each a 2 * threads-th of what is left, down to half the equal size, even-sized, as
// pairs of weight groups go through the kernels together), so that the last ranges claimed,
// which decide when the slowest thread ends, are small.  The ranges depend on n, grain and the
// thread count only.
template <class F>
void parallel_range(int64_t n, int64_t grain, const F& f) {
    if (n <= 0) return;
    const int threads = pool_threads();
    int64_t ntasks = std::max<int64_t>(1, std::min<int64_t>(n / std::max<int64_t>(grain, 1), 4 * threads));
    if (threads <= 1 || ntasks <= 1) {
        f(int64_t(0), n);
        return;
    }
    constexpr int kMaxGuided = 192;  // ~5 ranges a thread at most (16 threads: 82)
    struct Ctx {
        const F* f;
        int64_t n, ntasks;
        int64_t bounds[kMaxGuided + 1];  // guided ranges: task t is [bounds[t], bounds[t + 1])
        bool guided;
    } ctx{&f, n, ntasks, {}, false};
    if (ntasks == 4 * threads && 8 * threads <= kMaxGuided) {
        const int64_t floor_size = std::max<int64_t>({grain, n / (8 * threads), 1});
        int64_t at = 0, t = 0;
        ctx.bounds[0] = 0;
        while (at < n && t < kMaxGuided) {
            int64_t c = std::max<int64_t>(floor_size, (n - at + 2 * threads - 1) / (2 * threads));
            if (c >= 2) c += c & 1;
            if (n - at - c < floor_size / 2 || t == kMaxGuided - 1) c = n - at;  // no sliver at the end
            at += c;
            ctx.bounds[++t] = at;
        }
        ctx.ntasks = ntasks = t;
        ctx.guided = true;
    }
    WorkerPool::instance().run(
        ntasks, threads,
        [](void* p, int64_t t) {
            const Ctx& c = *static_cast<const Ctx*>(p);
            if (c.guided) (*c.f)(c.bounds[t], c.bounds[t + 1]);
            else (*c.f)(c.n * t / c.ntasks, c.n * (t + 1) / c.ntasks);
        },
        &ctx);
}

}  // namespace specdec
