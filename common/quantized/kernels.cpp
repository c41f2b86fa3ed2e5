// Matrix products on GGUF's own quantized weights (Q4_K, Q6_K, Q4_1, Q8_0, Q5_0), AVX2 (AVX512-VNNI where the CPU
// has it, and AMX tiles for Q4_K and Q6_K passes of 16 rows or more where it has those), batch-invariant by
// construction.
//
// y[r, n] = sum_k W[n, k] x[r, k]. Each activation row is quantized on its own to int8 (one scale per block of
// 256 values for the K-quant formats, of 32 for the others, as llama.cpp's Q8_K and Q8_0 do), the products are
// exact integer sums per weight group, and the float accumulation of one output element runs in one fixed order
// whatever the number of rows in the call: the rows of a call only share the loading and unpacking of the
// weights, never an accumulator, and threads split the output columns, never the sum. A row's result is
// therefore bit-identical alone, in a call of any row count and beside any other rows. Integer sums are exact,
// so the AVX2, VNNI and AMX paths of a format agree bit for bit too (the row kernels and the 1-row tiles of Q4_K
// and Q6_K are in kernel_rows.h, the column tiles of every format in kernel_columns.h, the AMX tiles in
// kernel_amx.h; Q4_K and Q6_K have two float numerics, see Lanes and Totals below).
//
// Compiled with -ffp-contract=off: the compiler must not fuse the scalar multiply-adds differently in the
// instantiations for different row tiles.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

// The column tiles' per-group steps, inlined into every row count's instantiation whatever the compiler's budget
// (left to it, the larger instantiations made smaller ones slower).
#define SPECDEC_INLINE inline __attribute__((always_inline))

// ---- activation quantization -------------------------------------------------------------------------------

inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

// One row, blocks of `block` values: q = round(x * 127 / amax), scale = amax / 127. sums[g] = sum of q over each
// group of `group` values (the offsets of unsigned weight codes are applied through them). Eight values at a time:
// the maximum is the same in any order, and rounding to the nearest integer, halves to even, is what nearbyint does
// in the default rounding mode. Blocks are multiples of 32 values and groups of 16 or 32 (the formats').
void quantize_row(const float* x, int64_t k, int block, int group, int8_t* q, float* scale, int16_t* sums) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs interleave 128-bit lanes: undone
    for (int64_t b = 0; b < k / block; ++b) {
        const float* xb = x + b * block;
        __m256 top = _mm256_setzero_ps();
        for (int i = 0; i < block; i += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        scale[b] = amax / 127.f;
        for (int i = 0; i < block; i += 32) {
            __m256i v[4];
            for (int j = 0; j < 4; ++j)
                v[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * j), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            _mm256_storeu_si256((__m256i*)(q + b * block + i), _mm256_permutevar8x32_epi32(bytes, order));
            const int64_t g = (b * block + i) / group;  // |sum| <= 32 * 127: fits int16
            if (group == 32) {
                sums[g] = (int16_t)hsum_i32(_mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3])));
            } else {
                sums[g] = (int16_t)hsum_i32(_mm256_add_epi32(v[0], v[1]));
                sums[g + 1] = (int16_t)hsum_i32(_mm256_add_epi32(v[2], v[3]));
            }
        }
    }
}

// A row's codes in Q4_K's grouped-lane order (the weights' layout, below): per 256 values, byte 64k + 4j + b is
// q[64 (j % 4) + 4 (2k + j / 4) + b] and byte 64k + 32 + 4j + b is q[64 (j % 4) + 32 + 4 (2k + j / 4) + b]
// (k < 4, j < 8, b < 4): the activations of the low and the high nibbles of the weights' k-th 32 bytes.
void grouped_row(const int8_t* q, int64_t k, int8_t* out) {
    // Elements j and j + 4 of each 32 bytes are 8 adjacent bytes of q: four 8-byte loads, then lanes in order.
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    for (int64_t s = 0; s < k / 256; ++s)
        for (int half = 0; half < 8; ++half) {  // 2k + (high nibbles)
            const int8_t* base = q + s * 256 + 32 * (half % 2) + 8 * (half / 2);
            int64_t e[4];
            for (int j = 0; j < 4; ++j) std::memcpy(&e[j], base + 64 * j, 8);
            const __m256i v = _mm256_setr_epi64x(e[0], e[1], e[2], e[3]);
            _mm256_storeu_si256((__m256i*)(out + s * 256 + half * 32), _mm256_permutevar8x32_epi32(v, order));
        }
}

struct QuantizedRows {
    std::vector<int8_t> q;
    std::vector<int8_t> grouped;  // q in grouped-lane order, for the Q4_K kernels that read it (FormatKernels)
    std::vector<float> scale;
    std::vector<int16_t> sums;
    int64_t k, blocks, groups;
    QuantizedRows(const float* x, int64_t rows, int64_t k, int block, int group, bool grouped_order = false)
        : q(rows * k), grouped(grouped_order ? rows * k : 0), scale(rows * (k / block)), sums(rows * (k / group)),
          k(k), blocks(k / block), groups(k / group) {
        at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                quantize_row(x + r * k, k, block, group, &q[r * k], &scale[r * blocks], &sums[r * groups]);
                if (!grouped.empty()) grouped_row(&q[r * k], k, &grouped[r * k]);
            }
        });
    }
    const int8_t* row_q(int64_t r) const { return &q[r * k]; }
    const int8_t* row_grouped(int64_t r) const { return grouped.empty() ? nullptr : &grouped[r * k]; }
    const float* row_scale(int64_t r) const { return &scale[r * blocks]; }
    const int16_t* row_sums(int64_t r) const { return &sums[r * groups]; }
};

inline float hsum_f32(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// Where few activation rows share a weight row, a pass streams the weights once and is bound by memory, yet the
// hardware prefetcher alone left a 1-row pass of the 1.5B at half of this VM's read bandwidth (12 of 24 GB/s).
// The row kernels therefore ask for the codes of a weight row about prefetch_bytes further on (0.77x the time of a
// 1-row pass, 0.92x at 4 rows, measured; no result changes). Full 512-bit tiles of 8 rows are bound by their
// products and do not (it cost them 2 %). A prefetch is a hint: it never faults, even past the end.
// The distance is in bytes, not rows: 8 rows ahead (as first written) is 6 KB of a 1536-wide Q4_K weight but 36 KB
// of the 8960-wide ffn_down, more than a 32 KB L1 holds (AMD Zen 4), so those lines were evicted before use.
constexpr int64_t kPrefetchBytes = 6144;
int64_t prefetch_bytes = kPrefetchBytes;
// How far ahead to prefetch a weight whose rows take row_bytes: whole rows, at least one.
inline int64_t prefetch_rows(int64_t row_bytes) { return std::max<int64_t>(1, prefetch_bytes / row_bytes); }
inline void prefetch(const void* start, int64_t bytes) {
    for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch((const char*)start + offset, _MM_HINT_T0);
}

// ---- weights -----------------------------------------------------------------------------------------------
// Q4_K: 4-bit codes, per 256: d, dmin; per 32: 6-bit scale and min. w = d * sc[g] * code - dmin * mn[g]. In the
// file, byte i of each 64 weights holds weight i (low nibble) and weight 32 + i (high nibble): a superblock's 32
// four-byte elements 8c + u hold weights 4u..4u+3 of groups 2c (low nibbles) and 2c + 1 (high). codes [N, K/2] keep
// them in grouped-lane order (formats.py permutes them at load): element 8k + j holds the file's element 8c + u with
// c = j % 4, u = 2k + j / 4. A 256-bit load of 32 bytes k then has group pair j % 4 in lane j, so dot products
// against the activations in the same order (QuantizedRows::grouped) leave each lane the exact partial sum of one
// group, which one madd by the lane's (sc, sc') pair scales: no shuffle of scales and no second product per
// weight. q4k_file_chunks gives the file's order back where a kernel needs it (AMX).
// Q6_K: 6-bit codes (0..63, weight = code - 32) as the file packs them; per 16: int8 scale; per 256: d. In each 128
// weights, ql byte l (l < 32) holds the low 4 bits of weights l (low nibble) and 64 + l (high), ql byte 32 + l those
// of 32 + l and 96 + l; qh byte l the high 2 bits of l, 32 + l, 64 + l and 96 + l.
// Q4_1: 4-bit codes (nibbles paired as Q4_K's), per 32: d and m; w = d * code + m.
// Q8_0 and Q5_0: int8 codes, per 32: d; w = d * code. (All their operands stored tile by tile, see Q41.)
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
// Q4_1's, Q8_0's and Q5_0's operands tile by tile (formats.py, TILED), element (t * count + e) * 8 + i being row
// 8t + i's element e: the codes as int32 elements (4 bytes), the scales (and minimums) as the file's float16.
struct Q41 { const uint8_t* codes; const uint16_t* d_tiles; const uint16_t* m_tiles; int64_t k; };

// The file's 32-byte chunks c < 4 (group pairs 2c, 2c + 1) of a superblock stored in grouped-lane order: chunk c is
// [V0[c], V0[c + 4], V1[c], V1[c + 4], V2[c], V2[c + 4], V3[c], V3[c + 4]] of the stored vectors Vk (int32 lanes).
inline void q4k_file_chunks(const uint8_t* superblock, __m256i chunk[4]) {
    const __m256i pairs = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // 64-bit element c: (V[c], V[c + 4])
    __m256i x[4];
    for (int k = 0; k < 4; ++k) x[k] = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i*)(superblock + 32 * k)), pairs);
    const __m256i lo01 = _mm256_unpacklo_epi64(x[0], x[1]), hi01 = _mm256_unpackhi_epi64(x[0], x[1]);  // c = 0, 2 | 1, 3
    const __m256i lo23 = _mm256_unpacklo_epi64(x[2], x[3]), hi23 = _mm256_unpackhi_epi64(x[2], x[3]);
    chunk[0] = _mm256_permute2x128_si256(lo01, lo23, 0x20);
    chunk[1] = _mm256_permute2x128_si256(hi01, hi23, 0x20);
    chunk[2] = _mm256_permute2x128_si256(lo01, lo23, 0x31);
    chunk[3] = _mm256_permute2x128_si256(hi01, hi23, 0x31);
}

// Q6_K's 6-bit codes of one half (128 weights) of superblock s of a one-row weight: v[j] holds weights 32j..32j+31
// of that half (as the row kernels and the AMX tiles both read them).
inline void q6k_codes(const Q6K& w, int64_t s, int half, __m256i v[4]) {
    const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
    const __m256i a0 = _mm256_loadu_si256((const __m256i*)(w.ql + (s * 2 + half) * 64));
    const __m256i a1 = _mm256_loadu_si256((const __m256i*)(w.ql + (s * 2 + half) * 64 + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i*)(w.qh + (s * 2 + half) * 32));
    v[0] = _mm256_or_si256(_mm256_and_si256(a0, low), _mm256_and_si256(_mm256_slli_epi16(h, 4), high));
    v[1] = _mm256_or_si256(_mm256_and_si256(a1, low), _mm256_and_si256(_mm256_slli_epi16(h, 2), high));
    v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a0, 4), low), _mm256_and_si256(h, high));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a1, 4), low), _mm256_and_si256(_mm256_srli_epi16(h, 2), high));
}
struct Q80 { const int8_t* codes; const uint16_t* d_tiles; int64_t k; };

// The two float numerics of Q4_K and Q6_K (kernel_rows.h explains them): Totals where AMX or AVX2's tiles run the
// products, Lanes on VNNI machines without AMX unless a process asks for Totals. One process computes in one of
// them (totals_in_use), whatever the instruction set and row count.
struct Lanes {};
struct Totals {};

// Q4_K's fused column tiles run on 512-bit vectors (kernel_wide_columns.h) for matrices of at least this many weights
// (output columns x inputs), on 256-bit ones below: the 1.5B's gate and up (17920 x 1536) and down (1536 x 8960)
// projections gain, its smaller ones (up to 2048 x 1536) were no faster (docs/engines.md). The same results either
// way; set_wide_columns_from moves it (the tests and the bench compare them).
constexpr int64_t kWideColumnsFrom = int64_t(1) << 23;
int64_t wide_columns_from = kWideColumnsFrom;

// ---- the kernels, once per instruction set ------------------------------------------------------------------

namespace avx2 {
constexpr int kRowTile = 4;  // 16 vector registers: 4 rows' integer and float accumulators and the weights fit
// Q4_K's row kernels: rows of a tile; output columns that share each load of the activations from kQ4KPairRows rows.
constexpr int kQ4KRows = 4, kQ4KColumns = 1, kQ4KPairRows = 0;
constexpr int kSplit = 0;    // madd + add: a chain of one-cycle adds
inline __m256i dot_add(__m256i acc, __m256i p, __m256i s) { return _mm256_add_epi32(acc, _mm256_madd_epi16(p, s)); }
inline __m256i dot4(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) { return _mm256_add_epi32(acc, dot4(u, s)); }
constexpr bool kDpbusd = false;  // column tiles: int16 sums of maddubs (kernel_columns.h)
#include "kernel_rows.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {
constexpr int kRowTile = 8;  // AVX-512 has 32 vector registers
// Q4_K's row kernels: in tiles of 3-4 rows, 2 output columns share each load of the activations (up to 16 integer
// accumulators), in the pairs form (kernel_rows.h); tiles of 1-2 rows compute one column at a time, where two
// weight rows streamed at once read memory more slowly.
constexpr int kQ4KRows = 4, kQ4KColumns = 2, kQ4KPairRows = 3;
constexpr int kSplit = 2;    // dpwssd: a chain of five-cycle fused products
inline __m256i dot_add(__m256i acc, __m256i p, __m256i s) { return _mm256_dpwssd_epi32(acc, p, s); }
inline __m256i dot4(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
constexpr bool kDpbusd = true;  // column tiles: dpbusd's int32 sums (kernel_columns.h)
#define SPECDEC_WIDE_TILES  // full tiles of Q6_K on 512-bit vectors (kernel_wide_tiles.h)
#include "kernel_rows.h"
#undef SPECDEC_WIDE_TILES
}  // namespace vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
namespace amx {
#include "kernel_amx.h"
}  // namespace amx
#pragma GCC pop_options

// The instruction set the products run on: "amx" where the CPU has AMX-INT8 and the kernel lets this process use
// its tiles (calls of at least kAmxMinRows rows, Q4_K's of kQ4KAmxMinRows, go to the tiles, fewer to the VNNI
// kernels), else "vnni" where it has AVX512-VNNI (Ice Lake and later Xeons, AMD Zen 4 and later), else "avx2";
// set_isa forces a lesser one (the tests compare them). All compute the same results bit for bit.
bool cpu_has_vnni() {  // what the vnni namespace is compiled for
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
}

// Linux hands out AMX's tile state only to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA); without it the first tile instruction raises SIGILL.
bool amx_permitted() {
    static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    return permitted;
}

bool cpu_has_amx() {
    return cpu_has_vnni() && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") && amx_permitted();
}

// Below this many rows the VNNI kernels are faster than a tile pass, whose unpacking of the weights costs the same
// for 1 row as for 16 (the 1.5B's 8960 x 1536 Q4_K block: 1.5x the VNNI kernels' time at 8 rows, 0.9x at 16, 0.35x
// at 256; its 1536 x 8960 Q6_K block 1.0x at 16, 0.5x at 256).
constexpr int64_t kAmxMinRows = 16;
// Q4_K's passes of up to 24 rows run faster on the VNNI column tiles than on a tile pass, its large matrices on
// 512-bit vectors, two column tiles side by side (kernel_wide_columns.h; docs/engines.md).
constexpr int64_t kQ4KAmxMinRows = 25;

// Q4_K's VNNI column tiles in Totals serve passes from this many rows, where they are measured faster than the
// row kernels (docs/engines.md): 5 below AMX's passes on a Xeon (where the row kernels would run a tile of 4 rows
// and one of 1), 12 on VNNI machines without AMX (a Zen 4), whose row kernels stay ahead for a few rows more.
// set_vnni_column_rows overrides it (0: this default), for the tests and the bench, which run the tiles' fused form
// (up to two row tiles) at any row count, on any VNNI machine.
int64_t vnni_column_rows = 0;
int64_t vnni_column_min_rows(bool amx) { return vnni_column_rows ? vnni_column_rows : amx ? 5 : 12; }

enum class Isa { avx2, vnni, amx };
Isa isa_in_use = cpu_has_amx() ? Isa::amx : cpu_has_vnni() ? Isa::vnni : Isa::avx2;
// Totals where the fastest kernels yield whole superblock totals: AMX's tiles, and AVX2's column tiles on machines
// without AVX512-VNNI. Lanes on VNNI machines without AMX, whose row kernels it costs less for a step and a few
// rows, and whose serving path ran faster in it (docs/engines.md).
bool totals_in_use = isa_in_use != Isa::vnni;

std::string isa() { return isa_in_use == Isa::amx ? "amx" : isa_in_use == Isa::vnni ? "vnni" : "avx2"; }
std::string numerics() { return totals_in_use ? "totals" : "lanes"; }

void set_isa(const std::string& name) {
    TORCH_CHECK(name == "avx2" || name == "vnni" || name == "amx", "isa must be avx2, vnni or amx, not ", name);
    TORCH_CHECK(name == "avx2" || cpu_has_vnni(), "this CPU lacks AVX512-VNNI");
    TORCH_CHECK(name != "amx" || cpu_has_amx(), "this CPU (or this kernel) gives no AMX tiles");
    TORCH_CHECK(name != "amx" || totals_in_use, "AMX computes in the totals numerics: set_numerics('totals') first");
    isa_in_use = name == "amx" ? Isa::amx : name == "vnni" ? Isa::vnni : Isa::avx2;
}

// For the tests: both numerics are batch-invariant on every instruction set; only AMX needs Totals.
void set_numerics(const std::string& name) {
    TORCH_CHECK(name == "lanes" || name == "totals", "numerics must be lanes or totals, not ", name);
    TORCH_CHECK(name == "totals" || isa_in_use != Isa::amx, "AMX computes in the totals numerics: set_isa('vnni') first");
    totals_in_use = name == "totals";
}

template <typename W>
using KernelFn = void (*)(const W&, const QuantizedRows&, int64_t, int64_t, float*);

// Q4_K's and Q6_K's column tiles (kernel_columns.h) in Totals, or their row kernels (the tests and the bench
// compare them).
bool column_tiles = true;

// A format's kernels: on each instruction set in each numerics, on AMX (Totals; none for the formats without) and
// in column tiles (Totals: AVX2's, and for Q4_K a VNNI form for the passes below AMX's).
template <typename W>
struct FormatKernels {
    KernelFn<W> avx2_lanes, vnni_lanes, avx2_totals, vnni_totals, amx = nullptr, avx2_columns = nullptr, vnni_columns = nullptr;
    // Q4_K: the row kernels (and the column kernels where they run them) read the activations in grouped-lane
    // order as well; the tiles read them as quantized.
    bool rows_read_grouped = false;
    int64_t amx_min_rows = kAmxMinRows;  // the least row count AMX's tiles serve
    bool reads_grouped(KernelFn<W> kernel, int64_t rows) const {
        return rows_read_grouped && kernel != amx && (kernel != avx2_columns || avx2::q4k_columns_on_row_kernels(rows)) &&
               (kernel != vnni_columns || vnni::q4k_columns_on_row_kernels(rows));
    }
    KernelFn<W> pick(int64_t rows) const {
        if (isa_in_use == Isa::amx && amx && rows >= amx_min_rows) return amx;
        if (isa_in_use == Isa::avx2 && totals_in_use && column_tiles && avx2_columns) return avx2_columns;
        if (isa_in_use != Isa::avx2 && totals_in_use && column_tiles && vnni_columns && rows >= vnni_column_min_rows(isa_in_use == Isa::amx))
            return vnni_columns;
        if (isa_in_use == Isa::avx2) return totals_in_use ? avx2_totals : avx2_lanes;
        return totals_in_use ? vnni_totals : vnni_lanes;
    }
    std::string name(int64_t rows) const {
        const KernelFn<W> k = pick(rows);
        return k == amx            ? "amx"
               : k == avx2_columns ? "avx2 columns"
               : k == vnni_columns ? "vnni columns"
               : k == avx2_totals || k == avx2_lanes ? "avx2 rows"
                                                     : "vnni rows";
    }
};

// y = x W^T for one format: the rows quantized once, then the product on the chosen kernel.
template <typename W>
torch::Tensor product(const W& w, const torch::Tensor& x, int64_t out_features, int block, int group, const FormatKernels<W>& kernels) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be [rows, K] float32");
    TORCH_CHECK(x.size(1) == w.k, "x has ", x.size(1), " features, the weight ", w.k);
    const int64_t rows = x.size(0);
    auto y = torch::empty({rows, out_features}, x.options());
    if (rows == 0) return y;
    const KernelFn<W> kernel = kernels.pick(rows);
    QuantizedRows a(x.data_ptr<float>(), rows, w.k, block, group, kernels.reads_grouped(kernel, rows));
    kernel(w, a, rows, out_features, y.data_ptr<float>());
    return y;
}

int64_t tiles_of(int64_t n) { return (n + 7) / 8; }

void check_weight(const torch::Tensor& t, torch::ScalarType type, int64_t n, int64_t per_row, const char* name) {
    TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.numel() == n * per_row, name, ": expected ", n, " x ",
                per_row, " contiguous values of ", c10::toString(type));
}

const FormatKernels<Q4K> q4k_kernels{&avx2::q4k<Lanes>, &vnni::q4k<Lanes>, &avx2::q4k<Totals>, &vnni::q4k<Totals>, &amx::q4k, &avx2::q4k_columns, &vnni::q4k_columns, true, kQ4KAmxMinRows};

torch::Tensor q4k_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor sc, torch::Tensor mn, torch::Tensor d,
                         torch::Tensor dmin, int64_t n, int64_t k) {
    TORCH_CHECK(k % 256 == 0, "Q4_K needs K divisible by 256");
    check_weight(codes, torch::kUInt8, n, k / 2, "codes");
    check_weight(sc, torch::kUInt8, n, k / 32, "sc");
    check_weight(mn, torch::kUInt8, n, k / 32, "mn");
    check_weight(d, torch::kFloat32, n, k / 256, "d");
    check_weight(dmin, torch::kFloat32, n, k / 256, "dmin");
    Q4K w{codes.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(), mn.data_ptr<uint8_t>(), d.data_ptr<float>(), dmin.data_ptr<float>(), k};
    return product(w, x, n, 256, 32, q4k_kernels);
}

const FormatKernels<Q6K> q6k_kernels{&avx2::q6k<Lanes>, &vnni::q6k<Lanes>, &avx2::q6k<Totals>, &vnni::q6k<Totals>, &amx::q6k, &avx2::q6k_columns};

torch::Tensor q6k_matmul(torch::Tensor x, torch::Tensor ql, torch::Tensor qh, torch::Tensor sc, torch::Tensor d, int64_t n,
                         int64_t k) {
    TORCH_CHECK(k % 256 == 0, "Q6_K needs K divisible by 256");
    check_weight(ql, torch::kUInt8, n, k / 2, "ql");
    check_weight(qh, torch::kUInt8, n, k / 4, "qh");
    check_weight(sc, torch::kInt8, n, k / 16, "sc");
    check_weight(d, torch::kFloat32, n, k / 256, "d");
    Q6K w{ql.data_ptr<uint8_t>(), qh.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), d.data_ptr<float>(), k};
    return product(w, x, n, 256, 16, q6k_kernels);
}

torch::Tensor q41_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor m, int64_t n, int64_t k) {
    TORCH_CHECK(k % 64 == 0, "Q4_1 needs K divisible by 64");
    check_weight(codes, torch::kInt32, tiles_of(n) * 8, k / 8, "codes (tile by tile)");
    check_weight(d, torch::kFloat16, tiles_of(n) * 8, k / 32, "d (tile by tile)");
    check_weight(m, torch::kFloat16, tiles_of(n) * 8, k / 32, "m (tile by tile)");
    Q41 w{(const uint8_t*)codes.data_ptr<int32_t>(), (const uint16_t*)d.data_ptr<at::Half>(), (const uint16_t*)m.data_ptr<at::Half>(), k};
    return product(w, x, n, 32, 32, FormatKernels<Q41>{&avx2::q41, &vnni::q41, &avx2::q41, &vnni::q41});
}

torch::Tensor q80_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor d, int64_t n, int64_t k) {
    TORCH_CHECK(k % 32 == 0, "Q8_0 needs K divisible by 32");
    check_weight(codes, torch::kInt32, tiles_of(n) * 8, k / 4, "codes (tile by tile)");
    check_weight(d, torch::kFloat16, tiles_of(n) * 8, k / 32, "d (tile by tile)");
    Q80 w{(const int8_t*)codes.data_ptr<int32_t>(), (const uint16_t*)d.data_ptr<at::Half>(), k};
    return product(w, x, n, 32, 32, FormatKernels<Q80>{&avx2::q80, &vnni::q80, &avx2::q80, &vnni::q80});
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
#include "attention_avx512.h"
#pragma GCC pop_options
#include "decoder_ops.h"
#include "decoder_layers.h"

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

// Q4_K's codes [N, K/2] from grouped-lane order back to the file's through q4k_file_chunks, for the tests (the AMX
// tiles unpack through it, and this CPU may have none).
torch::Tensor q4k_file_order(torch::Tensor codes) {
    TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.dim() == 2 && codes.size(1) % 128 == 0,
                "codes must be [N, K/2] contiguous uint8 with K divisible by 256");
    auto out = torch::empty_like(codes);
    const uint8_t* in = codes.data_ptr<uint8_t>();
    uint8_t* file = out.data_ptr<uint8_t>();
    for (int64_t s = 0; s < codes.numel() / 128; ++s) {
        __m256i chunks[4];
        q4k_file_chunks(in + s * 128, chunks);
        for (int c = 0; c < 4; ++c) _mm256_storeu_si256((__m256i*)(file + s * 128 + c * 32), chunks[c]);
    }
    return out;
}

// Which kernels a product of this format and row count runs on now: "avx2 columns" (AVX2's tiles in Totals,
// q4k_columns and q6k_columns, which leave some row counts to the row kernels), "avx2 rows", "vnni rows", "amx".
std::string product_kernel(const std::string& format, int64_t rows) {
    TORCH_CHECK(format == "q4k" || format == "q6k", "product_kernel knows q4k and q6k, not ", format);
    return format == "q4k" ? q4k_kernels.name(rows) : q6k_kernels.name(rows);
}
void set_vnni_column_rows(int64_t rows) {
    TORCH_CHECK(rows >= 0, "the VNNI column tiles' least row count must be 0 (the default) or more, not ", rows);
    vnni_column_rows = rows;
}
bool column_tiles_in_use() { return column_tiles; }
void set_column_tiles(bool on) { column_tiles = on; }
int64_t wide_columns_least_weights() { return wide_columns_from; }
void set_wide_columns_from(int64_t weights) {
    TORCH_CHECK(weights >= 0, "the 512-bit column tiles' least matrix size must be 0 or more weights, not ", weights);
    wide_columns_from = weights;
}

// The prefetch distance in bytes (kPrefetchBytes by default): a hint, so any value computes the same results; the
// bench and tests set it to compare.
int64_t prefetch_distance() { return prefetch_bytes; }
void set_prefetch_distance(int64_t bytes) {
    TORCH_CHECK(bytes > 0, "the prefetch distance must be positive, not ", bytes);
    prefetch_bytes = bytes;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    // The compute functions run without the GIL: a worker's event loop must go on reading and answering its
    // streams while a pass runs on its compute thread. Held, a Python thread beside a product stopped for 56-65 %
    // of it (measured; tests/service/test_gguf_engine.py checks that a thread wakes during a product).
    const auto no_gil = py::call_guard<py::gil_scoped_release>();
    m.def("q4k_matmul", &q4k_matmul, no_gil);
    m.def("q6k_matmul", &q6k_matmul, no_gil);
    m.def("q41_matmul", &q41_matmul, no_gil);
    m.def("q80_matmul", &q80_matmul, no_gil);
    m.def("quantize_activations", &quantize_activations, no_gil);
    m.def("q4k_file_order", &q4k_file_order, no_gil);
    m.def("rms_norm", &rms_norm, no_gil);
    m.def("rotary", &rotary, no_gil);
    m.def("attend_sessions", &attend_sessions, no_gil);
    py::class_<DecoderLayers>(m, "DecoderLayers")
        .def(py::init<int64_t, int64_t>(), py::arg("heads"), py::arg("kv_heads"))
        .def("add_layer", &DecoderLayers::add_layer)
        .def("__len__", &DecoderLayers::size)
        .def("forward", &DecoderLayers::forward, no_gil);
    m.def("isa", &isa);
    m.def("set_isa", &set_isa);
    m.def("numerics", &numerics);
    m.def("set_numerics", &set_numerics);
    m.def("product_kernel", &product_kernel);
    m.def("column_tiles", &column_tiles_in_use);
    m.def("set_column_tiles", &set_column_tiles);
    m.def("wide_columns_from", &wide_columns_least_weights);
    m.def("set_wide_columns_from", &set_wide_columns_from);
    m.def("set_vnni_column_rows", &set_vnni_column_rows);
    m.def("prefetch_distance", &prefetch_distance);
    m.def("set_prefetch_distance", &set_prefetch_distance);
}
