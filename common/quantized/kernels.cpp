// Matrix products on GGUF's own quantized weights (Q4_K, Q6_K, Q4_1, Q8_0, Q5_0), AVX2 (AVX512-VNNI where the CPU
// has it), batch-invariant by construction.
//
// y[r, n] = sum_k W[n, k] x[r, k]. Each activation row is quantized on its own to int8 (one scale per block of
// 256 values for the K-quant formats, of 32 for the others, as llama.cpp's Q8_K and Q8_0 do), the products are
// exact integer sums per weight group, and the float accumulation of one output element runs in one fixed order
// whatever the number of rows in the call: the rows of a call only share the loading and unpacking of the
// weights, never an accumulator, and threads split the output columns, never the sum. A row's result is
// therefore bit-identical alone, in a call of any row count and beside any other rows. Integer sums are exact,
// so the AVX2 and VNNI paths of a format agree bit for bit too (the row kernels are in kernel_rows.h).
//
// Compiled with -ffp-contract=off: the compiler must not fuse the scalar multiply-adds differently in the
// instantiations for different row tiles.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

// ---- activation quantization -------------------------------------------------------------------------------

// One row, blocks of `block` values: q = round(x * 127 / amax), scale = amax / 127. sums[g] = sum of q over each
// group of `group` values (the offsets of unsigned weight codes are applied through them).
void quantize_row(const float* x, int64_t k, int block, int group, int8_t* q, float* scale, int16_t* sums) {
    for (int64_t b = 0; b < k / block; ++b) {
        const float* xb = x + b * block;
        float amax = 0.f;
        for (int i = 0; i < block; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        scale[b] = amax / 127.f;
        for (int i = 0; i < block; ++i) q[b * block + i] = (int8_t)std::nearbyint(xb[i] * inv);
    }
    for (int64_t g = 0; g < k / group; ++g) {
        int32_t s = 0;
        for (int i = 0; i < group; ++i) s += q[g * group + i];
        sums[g] = (int16_t)s;  // |s| <= 32 * 127: fits
    }
}

struct QuantizedRows {
    std::vector<int8_t> q;
    std::vector<float> scale;
    std::vector<int16_t> sums;
    int64_t k, blocks, groups;
    QuantizedRows(const float* x, int64_t rows, int64_t k, int block, int group)
        : q(rows * k), scale(rows * (k / block)), sums(rows * (k / group)), k(k), blocks(k / block), groups(k / group) {
        at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r)
                quantize_row(x + r * k, k, block, group, &q[r * k], &scale[r * blocks], &sums[r * groups]);
        });
    }
    const int8_t* row_q(int64_t r) const { return &q[r * k]; }
    const float* row_scale(int64_t r) const { return &scale[r * blocks]; }
    const int16_t* row_sums(int64_t r) const { return &sums[r * groups]; }
};

inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

inline float hsum_f32(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Where few activation rows share a weight row, a pass streams the weights once and is bound by memory, yet the
// hardware prefetcher alone left a 1-row pass of the 1.5B at half of this VM's read bandwidth (12 of 24 GB/s).
// The row kernels therefore ask for the codes of the weight row kPrefetchAhead rows on (0.77x the time of a 1-row
// pass, 0.92x at 4 rows, measured; no result changes). Full 512-bit tiles of 8 rows are bound by their products
// and do not (it cost them 2 %). A prefetch is a hint: it never faults, even past the end.
constexpr int64_t kPrefetchAhead = 8;
inline void prefetch(const void* start, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch((const char*)start + offset, _MM_HINT_T0);
}

// ---- weights -----------------------------------------------------------------------------------------------
// Q4_K: 4-bit codes, per 256: d, dmin; per 32: 6-bit scale and min. codes [N, K/2]: in each 64 weights, byte i
// holds weight i (low nibble) and weight 32 + i (high nibble). w = d * sc[g] * code - dmin * mn[g].
// Q6_K: 6-bit codes (0..63, weight = code - 32) as the file packs them; per 16: int8 scale; per 256: d. In each 128
// weights, ql byte l (l < 32) holds the low 4 bits of weights l (low nibble) and 64 + l (high), ql byte 32 + l those
// of 32 + l and 96 + l; qh byte l the high 2 bits of l, 32 + l, 64 + l and 96 + l.
// Q4_1: 4-bit codes (layout as Q4_K's), per 32: d and m; w = d * code + m.
// Q8_0 and Q5_0: int8 codes, per 32: d; w = d * code.
struct Q4K {
    const uint8_t* codes; const uint8_t* sc; const uint8_t* mn; const float* d; const float* dmin; int64_t k;
    Q4K row(int64_t n) const {  // output row n's blocks, as a one-row weight
        return {codes + n * (k / 2), sc + n * (k / 32), mn + n * (k / 32), d + n * (k / 256), dmin + n * (k / 256), k};
    }
};
struct Q6K {
    const uint8_t* ql; const uint8_t* qh; const int8_t* sc; const float* d; int64_t k;
    Q6K row(int64_t n) const { return {ql + n * (k / 2), qh + n * (k / 4), sc + n * (k / 16), d + n * (k / 256), k}; }
};
struct Q41 { const uint8_t* codes; const float* d; const float* m; int64_t k; };
struct Q80 { const int8_t* codes; const float* d; int64_t k; };

#include "decoder_ops.h"

// ---- the kernels, once per instruction set ------------------------------------------------------------------

namespace avx2 {
constexpr int kRowTile = 4;  // 16 vector registers: 4 rows' integer and float accumulators and the weights fit
constexpr int kSplit = 0;    // madd + add: a chain of one-cycle adds
inline __m256i dot_add(__m256i acc, __m256i p, __m256i s) { return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s)); }
inline __m256i dot4(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }
#include "kernel_rows.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
constexpr int kRowTile = 8;  // AVX-512 has 32 vector registers
constexpr int kSplit = 2;    // dpwssd: a chain of five-cycle fused products
inline __m256i dot_add(__m256i acc, __m256i p, __m256i s) { return _mm256_dpwssd_epi32(acc, p, s); }
inline __m256i dot4(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
#define SPECDEC_WIDE_TILES  // full tiles of Q4_K and Q6_K on 512-bit vectors (kernel_wide_tiles.h)
#include "kernel_rows.h"
#undef SPECDEC_WIDE_TILES
}  // namespace vnni
#pragma GCC pop_options

// The instruction set the products run on: "vnni" where the CPU has AVX512-VNNI (Ice Lake and later Xeons, AMD Zen 4
// and later), else "avx2"; set_isa("avx2") forces the AVX2 path (the tests compare the two).
bool cpu_has_vnni() {  // what the vnni namespace is compiled for
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
}

bool use_vnni = cpu_has_vnni();

std::string isa() { return use_vnni ? "vnni" : "avx2"; }

void set_isa(const std::string& name) {
    TORCH_CHECK(name == "avx2" || name == "vnni", "isa must be avx2 or vnni, not ", name);
    TORCH_CHECK(name == "avx2" || cpu_has_vnni(), "this CPU lacks AVX512-VNNI");
    use_vnni = name == "vnni";
}

// y = x W^T for one format: the rows quantized once, then the product on the chosen instruction set.
template <typename W>
torch::Tensor product(const W& w, const torch::Tensor& x, int64_t out_features, int block, int group,
                      void (*on_avx2)(const W&, const QuantizedRows&, int64_t, int64_t, float*),
                      void (*on_vnni)(const W&, const QuantizedRows&, int64_t, int64_t, float*)) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be [rows, K] float32");
    TORCH_CHECK(x.size(1) == w.k, "x has ", x.size(1), " features, the weight ", w.k);
    const int64_t rows = x.size(0);
    auto y = torch::empty({rows, out_features}, x.options());
    if (rows == 0) return y;
    QuantizedRows a(x.data_ptr<float>(), rows, w.k, block, group);
    (use_vnni ? on_vnni : on_avx2)(w, a, rows, out_features, y.data_ptr<float>());
    return y;
}

void check_weight(const torch::Tensor& t, torch::ScalarType type, int64_t n, int64_t per_row, const char* name) {
    TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.numel() == n * per_row, name, ": expected ", n, " x ",
                per_row, " contiguous values of ", c10::toString(type));
}

torch::Tensor q4k_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor sc, torch::Tensor mn, torch::Tensor d,
                         torch::Tensor dmin, int64_t n, int64_t k) {
    TORCH_CHECK(k % 256 == 0, "Q4_K needs K divisible by 256");
    check_weight(codes, torch::kUInt8, n, k / 2, "codes");
    check_weight(sc, torch::kUInt8, n, k / 32, "sc");
    check_weight(mn, torch::kUInt8, n, k / 32, "mn");
    check_weight(d, torch::kFloat32, n, k / 256, "d");
    check_weight(dmin, torch::kFloat32, n, k / 256, "dmin");
    Q4K w{codes.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(), mn.data_ptr<uint8_t>(), d.data_ptr<float>(), dmin.data_ptr<float>(), k};
    return product(w, x, n, 256, 32, &avx2::q4k, &vnni::q4k);
}

torch::Tensor q6k_matmul(torch::Tensor x, torch::Tensor ql, torch::Tensor qh, torch::Tensor sc, torch::Tensor d, int64_t n,
                         int64_t k) {
    TORCH_CHECK(k % 256 == 0, "Q6_K needs K divisible by 256");
    check_weight(ql, torch::kUInt8, n, k / 2, "ql");
    check_weight(qh, torch::kUInt8, n, k / 4, "qh");
    check_weight(sc, torch::kInt8, n, k / 16, "sc");
    check_weight(d, torch::kFloat32, n, k / 256, "d");
    Q6K w{ql.data_ptr<uint8_t>(), qh.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), d.data_ptr<float>(), k};
    return product(w, x, n, 256, 16, &avx2::q6k, &vnni::q6k);
}

torch::Tensor q41_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t n, int64_t k) {
    TORCH_CHECK(k % 64 == 0, "Q4_1 needs K divisible by 64");
    check_weight(codes, torch::kUInt8, n, k / 2, "codes");
    check_weight(d, torch::kFloat32, n, k / 32, "d");
    check_weight(m, torch::kFloat32, n, k / 32, "m");
    Q41 w{codes.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), k};
    return product(w, x, n, 32, 32, &avx2::q41, &vnni::q41);
}

torch::Tensor q80_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor d, int64_t n, int64_t k) {
    TORCH_CHECK(k % 32 == 0, "Q8_0 needs K divisible by 32");
    check_weight(codes, torch::kInt8, n, k, "codes");
    check_weight(d, torch::kFloat32, n, k / 32, "d");
    Q80 w{codes.data_ptr<int8_t>(), d.data_ptr<float>(), k};
    return product(w, x, n, 32, 32, &avx2::q80, &vnni::q80);
}

// The activation quantization alone, for the tests' float64 reference: (codes, scales).
std::vector<torch::Tensor> quantize_activations(torch::Tensor x, int64_t block) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be [rows, K] float32");
    const int64_t rows = x.size(0), k = x.size(1);
    TORCH_CHECK(k % block == 0, "K must be divisible by the block");
    QuantizedRows a(x.data_ptr<float>(), rows, k, (int)block, 16);
    auto q = torch::from_blob(a.q.data(), {rows, k}, torch::kInt8).clone();
    auto s = torch::from_blob(a.scale.data(), {rows, k / block}, torch::kFloat32).clone();
    return {q, s};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("q4k_matmul", &q4k_matmul);
    m.def("q6k_matmul", &q6k_matmul);
    m.def("q41_matmul", &q41_matmul);
    m.def("q80_matmul", &q80_matmul);
    m.def("quantize_activations", &quantize_activations);
    m.def("rms_norm", &rms_norm);
    m.def("rotary", &rotary);
    m.def("attend_sessions", &attend_sessions);
    m.def("isa", &isa);
    m.def("set_isa", &set_isa);
}
