// Matrix products on GGUF's own quantized weights (Q4_K, Q6_K, Q4_1, Q8_0, Q5_0), AVX2, batch-invariant by
// construction.
//
// y[r, n] = sum_k W[n, k] x[r, k]. Each activation row is quantized on its own to int8 (one scale per block of
// 256 values for the K-quant formats, of 32 for the others, as llama.cpp's Q8_K and Q8_0 do), the products are
// exact integer sums per weight group, and the float accumulation of one output element runs in one fixed order
// whatever the number of rows in the call: the rows of a call only share the loading and unpacking of the
// weights, never an accumulator, and threads split the output columns, never the sum. A row's result is
// therefore bit-identical alone, in a call of any row count and beside any other rows. Integer sums are exact,
// so the AVX2 and scalar paths of a format agree bit for bit too.
//
// Compiled with -ffp-contract=off: the compiler must not fuse the scalar multiply-adds differently in the
// instantiations for different row tiles.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kRowTile = 4;  // activation rows that share one unpacking of a weight row

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

// ---- Q4_K: 4-bit codes, per 256: d, dmin; per 32: 6-bit scale and min --------------------------------------
// codes [N, K/2]: in each 64 weights, byte i holds weight i (low nibble) and weight 32 + i (high nibble).
// w = d * sc[g] * code - dmin * mn[g].

struct Q4K {
    const uint8_t* codes; const uint8_t* sc; const uint8_t* mn; const float* d; const float* dmin; int64_t k;
};

template <int R>
void q4k_rows(const Q4K& w, int64_t n, const QuantizedRows& a, const int64_t* rows, float* out[R]) {
    const int64_t superblocks = w.k / 256;
    const uint8_t* codes = w.codes + n * (w.k / 2);
    const uint8_t* sc = w.sc + n * (w.k / 32);
    const uint8_t* mn = w.mn + n * (w.k / 32);
    const float* d = w.d + n * superblocks;
    const float* dmin = w.dmin + n * superblocks;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const int8_t* aq[R];
    const float* as[R];
    const int16_t* sums[R];
    __m256 acc[R];
    __m128 acc_min[R];
    for (int r = 0; r < R; ++r) {
        aq[r] = a.row_q(rows[r]); as[r] = a.row_scale(rows[r]); sums[r] = a.row_sums(rows[r]);
        acc[r] = _mm256_setzero_ps(); acc_min[r] = _mm_setzero_ps();
    }
    for (int64_t s = 0; s < superblocks; ++s) {
        __m256i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(codes + s * 128 + c * 32));
            const __m256i lo = _mm256_and_si256(v, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            const __m256i s_lo = _mm256_set1_epi16(sc[s * 8 + 2 * c]);
            const __m256i s_hi = _mm256_set1_epi16(sc[s * 8 + 2 * c + 1]);
            for (int r = 0; r < R; ++r) {
                const int8_t* q = aq[r] + s * 256 + c * 64;
                const __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)q));
                const __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(q + 32)));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(p_lo, s_lo), _mm256_madd_epi16(p_hi, s_hi)));
            }
        }
        // The mins' term, sum over the 8 groups of mn[g] * (sum of the row's codes in g), as 4 int32 lanes.
        const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(mn + s * 8)));
        for (int r = 0; r < R; ++r) {
            const __m128i imin = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i*)(sums[r] + s * 8)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d[s] * as[r][s]), acc[r]);
            acc_min[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(imin), _mm_set1_ps(dmin[s] * as[r][s]), acc_min[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        const __m128 m = acc_min[r];
        __m128 t = _mm_add_ps(m, _mm_movehl_ps(m, m));
        t = _mm_add_ss(t, _mm_movehdup_ps(t));
        out[r][n] = hsum_f32(acc[r]) - _mm_cvtss_f32(t);
    }
}

// ---- Q6_K: 6-bit codes (0..63, weight = code - 32) as the file packs them; per 16: int8 scale; per 256: d ------
// In each 128 weights, ql byte l (l < 32) holds the low 4 bits of weights l (low nibble) and 64 + l (high), ql
// byte 32 + l those of 32 + l and 96 + l; qh byte l the high 2 bits of l, 32 + l, 64 + l and 96 + l.

struct Q6K { const uint8_t* ql; const uint8_t* qh; const int8_t* sc; const float* d; int64_t k; };

template <int R>
void q6k_rows(const Q6K& w, int64_t n, const QuantizedRows& a, const int64_t* rows, float* out[R]) {
    const int64_t superblocks = w.k / 256;
    const uint8_t* ql = w.ql + n * (w.k / 2);
    const uint8_t* qh = w.qh + n * (w.k / 4);
    const int8_t* sc = w.sc + n * (w.k / 16);
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i high = _mm256_set1_epi8(0x30);
    const float* d = w.d + n * superblocks;
    const int8_t* aq[R];
    const float* as[R];
    const int16_t* sums[R];
    __m256 acc[R];
    for (int r = 0; r < R; ++r) {
        aq[r] = a.row_q(rows[r]); as[r] = a.row_scale(rows[r]); sums[r] = a.row_sums(rows[r]);
        acc[r] = _mm256_setzero_ps();
    }
    for (int64_t s = 0; s < superblocks; ++s) {
        __m256i isum[R];
        const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(sc + s * 16)));
        for (int r = 0; r < R; ++r) {
            // The codes' offset of 32: 32 * sum over the 16 groups of sc[g] * (sum of the row's codes in g).
            const __m256i offset = _mm256_madd_epi16(scales16, _mm256_loadu_si256((const __m256i*)(sums[r] + s * 16)));
            isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5));
        }
        for (int c = 0; c < 8; ++c) {
            const int64_t half = s * 2 + c / 4;
            const __m256i a = _mm256_loadu_si256((const __m256i*)(ql + half * 64 + (c & 1) * 32));
            const __m256i h = _mm256_loadu_si256((const __m256i*)(qh + half * 32));
            const int j = c & 3;  // weights 32j..32j+31 of this 128: nibble j / 2 of ql half j % 2, qh bits 2j..2j+1
            const __m256i nibble = j < 2 ? _mm256_and_si256(a, low) : _mm256_and_si256(_mm256_srli_epi16(a, 4), low);
            const __m256i top = j == 0   ? _mm256_and_si256(_mm256_slli_epi16(h, 4), high)
                                : j == 1 ? _mm256_and_si256(_mm256_slli_epi16(h, 2), high)
                                : j == 2 ? _mm256_and_si256(h, high)
                                         : _mm256_and_si256(_mm256_srli_epi16(h, 2), high);
            const __m256i v = _mm256_or_si256(nibble, top);
            // int16 lanes 0..7 come from bytes 0..15 (group 2c), lanes 8..15 from bytes 16..31 (group 2c + 1).
            const __m256i scales = _mm256_setr_m128i(_mm_set1_epi16(sc[s * 16 + 2 * c]), _mm_set1_epi16(sc[s * 16 + 2 * c + 1]));
            for (int r = 0; r < R; ++r) {
                const __m256i p = _mm256_maddubs_epi16(v, _mm256_loadu_si256((const __m256i*)(aq[r] + s * 256 + c * 32)));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p, scales));
            }
        }
        for (int r = 0; r < R; ++r)
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d[s] * as[r][s]), acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r][n] = hsum_f32(acc[r]);
}

// ---- Q4_1: 4-bit codes (layout as Q4_K's), per 32: d and m; w = d * code + m ----------------------------------

struct Q41 { const uint8_t* codes; const float* d; const float* m; int64_t k; };

template <int R>
void q41_rows(const Q41& w, int64_t n, const QuantizedRows& a, const int64_t* rows, float* out[R]) {
    const int64_t groups = w.k / 32;
    const uint8_t* codes = w.codes + n * (w.k / 2);
    const float* d = w.d + n * groups;
    const float* m = w.m + n * groups;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    float acc_min[R];
    for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); acc_min[r] = 0.f; }
    for (int64_t c = 0; c < groups / 2; ++c) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(codes + c * 32));
        const __m256i half[2] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
        for (int h = 0; h < 2; ++h) {
            const int64_t g = 2 * c + h;
            for (int r = 0; r < R; ++r) {
                const int8_t* aq = a.row_q(rows[r]) + g * 32;
                const float as = a.row_scale(rows[r])[g];
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(half[h], _mm256_loadu_si256((const __m256i*)aq)), ones);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[g] * as), acc[r]);
                acc_min[r] += (m[g] * as) * (float)a.row_sums(rows[r])[g];
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r][n] = hsum_f32(acc[r]) + acc_min[r];
}

// ---- Q8_0 and Q5_0: int8 codes, per 32: d; w = d * code ----------------------------------------------------------

struct Q80 { const int8_t* codes; const float* d; int64_t k; };

template <int R>
void q80_rows(const Q80& w, int64_t n, const QuantizedRows& a, const int64_t* rows, float* out[R]) {
    const int64_t groups = w.k / 32;
    const int8_t* codes = w.codes + n * w.k;
    const float* d = w.d + n * groups;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(codes + g * 32));
        const __m256i magnitude = _mm256_sign_epi8(v, v);  // maddubs takes its first operand unsigned
        for (int r = 0; r < R; ++r) {
            const __m256i aq = _mm256_loadu_si256((const __m256i*)(a.row_q(rows[r]) + g * 32));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(aq, v)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[g] * a.row_scale(rows[r])[g]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r][n] = hsum_f32(acc[r]);
}

// ---- driver --------------------------------------------------------------------------------------------------


#define SPECDEC_KERNEL(name, fn)                                                                    \
    template <int R> struct name {                                                                  \
        template <typename W>                                                                       \
        static void run(const W& w, int64_t n, const QuantizedRows& a, const int64_t* rows, float** out) { \
            fn<R>(w, n, a, rows, out);                                                              \
        }                                                                                           \
    };
SPECDEC_KERNEL(Q4KKernel, q4k_rows)
SPECDEC_KERNEL(Q6KKernel, q6k_rows)
SPECDEC_KERNEL(Q41Kernel, q41_rows)
SPECDEC_KERNEL(Q80Kernel, q80_rows)

// Every output column n for every row: rows in tiles of kRowTile (the remainder in one smaller tile), columns
// split over threads.
template <template <int> class Kernel, typename W>
torch::Tensor matmul(const W& w, const torch::Tensor& x, int64_t out_features, int block, int group) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be [rows, K] float32");
    TORCH_CHECK(x.size(1) == w.k, "x has ", x.size(1), " features, the weight ", w.k);
    const int64_t rows = x.size(0);
    auto y = torch::empty({rows, out_features}, x.options());
    if (rows == 0) return y;
    QuantizedRows a(x.data_ptr<float>(), rows, w.k, block, group);
    float* base = y.data_ptr<float>();
    at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
        std::vector<int64_t> index(rows);
        for (int64_t r = 0; r < rows; ++r) index[r] = r;
        std::vector<float*> out(rows);
        for (int64_t r = 0; r < rows; ++r) out[r] = base + r * out_features;
        for (int64_t n = begin; n < end; ++n) {
            int64_t r = 0;
            for (; r + kRowTile <= rows; r += kRowTile) Kernel<kRowTile>::run(w, n, a, &index[r], &out[r]);
            switch (rows - r) {
                case 1: Kernel<1>::run(w, n, a, &index[r], &out[r]); break;
                case 2: Kernel<2>::run(w, n, a, &index[r], &out[r]); break;
                case 3: Kernel<3>::run(w, n, a, &index[r], &out[r]); break;
                default: break;
            }
        }
    });
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
    return matmul<Q4KKernel>(w, x, n, 256, 32);
}

torch::Tensor q6k_matmul(torch::Tensor x, torch::Tensor ql, torch::Tensor qh, torch::Tensor sc, torch::Tensor d, int64_t n,
                         int64_t k) {
    TORCH_CHECK(k % 256 == 0, "Q6_K needs K divisible by 256");
    check_weight(ql, torch::kUInt8, n, k / 2, "ql");
    check_weight(qh, torch::kUInt8, n, k / 4, "qh");
    check_weight(sc, torch::kInt8, n, k / 16, "sc");
    check_weight(d, torch::kFloat32, n, k / 256, "d");
    Q6K w{ql.data_ptr<uint8_t>(), qh.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), d.data_ptr<float>(), k};
    return matmul<Q6KKernel>(w, x, n, 256, 16);
}

torch::Tensor q41_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t n, int64_t k) {
    TORCH_CHECK(k % 64 == 0, "Q4_1 needs K divisible by 64");
    check_weight(codes, torch::kUInt8, n, k / 2, "codes");
    check_weight(d, torch::kFloat32, n, k / 32, "d");
    check_weight(m, torch::kFloat32, n, k / 32, "m");
    Q41 w{codes.data_ptr<uint8_t>(), d.data_ptr<float>(), m.data_ptr<float>(), k};
    return matmul<Q41Kernel>(w, x, n, 32, 32);
}

torch::Tensor q80_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor d, int64_t n, int64_t k) {
    TORCH_CHECK(k % 32 == 0, "Q8_0 needs K divisible by 32");
    check_weight(codes, torch::kInt8, n, k, "codes");
    check_weight(d, torch::kFloat32, n, k / 32, "d");
    Q80 w{codes.data_ptr<int8_t>(), d.data_ptr<float>(), k};
    return matmul<Q80Kernel>(w, x, n, 32, 32);
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
}
