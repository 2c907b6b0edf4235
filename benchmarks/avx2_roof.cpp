// The AVX2 compute roofs of one core (benchmarks/avx2_roof.py builds and runs this; not a test):
// register-only independent chains, best of many short bursts.
//   int8: vpmaddubsw (32 u8 x s8 products, pairs summed to int16) + vpmaddwd with ones (to int32)
//         + vpaddd: how the AVX2 8-bit activation kernels multiply-add 32 int8 values;
//   fp32: vfmadd231ps, 8 multiply-adds.
// Prints one JSON line: multiply-adds per second of each, per core.
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

constexpr int kChains = 10;
constexpr long kIters = 1 << 16;

double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

__attribute__((noinline)) int int8_burst(__m256i a, __m256i b) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_epi32(c);
    for (long i = 0; i < kIters; ++i) {
        for (int c = 0; c < kChains; ++c) {
            __m256i p = _mm256_maddubs_epi16(a, b);
            acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(p, ones));
        }
        a = _mm256_xor_si256(a, b);  // keeps the compiler from hoisting the products
    }
    __m256i s = acc[0];
    for (int c = 1; c < kChains; ++c) s = _mm256_add_epi32(s, acc[c]);
    return _mm256_extract_epi32(s, 0);
}

__attribute__((noinline)) float fp32_burst(__m256 a, __m256 b) {
    __m256 acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(static_cast<float>(c));
    for (long i = 0; i < kIters; ++i) {
        for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(a, b, acc[c]);
    }
    __m256 s = acc[0];
    for (int c = 1; c < kChains; ++c) s = _mm256_add_ps(s, acc[c]);
    return _mm256_cvtss_f32(s);
}

}  // namespace

int main(int argc, char** argv) {
    int bursts = argc > 1 ? std::atoi(argv[1]) : 200;
    volatile int sink_i = 0;
    volatile float sink_f = 0.0f;
    double best_i = 1e30, best_f = 1e30;
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
    __m256 x = _mm256_set1_ps(1.0001f), y = _mm256_set1_ps(0.9999f);
    for (int r = 0; r < bursts; ++r) {
        double t0 = now();
        sink_i = sink_i + int8_burst(a, b);
        double t1 = now();
        sink_f = sink_f + fp32_burst(x, y);
        double t2 = now();
        if (t1 - t0 < best_i) best_i = t1 - t0;
        if (t2 - t1 < best_f) best_f = t2 - t1;
    }
    double n = static_cast<double>(kIters) * kChains;
    std::printf("{\"int8_macs_per_s\": %.4g, \"fp32_macs_per_s\": %.4g}\n", n * 32 / best_i,
                n * 8 / best_f);
    return 0;
}
