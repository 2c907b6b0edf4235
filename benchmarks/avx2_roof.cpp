// The AVX2 compute roofs of one core (benchmarks/avx2_roof.py builds and runs this; not a test):
// 12 independent chains, each multiplying its own operand loaded from memory (as a kernel streams
// its weights) by a shared one that changes every iteration, best of many short bursts.
//   int8: vpmaddubsw (32 u8 x s8 products, pairs summed to int16) + vpaddw into an int16
//         accumulator: the inner step of the AVX2 8-bit activation kernels (kernels_avx2_a8.cpp,
//         which widen to int32 with vpmaddwd once per block);
//   int16: vpmaddwd (16 s16 x s16 products, pairs summed to int32) + vpaddd;
//   fp32: vfmadd231ps, 8 multiply-adds.
// NOTE: the loops are assembly, each chain's accumulator in a register of its own.  Written in
// C++, the compiler computed a product shared by all chains once per iteration (this file
// reported ~94 "int8" GMAC/s a core that way until session 23: it timed vpaddd alone), and, given
// one operand per chain, kept the 12 operands in registers and spilled accumulators to the stack
// (77-82 "int8" GMAC/s; this assembly: 140-150 on the same core).
// Prints one JSON line: multiply-adds per second of each, per core.
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr long kChains = 12;
constexpr long kIters = 1 << 16;

alignas(64) char g_w[kChains * 32];  // one 32-byte operand per chain

double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// Chain c: load its operand, multiply it by ymm0 (OP), add the product into its accumulator (ADD).
#define ROOF_STEP(OP, ADD, c, acc) \
    "vmovdqa " #c "*32(%1), %%ymm1\n\t" OP " %%ymm0, %%ymm1, %%ymm1\n\t" ADD " %%ymm1, %%" acc ", %%" acc "\n\t"
// fp32: the FMA reads its chain's operand from memory.
#define ROOF_FMA(OP, ADD, c, acc) "vfmadd231ps " #c "*32(%1), %%ymm0, %%" acc "\n\t"
#define ROOF_CHAINS(S, OP, ADD)                                                                           \
    S(OP, ADD, 0, "ymm4") S(OP, ADD, 1, "ymm5") S(OP, ADD, 2, "ymm6") S(OP, ADD, 3, "ymm7")                \
    S(OP, ADD, 4, "ymm8") S(OP, ADD, 5, "ymm9") S(OP, ADD, 6, "ymm10") S(OP, ADD, 7, "ymm11")              \
    S(OP, ADD, 8, "ymm12") S(OP, ADD, 9, "ymm13") S(OP, ADD, 10, "ymm14") S(OP, ADD, 11, "ymm15")
// A burst of kIters iterations; ymm0 changes every iteration (xor with ymm2, or + ymm2 for floats).
#define ROOF_BURST(S, OP, ADD, CHANGE)                                                                     \
    do {                                                                                                \
        long n = kIters;                                                                                \
        __asm__ volatile("vpxor %%ymm0, %%ymm0, %%ymm0\n\tvpcmpeqd %%ymm2, %%ymm2, %%ymm2\n\t"          \
                         "1:\n\t" ROOF_CHAINS(S, OP, ADD) CHANGE " %%ymm2, %%ymm0, %%ymm0\n\t"          \
                         "dec %0\n\tjnz 1b"                                                             \
                         : "+r"(n)                                                                      \
                         : "r"(g_w)                                                                     \
                         : "ymm0", "ymm1", "ymm2", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9",     \
                           "ymm10", "ymm11", "ymm12", "ymm13", "ymm14", "ymm15", "memory", "cc");       \
    } while (0)

double int8_burst() {
    const double t0 = now();
    ROOF_BURST(ROOF_STEP, "vpmaddubsw", "vpaddw", "vpxor");
    return now() - t0;
}

double int16_burst() {
    const double t0 = now();
    ROOF_BURST(ROOF_STEP, "vpmaddwd", "vpaddd", "vpxor");
    return now() - t0;
}

double fp32_burst() {
    const double t0 = now();
    ROOF_BURST(ROOF_FMA, "", "", "vaddps");
    return now() - t0;
}

}  // namespace

int main(int argc, char** argv) {
    const int bursts = argc > 1 ? std::atoi(argv[1]) : 200;
    for (long i = 0; i < kChains * 32; ++i) g_w[i] = static_cast<char>(i % 7 + 1);
    double best[3] = {1e30, 1e30, 1e30};
    for (int r = 0; r < bursts; ++r) {
        const double d[3] = {int8_burst(), int16_burst(), fp32_burst()};
        for (int k = 0; k < 3; ++k)
            if (d[k] < best[k]) best[k] = d[k];
    }
    const double n = static_cast<double>(kIters) * kChains;
    std::printf("{\"int8_macs_per_s\": %.4g, \"int16_macs_per_s\": %.4g, \"fp32_macs_per_s\": %.4g}\n",
                n * 32 / best[0], n * 16 / best[1], n * 8 / best[2]);
    return 0;
}
