// The row kernels and their driver, included by kernels.cpp once per instruction set, each time in a namespace
// that defines
//   kRowTile          activation rows that share one unpacking of a weight row;
//   dot_add(acc, p, s) acc + the int32 pair sums of the int16 products p * s (AVX2: madd + add; VNNI: dpwssd);
//   dot4(u, s)         the int32 sums of four products of unsigned bytes u and signed bytes s (maddubs + madd; dpbusd).
//   kSplit            up to this many rows, a row's integer sums run in two chains: with one or two rows the
//                     latency of dependent dot products, not their count, would bound the loop.
// Both instruction sets compute the same exact integer sums and then the same float operations in the same order,
// so they agree bit for bit: which one a machine runs never changes a result.

// A tile's activation rows: their int8 codes (Q4_K's also in grouped-lane order), block scales and group sums.
template <int R>
struct RowTile {
    const int8_t* q[R];
    const int8_t* grouped[R];
    const float* scale[R];
    const int16_t* sums[R];
    RowTile(const QuantizedRows& a, const int64_t* rows) {
        for (int r = 0; r < R; ++r) {
            q[r] = a.row_q(rows[r]);
            grouped[r] = a.row_grouped(rows[r]);
            scale[r] = a.row_scale(rows[r]);
            sums[r] = a.row_sums(rows[r]);
        }
    }
};

// ---- Q4_K: 4-bit codes, per 256: d, dmin; per 32: 6-bit scale and min --------------------------------------
// codes [N, K/2] in grouped-lane order (kernels.cpp). w = d * sc[g] * code - dmin * mn[g].

// The float accumulation of Q4_K and Q6_K, in one of two numerics (Numerics in kernels.cpp), each written once for
// every kernel that runs it:
//   Lanes   each superblock's 8 int32 lanes (the partial sums the 256-bit products leave) converted and added
//           into 8 float lanes per row, one fused multiply-add each; the lanes summed once at the end. No
//           horizontal work per superblock: the cheapest on the row kernels; the numerics of VNNI machines
//           without AMX.
//   Totals  each superblock's integer sums reduced to one int32 per row first (exact in any order), then one
//           fused multiply-add per row and superblock, acc = total * (d * the row's activation scale) + acc, in the
//           order of the superblocks; a tile's rows in one vector, a row per lane. AMX's tile products yield whole
//           totals, not the row kernels' lanes, as do the column tiles: the numerics of AMX and AVX2 machines.
// A lane's operations are the same whatever the other lanes hold, so within one numerics every kernel (256- and
// 512-bit, AMX) and every row count gives each row the same bits.

// [sum of v[0]'s lanes, ..., sum of v[R - 1]'s, 0, ...]: a tile's superblock totals, one row per lane (exact).
template <int R>
inline __m256i row_totals(const __m256i* v) {
    static_assert(R >= 1 && R <= 8, "one lane per row");
    __m256i w[8];
    for (int r = 0; r < 8; ++r) w[r] = r < R ? v[r] : _mm256_setzero_si256();
    const __m256i t0 = _mm256_hadd_epi32(w[0], w[1]), t1 = _mm256_hadd_epi32(w[2], w[3]);
    const __m256i u0 = _mm256_hadd_epi32(t0, t1);  // rows 0-3: [lanes 0-3 | lanes 4-7]
    if constexpr (R <= 4)
        return _mm256_zextsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(u0), _mm256_extracti128_si256(u0, 1)));
    const __m256i t2 = _mm256_hadd_epi32(w[4], w[5]), t3 = _mm256_hadd_epi32(w[6], w[7]);
    const __m256i u1 = _mm256_hadd_epi32(t2, t3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// d * each row's activation scale of superblock s, one row per lane: the multiplier of every row's step.
template <int R>
inline __m256 row_scales(float d, const RowTile<R>& x, int64_t s) {
    alignas(32) float scales[8] = {};
    for (int r = 0; r < R; ++r) scales[r] = x.scale[r][s];
    return _mm256_mul_ps(_mm256_set1_ps(d), _mm256_load_ps(scales));
}

template <int R>
inline void store_rows(__m256 v, int64_t n, float* out[R]) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (int r = 0; r < R; ++r) out[r][n] = lanes[r];
}

// One superblock's step for a tile's rows: lanes[r], row r's int32 lanes of the superblock.
template <int R>
inline __m256 rows_step(__m256 acc, const __m256i* lanes, float d, const RowTile<R>& x, int64_t s) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(row_totals<R>(lanes)), row_scales<R>(d, x, s), acc);
}

// Q4_K's mins term of a superblock for each row: the sum over its 8 groups of mn[g] * (the row's code sum in g), as
// int32 lanes (row_totals adds them up).
template <int R>
inline void q4k_min_lanes(__m128i mins, const RowTile<R>& x, int64_t s, __m256i* out) {
    for (int r = 0; r < R; ++r)
        out[r] = _mm256_zextsi128_si256(_mm_madd_epi16(mins, _mm_loadu_si128((const __m128i*)(x.sums[r] + s * 8))));
}

template <int R, class N>
struct Q4KAcc;

// A row's Q4_K output in Lanes: its 8 lanes of the products' term summed, less its 4 lanes of the mins' term.
inline float q4k_lanes_result(__m256 acc, __m128 acc_min) {
    __m128 t = _mm_add_ps(acc_min, _mm_movehl_ps(acc_min, acc_min));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return hsum_f32(acc) - _mm_cvtss_f32(t);
}

// Q4_K in Lanes: per row, 8 float lanes of the products' term and 4 of the mins'.
template <int R>
struct Q4KAcc<R, Lanes> {
    __m256 acc[R];
    __m128 acc_min[R];
    Q4KAcc() {
        for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); acc_min[r] = _mm_setzero_ps(); }
    }
    // isum[r]: row r's int32 lanes of superblock s; mins: its 8 group mins as int16.
    void add(const __m256i* isum, __m128i mins, const RowTile<R>& x, int64_t s, float d, float dmin) {
        for (int r = 0; r < R; ++r) {
            // The mins' term, sum over the 8 groups of mn[g] * (sum of the row's codes in g), as 4 int32 lanes.
            const __m128i imin = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i*)(x.sums[r] + s * 8)));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * x.scale[r][s]), acc[r]);
            acc_min[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(imin), _mm_set1_ps(dmin * x.scale[r][s]), acc_min[r]);
        }
    }
    void store(float** out, int64_t n) const { for (int r = 0; r < R; ++r) out[r][n] = q4k_lanes_result(acc[r], acc_min[r]); }
};

// Q4_K in Totals: both terms' totals, a row per lane.
template <int R>
struct Q4KAcc<R, Totals> {
    __m256 acc = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
    void add(const __m256i* isum, __m128i mins, const RowTile<R>& x, int64_t s, float d, float dmin) {
        __m256i min_lanes[R];
        q4k_min_lanes<R>(mins, x, s, min_lanes);
        if constexpr (R <= 4) {
            // Both terms of up to 4 rows in one vector, acc's in lanes 0..R-1 and acc_min's in R..2R-1: one
            // reduction and one fused multiply-add where rows_step would take two (the same operations per lane).
            __m256i both[2 * R];
            alignas(32) float scales[8] = {};
            for (int r = 0; r < R; ++r) {
                both[r] = isum[r];
                both[R + r] = min_lanes[r];
                scales[r] = d * x.scale[r][s];
                scales[R + r] = dmin * x.scale[r][s];
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(row_totals<2 * R>(both)), _mm256_load_ps(scales), acc);
        } else {
            acc = rows_step<R>(acc, isum, d, x, s);
            acc_min = rows_step<R>(acc_min, min_lanes, dmin, x, s);
        }
    }
    void store(float** out, int64_t n) const {
        alignas(32) float lanes[8], min_lanes[8];
        _mm256_store_ps(lanes, acc);
        _mm256_store_ps(min_lanes, acc_min);
        for (int r = 0; r < R; ++r) out[r][n] = R <= 4 ? lanes[r] - lanes[R + r] : lanes[r] - min_lanes[r];
    }
};

// Superblock s of one-row weights for a tile's rows: isum[r], row r's int32 lanes. Lane j holds, for group pair
// h = j % 4 and the units u = j / 4, 2 + j / 4, 4 + j / 4, 6 + j / 4 (4 weights each) of both its groups,
//   E_j = sum of code * q over those 16 weights of group 2h,  O_j = the same over group 2h + 1,
//   lane j = sc[2h] * E_j + sc[2h + 1] * O_j
// exact integers, whichever of the two forms below computes them (so both give the same bits):
//   scaled  per 32 bytes k of the weights, maddubs of the low (high) nibbles and the activations' grouped bytes 64k
//           (64k + 32), then dot_add by the lanes' sc[2h] (sc[2h + 1]) as int16: the file kernels' instructions.
//   pairs   dot4 (dpbusd) of the same into E and O, then one madd of the int16 pair (E_j, O_j) by (sc[2h],
//           sc[2h + 1]) (|E_j|, |O_j| <= 16 * 15 * 127 < 2^15): half the products, for C output columns that share
//           each load of the activations: VNNI's 4-row tiles. Tiles of 1-3 rows keep one column and the scaled
//           form, which ran faster there (a pass of 1-2 rows streams the weights from memory, and two weight rows
//           at once read them more slowly: docs/engines.md).
template <int R>
inline void q4k_superblock_scaled(const Q4K& w, int64_t s, const RowTile<R>& x, __m256i* isum) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(w.sc + s * 8))));
    const __m256i s_lo = _mm256_shuffle_epi8(scales, _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                                                      0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13));
    const __m256i s_hi = _mm256_shuffle_epi8(scales, _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
                                                                      2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15));
    __m256i isum2[R];  // a second chain for few rows (see kSplit)
    for (int r = 0; r < R; ++r) isum[r] = isum2[r] = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w.codes + s * 128 + k * 32));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
            const int8_t* q = x.grouped[r] + s * 256 + k * 64;
            const __m256i p_lo = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)q));
            const __m256i p_hi = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(q + 32)));
            if constexpr (R <= kSplit) {
                isum[r] = dot_add(isum[r], p_lo, s_lo);
                isum2[r] = dot_add(isum2[r], p_hi, s_hi);
            } else {
                isum[r] = dot_add(dot_add(isum[r], p_lo, s_lo), p_hi, s_hi);
            }
        }
    }
    if constexpr (R <= kSplit)
        for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(isum[r], isum2[r]);
}

template <int C, int R>
inline void q4k_superblock_pairs(const Q4K* w, int64_t s, const RowTile<R>& x, __m256i (*isum)[R]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i e[C][R], o[C][R];
    for (int c = 0; c < C; ++c)
        for (int r = 0; r < R; ++r) e[c][r] = o[c][r] = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) {
        __m256i lo[C], hi[C];
        for (int c = 0; c < C; ++c) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(w[c].codes + s * 128 + k * 32));
            lo[c] = _mm256_and_si256(v, low);
            hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        for (int r = 0; r < R; ++r) {
            const int8_t* q = x.grouped[r] + s * 256 + k * 64;
            const __m256i q_lo = _mm256_loadu_si256((const __m256i*)q), q_hi = _mm256_loadu_si256((const __m256i*)(q + 32));
            for (int c = 0; c < C; ++c) {
                e[c][r] = dot4_add(e[c][r], lo[c], q_lo);
                o[c][r] = dot4_add(o[c][r], hi[c], q_hi);
            }
        }
    }
    for (int c = 0; c < C; ++c) {
        // int32 lane j: (sc[2h], sc[2h + 1]) as int16, h = j % 4.
        const __m256i pairs = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(w[c].sc + s * 8))));
        for (int r = 0; r < R; ++r)
            isum[c][r] = _mm256_madd_epi16(_mm256_blend_epi16(e[c][r], _mm256_slli_epi32(o[c][r], 16), 0xAA), pairs);
    }
}

// Superblock s's 8 group minimums as int16.
inline __m128i q4k_mins(const Q4K& w, int64_t s) { return _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(w.mn + s * 8))); }

// Output columns n..n + C - 1 for a tile's R rows (C > 1: the pairs form).
template <int C, int R, class N>
void q4k_rows(const Q4K& weights, int64_t n, const QuantizedRows& a, const int64_t* rows, float* out[R]) {
    Q4K w[C];
    for (int c = 0; c < C; ++c) w[c] = weights.row(n + c);
    // The same superblock, rows further on: at least the next call's C rows.
    const int64_t ahead = std::max<int64_t>(C, prefetch_rows(weights.k / 2)) * (weights.k / 2);
    const RowTile<R> x(a, rows);
    Q4KAcc<R, N> acc[C];
    for (int64_t s = 0; s < weights.k / 256; ++s) {
        for (int c = 0; c < C; ++c) prefetch(w[c].codes + ahead + s * 128, 128);
        __m256i isum[C][R];
        if constexpr (C == 1) q4k_superblock_scaled<R>(w[0], s, x, isum[0]);
        else q4k_superblock_pairs<C, R>(w, s, x, isum);
        for (int c = 0; c < C; ++c) acc[c].add(isum[c], q4k_mins(w[c], s), x, s, w[c].d[s], w[c].dmin[s]);
    }
    for (int c = 0; c < C; ++c) acc[c].store(out, n + c);
}

// ---- Q6_K: 6-bit codes (0..63, weight = code - 32) as the file packs them; per 16: int8 scale; per 256: d ------
// In each 128 weights, ql byte l (l < 32) holds the low 4 bits of weights l (low nibble) and 64 + l (high), ql
// byte 32 + l those of 32 + l and 96 + l; qh byte l the high 2 bits of l, 32 + l, 64 + l and 96 + l.


// A superblock's start, scales16 holding its 16 group scales as int16: minus the codes' offset of 32, 32 * sum
// over the groups of sc[g] * (sum of the row's codes in g), as 8 int32 lanes (shared by every Q6_K kernel).
inline __m256i q6k_offset(__m256i scales16, const int16_t* sums) {
    const __m256i offset = _mm256_madd_epi16(scales16, _mm256_loadu_si256((const __m256i*)sums));
    return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5));
}


template <int R, class N>
struct Q6KAcc;

// Q6_K in Lanes: 8 float lanes per row.
template <int R>
struct Q6KAcc<R, Lanes> {
    __m256 acc[R];
    Q6KAcc() { for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(); }
    void add(const __m256i* isum, const RowTile<R>& x, int64_t s, float d) {
        for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * x.scale[r][s]), acc[r]);
    }
    void store(float** out, int64_t n) const { for (int r = 0; r < R; ++r) out[r][n] = hsum_f32(acc[r]); }
};

// Q6_K in Totals: a row per lane.
template <int R>
struct Q6KAcc<R, Totals> {
    __m256 acc = _mm256_setzero_ps();
    void add(const __m256i* isum, const RowTile<R>& x, int64_t s, float d) { acc = rows_step<R>(acc, isum, d, x, s); }
    void store(float** out, int64_t n) const { store_rows<R>(acc, n, out); }
};

// Superblock s of a one-row weight w for a tile's rows: isum[r], row r's int32 lanes of the sum of
// sc * (code - 32) * q.
template <int R>
inline void q6k_superblock(const Q6K& w, int64_t s, const RowTile<R>& x, __m256i* isum) {
    // Bytes 0-1 of each int32 into the low 128 bits' int16 lanes, bytes 2-3 into the high ones'.
    const __m256i split = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                           2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    __m256i isum2[R];  // a second chain for few rows (see kSplit)
    // int16 lane g = sc[g]; int32 element c therefore holds the scales of chunk c's two groups, 2c and 2c + 1.
    const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w.sc + s * 16)));
    for (int r = 0; r < R; ++r) {
        isum[r] = q6k_offset(scales16, x.sums[r] + s * 16);
        isum2[r] = _mm256_setzero_si256();
    }
    for (int half = 0; half < 2; ++half) {
        __m256i v[4];  // weights 32j..32j+31 of this 128
        q6k_codes(w, s, half, v);
        for (int j = 0; j < 4; ++j) {
            const int c = half * 4 + j;
            // int16 lanes 0..7 come from bytes 0..15 (group 2c), lanes 8..15 from bytes 16..31 (group 2c + 1).
            const __m256i scales = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(scales16, _mm256_set1_epi32(c)), split);
            for (int r = 0; r < R; ++r) {
                const __m256i p = _mm256_maddubs_epi16(v[j], _mm256_loadu_si256((const __m256i*)(x.q[r] + s * 256 + c * 32)));
                if (R <= kSplit && (j & 1)) isum2[r] = dot_add(isum2[r], p, scales);
                else isum[r] = dot_add(isum[r], p, scales);
            }
        }
    }
    if constexpr (R <= kSplit)
        for (int r = 0; r < R; ++r) isum[r] = _mm256_add_epi32(isum[r], isum2[r]);
}

template <int R, class N>
void q6k_rows(const Q6K& weights, int64_t n, const QuantizedRows& a, const int64_t* rows, float* out[R]) {
    const Q6K w = weights.row(n);
    const int64_t ahead = prefetch_rows(w.k / 2 + w.k / 4);
    const uint8_t* ql_ahead = w.ql + ahead * (w.k / 2);  // the same superblock, rows further on
    const uint8_t* qh_ahead = w.qh + ahead * (w.k / 4);
    const RowTile<R> x(a, rows);
    Q6KAcc<R, N> acc;
    for (int64_t s = 0; s < w.k / 256; ++s) {
        prefetch(ql_ahead + s * 128, 128);
        prefetch(qh_ahead + s * 64, 64);
        __m256i isum[R];
        q6k_superblock<R>(w, s, x, isum);
        acc.add(isum, x, s, w.d[s]);
    }
    acc.store(out, n);
}

// ---- Q4_1, Q8_0 and Q5_0: one scale per 32 weights, in column tiles (kernel_columns.h) ------------------------

#include "kernel_columns.h"
#ifdef SPECDEC_WIDE_TILES
#include "kernel_wide_columns.h"  // Q4_K's fused column tiles on 512-bit vectors, two tiles side by side
#endif

// ---- one row of Q4_K and Q6_K in 8-column tiles, in the file's layout ------------------------------------------
// A 1-row product (a step) in the Totals numerics without the column tiles' transposes: each of a tile's 8 columns
// runs the row kernels' superblock (q4k_superblock_scaled, q6k_superblock) into its int32 lanes, one reduction gives the
// 8 columns' totals (row_totals<8>), and one conversion and fused multiply-add per superblock serve the 8 columns
// at once, where the Totals row kernel reduces and multiply-adds each column on its own. Per superblock s:
//   Q4_K  acc = fma(float(T), d_s * as_s, acc); acc_min = fma(float(M), dmin_s * as_s, acc_min); result acc - acc_min
//   Q6_K  acc = fma(float(T), d_s * as_s, acc)
// T and M the exact totals of the row kernels (kernel_rows.h's Totals): the same bits as every other kernel.
// Each column runs all its superblocks before the next column, its lanes kept until the tile's reduction: its
// weights then stream in order as the row kernels read them (the 8 columns interleaved superblock by superblock,
// 8 streams of 128 bytes at a time, cost more than the reductions save).

// lanes[s * 16 + i]: column i's int32 lanes of superblock s's products, lanes[s * 16 + 8 + i] of its minimums
// (Q4_K); step(s, ...) reduces and accumulates them. One row only: for 2 and 3 rows the same scheme was no faster
// than the column tiles.
template <class W, class Gather, class Column, class Step>
void one_row_tiles(const W& w, const QuantizedRows& a, int64_t out_features, float* y, Gather gather, Column column, Step step) {
    const int64_t tiles = (out_features + kColumns - 1) / kColumns, superblocks = w.k / 256;
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        ColumnTile t(w.k / 32, 0);
        std::vector<__m256i> lanes(superblocks * 2 * kColumns);
        const int64_t first = 0;
        const RowTile<1> x(a, &first);
        for (int64_t tile = begin; tile < end; ++tile) {
            int64_t col[kColumns];
            const int valid = tile_columns(tile, out_features, col);
            gather(w, col, t);
            for (int i = 0; i < kColumns; ++i) column(col[i], i, x, lanes.data());
            __m256 acc = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
            for (int64_t s = 0; s < superblocks; ++s) step(s, t, x, &lanes[s * 2 * kColumns], acc, acc_min);
            alignas(32) float out[8];
            _mm256_store_ps(out, _mm256_sub_ps(acc, acc_min));
            for (int i = 0; i < valid; ++i) y[tile * kColumns + i] = out[i];
        }
    });
}

inline void q4k_one_row(const Q4K& w, const QuantizedRows& a, int64_t out_features, float* y) {
    const int64_t superblocks = w.k / 256;
    auto column = [&](int64_t n, int i, const RowTile<1>& x, __m256i* lanes) {
        const Q4K row = w.row(n);
        const uint8_t* ahead = row.codes + prefetch_rows(w.k / 2) * (w.k / 2);
        for (int64_t s = 0; s < superblocks; ++s) {
            prefetch(ahead + s * 128, 128);
            // Into a local first: written through the pointer, the sums would go back to memory after every
            // int8 load (which may alias them).
            __m256i isum;
            q4k_superblock_scaled<1>(row, s, x, &isum);
            __m256i* block = &lanes[s * 2 * kColumns];
            block[i] = isum;
            block[kColumns + i] = _mm256_zextsi128_si256(_mm_madd_epi16(q4k_mins(row, s), _mm_loadu_si128((const __m128i*)(x.sums[0] + s * 8))));
        }
    };
    auto step = [&](int64_t s, const ColumnTile& t, const RowTile<1>& x, const __m256i* block, __m256& acc, __m256& acc_min) {
        const __m256 as = _mm256_set1_ps(x.scale[0][s]);
        const __m256 d = _mm256_loadu_ps(&t.d[s * kColumns]), dmin = _mm256_loadu_ps(&t.m[s * kColumns]);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(row_totals<8>(block)), _mm256_mul_ps(d, as), acc);
        acc_min = _mm256_fmadd_ps(_mm256_cvtepi32_ps(row_totals<8>(block + kColumns)), _mm256_mul_ps(dmin, as), acc_min);
    };
    one_row_tiles(w, a, out_features, y, &gather_q4k, column, step);
}

inline void q6k_one_row(const Q6K& w, const QuantizedRows& a, int64_t out_features, float* y) {
    const int64_t superblocks = w.k / 256;
    auto column = [&](int64_t n, int i, const RowTile<1>& x, __m256i* lanes) {
        const Q6K row = w.row(n);
        const int64_t ahead = prefetch_rows(w.k / 2 + w.k / 4);
        for (int64_t s = 0; s < superblocks; ++s) {
            prefetch(row.ql + ahead * (w.k / 2) + s * 128, 128);
            prefetch(row.qh + ahead * (w.k / 4) + s * 64, 64);
            __m256i isum;  // a local, as q4k_one_row's
            q6k_superblock<1>(row, s, x, &isum);
            lanes[s * 2 * kColumns + i] = isum;
        }
    };
    auto step = [&](int64_t s, const ColumnTile& t, const RowTile<1>& x, const __m256i* block, __m256& acc, __m256&) {
        const __m256 d = _mm256_loadu_ps(&t.d[s * kColumns]);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(row_totals<8>(block)), _mm256_mul_ps(d, _mm256_set1_ps(x.scale[0][s])), acc);
    };
    one_row_tiles(w, a, out_features, y, &gather_q6k, column, step);
}

// ---- driver --------------------------------------------------------------------------------------------------

#ifdef SPECDEC_WIDE_TILES
#include "kernel_wide_tiles.h"
#endif

// A tile of R rows: full tiles of Q6_K on 512-bit vectors where the namespace has them (same results).
template <int R, class N>
void q6k_tile(const Q6K& w, int64_t n, const QuantizedRows& a, const int64_t* rows, float* out[R]) {
#ifdef SPECDEC_WIDE_TILES
    if constexpr (R == kRowTile) return q6k_rows_wide<R, N>(w, n, a, rows, out);
#endif
    q6k_rows<R, N>(w, n, a, rows, out);
}

// Kernel<R> for each format and numerics (Q4_1, Q8_0 and Q5_0 have one numerics of their own, in kernel_columns.h):
// run computes kWidth output columns from n, run_one one; kRows rows make a full tile. kEvenTiles: a pass of more
// than kRows rows goes in tiles of nearly equal sizes (Q6_K's 9 rows as 5 and 4), not in full tiles and a remainder
// (8 and 1), where a remainder tile of a row or two costs almost what a full one does (docs/engines.md).
template <class N>
struct KernelsOf {
    template <int R> struct Q4K_ {
        static constexpr int kRows = kQ4KRows, kWidth = R >= kQ4KPairRows ? kQ4KColumns : 1;
        static constexpr bool kEvenTiles = false;
        static void run(const Q4K& w, int64_t n, const QuantizedRows& a, const int64_t* rows, float** out) { q4k_rows<kWidth, R, N>(w, n, a, rows, out); }
        static void run_one(const Q4K& w, int64_t n, const QuantizedRows& a, const int64_t* rows, float** out) { q4k_rows<1, R, N>(w, n, a, rows, out); }
    };
    template <int R> struct Q6K_ {
        static constexpr int kRows = kRowTile, kWidth = 1;
        static constexpr bool kEvenTiles = true;
        static void run(const Q6K& w, int64_t n, const QuantizedRows& a, const int64_t* rows, float** out) { q6k_tile<R, N>(w, n, a, rows, out); }
        static constexpr auto run_one = run;
    };
};

// Output columns [first, last) for a tile's R rows, Kernel's width at a time.
template <template <int> class Kernel, int R, typename W>
inline void run_columns(const W& w, int64_t first, int64_t last, const QuantizedRows& a, const int64_t* rows, float** out) {
    constexpr int width = Kernel<R>::kWidth;
    int64_t n = first;
    if constexpr (width > 1)
        for (; n + width <= last; n += width) Kernel<R>::run(w, n, a, rows, out);
    for (; n < last; ++n) Kernel<R>::run_one(w, n, a, rows, out);
}

// The last rows % kRows rows, in one tile of their own.
template <template <int> class Kernel, typename W, int R = Kernel<1>::kRows - 1>
inline void run_remainder(int64_t remainder, const W& w, int64_t first, int64_t last, const QuantizedRows& a, const int64_t* rows, float** out) {
    if constexpr (R > 0) {
        if (remainder == R) run_columns<Kernel, R>(w, first, last, a, rows, out);
        else run_remainder<Kernel, W, R - 1>(remainder, w, first, last, a, rows, out);
    }
}

// Every output column n for every row: rows in tiles of kRows (the remainder in one smaller tile; or, for
// kEvenTiles, in as many tiles of nearly equal sizes), columns split over threads. The even tiles have a loop of
// their own, compiled only where kEvenTiles: one loop computing each tile's size for every kernel changed the
// compiled code of Q4_K's steps, and made them slower. Columns go in blocks of kColumnBlock, each block through
// every tile in turn: a tile's activation rows then stay in L1 while the block's weight rows (up to 7 KB each: the
// block fits in L2) are read again from L2, where going through all tiles per column would stream every activation
// row past L1 once per column. Each output is still computed by one kernel call, in the same order: the blocking
// changes no result.
constexpr int64_t kColumnBlock = 128;

template <template <int> class Kernel, typename W>
void matmul(const W& w, const QuantizedRows& a, int64_t rows, int64_t out_features, float* base) {
    constexpr int tile = Kernel<1>::kRows;
    at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
        std::vector<int64_t> index(rows);
        for (int64_t r = 0; r < rows; ++r) index[r] = r;
        std::vector<float*> out(rows);
        for (int64_t r = 0; r < rows; ++r) out[r] = base + r * out_features;
        for (int64_t block = begin; block < end; block += kColumnBlock) {
            const int64_t last = std::min(end, block + kColumnBlock);
            if constexpr (Kernel<1>::kEvenTiles) {
                if (rows > tile) {
                    const int64_t tiles = (rows + tile - 1) / tile;
                    for (int64_t i = 0, r = 0; i < tiles; ++i) {
                        const int64_t size = rows / tiles + (i < rows % tiles);
                        if (size == tile) run_columns<Kernel, tile>(w, block, last, a, &index[r], &out[r]);
                        else run_remainder<Kernel>(size, w, block, last, a, &index[r], &out[r]);
                        r += size;
                    }
                    continue;
                }
            }
            int64_t r = 0;
            for (; r + tile <= rows; r += tile) run_columns<Kernel, tile>(w, block, last, a, &index[r], &out[r]);
            if (r < rows) run_remainder<Kernel>(rows - r, w, block, last, a, &index[r], &out[r]);
        }
    });
}

template <class N>
void q4k(const Q4K& w, const QuantizedRows& a, int64_t rows, int64_t n, float* y) { matmul<KernelsOf<N>::template Q4K_>(w, a, rows, n, y); }
template <class N>
void q6k(const Q6K& w, const QuantizedRows& a, int64_t rows, int64_t n, float* y) { matmul<KernelsOf<N>::template Q6K_>(w, a, rows, n, y); }
inline void q41(const Q41& w, const QuantizedRows& a, int64_t rows, int64_t n, float* y) {
    column_matmul<Q41, Q41Columns>(w, a, rows, n, y, 8, &unpack_q41, &gather_q41);
}
// Q4_K and Q6_K in Totals on column tiles (AVX2's, and VNNI's Q4_K, which kernels.cpp calls from
// vnni_column_min_rows rows): a step in 8-column tiles of the stored layout, more rows in column tiles; AVX2's passes
// of 2 to kQ4KColumnRows - 1 (Q6_K: kQ6KColumnRows - 1) rows on the row kernels, which are faster there
// (docs/engines.md).
constexpr int64_t kQ4KColumnRows = 6, kQ6KColumnRows = 12;

// Whether q4k_columns hands a pass of this many rows to the row kernels (which read the activations' grouped order).
inline bool q4k_columns_on_row_kernels(int64_t rows) { return rows == 1 || (!kDpbusd && rows < kQ4KColumnRows); }

inline void q4k_columns(const Q4K& w, const QuantizedRows& a, int64_t rows, int64_t n, float* y) {
    if (rows == 1) return q4k_one_row(w, a, n, y);
    if (q4k_columns_on_row_kernels(rows)) return q4k<Totals>(w, a, rows, n, y);
#ifdef SPECDEC_WIDE_TILES
    if (rows <= kWideGroups * kRowTile && n * w.k >= wide_columns_from) return q4k_wide_columns(w, a, rows, n, y);
#endif
    column_matmul<Q4K, Q4KColumns>(w, a, rows, n, y, 8, &unpack_q4k, &gather_q4k);
}
inline void q6k_columns(const Q6K& w, const QuantizedRows& a, int64_t rows, int64_t n, float* y) {
    if (rows == 1) return q6k_one_row(w, a, n, y);
    if (rows < kQ6KColumnRows) return q6k<Totals>(w, a, rows, n, y);
    column_matmul<Q6K, Q6KColumns>(w, a, rows, n, y, 8, &unpack_q6k, &gather_q6k);
}
inline void q80(const Q80& w, const QuantizedRows& a, int64_t rows, int64_t n, float* y) {
    column_matmul<Q80, Q80Columns>(w, a, rows, n, y, 16, &unpack_q80, &gather_q80);
}
