// Torch binding of the native kernels: argument checks, runtime ISA choice and threading.
//
// Threading splits the independent outputs (weight rows for linear, rows for rms_norm, (row, kv
// head) pairs for attention) across the threads of parallel.h, so it never changes an output's
// arithmetic.
#include <ATen/Parallel.h>
#include <pthread.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <cstring>
#include <exception>
#include <mutex>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "half.h"
#include "kernels.h"
#include "ops.h"
#include "parallel.h"
#include "timeline.h"

namespace specdec {
namespace {

bool cpu_has(const char* feature) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const std::string f(feature);
    if (f == "avx2") return __builtin_cpu_supports("avx2");
    if (f == "fma") return __builtin_cpu_supports("fma");
    if (f == "f16c") return __builtin_cpu_supports("f16c");
    if (f == "avx512f") return __builtin_cpu_supports("avx512f");
    if (f == "avx512dq") return __builtin_cpu_supports("avx512dq");
    if (f == "avx512bw") return __builtin_cpu_supports("avx512bw");
    if (f == "avx512vl") return __builtin_cpu_supports("avx512vl");
    if (f == "avx512vnni") return __builtin_cpu_supports("avx512vnni");
    if (f == "avxvnni") return __builtin_cpu_supports("avxvnni");
    return false;
#else
    (void)feature;
    return false;
#endif
}

bool avx2_usable() {
#ifdef SPECDEC_HAVE_AVX2
    return cpu_has("avx2") && cpu_has("fma") && cpu_has("f16c");
#else
    return false;
#endif
}

bool avx512_usable() {
#if defined(SPECDEC_HAVE_AVX512) && defined(SPECDEC_HAVE_AVX2)
    return avx2_usable() && cpu_has("avx512f") && cpu_has("avx512dq") && cpu_has("avx512bw") &&
           cpu_has("avx512vl");
#else
    return false;
#endif
}

bool a8_usable() {
#if defined(SPECDEC_HAVE_VNNI)
    return avx512_usable() && cpu_has("avx512vnni");
#else
    return false;
#endif
}

// AMX-INT8: CPUID leaf 7 (EDX bit 24 AMX-TILE, bit 25 AMX-INT8), XCR0 bits 17-18 (the OS
// saves the tile state), then Linux's per-process permission for the tile data
// (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): without it the first tile instruction
// faults.  The permission is asked once per process, and again in a forked child.
bool amx_cpu() {
#if defined(SPECDEC_HAVE_AMX) && defined(__x86_64__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((lo >> 17) & 3) == 3;
#else
    return false;
#endif
}

// AMX-BF16 (CPUID leaf 7 EDX bit 22) and AVX512-BF16 (leaf 7 subleaf 1 EAX bit 5), on top of the
// tile state amx_cpu checks.
bool amx16_cpu() {
#if defined(SPECDEC_HAVE_AMX16) && defined(__x86_64__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!amx_cpu() || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1)) return false;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
#else
    return false;
#endif
}

std::atomic<int> g_amx_perm{-1};  // -1 not asked yet (in this process), 0 refused, 1 granted

bool amx_permitted() {
    int p = g_amx_perm.load(std::memory_order_acquire);
    if (p >= 0) return p == 1;
#if defined(SPECDEC_HAVE_AMX) && defined(__linux__) && defined(__x86_64__)
    static const int registered = pthread_atfork(nullptr, nullptr, [] { g_amx_perm.store(-1); });
    (void)registered;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    p = amx_cpu() && syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0 ? 1 : 0;
#else
    p = 0;
#endif
    g_amx_perm.store(p, std::memory_order_release);
    return p == 1;
}

// SPECDEC_AMX=0 turns the AMX kernels off from the start; _C.set_amx switches them at run time.
// SPECDEC_AMX_MIN_ROWS=n sends every format to them from n rows (benchmarks; default: the
// measured per-format thresholds of kernels_amx.cpp).
std::atomic<bool> g_amx_enabled{[] {
#ifdef SPECDEC_HAVE_AMX
    if (const char* rows = std::getenv("SPECDEC_AMX_MIN_ROWS")) amx_set_min_rows(std::atoll(rows));
#endif
    const char* env = std::getenv("SPECDEC_AMX");
    return !(env && std::string(env) == "0");
}()};

const KernelTable* table_for(const std::string& isa) {
    if (isa == "portable") return portable_table();
    if (isa == "avx512") {
#if defined(SPECDEC_HAVE_AVX512) && defined(SPECDEC_HAVE_AVX2)
        TORCH_CHECK(avx512_usable(), "specdec kernels: this CPU lacks AVX-512 F/DQ/BW/VL");
        return avx512_table();
#else
        TORCH_CHECK(false, "specdec kernels: built without the AVX-512 translation unit");
#endif
    }
    if (isa == "avx2") {
#ifdef SPECDEC_HAVE_AVX2
        TORCH_CHECK(avx2_usable(), "specdec kernels: this CPU lacks AVX2/FMA/F16C");
        return avx2_table();
#else
        TORCH_CHECK(false, "specdec kernels: built without the AVX2 translation unit");
#endif
    }
    TORCH_CHECK(isa == "auto", "specdec kernels: unknown ISA '", isa,
                "' (auto, avx512, avx2, portable)");
#if defined(SPECDEC_HAVE_AVX512) && defined(SPECDEC_HAVE_AVX2)
    if (avx512_usable()) return avx512_table();
#endif
#ifdef SPECDEC_HAVE_AVX2
    if (avx2_usable()) return avx2_table();
#endif
    return portable_table();
}

const KernelTable* initial_table() {
    const char* env = std::getenv("SPECDEC_KERNELS_ISA");
    try {
        return table_for(env && *env ? std::string(env) : std::string("auto"));
    } catch (const std::exception&) {
        return table_for("auto");  // a bad value must not make the module unimportable
    }
}

const KernelTable* g_table = initial_table();

int64_t block_bytes(int64_t qtype) {
    switch (qtype) {
        case QT_Q8_0: return 34;
        case QT_Q4_0: return 18;
        case QT_Q4_1: return 20;
        default: return 0;
    }
}

void check_float_cpu(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu(), "specdec native ", name, ": expected a CPU tensor, got ", t.device());
    TORCH_CHECK(t.scalar_type() == torch::kFloat32, "specdec native ", name,
                ": expected float32, got ", t.scalar_type());
}

// Thread-private scratch buffer, grown on demand.
float* scratch(int64_t n) {
    thread_local std::vector<float> buf;
    if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
    return buf.data();
}

// Smallest task worth a thread, in estimated nanoseconds of single-core work.  Waking a sleeping
// worker costs microseconds, so small calls run inline.
// The per-item cost models below were fitted roughly to single-core timings of the AVX2 kernels.
constexpr double kMinTaskNs = 3000.0;

}  // namespace

int64_t grain_for(double item_ns) {
    return std::max<int64_t>(1, static_cast<int64_t>(kMinTaskNs / std::max(item_ns, 1e-3)) + 1);
}

namespace {

// The VNNI kernels' walk (kernels.h A8Walk): SPECDEC_A8_WALK=groups|stationary, else by the CPU's
// vendor (CPUID leaf 0): weight-stationary on AMD, where it was measured faster (Zen 4), the groups
// walk elsewhere (measured on Intel Xeons).  set_a8_walk changes it at run time (benchmarks and
// tests; results are the same bits either way).
int a8_walk_named(const std::string& name) {  // 0: not a walk's name
    return name == "groups" ? A8_WALK_GROUPS : name == "stationary" ? A8_WALK_STATIONARY : 0;
}

int a8_walk_for_cpu() {
    if (const char* env = std::getenv("SPECDEC_A8_WALK"))
        if (const int walk = a8_walk_named(env)) return walk;
#if defined(__x86_64__)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(0, &a, &b, &c, &d)) {
        char vendor[13] = {};
        std::memcpy(vendor, &b, 4);
        std::memcpy(vendor + 4, &d, 4);
        std::memcpy(vendor + 8, &c, 4);
        if (std::string(vendor) == "AuthenticAMD") return A8_WALK_STATIONARY;
    }
#endif
    return A8_WALK_GROUPS;
}

std::atomic<int> g_a8_walk{a8_walk_for_cpu()};

}  // namespace

int a8_walk() { return g_a8_walk.load(std::memory_order_relaxed); }

namespace {

bool amx_usable() { return a8_usable() && amx_permitted(); }

// The AVX2 table's 8-bit activation kernels on 256-bit VNNI (a8_vnni256.h) where the CPU has
// vpdpbusd on ymm registers: AVX-VNNI's VEX form, else AVX-512 VNNI + VL's EVEX form (a CPU with
// AVX-512 running the AVX2 table).  On by default; SPECDEC_A8_VNNI256=0 or set_a8_vnni256(false)
// keeps the vpmaddubsw kernels (the same results).
std::atomic<bool> g_a8_vnni256{[] {
    const char* env = std::getenv("SPECDEC_A8_VNNI256");
    return !(env && std::string(env) == "0");
}()};

const A8Table* vnni256_a8_table() {
    // NOTE: the CPU's answer found once (a8_table() runs on every linear call)
    static const A8Table* const for_cpu = [] {
#if defined(SPECDEC_HAVE_AVXVNNI)
        if (cpu_has("avxvnni")) return avxvnni_a8_table();
#endif
#if defined(SPECDEC_HAVE_VNNI256EVEX)
        if (cpu_has("avx512f") && cpu_has("avx512vl") && cpu_has("avx512vnni")) return avx2_vnni_evex_a8_table();
#endif
        return static_cast<const A8Table*>(nullptr);
    }();
    return g_a8_vnni256.load(std::memory_order_relaxed) ? for_cpu : nullptr;
}

// The VNNI kernels when the CPU has them and the AVX-512 table is selected (their AMX-INT8 form
// when the CPU has that too and it is not switched off), else the AVX2 ones when a vector table
// is selected (on 256-bit VNNI where the CPU has it), else the scalar ones (the same results,
// much slower).
const A8Table* a8_table() {
#if defined(SPECDEC_HAVE_VNNI)
#if defined(SPECDEC_HAVE_AMX)
    if (g_table == avx512_table() && g_amx_enabled.load(std::memory_order_relaxed) && amx_usable())
        return amx_table();
#endif
    if (g_table == avx512_table() && a8_usable()) return vnni_table();
#endif
#if defined(SPECDEC_HAVE_AVX2A8)
    if (g_table != portable_table() && avx2_usable()) {
        const A8Table* v = vnni256_a8_table();
        return v != nullptr ? v : avx2_a8_table();
    }
#endif
    return portable_a8_table();
}

int64_t a8_row_bytes(int64_t kind, int64_t K) { return K / 32 * a8_tile_bytes(static_cast<int>(kind)) / kA8TileRows; }

bool a8_kind_ok(int64_t kind) { return kind == A8_Q8 || kind == A8_Q4_0 || kind == A8_Q4_1; }

// x [M, K] float32 -> y [M, N] through the 8-bit activation kernels; w from repack_a8.
torch::Tensor linear_a8(const torch::Tensor& x_in, const torch::Tensor& w, int64_t kind, int64_t N,
                        int64_t K, const float* bias_ptr) {
    TORCH_CHECK(a8_kind_ok(kind), "specdec native linear: unknown 8-bit activation kind ", kind);
    TORCH_CHECK(K % 32 == 0 && N % kA8TileRows == 0,
                "specdec native linear: repacked weights need K % 32 == 0 and N % 16 == 0");
    TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.numel() == N * a8_row_bytes(kind, K),
                "specdec native linear: repacked weight must be uint8 with ", N * a8_row_bytes(kind, K),
                " bytes");
    torch::Tensor x = x_in.contiguous();
    const int64_t M = x.size(0), nb = K / 32;
    auto y = torch::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;
    const A8Table* tab = a8_table();
    thread_local std::vector<int8_t> xq_buf;
    thread_local std::vector<float> dx_buf, dxs_buf;
    thread_local std::vector<int32_t> sx_buf;
    if (static_cast<int64_t>(xq_buf.size()) < M * K) xq_buf.resize(static_cast<size_t>(M * K));
    if (static_cast<int64_t>(dx_buf.size()) < M * nb) {
        dx_buf.resize(static_cast<size_t>(M * nb));
        dxs_buf.resize(static_cast<size_t>(M * nb));
        sx_buf.resize(static_cast<size_t>(M * nb));
    }
    int8_t* xq = xq_buf.data();
    float* dx = dx_buf.data();
    float* dxs = dxs_buf.data();
    int32_t* sx = sx_buf.data();
    const float* xp = x.data_ptr<float>();
    // NOTE: laid out once per product, not in every task (at 16 rows x 576 inputs each task's
    // copy cost a quarter of its time), by the tasks that quantize the rows (on the calling
    // thread alone, the copy was 4% of a prefill's samples while the other cores waited)
    const void* prep = tab->layout_alloc ? tab->layout_alloc(static_cast<int>(kind), M, K) : nullptr;
    parallel_range(M, grain_for(K * 0.5), [&](int64_t m0, int64_t m1) {
        if (prep) tab->quantize_layout(prep, static_cast<int>(kind), xp, K, M, m0, m1, xq, dx, sx, dxs);
        else tab->quantize_rows(xp, K, xq, dx, sx, dxs, m0, m1);
    });
    const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
    float* yp = y.data_ptr<float>();
    const int64_t groups = N / kA8TileRows;
    const double tile_ns = a8_tile_bytes(static_cast<int>(kind)) / 15.0 + 2.5 * static_cast<double>(M);
    const int64_t grain = grain_for(tile_ns * nb);
    parallel_range(groups, grain, [&](int64_t g0, int64_t g1) {
        tab->linear_groups(static_cast<int>(kind), xq, dx, sx, dxs, M, K, wp, bias_ptr, yp, N, g0, g1, prep);
    });
    return y;
}

// The AVX2 table's K-quant kernels on 256-bit VNNI where a8_table() takes it for the others.
const KqTable* vnni256_kq_table() {
#if defined(SPECDEC_HAVE_AVXVNNI)
    if (vnni256_a8_table() == avxvnni_a8_table()) return avxvnni_kq_table();
#endif
#if defined(SPECDEC_HAVE_VNNI256EVEX)
    if (vnni256_a8_table() == avx2_vnni_evex_a8_table()) return avx2_vnni_evex_kq_table();
#endif
    return nullptr;
}

// K-quant kernels: the VNNI ones when a8_table() would pick VNNI, else the AVX2 ones when a
// vector table is selected (on 256-bit VNNI where a8_table() takes it), else their scalar twins
// (the same results, float path included).
const KqTable* kq_table() {
#if defined(SPECDEC_HAVE_VNNI)
    if (g_table == avx512_table() && a8_usable()) return vnni_kq_table();
#endif
#if defined(SPECDEC_HAVE_AVX2KQ)
    if (g_table != portable_table() && avx2_usable()) {
        const KqTable* v = vnni256_kq_table();
        return v != nullptr ? v : avx2_kq_table();
    }
#endif
    return portable_kq_table();
}

// Which K-quant 8-bit activation kernels kq_table() picks: avx512vnni, avx-vnni, avx2-vnni, avx2
// or portable (the names a8_kernels() gives).
std::string kq_kernels() {
    const KqTable* t = kq_table();
#if defined(SPECDEC_HAVE_VNNI)
    if (t == vnni_kq_table()) return "avx512vnni";
#endif
#if defined(SPECDEC_HAVE_AVX2KQ)
    if (t == vnni256_kq_table()) return vnni256_a8_table()->name;
    if (t == avx2_kq_table()) return "avx2";
#endif
    return "portable";
}

bool kq_format_ok(int64_t fmt) { return fmt == QT_Q4_K || fmt == QT_Q5_K || fmt == QT_Q6_K; }

// One part of a K-quant weight: its format, first row, rows and tile bytes from the start.
struct KqPart {
    int fmt;
    int64_t row0, rows;
    int64_t offset;
};

// parts = [format, rows, format, rows, ...] (kernels.h); checks them against N, K and w.
std::vector<KqPart> kq_parts(const std::vector<int64_t>& parts, const torch::Tensor& w, int64_t N, int64_t K,
                             const char* op) {
    TORCH_CHECK(!parts.empty() && parts.size() % 2 == 0, "specdec ", op,
                ": a K-quant weight needs its parts as [format, rows, ...]");
    TORCH_CHECK(K > 0 && K % kKqBlock == 0, "specdec ", op, ": K-quant K must be a multiple of 256, got ", K);
    std::vector<KqPart> out;
    int64_t row = 0, offset = 0;
    for (size_t i = 0; i < parts.size(); i += 2) {
        const int64_t fmt = parts[i], rows = parts[i + 1];
        TORCH_CHECK(kq_format_ok(fmt), "specdec ", op, ": unknown K-quant format ", fmt);
        TORCH_CHECK(rows > 0 && rows % kKqTileRows == 0, "specdec ", op, ": K-quant parts need rows % 16 == 0, got ",
                    rows);
        out.push_back({static_cast<int>(fmt), row, rows, offset});
        row += rows;
        offset += rows / kKqTileRows * (K / kKqBlock) * kq_tile_bytes(static_cast<int>(fmt));
    }
    TORCH_CHECK(row == N, "specdec ", op, ": the parts hold ", row, " rows, expected ", N);
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.numel() == offset,
                "specdec ", op, ": K-quant tiles must be contiguous CPU uint8 with ", offset, " bytes");
    return out;
}

// fn(part, local g0, local g1) for the parts' tile groups within global groups [g0, g1).
template <typename Fn>
void for_part_groups(const std::vector<KqPart>& parts, int64_t g0, int64_t g1, Fn&& fn) {
    for (const KqPart& p : parts) {
        const int64_t pg0 = p.row0 / kKqTileRows, pg1 = pg0 + p.rows / kKqTileRows;
        const int64_t a = std::max(g0, pg0), b = std::min(g1, pg1);
        if (a < b) fn(p, a - pg0, b - pg0);
    }
}

// x [M, K] float32 -> y [M, N] for a K-quant weight, with 8-bit activations (a8) or float ones.
torch::Tensor linear_kq(const torch::Tensor& x_in, const torch::Tensor& w, const std::vector<int64_t>& part_list,
                        int64_t N, int64_t K, const float* bias, bool a8) {
    const std::vector<KqPart> parts = kq_parts(part_list, w, N, K, "linear");
    torch::Tensor x = x_in.contiguous();
    const int64_t M = x.size(0), nb = K / kKqBlock, groups = N / kKqTileRows;
    auto y = torch::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;
    const float* xp = x.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    const KqTable* tab = kq_table();
    if (!a8) {
        const double group_ns = kKqTileRows * K * (0.2 + 0.07 * static_cast<double>(M));
        parallel_range(groups, grain_for(group_ns), [&](int64_t g0, int64_t g1) {
            float* s = scratch(kKqFloatScratch + K + 64 * M);
            for_part_groups(parts, g0, g1, [&](const KqPart& p, int64_t a, int64_t b) {
                tab->linear_groups_f32(p.fmt, xp, M, K, wp + p.offset, bias ? bias + p.row0 : nullptr,
                                       yp + p.row0, N, a, b, s);
            });
        });
        return y;
    }
    thread_local std::vector<int8_t> xq_buf;
    thread_local std::vector<float> dk_buf;
    thread_local std::vector<int16_t> bs16_buf;
    thread_local std::vector<int8_t> bsm_buf;
    if (static_cast<int64_t>(xq_buf.size()) < M * K) xq_buf.resize(static_cast<size_t>(M * K));
    if (static_cast<int64_t>(bs16_buf.size()) < M * K / 16) {
        dk_buf.resize(static_cast<size_t>(M * nb));
        bs16_buf.resize(static_cast<size_t>(M * K / 16));
        bsm_buf.resize(static_cast<size_t>(M * K / 16));
    }
    int8_t* xq = xq_buf.data();
    float* dk = dk_buf.data();
    int16_t* bs16 = bs16_buf.data();
    int8_t* bsm = bsm_buf.data();
    parallel_range(M, grain_for(K * 0.5), [&](int64_t m0, int64_t m1) {
        tab->quantize_rows(xp, K, xq, dk, bs16, bsm, m0, m1);
    });
    const double tile_ns = kq_tile_bytes(parts[0].fmt) / 15.0 + 20.0 * static_cast<double>(M);
    parallel_range(groups, grain_for(tile_ns * nb), [&](int64_t g0, int64_t g1) {
        for_part_groups(parts, g0, g1, [&](const KqPart& p, int64_t a, int64_t b) {
            tab->linear_groups(p.fmt, xq, dk, bs16, bsm, M, K, wp + p.offset, bias ? bias + p.row0 : nullptr,
                               yp + p.row0, N, a, b);
        });
    });
    return y;
}

// 16-bit weight rows [n0, n1) (qtype QT_F16 or QT_BF16, [N, K]): the AVX-512 kernels of
// kernels_bf16.cpp when that table runs, else rows widened exactly into scratch, kMaxScratchRows at
// a time, through the selected table's f32 kernel.  Either way what a float32 copy gives.
void half_linear_rows(const KernelTable* tab, int qtype, const float* x, int64_t M, int64_t K,
                      const uint16_t* w, const float* bias, float* y, int64_t N, int64_t n0, int64_t n1,
                      float* s) {
#if defined(SPECDEC_HAVE_HALF512) && defined(SPECDEC_HAVE_AVX512) && defined(SPECDEC_HAVE_AVX2)
    if (tab == avx512_table()) return half512_linear_rows(qtype, x, M, K, w, bias, y, N, n0, n1, s);
#endif
    for (int64_t r0 = n0; r0 < n1; r0 += kMaxScratchRows) {
        const int64_t r1 = std::min(n1, r0 + kMaxScratchRows);
        const uint16_t* src = w + r0 * K;
        for (int64_t i = 0; i < (r1 - r0) * K; ++i) {
            if (qtype == QT_F16) {
                s[i] = half_to_float(src[i]);
            } else {
                const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
                std::memcpy(s + i, &bits, 4);
            }
        }
        tab->linear_rows(QT_F32, x, M, K, reinterpret_cast<const uint8_t*>(s), K * 4, bias ? bias + r0 : nullptr,
                         y + r0, N, 0, r1 - r0, nullptr);
    }
}

// The CPU part asked once (CPUID traps to the hypervisor in a VM: microseconds per linear call).
bool amx16_usable() {
    static const bool cpu = avx512_usable() && amx16_cpu();
    return cpu && amx_permitted();
}

#ifdef SPECDEC_HAVE_AMX16
// 16-bit weights with bf16x2 activations (kernels_amx16.cpp): the activations are packed into
// tiles once, then units of 64 weight rows run on the pool.
torch::Tensor linear_half_x2(const torch::Tensor& x_in, const torch::Tensor& w, int64_t qtype, int64_t N, int64_t K,
                             const float* bias) {
    TORCH_CHECK(amx16_usable(), "specdec native linear: bf16x2 activations need AMX-BF16, which this CPU ",
                "(or this process) lacks");
    TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.numel() == amx16_weight_bytes(N, K), "specdec native linear: ",
                qtype == QT_F16 ? "f16" : "bf16", " bf16x2 weight must be repack_x2's tiles (", amx16_weight_bytes(N, K),
                " bytes) for [", N, ", ", K, "]");
    torch::Tensor x = x_in.contiguous();
    const int64_t M = x.size(0);
    auto y = torch::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;
    const float* xp = x.data_ptr<float>();
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<uint8_t>());
    float* yp = y.data_ptr<float>();
    thread_local std::vector<uint16_t> packed;
    const int64_t need = amx16_packed_x_elems(M, K);
    if (static_cast<int64_t>(packed.size()) < need) packed.resize(static_cast<size_t>(need));
    uint16_t* pk = packed.data();
    const int64_t groups = (M + 15) / 16;
    parallel_range(groups, grain_for(16.0 * K * 0.3), [&](int64_t g0, int64_t g1) {
        amx16_pack_x(xp, M, K, pk, g0, g1);
    });
    constexpr int64_t unit = 64;
    const int64_t units = (N + unit - 1) / unit;
    const double unit_ns = unit * (K * 2 / 15.0 + K * static_cast<double>(groups) * 0.02);
    parallel_range(units, grain_for(unit_ns), [&](int64_t u0, int64_t u1) {
        void* s = scratch(kAmx16ScratchBytes / 4);
        amx16_linear_rows(static_cast<int>(qtype), pk, M, K, wp, bias, yp, N, u0 * unit, std::min(u1 * unit, N), s);
    });
    return y;
}
#endif

torch::Tensor linear_half(const torch::Tensor& x_in, const torch::Tensor& w, int64_t qtype, int64_t N, int64_t K,
                          const float* bias) {
    const auto want = qtype == QT_F16 ? torch::kHalf : torch::kBFloat16;
    TORCH_CHECK(w.scalar_type() == want && w.numel() == N * K, "specdec native linear: ",
                qtype == QT_F16 ? "f16" : "bf16", " weight must be ", want, " [", N, ", ", K, "]");
    torch::Tensor x = x_in.contiguous();
    const int64_t M = x.size(0);
    auto y = torch::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;
    const float* xp = x.data_ptr<float>();
    const uint16_t* wp = static_cast<const uint16_t*>(w.data_ptr());
    float* yp = y.data_ptr<float>();
    const KernelTable* tab = g_table;
    // Few rows: units of 24 weight rows; many: one widened block (kernels_bf16.cpp) per unit.
    const int64_t unit = M <= 8 ? 24 : std::max<int64_t>(4, kHalfScratchFloats / K / 4 * 4);
    const int64_t units = (N + unit - 1) / unit;
    const double row_ns = K * 2 / 15.0 + K * static_cast<double>(M) * 0.01;
    parallel_range(units, grain_for(unit * row_ns), [&](int64_t u0, int64_t u1) {
        float* s = scratch(std::max<int64_t>(kHalfScratchFloats, kMaxScratchRows * K));
        half_linear_rows(tab, static_cast<int>(qtype), xp, M, K, wp, bias, yp, N, u0 * unit,
                         std::min(u1 * unit, N), s);
    });
    return y;
}

}  // namespace

// A uint8 tensor of n bytes for a weight that is streamed whole at every step: a mapping of its own,
// 2 MiB aligned, whose whole 2 MiB chunks are advised to use transparent huge pages (far fewer
// TLB misses while streaming; the tail keeps 4 KiB pages, so nothing is wasted).  Released with
// the tensor; torch's allocator when the mapping fails.
torch::Tensor weight_bytes(int64_t n) {
    constexpr size_t kHuge = size_t(2) << 20, kPage = 4096;
    const size_t len = (static_cast<size_t>(n) + kPage - 1) / kPage * kPage;
    if (len >= kHuge) {
        void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw != MAP_FAILED) {
            const uintptr_t base = reinterpret_cast<uintptr_t>(raw), end = base + len + kHuge;
            const uintptr_t start = (base + kHuge - 1) / kHuge * kHuge;
            if (start > base) munmap(raw, start - base);
            if (end > start + len) munmap(reinterpret_cast<void*>(start + len), end - (start + len));
            void* p = reinterpret_cast<void*>(start);
            madvise(p, len / kHuge * kHuge, MADV_HUGEPAGE);
            return torch::from_blob(
                p, {n}, [len](void* q) { munmap(q, len); }, torch::dtype(torch::kUInt8));
        }
    }
    return torch::empty({n}, torch::dtype(torch::kUInt8));
}

// n bytes of the file at path from offset, read into a weight_bytes tensor (huge pages), in 8 MiB
// pieces across the pool.  NOTE: the weight cache's file mapped in place has 4 KiB pages, which
// made a 1.7B Q4_0 step 1.03-1.09x slower than the same tiles in huge pages (2-core AVX2 EPYC,
// 2026-11-28; BENCHMARKS.md, Memory).
torch::Tensor weight_from_file(const std::string& path, int64_t offset, int64_t n) {
    TORCH_CHECK(offset >= 0 && n >= 0, "specdec weight_from_file: negative offset or size");
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TORCH_CHECK(fd >= 0, "specdec weight_from_file: cannot open ", path);
    torch::Tensor out = weight_bytes(n);
    uint8_t* dst = out.data_ptr<uint8_t>();
    constexpr int64_t kPiece = int64_t(8) << 20;
    std::atomic<bool> short_read{false};
    parallel_range((n + kPiece - 1) / kPiece, 1, [&](int64_t p0, int64_t p1) {
        for (int64_t p = p0; p < p1 && !short_read; ++p) {
            int64_t at = p * kPiece;
            const int64_t end = std::min(n, at + kPiece);
            while (at < end) {
                const ssize_t got = pread(fd, dst + at, static_cast<size_t>(end - at), offset + at);
                if (got <= 0) {
                    short_read = true;
                    break;
                }
                at += got;
            }
        }
    });
    close(fd);
    TORCH_CHECK(!short_read, "specdec weight_from_file: ", path, " ended before byte ", offset + n);
    return out;
}

// The bytes of several CPU uint8 tensors, one after the other, in a weight_bytes tensor.
torch::Tensor weight_cat(const std::vector<torch::Tensor>& parts) {
    int64_t n = 0;
    for (const torch::Tensor& t : parts) {
        TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kUInt8, "specdec weight_cat: CPU uint8 tensors");
        n += t.numel();
    }
    torch::Tensor out = weight_bytes(n);
    uint8_t* dst = out.data_ptr<uint8_t>();
    for (const torch::Tensor& t : parts) {
        const torch::Tensor c = t.contiguous();
        std::memcpy(dst, c.data_ptr<uint8_t>(), static_cast<size_t>(c.numel()));
        dst += c.numel();
    }
    return out;
}

// One GGUF K-quant weight [N, K] into its tiles at dst (checked), both cores.
static void repack_kq_into(torch::Tensor w, int64_t fmt, int64_t N, int64_t K, uint8_t* dst) {
    TORCH_CHECK(kq_format_ok(fmt), "specdec repack_kq: format must be q4_k, q5_k or q6_k, got ", fmt);
    TORCH_CHECK(K > 0 && K % kKqBlock == 0 && N % kKqTileRows == 0,
                "specdec repack_kq: need K % 256 == 0 and N % 16 == 0, got N=", N, " K=", K);
    const int64_t row_bytes = K / kKqBlock * kq_gguf_block_bytes(static_cast<int>(fmt));
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.numel() == N * row_bytes,
                "specdec repack_kq: weight must be CPU uint8 GGUF blocks [", N, ", ", row_bytes, "]");
    w = w.contiguous();
    const int64_t group_bytes = K / kKqBlock * kq_tile_bytes(static_cast<int>(fmt));
    const uint8_t* src = w.data_ptr<uint8_t>();
    parallel_range(N / kKqTileRows, grain_for(kKqTileRows * K * 2.0), [&](int64_t g0, int64_t g1) {
        kq_repack(static_cast<int>(fmt), src + g0 * kKqTileRows * row_bytes, (g1 - g0) * kKqTileRows, K,
                  dst + g0 * group_bytes);
    });
}

torch::Tensor repack_kq(torch::Tensor w, int64_t fmt, int64_t N, int64_t K) {
    TORCH_CHECK(kq_format_ok(fmt) && K % kKqBlock == 0, "specdec repack_kq: bad format or K");
    auto out = weight_bytes(N / kKqTileRows * (K / kKqBlock * kq_tile_bytes(static_cast<int>(fmt))));
    repack_kq_into(w, fmt, N, K, out.data_ptr<uint8_t>());
    return out;
}

// Several K-quant weights with one K (fused q|k|v, gate|up), repacked one after the other into
// one buffer: the same bytes as weight_cat over repack_kq, without the second copy.
torch::Tensor repack_kq_cat(const std::vector<torch::Tensor>& ws, const std::vector<int64_t>& fmts,
                            const std::vector<int64_t>& Ns, int64_t K) {
    TORCH_CHECK(ws.size() == fmts.size() && ws.size() == Ns.size() && !ws.empty(),
                "specdec repack_kq_cat: one format and row count per weight");
    int64_t total = 0;
    for (size_t i = 0; i < ws.size(); ++i) {
        TORCH_CHECK(kq_format_ok(fmts[i]) && K % kKqBlock == 0 && Ns[i] % kKqTileRows == 0,
                    "specdec repack_kq_cat: bad format, K or N");
        total += Ns[i] / kKqTileRows * (K / kKqBlock * kq_tile_bytes(static_cast<int>(fmts[i])));
    }
    auto out = weight_bytes(total);
    uint8_t* dst = out.data_ptr<uint8_t>();
    for (size_t i = 0; i < ws.size(); ++i) {
        repack_kq_into(ws[i], fmts[i], Ns[i], K, dst);
        dst += Ns[i] / kKqTileRows * (K / kKqBlock * kq_tile_bytes(static_cast<int>(fmts[i])));
    }
    return out;
}

// Row indices as a flat int64 tensor, each checked to lie in [0, N).
torch::Tensor checked_rows(const torch::Tensor& rows, int64_t N, const char* op) {
    torch::Tensor idx = rows.to(torch::kLong).contiguous().reshape({-1});
    const int64_t* ip = idx.data_ptr<int64_t>();
    for (int64_t i = 0; i < idx.numel(); ++i)
        TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "specdec ", op, ": row ", ip[i], " out of range [0, ", N, ")");
    return idx;
}

torch::Tensor dequantize_kq(torch::Tensor w, const std::vector<int64_t>& part_list, int64_t N, int64_t K,
                            c10::optional<torch::Tensor> rows) {
    const std::vector<KqPart> parts = kq_parts(part_list, w, N, K, "dequantize_kq");
    const uint8_t* wp = w.data_ptr<uint8_t>();
    auto part_of = [&](int64_t n) -> const KqPart& {
        for (const KqPart& p : parts)
            if (n < p.row0 + p.rows) return p;
        return parts.back();
    };
    if (!rows.has_value() || !rows->defined()) {
        auto out = torch::empty({N, K}, torch::dtype(torch::kFloat32));
        float* op = out.data_ptr<float>();
        parallel_range(N / kKqTileRows, grain_for(kKqTileRows * K * 0.5), [&](int64_t g0, int64_t g1) {
            for_part_groups(parts, g0, g1, [&](const KqPart& p, int64_t a, int64_t b) {
                kq_decode_rows(p.fmt, wp + p.offset, K, a * kKqTileRows, b * kKqTileRows,
                               op + (p.row0 + a * kKqTileRows) * K);
            });
        });
        return out;
    }
    const torch::Tensor idx = checked_rows(*rows, N, "dequantize_kq");
    const int64_t R = idx.numel();
    const int64_t* ip = idx.data_ptr<int64_t>();
    auto out = torch::empty({R, K}, torch::dtype(torch::kFloat32));
    float* op = out.data_ptr<float>();
    parallel_range(R, grain_for(K * 0.5), [&](int64_t r0, int64_t r1) {
        for (int64_t i = r0; i < r1; ++i) {
            const KqPart& p = part_of(ip[i]);
            kq_decode_rows(p.fmt, wp + p.offset, K, ip[i] - p.row0, ip[i] - p.row0 + 1, op + i * K);
        }
    });
    return out;
}

// Tile layout (kernels_vnni.cpp): per 16 rows x 32 inputs, the rows' f16 scales d at 2 j, Q4_1's
// f16 minimums m at 32 + 2 j, then the codes from h = a8_head_bytes (32; Q4_1: 64): quad t of row j
// at h + t * 64 + 4 j (Q8_0: q + 128);
// Q4: byte (c, j, i) = the GGUF byte qs[4 c + i] of row j (low nibble: element 4 c + i, high:
// element 16 + 4 c + i).  A lossless rearrangement, so unpack_a8 gives back the GGUF blocks.

// Group g (16 rows) of a8 tiles from the GGUF block rows row(j) (j = 0..15).
template <typename RowFn>
void repack_a8_group(int64_t qtype, int64_t nb, RowFn&& row, uint8_t* dst) {
    const int64_t bb = block_bytes(qtype), TB = a8_tile_bytes(static_cast<int>(qtype));
    const int64_t h = a8_head_bytes(static_cast<int>(qtype));
    for (int64_t b = 0; b < nb; ++b) {
        uint8_t* tile = dst + b * TB;
        std::memset(tile, 0, static_cast<size_t>(TB));
        for (int64_t j = 0; j < kA8TileRows; ++j) {
            const uint8_t* blk = row(j) + b * bb;
            std::memcpy(tile + 2 * j, blk, 2);  // d (f16 bits)
            if (qtype == QT_Q8_0) {
                for (int t = 0; t < 8; ++t)
                    for (int i = 0; i < 4; ++i)
                        tile[h + t * 64 + j * 4 + i] = static_cast<uint8_t>(blk[2 + 4 * t + i] ^ 0x80);
            } else {
                if (qtype == QT_Q4_1) std::memcpy(tile + 32 + 2 * j, blk + 2, 2);  // m (f16 bits)
                const uint8_t* qs = blk + (qtype == QT_Q4_1 ? 4 : 2);
                for (int c = 0; c < 4; ++c) std::memcpy(tile + h + c * 64 + j * 4, qs + 4 * c, 4);
            }
        }
    }
}

// GGUF block rows of several weights, one after the other (q|k|v, gate|up), repacked straight into
// one a8 buffer: no concatenated copy of the blocks is made.
torch::Tensor repack_a8_cat(const std::vector<torch::Tensor>& ws, int64_t qtype, const std::vector<int64_t>& Ns,
                            int64_t K) {
    TORCH_CHECK(a8_kind_ok(qtype), "specdec repack_a8: qtype must be q8_0, q4_0 or q4_1, got ", qtype);
    TORCH_CHECK(!ws.empty() && ws.size() == Ns.size(), "specdec repack_a8: one row count per weight");
    const int64_t bb = block_bytes(qtype), nb = K / 32, row_bytes = nb * bb;
    std::vector<const uint8_t*> rows;
    std::vector<torch::Tensor> keep;
    for (size_t i = 0; i < ws.size(); ++i) {
        torch::Tensor w = ws[i].contiguous();
        TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.numel() == Ns[i] * row_bytes,
                    "specdec repack_a8: weight must be CPU uint8 [", Ns[i], ", ", row_bytes, "]");
        const uint8_t* p = w.data_ptr<uint8_t>();
        for (int64_t r = 0; r < Ns[i]; ++r) rows.push_back(p + r * row_bytes);
        keep.push_back(w);
    }
    const int64_t N = static_cast<int64_t>(rows.size());
    TORCH_CHECK(K % 32 == 0 && N % kA8TileRows == 0, "specdec repack_a8: need K % 32 == 0 and N % 16 == 0, got N=",
                N, " K=", K);
    const int64_t group_bytes = nb * a8_tile_bytes(static_cast<int>(qtype));
    auto out = weight_bytes(N * a8_row_bytes(qtype, K)).view({N, a8_row_bytes(qtype, K)});
    uint8_t* dst = out.data_ptr<uint8_t>();
    parallel_range(N / kA8TileRows, grain_for(static_cast<double>(group_bytes)), [&](int64_t g0, int64_t g1) {
        for (int64_t g = g0; g < g1; ++g)
            repack_a8_group(qtype, nb, [&](int64_t j) { return rows[g * kA8TileRows + j]; }, dst + g * group_bytes);
    });
    return out;
}

torch::Tensor repack_a8(torch::Tensor w, int64_t qtype, int64_t N, int64_t K) {
    return repack_a8_cat({w}, qtype, {N}, K);
}

// 16-bit weights [N, K] as the tiles of kernels_amx16.cpp (bf16x2 activations): per 16 weight rows
// and 32 inputs one 1 KiB tile of 16 rows x 32 elements, blocks along K, then the next 16 rows;
// rows past N and inputs past K are zeros.  The same values rearranged (unpack_x2 inverts it).
torch::Tensor repack_x2(torch::Tensor w, int64_t N, int64_t K) {
    TORCH_CHECK(w.device().is_cpu() && (w.scalar_type() == torch::kHalf || w.scalar_type() == torch::kBFloat16) &&
                    w.numel() == N * K,
                "specdec repack_x2: weight must be a CPU float16 / bfloat16 [", N, ", ", K, "]");
    torch::Tensor src_t = w.contiguous();
    const uint16_t* src = static_cast<const uint16_t*>(src_t.data_ptr());
    const int64_t nb = (K + 31) / 32, ntiles = (N + 15) / 16;
    torch::Tensor out = weight_bytes(amx16_weight_bytes(N, K));
    uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<uint8_t>());
    parallel_range(ntiles, grain_for(16.0 * K * 0.2), [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
            for (int64_t r = 0; r < 16; ++r) {
                const int64_t n = t * 16 + r;
                for (int64_t b = 0; b < nb; ++b) {
                    uint16_t* d = dst + ((t * nb + b) * 16 + r) * 32;
                    const int64_t kn = n < N ? std::min<int64_t>(32, K - b * 32) : 0;
                    if (kn > 0) std::memcpy(d, src + n * K + b * 32, static_cast<size_t>(kn) * 2);
                    if (kn < 32) std::memset(d + kn, 0, static_cast<size_t>(32 - kn) * 2);
                }
            }
    });
    return out;
}

// The [N, K] rows (all, or the given ones) back from repack_x2's tiles, as float16 (qtype
// QT_F16) or bfloat16.
torch::Tensor unpack_x2(torch::Tensor tiles, int64_t qtype, int64_t N, int64_t K, c10::optional<torch::Tensor> rows) {
    TORCH_CHECK(qtype == QT_F16 || qtype == QT_BF16, "specdec unpack_x2: qtype must be f16 or bf16, got ", qtype);
    TORCH_CHECK(tiles.device().is_cpu() && tiles.scalar_type() == torch::kUInt8 && tiles.is_contiguous() &&
                    tiles.numel() == amx16_weight_bytes(N, K),
                "specdec unpack_x2: tiles must be contiguous CPU uint8 with ", amx16_weight_bytes(N, K), " bytes");
    const bool all = !rows.has_value() || !rows->defined();
    const torch::Tensor idx = all ? torch::Tensor() : checked_rows(*rows, N, "unpack_x2");
    const int64_t R = all ? N : idx.numel(), nb = (K + 31) / 32;
    const int64_t* ip = all ? nullptr : idx.data_ptr<int64_t>();
    auto out = torch::empty({R, K}, torch::dtype(qtype == QT_F16 ? torch::kHalf : torch::kBFloat16));
    const uint16_t* src = reinterpret_cast<const uint16_t*>(tiles.data_ptr<uint8_t>());
    uint16_t* dst = static_cast<uint16_t*>(out.data_ptr());
    parallel_range(R, grain_for(static_cast<double>(K) * 0.5), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t n = ip ? ip[r] : r, t = n / 16, j = n % 16;
            for (int64_t b = 0; b < nb; ++b)
                std::memcpy(dst + r * K + b * 32, src + ((t * nb + b) * 16 + j) * 32,
                            static_cast<size_t>(std::min<int64_t>(32, K - b * 32)) * 2);
        }
    });
    return out;
}

// GGUF block rows [R, K / 32 * block bytes] (q8_0, q4_0 or q4_1) -> float32 [R, K], bit-exact with
// the Python reference (kernels/__init__.py _dequantize).  One embedding row a decode step through
// torch took ~10 small ops (~0.3 ms); this takes microseconds.
torch::Tensor dequantize_blocks(torch::Tensor blocks, int64_t qtype, int64_t K) {
    TORCH_CHECK(a8_kind_ok(qtype), "specdec dequantize_blocks: qtype must be q8_0, q4_0 or q4_1, got ", qtype);
    TORCH_CHECK(K > 0 && K % 32 == 0, "specdec dequantize_blocks: K must be a positive multiple of 32");
    const int64_t row_bytes = K / 32 * block_bytes(qtype);
    TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() &&
                    blocks.numel() % row_bytes == 0,
                "specdec dequantize_blocks: blocks must be contiguous CPU uint8 rows of ", row_bytes, " bytes");
    const int64_t R = blocks.numel() / row_bytes;
    auto out = torch::empty({R, K}, torch::dtype(torch::kFloat32));
    const uint8_t* src = blocks.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r) gguf_decode_row(static_cast<int>(qtype), src + r * row_bytes, K, dst + r * K);
    return out;
}

// The GGUF block rows (all, or the given ones) back from a8 tiles: repack_a8's exact inverse.
torch::Tensor unpack_a8(torch::Tensor a8, int64_t qtype, int64_t N, int64_t K, c10::optional<torch::Tensor> rows) {
    TORCH_CHECK(a8_kind_ok(qtype), "specdec unpack_a8: qtype must be q8_0, q4_0 or q4_1, got ", qtype);
    TORCH_CHECK(K % 32 == 0 && N % kA8TileRows == 0, "specdec unpack_a8: need K % 32 == 0 and N % 16 == 0");
    TORCH_CHECK(a8.device().is_cpu() && a8.scalar_type() == torch::kUInt8 && a8.is_contiguous() &&
                    a8.numel() == N * a8_row_bytes(qtype, K),
                "specdec unpack_a8: tiles must be contiguous CPU uint8 with ", N * a8_row_bytes(qtype, K), " bytes");
    const int64_t bb = block_bytes(qtype), nb = K / 32, row_bytes = nb * bb;
    const int64_t TB = a8_tile_bytes(static_cast<int>(qtype)), h = a8_head_bytes(static_cast<int>(qtype));
    const bool all = !rows.has_value() || !rows->defined();
    const torch::Tensor idx = all ? torch::Tensor() : checked_rows(*rows, N, "unpack_a8");
    const int64_t R = all ? N : idx.numel();
    const int64_t* ip = all ? nullptr : idx.data_ptr<int64_t>();
    auto out = torch::empty({R, row_bytes}, torch::dtype(torch::kUInt8));
    const uint8_t* src = a8.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    parallel_range(R, grain_for(static_cast<double>(row_bytes)), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t n = ip ? ip[r] : r, g = n / kA8TileRows, j = n % kA8TileRows;
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t* tile = src + (g * nb + b) * TB;
                uint8_t* blk = dst + r * row_bytes + b * bb;
                std::memcpy(blk, tile + 2 * j, 2);
                if (qtype == QT_Q8_0) {
                    for (int t = 0; t < 8; ++t)
                        for (int i = 0; i < 4; ++i)
                            blk[2 + 4 * t + i] = static_cast<uint8_t>(tile[h + t * 64 + j * 4 + i] ^ 0x80);
                } else {
                    if (qtype == QT_Q4_1) std::memcpy(blk + 2, tile + 32 + 2 * j, 2);
                    uint8_t* qs = blk + (qtype == QT_Q4_1 ? 4 : 2);
                    for (int c = 0; c < 4; ++c) std::memcpy(qs + 4 * c, tile + h + c * 64 + j * 4, 4);
                }
            }
        }
    });
    return out;
}

void parallel_tasks(int64_t n, const std::function<void(int64_t)>& fn) {
    std::exception_ptr failed;
    std::mutex mu;
    parallel_range(n, 1, [&](int64_t a, int64_t b) {
        WorkerPool::InlineScope scope;
        for (int64_t i = a; i < b; ++i) {
            try {
                fn(i);
            } catch (...) {
                std::lock_guard<std::mutex> lk(mu);
                if (!failed) failed = std::current_exception();
            }
        }
    });
    if (failed) std::rethrow_exception(failed);
}

namespace {
torch::Tensor linear_any(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t N, int64_t K,
                         c10::optional<torch::Tensor> bias, const std::vector<int64_t>& parts);
}  // namespace

torch::Tensor linear(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t N, int64_t K,
                     c10::optional<torch::Tensor> bias, const std::vector<int64_t>& parts) {
    Timeline::mark(kMarkLinear, static_cast<double>(w.nbytes()));
    torch::Tensor y = linear_any(std::move(x), std::move(w), qtype, N, K, std::move(bias), parts);
    Timeline::mark(kMarkLinearEnd);
    return y;
}

namespace {
torch::Tensor linear_any(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t N, int64_t K,
                         c10::optional<torch::Tensor> bias, const std::vector<int64_t>& parts) {
    check_float_cpu(x, "linear x");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "specdec native linear: x must be [M, ", K, "], got ",
                x.sizes());
    TORCH_CHECK(w.device().is_cpu() && w.is_contiguous(), "specdec native linear: weight must be contiguous on CPU");
    const float* bias_ptr = nullptr;
    torch::Tensor b;
    if (bias.has_value() && bias->defined()) {
        b = bias->contiguous();
        check_float_cpu(b, "linear bias");
        TORCH_CHECK(b.numel() == N, "specdec native linear: bias must have ", N, " elements");
        bias_ptr = b.data_ptr<float>();
    }
    if (qtype == QT_KQUANT || qtype == kA8QtypeBase + QT_KQUANT)
        return linear_kq(x, w, parts, N, K, bias_ptr, qtype != QT_KQUANT);
    if (qtype >= kA8QtypeBase) return linear_a8(x, w, qtype - kA8QtypeBase, N, K, bias_ptr);
    if (qtype == QT_F16 || qtype == QT_BF16) return linear_half(x, w, qtype, N, K, bias_ptr);
    if (qtype == QT_F16_X2 || qtype == QT_BF16_X2) {
#ifdef SPECDEC_HAVE_AMX16
        return linear_half_x2(x, w, qtype == QT_F16_X2 ? QT_F16 : QT_BF16, N, K, bias_ptr);
#else
        TORCH_CHECK(false, "specdec native linear: built without the AMX-BF16 unit (bf16x2 activations)");
#endif
    }
    int64_t row_bytes;
    if (qtype == QT_F32) {
        TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.numel() == N * K,
                    "specdec native linear: f32 weight must be float32 [N, K]");
        row_bytes = K * 4;
    } else {
        const int64_t bb = block_bytes(qtype);
        TORCH_CHECK(bb > 0, "specdec native linear: unknown qtype ", qtype);
        TORCH_CHECK(K % 32 == 0, "specdec native linear: quantized K must be a multiple of 32");
        row_bytes = K / 32 * bb;
        TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.numel() == N * row_bytes,
                    "specdec native linear: quantized weight must be uint8 [N, ", row_bytes, "]");
    }
    x = x.contiguous();
    const int64_t M = x.size(0);
    auto y = torch::empty({M, N}, x.options());
    if (M == 0 || N == 0) return y;
    const float* xp = x.data_ptr<float>();
    const uint8_t* wp = static_cast<const uint8_t*>(w.data_ptr());
    float* yp = y.data_ptr<float>();
    const KernelTable* tab = g_table;
    constexpr int64_t kUnit = 24;  // rows per scheduling unit (a multiple of every tile width)
    const int64_t units = (N + kUnit - 1) / kUnit;
    // Per weight row: stream its bytes (~15 GB/s per core), decode its blocks, run the FMAs.
    const double decode_ns = qtype == QT_F32 ? 0.0 : qtype == QT_Q8_0 ? 0.6 : 1.0;
    const double row_ns = row_bytes / 15.0 + (K / 32) * decode_ns +
                          K * static_cast<double>(std::min<int64_t>(M, kChunkRows) - 1) * 0.02;
    const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
    const int64_t grain = grain_for(kUnit * row_ns * chunks);
    parallel_range(units, grain, [&](int64_t u0, int64_t u1) {
        float* s = qtype == QT_F32 ? nullptr : scratch(kMaxScratchRows * K);
        tab->linear_rows(static_cast<int>(qtype), xp, M, K, wp, row_bytes, bias_ptr, yp, N,
                         u0 * kUnit, std::min(u1 * kUnit, N), s);
    });
    return y;
}
}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
    check_float_cpu(x, "rms_norm x");
    check_float_cpu(weight, "rms_norm weight");
    const int64_t K = x.size(-1);
    TORCH_CHECK(weight.numel() == K, "specdec native rms_norm: weight must have ", K, " elements");
    x = x.contiguous();
    weight = weight.contiguous();
    auto y = torch::empty_like(x);
    const int64_t M = K ? x.numel() / K : 0;
    if (M == 0) return y;
    const float* xp = x.data_ptr<float>();
    const float* wp = weight.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const KernelTable* tab = g_table;
    const int64_t grain = grain_for(K * 0.3);
    const float feps = static_cast<float>(eps);
    parallel_range(M, grain, [&](int64_t m0, int64_t m1) {
        tab->rms_norm_rows(xp, wp, yp, K, feps, m0, m1);
    });
    return y;
}

namespace {
// out[r] = the index of row r's first maximum, for the R rows of x [R, V] (float32, contiguous).
void argmax_into(const torch::Tensor& x, int64_t* out) {
    const int64_t R = x.size(0), V = x.size(1);
    const float* xp = x.data_ptr<float>();
    const KernelTable* tab = g_table;
    parallel_range(R, grain_for(V * 0.05), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) out[r] = tab->argmax(xp + r * V, V);
    });
}
}  // namespace

torch::Tensor argmax_rows(torch::Tensor x) {
    check_float_cpu(x, "argmax x");
    TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "specdec native argmax: x must be [R, V] with V > 0");
    x = x.contiguous();
    auto out = torch::empty({x.size(0)}, torch::dtype(torch::kLong));
    argmax_into(x, out.data_ptr<int64_t>());
    return out;
}

// Each row's first maximum as a list, and whether every row's maximum is finite (a row of NaNs
// or one holding +inf has no usable argmax): a greedy step's one call, without a tensor of
// indices to read back and a read of each chosen logit.
std::tuple<std::vector<int64_t>, bool> argmax_finite(torch::Tensor x) {
    check_float_cpu(x, "argmax x");
    TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "specdec native argmax: x must be [R, V] with V > 0");
    x = x.contiguous();
    const int64_t R = x.size(0), V = x.size(1);
    std::vector<int64_t> best(static_cast<size_t>(R));
    argmax_into(x, best.data());
    const float* xp = x.data_ptr<float>();
    bool finite = true;
    for (int64_t r = 0; r < R; ++r) finite = finite && std::isfinite(xp[r * V + best[r]]);
    return {std::move(best), finite};
}

namespace {

// Up to kAttnRows consecutive query rows of one sequence and one kv head, against key blocks
// [b0, b1); its partials start at part (floats) in the call's buffer.
// Blocks [0, nb) come from slot `base` instead: a prefix another sequence's slot holds (see
// attention_seqs).
struct AttnUnit {
    int64_t row0, rows, slot, hk, b0, b1, part;
    int64_t base, nb;
    int64_t slot_of(int64_t b) const { return b < nb ? base : slot; }
};

// One work item: a unit and one of its key blocks.
struct AttnItem {
    int64_t unit, block;
};

// One work item of a shared prefix: block `block` of slot `base` for the rows of units
// members[first, first + count) (whole units, kAttnRows rows at most), one pass for all of them.
struct AttnGroupItem {
    int64_t base, block, first, count, rows;
};

// The units of a call: each sequence's rows in groups of at most unit_rows (kAttnRows or fewer,
// as even as possible), times the kv heads; their items in unit order.  Returns the floats of
// partials they need (record_floats per row a block).  prefix_slots / prefix_lens: as
// attention_seqs takes them (empty: none).
int64_t attention_units(const std::vector<int64_t>& slots, const std::vector<int64_t>& counts,
                        const std::vector<int64_t>& prefix_slots, const std::vector<int64_t>& prefix_lens,
                        const std::vector<int64_t>& row_lo, const std::vector<int64_t>& row_hi, int64_t Hkv,
                        int64_t record_floats, int64_t unit_rows, std::vector<AttnUnit>* units,
                        std::vector<AttnItem>* items) {
    int64_t part = 0, row = 0;
    for (size_t s = 0; s < slots.size(); ++s) {
        const int64_t nu = (counts[s] + unit_rows - 1) / unit_rows;
        for (int64_t i = 0, r0 = 0; i < nu; ++i) {
            const int64_t rows = (counts[s] - r0) / (nu - i);
            const int64_t row0 = row + r0;
            r0 += rows;
            int64_t lo = row_lo[row0], hi = row_hi[row0];
            for (int64_t r = row0; r < row0 + rows; ++r) {
                lo = std::min(lo, row_lo[r]);
                hi = std::max(hi, row_hi[r]);
            }
            const int64_t b0 = lo / kAttnBlock, b1 = hi / kAttnBlock + 1;
            const int64_t nb = prefix_lens.empty() ? 0 : prefix_lens[s] / kAttnBlock;
            const int64_t base = nb > 0 ? prefix_slots[s] : slots[s];
            for (int64_t hk = 0; hk < Hkv; ++hk) {
                for (int64_t b = b0; b < b1; ++b) items->push_back({static_cast<int64_t>(units->size()), b});
                units->push_back({row0, rows, slots[s], hk, b0, b1, part, base, nb});
                part += ((b1 - b0) * rows * record_floats + 15) / 16 * 16;  // own cache lines
            }
        }
        row += counts[s];
    }
    return part;
}

// Shared prefixes: where units of two or more sequences read the same prefix slot, each of its
// blocks is one pass over the units' rows together (whole units, up to kAttnRows rows a pass),
// and those units' own items keep only their blocks past the prefix.  Every row's records are
// those it would get alone (a row's partial depends on its query, its range and the block only).
void attention_groups(const std::vector<AttnUnit>& units, std::vector<AttnItem>* items,
                      std::vector<int64_t>* members, std::vector<AttnGroupItem>* groups) {
    // (prefix slot, kv head) -> its units in unit order, and whether two sequences read it
    std::map<std::pair<int64_t, int64_t>, std::vector<int64_t>> readers;
    for (size_t u = 0; u < units.size(); ++u)
        if (units[u].nb > 0) readers[{units[u].base, units[u].hk}].push_back(static_cast<int64_t>(u));
    std::vector<char> grouped(units.size(), 0);
    for (const auto& [key, same] : readers) {
        const int64_t slot0 = units[static_cast<size_t>(same[0])].slot;
        bool two = false;
        int64_t nb = 0;
        for (int64_t v : same) {
            two = two || units[static_cast<size_t>(v)].slot != slot0;
            nb = std::max(nb, units[static_cast<size_t>(v)].nb);
        }
        if (!two) continue;
        for (int64_t v : same) grouped[static_cast<size_t>(v)] = 1;
        for (int64_t b = 0; b < nb; ++b) {
            AttnGroupItem g{key.first, b, static_cast<int64_t>(members->size()), 0, 0};
            for (int64_t v : same) {
                const AttnUnit& a = units[static_cast<size_t>(v)];
                if (b >= a.nb || b < a.b0) continue;  // past its prefix, or before its window
                if (g.rows + a.rows > kAttnRows) {
                    groups->push_back(g);
                    g = AttnGroupItem{key.first, b, static_cast<int64_t>(members->size()), 0, 0};
                }
                members->push_back(v);
                g.count += 1;
                g.rows += a.rows;
            }
            if (g.count > 0) groups->push_back(g);
        }
    }
    // the grouped units' own items: their blocks past the prefix
    std::vector<AttnItem> own;
    own.reserve(items->size());
    for (const AttnItem& it : *items) {
        const AttnUnit& a = units[static_cast<size_t>(it.unit)];
        if (!grouped[static_cast<size_t>(it.unit)] || it.block >= a.nb) own.push_back(it);
    }
    items->swap(own);
}

}  // namespace

// Flash-decoding over every sequence at once (kernels.h, AttnRows): units of up to kAttnRows rows
// of a sequence and one kv head, each against its key blocks of kAttnBlock positions, so the rows
// of a verification step read each K / V block once.  Merges run in block order whoever computed
// the blocks: the split (whole units or single blocks per task) changes no result.
//
// Shared prefixes (kv_cache/pool.py): sequence s reads its positions [0, prefix_lens[s]) (a
// multiple of kAttnBlock, at most starts[s]) from slot prefix_slots[s], where another request's
// KV holds them, and the rest from slots[s].  Sequences reading the same prefix slot read each of
// its blocks once, together (attention_groups).  Empty vectors, or a length of 0: no prefix.
torch::Tensor attention_seqs(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                             const std::vector<int64_t>& slots, const std::vector<int64_t>& starts,
                             const std::vector<int64_t>& counts, double scale, int64_t sliding_window,
                             double softcap, const std::vector<int64_t>& prefix_slots,
                             const std::vector<int64_t>& prefix_lens) {
    check_float_cpu(q, "attention q");
    TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(),
                "specdec native attention: the KV cache must be on the CPU");
    const bool half = k_cache.scalar_type() == torch::kHalf, q8 = k_cache.scalar_type() == torch::kInt8;
    TORCH_CHECK((half || q8 || k_cache.scalar_type() == torch::kFloat32) &&
                    v_cache.scalar_type() == k_cache.scalar_type(),
                "specdec native attention: k_cache and v_cache must both be float32, both float16 or both int8, "
                "got ",
                k_cache.scalar_type(), " and ", v_cache.scalar_type());
    const int64_t T = q.dim() == 3 ? q.size(0) : 0, H = q.dim() == 3 ? q.size(1) : 0, D = q.dim() == 3 ? q.size(2) : 0;
    if (q8) {
        // kernels.h kQ8Header: [S, Hkv, L / kKeyBlock, q8_block_bytes(D)] bytes, keys and values alike
        TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                        k_cache.size(3) == q8_block_bytes(D),
                    "specdec native attention: q [T, H, D], an int8 cache's k_cache and v_cache [S, Hkv, L / ",
                    kKeyBlock, ", ", kQ8Header, " + ", kKeyBlock, " D], got q ", q.sizes(), " k ", k_cache.sizes(),
                    " v ", v_cache.sizes());
    } else {
        TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 5 && v_cache.dim() == 4,
                    "specdec native attention: q [T, H, D], k_cache [S, Hkv, L / ", kKeyBlock, ", D, ", kKeyBlock,
                    "] (blocked), v_cache [S, Hkv, L, D]");
        TORCH_CHECK(v_cache.size(3) == D && k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                        k_cache.size(2) * kKeyBlock >= v_cache.size(2) && k_cache.size(3) == D &&
                        k_cache.size(4) == kKeyBlock,
                    "specdec native attention: shape mismatch q ", q.sizes(), " k ", k_cache.sizes(), " v ",
                    v_cache.sizes());
    }
    const int64_t S = v_cache.size(0), Hkv = v_cache.size(1), L = q8 ? v_cache.size(2) * kKeyBlock : v_cache.size(2);
    TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "specdec native attention: H (", H, ") not a multiple of Hkv (", Hkv, ")");
    TORCH_CHECK(slots.size() == starts.size() && slots.size() == counts.size(),
                "specdec native attention: slots, starts and counts differ in length");
    TORCH_CHECK(prefix_slots.size() == prefix_lens.size() && (prefix_lens.empty() || prefix_lens.size() == slots.size()),
                "specdec native attention: prefix_slots and prefix_lens must be empty or one per sequence");
    for (size_t s = 0; s < prefix_lens.size(); ++s) {
        TORCH_CHECK(prefix_lens[s] >= 0 && prefix_lens[s] % kAttnBlock == 0 && prefix_lens[s] <= starts[s],
                    "specdec native attention: a prefix length must be a multiple of ", kAttnBlock,
                    " no longer than the sequence's start, got ", prefix_lens[s]);
        TORCH_CHECK(prefix_lens[s] == 0 || (prefix_slots[s] >= 0 && prefix_slots[s] < S),
                    "specdec native attention: prefix slot out of range");
    }
    // Per row: the first and last key it sees.
    std::vector<int64_t> row_lo, row_hi;
    row_lo.reserve(static_cast<size_t>(T));
    row_hi.reserve(static_cast<size_t>(T));
    for (size_t s = 0; s < slots.size(); ++s) {
        TORCH_CHECK(slots[s] >= 0 && slots[s] < S, "specdec native attention: slot out of range");
        TORCH_CHECK(starts[s] >= 0 && counts[s] >= 0 && starts[s] + counts[s] <= L,
                    "specdec native attention: start_pos + T (", starts[s] + counts[s],
                    ") exceeds cache length ", L);
        for (int64_t i = 0; i < counts[s]; ++i) {
            const int64_t pos = starts[s] + i;
            row_lo.push_back(sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0);
            row_hi.push_back(pos);
        }
    }
    TORCH_CHECK(static_cast<int64_t>(row_hi.size()) == T, "specdec native attention: counts sum to ",
                row_hi.size(), " but q has ", T, " rows");
    if (q.stride(2) != 1) q = q.contiguous();
    if (!contiguous_per_slot(k_cache)) k_cache = k_cache.contiguous();
    if (v_cache.stride(3) != 1 || (q8 && !contiguous_per_slot(v_cache))) v_cache = v_cache.contiguous();
    auto out = torch::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
    if (T == 0 || H == 0) return out;
    const int64_t G = H / Hkv, P = attn_part_floats(D);
    std::vector<AttnUnit> units;
    std::vector<AttnItem> items;
    // A step of few rows against few key blocks (one request's verification rows at a short
    // context: a unit per kv head, one block each) has fewer items than two per thread, and the
    // threads would wait on each other: its rows are then split into smaller units (each row's
    // result depends on its own query, range and block only, so no result changes).
    const int64_t threads = pool_threads();
    int64_t unit_rows = kAttnRows;
    int64_t part_floats = attention_units(slots, counts, prefix_slots, prefix_lens, row_lo, row_hi, Hkv, G * P,
                                          unit_rows, &units, &items);
    while (static_cast<int64_t>(items.size()) < 2 * threads && unit_rows > 1) {
        int64_t most = 0;
        for (const AttnUnit& u : units) most = std::max(most, u.rows);
        if (most <= 1) break;
        unit_rows = (most + 1) / 2;
        units.clear();
        items.clear();
        part_floats = attention_units(slots, counts, prefix_slots, prefix_lens, row_lo, row_hi, Hkv, G * P, unit_rows,
                                      &units, &items);
    }
    // NOTE: grouping keeps every unit's partials until its last block: only where they are few
    // (decode and verification rows; a long prefill keeps to whole units below)
    std::vector<int64_t> members;
    std::vector<AttnGroupItem> groups;
    if (!prefix_lens.empty() && part_floats <= (int64_t{1} << 22)) attention_groups(units, &items, &members, &groups);
    const float* qp = q.data_ptr<float>();
    const char* kp = static_cast<const char*>(k_cache.data_ptr());
    const char* vp = static_cast<const char*>(v_cache.data_ptr());
    const int64_t elt = q8 ? 1 : half ? 2 : 4;
    float* op = out.data_ptr<float>();
    const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
    const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1);
    const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
    const KernelTable* tab = g_table;
#if defined(SPECDEC_HAVE_AVX512ATTN) && defined(SPECDEC_HAVE_AMX)
    // the 8-bit cache's integer sums on the tile unit while the AMX kernels are in use (the same sums)
    if (q8) {
        const bool on = tab == avx512_table() && g_amx_enabled.load(std::memory_order_relaxed) && amx_usable();
        set_attention_amx(on ? amx_value_sums : nullptr, on ? amx_score_sums : nullptr);
    }
#endif
    const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
    // unit u's rows against its block b (b's slot: the prefix's or the sequence's own)
    auto rows_of = [&](const AttnUnit& u, int64_t b) {
        const int64_t slot = u.slot_of(b);
        return AttnRows{qp + u.row0 * qs0 + u.hk * G * qs1, qs0, qs1, u.rows, G, D,
                        row_lo.data() + u.row0, row_hi.data() + u.row0,
                        kp + (slot * ks0 + u.hk * ks1) * elt, vp + (slot * vs0 + u.hk * vs1) * elt,
                        vs2, half, fscale, fcap, q8};
    };
    // NOTE: per item, its K and V bytes at ~8 GB/s a thread plus its products at ~32 flops/ns
    const double rows_avg = static_cast<double>(T * Hkv) / static_cast<double>(units.size());
    const double item_ns = kAttnBlock * D * 2.0 * elt / 8.0 + rows_avg * G * kAttnBlock * D * 4.0 / 32.0;
    const int64_t nunits = static_cast<int64_t>(units.size()), nitems = static_cast<int64_t>(items.size());
    if (groups.empty() && nunits >= 4 * at::get_num_threads()) {
        // Units enough for the threads (MHA, batches, prefill): each unit whole in one task, its
        // partials in that task's buffer (a prefill's would not fit in one), merged at once.
        parallel_range(nunits, grain_for(item_ns * nitems / nunits), [&](int64_t u0, int64_t u1) {
            float* s = scratch(attn_scratch_floats(kAttnRows, G, D));
            thread_local std::vector<float> buf;
            for (int64_t i = u0; i < u1; ++i) {
                const AttnUnit& u = units[static_cast<size_t>(i)];
                const int64_t rec = u.rows * G * P, need = (u.b1 - u.b0) * rec + 16;
                if (static_cast<int64_t>(buf.size()) < need) buf.resize(static_cast<size_t>(need));
                float* up = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
                for (int64_t b = u.b0; b < u.b1; ++b)
                    tab->attention_block(rows_of(u, b), b * kAttnBlock, up + (b - u.b0) * rec, s);
                tab->attention_merge(rows_of(u, u.b0), u.b0, u.b1, up, op + (u.row0 * H + u.hk * G) * D, H * D);
            }
        });
        return out;
    }
    // Few units (one request's decode or verification step): one item per block, so that even a
    // single row spreads over the threads; the thread finishing a unit's last block merges it.
    thread_local std::vector<float> part_buf;
    if (static_cast<int64_t>(part_buf.size()) < part_floats + 16) part_buf.resize(static_cast<size_t>(part_floats + 16));
    float* part = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(part_buf.data()) + 63) & ~uintptr_t(63));
    // Blocks of each unit not finished yet, a cache line each (threads finishing their units'
    // blocks would otherwise pass lines back and forth).
    struct alignas(64) Pending {
        std::atomic<int64_t> blocks;
    };
    std::unique_ptr<Pending[]> pending(new Pending[units.size()]);
    for (size_t u = 0; u < units.size(); ++u)
        pending[u].blocks.store(units[u].b1 - units[u].b0, std::memory_order_relaxed);
    auto finish_block = [&](int64_t unit) {  // the last of a unit's blocks merges it
        if (pending[static_cast<size_t>(unit)].blocks.fetch_sub(1, std::memory_order_acq_rel) == 1) {
            const AttnUnit& u = units[static_cast<size_t>(unit)];
            tab->attention_merge(rows_of(u, u.b0), u.b0, u.b1, part + u.part, op + (u.row0 * H + u.hk * G) * D,
                                 H * D);
        }
    };
    // Shared prefix blocks first (groups), then every unit's own blocks.
    const int64_t ngroups = static_cast<int64_t>(groups.size());
    parallel_range(ngroups + nitems, grain_for(item_ns), [&](int64_t i0, int64_t i1) {
        float* s = scratch(attn_scratch_floats(kAttnRows, G, D));
        for (int64_t i = i0; i < i1; ++i) {
            if (i < ngroups) {
                const AttnGroupItem& g = groups[static_cast<size_t>(i)];
                // the units' queries side by side ([rows, G, D]), their ranges, and the records
                thread_local std::vector<float> gq, grec;
                thread_local std::vector<int64_t> glo, ghi;
                gq.resize(static_cast<size_t>(g.rows * G * D));
                grec.resize(static_cast<size_t>(g.rows * G * P + 16));
                glo.resize(static_cast<size_t>(g.rows));
                ghi.resize(static_cast<size_t>(g.rows));
                int64_t r = 0;
                for (int64_t m = g.first; m < g.first + g.count; ++m) {
                    const AttnUnit& u = units[static_cast<size_t>(members[static_cast<size_t>(m)])];
                    for (int64_t j = 0; j < u.rows; ++j, ++r) {
                        for (int64_t h = 0; h < G; ++h)
                            std::memcpy(gq.data() + (r * G + h) * D, qp + (u.row0 + j) * qs0 + (u.hk * G + h) * qs1,
                                        static_cast<size_t>(D) * sizeof(float));
                        glo[static_cast<size_t>(r)] = row_lo[static_cast<size_t>(u.row0 + j)];
                        ghi[static_cast<size_t>(r)] = row_hi[static_cast<size_t>(u.row0 + j)];
                    }
                }
                const int64_t hk = units[static_cast<size_t>(members[static_cast<size_t>(g.first)])].hk;
                const AttnRows a{gq.data(), G * D, D, g.rows, G, D, glo.data(), ghi.data(),
                                 kp + (g.base * ks0 + hk * ks1) * elt, vp + (g.base * vs0 + hk * vs1) * elt,
                                 vs2, half, fscale, fcap, q8};
                float* rec = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(grec.data()) + 63) & ~uintptr_t(63));
                tab->attention_block(a, g.block * kAttnBlock, rec, s);
                r = 0;
                for (int64_t m = g.first; m < g.first + g.count; ++m) {
                    const int64_t unit = members[static_cast<size_t>(m)];
                    const AttnUnit& u = units[static_cast<size_t>(unit)];
                    std::memcpy(part + u.part + (g.block - u.b0) * u.rows * G * P, rec + r * G * P,
                                static_cast<size_t>(u.rows * G * P) * sizeof(float));
                    r += u.rows;
                    finish_block(unit);
                }
                continue;
            }
            const AttnItem& it = items[static_cast<size_t>(i - ngroups)];
            const AttnUnit& u = units[static_cast<size_t>(it.unit)];
            tab->attention_block(rows_of(u, it.block), it.block * kAttnBlock,
                                 part + u.part + (it.block - u.b0) * u.rows * G * P, s);
            finish_block(it.unit);
        }
    });
    return out;
}

torch::Tensor attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                        int64_t start_pos, double scale, int64_t sliding_window, double softcap) {
    TORCH_CHECK((k_cache.dim() == 4 && v_cache.dim() == 3) ||
                    (k_cache.scalar_type() == torch::kInt8 && k_cache.dim() == 3 && v_cache.dim() == 3),
                "specdec native attention: q [T, H, D], k_cache [Hkv, L / ", kKeyBlock, ", D, ", kKeyBlock,
                "] (blocked), v_cache [Hkv, L, D]; an int8 cache's both [Hkv, L / ", kKeyBlock, ", ", kQ8Header,
                " + ", kKeyBlock, " D]");
    return attention_seqs(q, k_cache.unsqueeze(0), v_cache.unsqueeze(0), {0}, {start_pos}, {q.size(0)},
                          scale, sliding_window, softcap, {}, {});
}

namespace {

py::dict cpu_features() {
    py::dict d;
    for (const char* f : {"avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512vnni", "avxvnni"})
        d[f] = cpu_has(f);
    return d;
}

void set_isa(const std::string& isa) { g_table = table_for(isa); }
void set_amx(bool on) { g_amx_enabled.store(on); }
bool amx_enabled() { return g_amx_enabled.load(); }
std::string a8_kernels() { return a8_table()->name; }
void set_a8_vnni256(bool on) { g_a8_vnni256.store(on); }
void set_amx_min_rows(int64_t rows) {
#ifdef SPECDEC_HAVE_AMX
    amx_set_min_rows(rows);
#else
    (void)rows;
#endif
}
std::string isa() { return g_table->name; }
void set_a8_walk(const std::string& walk) {
    const int w = walk == "auto" ? a8_walk_for_cpu() : a8_walk_named(walk);
    if (w == 0) throw std::invalid_argument("a8 walk must be 'auto', 'groups' or 'stationary', not '" + walk + "'");
    g_a8_walk.store(w);
}
std::string a8_walk_name() { return a8_walk() == A8_WALK_STATIONARY ? "stationary" : "groups"; }

// The 8-bit KV cache's integer attention (kernels.h avx512_q8_int_attention): whether the kernels
// in use take it, and a switch for benchmarks and tests (it changes results: never mid-request).
bool int8_attention() {
#ifdef SPECDEC_HAVE_AVX512ATTN
    return g_table == avx512_table() && avx512_q8_int_attention(-1);
#else
    return false;
#endif
}
void set_int8_attention(bool on) {
#ifdef SPECDEC_HAVE_AVX512ATTN
    avx512_q8_int_attention(on ? 1 : 0);
#else
    (void)on;
#endif
}
bool has_avx2_build() {
#ifdef SPECDEC_HAVE_AVX2
    return true;
#else
    return false;
#endif
}
bool has_avx512_build() {
#if defined(SPECDEC_HAVE_AVX512) && defined(SPECDEC_HAVE_AVX2)
    return true;
#else
    return false;
#endif
}

}  // namespace

const KernelTable* active_table() { return g_table; }

}  // namespace specdec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    using namespace specdec;
    m.doc() = "specdec native CPU kernels (batch-invariant linear, rms_norm, attention)";
    const auto nogil = py::call_guard<py::gil_scoped_release>();
    m.def("linear", &linear, "y = x @ W.T (+ bias) for f32 / GGUF-block weights", py::arg("x"),
          py::arg("w"), py::arg("qtype"), py::arg("n"), py::arg("k"), py::arg("bias") = py::none(),
          py::arg("parts") = std::vector<int64_t>{}, nogil);
    m.def("argmax", &argmax_rows, "Index of the first maximum of each row of x [R, V]", py::arg("x"),
          nogil);
    m.def("argmax_finite", &argmax_finite,
          "(each row's first maximum as a list, whether every row's maximum is finite) of x [R, V]",
          py::arg("x"), nogil);
    m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"), nogil);
    m.def("attention", &attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
          py::arg("start_pos"), py::arg("scale"), py::arg("sliding_window") = 0,
          py::arg("softcap") = 0.0, nogil);
    m.def("attention_seqs", &attention_seqs,
          "Attention of several sequences' rows in one call: k_cache [S, Hkv, L / 16, D, 16] (blocked), "
          "v_cache [S, Hkv, L, D]; sequence i's counts[i] rows of q sit at positions starts[i]... of slot slots[i]",
          py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("starts"),
          py::arg("counts"), py::arg("scale"), py::arg("sliding_window") = 0, py::arg("softcap") = 0.0,
          py::arg("prefix_slots") = std::vector<int64_t>{}, py::arg("prefix_lens") = std::vector<int64_t>{}, nogil);
    m.attr("ATTN_BLOCK") = kAttnBlock;
    m.def("repack_a8", &repack_a8, "Repack GGUF q8_0/q4_0/q4_1 rows for the 8-bit activation kernels",
          py::arg("w"), py::arg("qtype"), py::arg("n"), py::arg("k"), nogil);
    m.def("repack_a8_cat", &repack_a8_cat, "Several GGUF q8_0/q4_0/q4_1 weights of one K, repacked into one buffer",
          py::arg("ws"), py::arg("qtype"), py::arg("ns"), py::arg("k"), nogil);
    m.def("dequantize_blocks", &dequantize_blocks, "GGUF q8_0 / q4_0 / q4_1 block rows -> float32 [R, K]",
          py::arg("blocks"), py::arg("qtype"), py::arg("K"), nogil);
    m.def("unpack_a8", &unpack_a8, "a8 tiles -> the GGUF block rows (all, or the given ones)", py::arg("a8"),
          py::arg("qtype"), py::arg("n"), py::arg("k"), py::arg("rows") = py::none(), nogil);
    m.def(
        "dequantize_a8_rows",
        [](torch::Tensor a8, int64_t qtype, int64_t n, int64_t k, torch::Tensor rows) {
            return dequantize_blocks(unpack_a8(std::move(a8), qtype, n, k, rows).contiguous(), qtype, k);
        },
        "unpack_a8 then dequantize_blocks in one call: float32 [R, K] of the given rows (an embedding lookup)",
        py::arg("a8"), py::arg("qtype"), py::arg("n"), py::arg("k"), py::arg("rows"), nogil);
    m.def("repack_kq", &repack_kq, "GGUF Q4_K/Q5_K/Q6_K rows -> the K-quant tiles of kquants.cpp",
          py::arg("w"), py::arg("fmt"), py::arg("n"), py::arg("k"), nogil);
    m.def("repack_kq_cat", &repack_kq_cat, "Several K-quant weights of one K, repacked into one buffer",
          py::arg("ws"), py::arg("fmts"), py::arg("ns"), py::arg("k"), nogil);
    m.def("weight_from_file", &weight_from_file, "n bytes of a file from offset, in huge-page backed memory",
          py::arg("path"), py::arg("offset"), py::arg("n"), nogil);
    m.def("weight_cat", &weight_cat, "Concatenate uint8 weight tensors (huge-page backed)", py::arg("parts"),
          nogil);
    m.def("dequantize_kq", &dequantize_kq, "K-quant tiles -> float32 rows (all, or the given ones)",
          py::arg("w"), py::arg("parts"), py::arg("n"), py::arg("k"), py::arg("rows") = py::none(), nogil);
    m.def("a8_available", &a8_usable, "True when the 8-bit activation (AVX-512 VNNI) kernels can run");
    m.def("amx_available", &amx_usable,
          "True when the 8-bit activation kernels can run on AMX-INT8 (built, CPU, OS permission)");
    m.def("set_amx", &set_amx, "Let the 8-bit activation kernels use AMX-INT8 where available (process-wide)",
          py::arg("enabled"));
    m.def("int8_attention", &int8_attention,
          "Whether attention over an int8 KV cache uses integer products (AVX-512 VNNI + VBMI)");
    m.def("set_int8_attention", &set_int8_attention,
          "Switch integer attention over int8 KV caches (where the CPU has it; process-wide)", py::arg("on"));
    m.def("amx_enabled", &amx_enabled, "Whether AMX-INT8 is allowed (SPECDEC_AMX=0 or set_amx(False): not)");
    m.def("set_amx_min_rows", &set_amx_min_rows,
          "Rows from which every format uses AMX-INT8 (0: the measured per-format thresholds)", py::arg("rows"));
    m.def("a8_kernels", &a8_kernels,
          "Name of the 8-bit activation kernels in use: amx-int8, avx512vnni, avx-vnni, avx2-vnni, avx2 or "
          "portable");
    m.def("set_a8_vnni256", &set_a8_vnni256,
          "Let the AVX2 table's 8-bit activation kernels use 256-bit VNNI where the CPU has it (the same "
          "results; process-wide; SPECDEC_A8_VNNI256=0: not)",
          py::arg("on"));
    m.def("set_a8_walk", &set_a8_walk,
          "How the VNNI kernels walk a product: 'groups', 'stationary' or 'auto' (by CPU; same results, "
          "process-wide; never while a product runs)", py::arg("walk"));
    m.def("set_timeline", [](bool on) { Timeline::on().store(on); },
          "Whether the native forward records when its layers, linears and attention begin and end "
          "(benchmarks/layer_timeline.py; off by default)", py::arg("on"));
    m.def("timeline", &Timeline::take,
          "The recorded marks, cleared: flat (kind, steady-clock microseconds, bytes) triples; kinds: 0 a layer "
          "begins, 1 / 2 a linear begins (bytes: its weights) / ends, 3 / 4 a layer's attention begins / ends");
    m.def("a8_walk", &a8_walk_name, "The VNNI kernels' walk in use: 'groups' or 'stationary'");
    m.def("kq_kernels", &kq_kernels,
          "Name of the K-quant 8-bit activation kernels in use: avx512vnni, avx-vnni, avx2-vnni, avx2 or portable");
    m.attr("QT_A8_BASE") = static_cast<int>(kA8QtypeBase);
    m.attr("KEY_BLOCK") = static_cast<int>(kKeyBlock);
    m.def("cpu_features", &cpu_features);
    m.def("set_isa", &set_isa, "Select 'auto', 'avx512', 'avx2' or 'portable' kernels (process-wide)");
    m.def("isa", &isa, "Name of the kernels in use");
    m.def("has_avx2_build", &has_avx2_build);
    m.def("has_avx512_build", &has_avx512_build);
    bind_allreduce(m);  // NOTE: before the layer, whose bindings name ShmReducer
    bind_moe(m);
    bind_decoder_layer(m);
    bind_eagle3_head(m);
    m.attr("QT_F32") = static_cast<int>(QT_F32);
    m.attr("QT_Q8_0") = static_cast<int>(QT_Q8_0);
    m.attr("QT_Q4_0") = static_cast<int>(QT_Q4_0);
    m.attr("QT_Q4_1") = static_cast<int>(QT_Q4_1);
    m.attr("QT_Q4_K") = static_cast<int>(QT_Q4_K);
    m.attr("QT_Q5_K") = static_cast<int>(QT_Q5_K);
    m.attr("QT_Q6_K") = static_cast<int>(QT_Q6_K);
    m.attr("QT_KQUANT") = static_cast<int>(QT_KQUANT);
    m.attr("QT_F16") = static_cast<int>(QT_F16);
    m.attr("QT_BF16") = static_cast<int>(QT_BF16);
    m.attr("QT_F16_X2") = static_cast<int>(QT_F16_X2);
    m.attr("QT_BF16_X2") = static_cast<int>(QT_BF16_X2);
    m.def("repack_x2", &repack_x2, "16-bit weight [N, K] -> the tiles of the bf16x2 kernels (kernels_amx16.cpp)",
          py::arg("w"), py::arg("n"), py::arg("k"));
    m.def("unpack_x2", &unpack_x2, "bf16x2 tiles -> the 16-bit rows (all, or the given ones)", py::arg("tiles"),
          py::arg("qtype"), py::arg("n"), py::arg("k"), py::arg("rows") = py::none());
    m.def("amx16_available", &amx16_usable,
          "True when 16-bit weights can run with bf16x2 activations on AMX-BF16 (built, CPU, OS permission)");
}
