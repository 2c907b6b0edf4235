// The AVX2 compute roofs of one core (benchmarks/avx2_roof.py builds and runs this; not a test):
// independent chains, each multiplying its own operand loaded from memory (as a kernel streams
// its weights), best of many short bursts.
//   int8: vpmaddubsw (32 u8 x s8 products, pairs summed to int16) + vpaddw into an int16
//         accumulator: the inner step of the AVX2 8-bit activation kernels (kernels_avx2_a8.cpp,
//         which widen to int32 with vpmaddwd once per block);
//   int16: vpmaddwd (16 s16 x s16 products, pairs summed to int32) + vpaddd;
//   fp32: vfmadd231ps, 8 multiply-adds.
// NOTE: every chain's product differs and the shared operand changes each iteration: with one
// product shared by all chains the compiler computes it once per iteration, and the loop then
// times vpaddd alone (this file did so until session 23, reporting ~94 "int8" GMAC/s a core).
// Prints one JSON line: multiply-adds per second of each, per core.
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kChains = 12;
constexpr long kIters = 1 << 16;

alignas(64) __m256i g_w8[kChains];
alignas(64) __m256 g_wf[kChains];

double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

__attribute__((noinline)) int int8_burst(__m256i x, __m256i step) {
    __m256i acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_setzero_si256();
    for (long i = 0; i < kIters; ++i) {
#pragma GCC unroll 12  // the accumulators in registers
        for (int c = 0; c < kChains; ++c)
            acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(_mm256_load_si256(g_w8 + c), x));
        x = _mm256_xor_si256(x, step);
    }
    __m256i s = acc[0];
    for (int c = 1; c < kChains; ++c) s = _mm256_add_epi16(s, acc[c]);
    return _mm256_extract_epi32(s, 0);
}

__attribute__((noinline)) int int16_burst(__m256i x, __m256i step) {
    __m256i acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_setzero_si256();
    for (long i = 0; i < kIters; ++i) {
#pragma GCC unroll 12  // the accumulators in registers
        for (int c = 0; c < kChains; ++c)
            acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_load_si256(g_w8 + c), x));
        x = _mm256_xor_si256(x, step);
    }
    __m256i s = acc[0];
    for (int c = 1; c < kChains; ++c) s = _mm256_add_epi32(s, acc[c]);
    return _mm256_extract_epi32(s, 0);
}

__attribute__((noinline)) float fp32_burst(__m256 x, __m256 step) {
    __m256 acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_setzero_ps();
    for (long i = 0; i < kIters; ++i) {
#pragma GCC unroll 12  // the accumulators in registers
        for (int c = 0; c < kChains; ++c)
            acc[c] = _mm256_fmadd_ps(x, _mm256_load_ps(reinterpret_cast<const float*>(g_wf + c)), acc[c]);
        x = _mm256_add_ps(x, step);
    }
    __m256 s = acc[0];
    for (int c = 1; c < kChains; ++c) s = _mm256_add_ps(s, acc[c]);
    return _mm256_cvtss_f32(s);
}

}  // namespace

int main(int argc, char** argv) {
    int bursts = argc > 1 ? std::atoi(argv[1]) : 200;
    for (int c = 0; c < kChains; ++c) {
        g_w8[c] = _mm256_set1_epi8(static_cast<char>(c + 1));
        g_wf[c] = _mm256_set1_ps(0.5f + static_cast<float>(c));
    }
    volatile int sink_i = 0;
    volatile float sink_f = 0.0f;
    double best[3] = {1e30, 1e30, 1e30};
    const __m256i x8 = _mm256_set1_epi8(3), step8 = _mm256_set1_epi8(5);
    const __m256 xf = _mm256_set1_ps(1.0001f), stepf = _mm256_set1_ps(1e-7f);
    for (int r = 0; r < bursts; ++r) {
        const double t0 = now();
        sink_i = sink_i + int8_burst(x8, step8);
        const double t1 = now();
        sink_i = sink_i + int16_burst(x8, step8);
        const double t2 = now();
        sink_f = sink_f + fp32_burst(xf, stepf);
        const double t3 = now();
        const double d[3] = {t1 - t0, t2 - t1, t3 - t2};
        for (int k = 0; k < 3; ++k)
            if (d[k] < best[k]) best[k] = d[k];
    }
    const double n = static_cast<double>(kIters) * kChains;
    std::printf("{\"int8_macs_per_s\": %.4g, \"int16_macs_per_s\": %.4g, \"fp32_macs_per_s\": %.4g}\n",
                n * 32 / best[0], n * 16 / best[1], n * 8 / best[2]);
    return 0;
}
