// The int8 GEMM (8-bit activation kernels, kernels_vnni.cpp) against the VNNI roof, one core.
// Built and run by gemm_roof.py; see there.  Per format, K and row count M: the share of the
// roof reached (useful vpdpbusd per second: M * N * K / 64 per call, over the roof measured
// just before), best of many calls on cache-resident weights; every result is also checked
// bit for bit against the scalar twin and against each row computed alone.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <vector>

#include "kernels.h"

using namespace specdec;
using Clock = std::chrono::steady_clock;

static double secs_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
// CPU time of this thread: on a machine shared with other work it leaves out the time slices
// other processes take (a call's wall time would include them).
static double cpu_now() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// The roof: 16 independent register-only vpdpbusd chains (8 x 16 per loop trip), best of many
// short bursts so that a busy machine's preemptions fall out.
#define D(i) "vpdpbusd %%zmm17, %%zmm16, %%zmm" #i "\n\t"
#define D16 D(0) D(1) D(2) D(3) D(4) D(5) D(6) D(7) D(8) D(9) D(10) D(11) D(12) D(13) D(14) D(15)
static double roof(double seconds) {
    double best = 1e9;
    const auto start = Clock::now();
    while (secs_since(start) < seconds) {
        const auto t0 = Clock::now();
        for (int it = 0; it < 2000; ++it)
            __asm__ volatile(D16 D16 D16 D16 D16 D16 D16 D16 ::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5",
                             "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
        best = std::min(best, secs_since(t0));
    }
    return 2000.0 * 128 / best;
}

int main(int argc, char** argv) {
    // argv: N, seconds per measurement, copies, then "kind:K" ... (kind 1 Q8_0, 2 Q4_0, 3 Q4_1),
    // then "--ms" and the row counts.  copies > 1: the timed calls cycle through that many copies
    // of the weight, so that they stream from memory as in a forward pass.
    const int64_t N = argc > 1 ? atol(argv[1]) : 3072;
    const double secs = argc > 2 ? atof(argv[2]) : 0.15;
    const int64_t copies = argc > 3 ? atol(argv[3]) : 1;
    std::vector<std::pair<int, int64_t>> cases;
    std::vector<int64_t> ms;
    bool in_ms = false;
    for (int i = 4; i < argc; ++i) {
        if (!strcmp(argv[i], "--ms")) in_ms = true;
        else if (in_ms) ms.push_back(atol(argv[i]));
        else cases.push_back({atoi(argv[i]), atol(strchr(argv[i], ':') + 1)});
    }
    std::mt19937 rng(1);
    // GEMM_TABLE=amx: the AMX-INT8 kernels (kernels_amx.cpp) at their per-format thresholds
    // (fewer rows go to VNNI), amx1: AMX for every row count; after asking Linux for the tile state.
    const char* which = getenv("GEMM_TABLE");
    const A8Table* v = vnni_table();
#ifdef SPECDEC_HAVE_AMX
    if (which && !strcmp(which, "amx1")) amx_set_min_rows(1);
    if (which && (!strcmp(which, "amx") || !strcmp(which, "amx1"))) {
        if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {
            fprintf(stderr, "no AMX tile-data permission\n");
            return 1;
        }
        v = amx_table();
    }
#else
    if (which && !strncmp(which, "amx", 3)) {
        fprintf(stderr, "built without the AMX kernels\n");
        return 1;
    }
#endif
    printf("kernels: %s%s\n", v->name, which && !strcmp(which, "amx1") ? " (from 1 row)" : "");
    const A8Table* p = portable_a8_table();
    const char* names[] = {"", "q8_0", "q4_0", "q4_1"};
    printf("format     K  roof/1e9");
    for (int64_t M : ms) printf("  M=%-3ld", (long)M);
    printf("   (%% of the roof)\n");
    for (auto [kind, K] : cases) {
        const int64_t nb = K / 32, TB = a8_tile_bytes(kind);
        const int64_t WB = N / 16 * nb * TB;
        std::vector<uint8_t> w(WB * copies);
        for (auto& c : w) c = rng() & 0xFF;
        for (int64_t t = 0; t < N / 16 * nb * copies; ++t) {  // scales: f16 in [2^-7, 2^-5), minimums either sign
            uint16_t h[32];
            for (int j = 0; j < 32; ++j) h[j] = 0x2000 + rng() % 0x0C00 + (j >= 16 && (rng() & 1) ? 0x8000 : 0);
            memcpy(w.data() + t * TB, h, a8_head_bytes(kind));
        }
        double r = roof(0.2);
        printf("%-6s %5ld  %8.2f", names[kind], (long)K, r / 1e9);
        bool all_ok = true;
        for (int64_t M : ms) {
            std::vector<float> x(M * K), dx(M * nb), dxs(M * nb), y(M * N), y2(M * N), y1(N);
            std::normal_distribution<float> nd;
            for (auto& e : x) e = nd(rng);
            std::vector<int8_t> xq(M * K);
            std::vector<int32_t> sx(M * nb);
            v->quantize_rows(x.data(), K, xq.data(), dx.data(), sx.data(), dxs.data(), 0, M);
            auto run = [&](const A8Table* t, int64_t m0, int64_t rows, float* out, int64_t copy = 0) {
                t->linear_groups(kind, xq.data() + m0 * K, dx.data() + m0 * nb, sx.data() + m0 * nb,
                                 dxs.data() + m0 * nb, rows, K, w.data() + copy * WB, nullptr, out, N, 0, N / 16, nullptr);
            };
            run(v, 0, M, y.data());
            run(p, 0, M, y2.data());
            bool ok = memcmp(y.data(), y2.data(), sizeof(float) * M * N) == 0;
            for (int64_t m = 0; m < M && ok; ++m) {
                run(v, m, 1, y1.data());
                ok = memcmp(y1.data(), y.data() + m * N, sizeof(float) * N) == 0;
            }
            all_ok = all_ok && ok;
            double best = 1e9;
            const auto start = Clock::now();
            // Each sample repeats the call for at least 0.3 ms (the thread CPU clock is coarse on
            // some machines: a single short call could read as zero).
            int64_t reps = 1;
            while (secs_since(start) < secs) {
                const double t0 = cpu_now();
                for (int64_t i = 0; i < reps; ++i)
                    for (int64_t c = 0; c < copies; ++c) run(v, 0, M, y.data(), c);
                const double dt = cpu_now() - t0;
                if (dt < 3e-4) {
                    reps *= 2;
                    continue;
                }
                best = std::min(best, dt / (copies * reps));
            }
            r = std::max(r, roof(0.05));
            printf("  %5.1f", 100.0 * M * N * K / 64.0 / best / r);
            fflush(stdout);
        }
        printf("%s\n", all_ok ? "" : "   MISMATCH (against the scalar twin or a row alone)");
    }
    return 0;
}
