// Column tiles, included by kernel_rows.h once per instruction set: every product of Q4_1, Q8_0 and Q5_0, and AVX2's
// Q4_K and Q6_K passes of several rows in the Totals numerics. Row kernels spend much of their time outside the
// integer products: per 32 weights and activation row, one maddubs and one madd do the multiply-adds, and around
// them go a conversion of 8 int32 lanes, the scales' multiply and broadcast and a fused multiply-add (Q4_1, Q8_0,
// Q5_0), or for the K-quants the unpacking of each weight block again for every tile of rows and a reduction per
// superblock and row (Totals).
//
// Here a tile is 8 output columns, one per int32 lane, as llama.cpp's repacked 8-column kernels (ggml-cpu's
// repack.cpp) lay them out: the tile's weights are unpacked and transposed once per call, so that register j of a
// 32-weight group holds weights 4j..4j+3 of each of the 8 columns, and the 4 activations k = 4j..4j+3 of a row are
// broadcast to every lane. One maddubs then gives each column 4 products (in two int16 pair sums), the 8 registers
// of a group add up, in int16 where the codes are small enough not to overflow, to each column's exact int32 total
// of the group, and the float work is one conversion and two fused multiply-adds per group and row for 8 columns
// at once (where the row kernels did one per column). One unpacking serves every row of the call.
//
// The numerics (the same for every row, row count, tile, batch-mate and instruction set: each column's float
// operations run in its own lane, in the order of the groups, and integer sums are exact in any order):
//   Q4_1  t_g = sum over the group's 32 weights of code * q (exact), s_g = sum of q (exact, QuantizedRows' sums);
//         acc = fma(float(t_g), d_g * as_g, acc); acc = fma(m_g, as_g * float(s_g), acc), for g = 0, 1, ...
//   Q8_0, Q5_0  acc = fma(float(t_g), d_g * as_g, acc).
// (as_g: the row's activation scale of group g; the result is acc.)

constexpr int kColumns = 8;     // output columns of a tile: one per int32 lane
// Activation rows computed together against one tile: 4 (each format's Rows<R>::kRows says; Q4_K's VNNI form takes
// a row tile's, kRowTile: 8 with AVX-512's 32 vector registers).
constexpr int kColumnRows = 4;

// r[j] <- column j of the 8 x 8 matrix of int32 elements whose row i is r[i].
SPECDEC_INLINE void transpose8x8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);      // elements 0, 1 | 4, 5 of rows 2i, 2i + 1
        t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);  // elements 2, 3 | 6, 7
    }
    for (int i = 0; i < 2; ++i) {
        u[4 * i + 0] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);      // element 0 | 4 of rows 4i..4i+3
        u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);      // 1 | 5
        u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);  // 2 | 6
        u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);  // 3 | 7
    }
    for (int j = 0; j < 4; ++j) {
        r[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        r[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
}

// The 4 activation codes at p in every int32 lane.
inline __m256i broadcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// One tile's weights, unpacked for the row loops (a buffer per thread, reused from tile to tile).
struct ColumnTile {
    int64_t groups;
    std::vector<__m256i> codes;  // Q4_1: [group][j], 8 per group; Q8_0/Q5_0: [group][magnitudes j | codes j], 16
    std::vector<float> d, m;     // Q4_K: [superblock][column], d and dmin of the tile's columns; Q6_K: d
    const uint16_t* d_tile = nullptr;  // Q4_1, Q8_0, Q5_0: the tile's scales (and Q4_1's minimums) in the weight,
    const uint16_t* m_tile = nullptr;  // [group][column] float16
    std::vector<__m256i> scales; // Q4_K: [superblock][12], q4k_scales's sub-block scales and minimums
    bool small = false;          // Q8_0/Q5_0: every |code| <= 16 (Q5_0 always): the int16 sums cannot overflow
    const float* scaled_sums = nullptr;  // Q4_1: as_g * float(s_g) of every row and group of the call, [row][group]
    ColumnTile(int64_t groups, int vectors) : groups(groups), codes(groups * vectors), d(groups * kColumns), m(groups * kColumns) {}
};

// out[g * 8 + i] = v[col[i] * groups + g]: a tile's per-group floats, column per lane, in 8 x 8 transposes (the
// last one overlapping the one before where the groups are not a multiple of 8; fewer than 8 groups one by one).
inline void gather_columns(const float* v, int64_t groups, const int64_t* col, float* out) {
    if (groups < 8) {
        for (int64_t g = 0; g < groups; ++g)
            for (int i = 0; i < 8; ++i) out[g * kColumns + i] = v[col[i] * groups + g];
        return;
    }
    for (int64_t next = 0; next < groups; next += 8) {
        const int64_t g = std::min(next, groups - 8);
        __m256i r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_castps_si256(_mm256_loadu_ps(v + col[i] * groups + g));
        transpose8x8(r);
        for (int j = 0; j < 8; ++j) _mm256_storeu_si256((__m256i*)(out + (g + j) * kColumns), r[j]);
    }
}

// Stored vector v (32 bytes) of superblock s of Q4_K (codes in grouped-lane order, kernels.cpp) for the tile's
// columns col[0..7] (the last tile of a call repeats its last column where it has fewer than 8), transposed: stored
// element 8v + j is the file's element 8 (j % 4) + 2v + j / 4, so int32 lane i of r[c] (r[c + 4]) holds the file's
// bytes 4u..4u + 3 of column i's group pair c, for unit u = 2v (2v + 1): 32 bytes with weight i of group 2c in the
// low nibble of byte i and weight i of group 2c + 1 in the high one. The next tile's lines are prefetched.
SPECDEC_INLINE void q4k_tile_vector(const uint8_t* codes, int64_t k, const int64_t* col, int64_t s, int v, __m256i r[8]) {
    const int64_t bytes = k / 2;
    for (int i = 0; i < 8; ++i) {
        r[i] = _mm256_loadu_si256((const __m256i*)(codes + col[i] * bytes + s * 128 + v * 32));
        if (!(v & 1)) _mm_prefetch((const char*)(codes + (col[i] + kColumns) * bytes + s * 128 + v * 32), _MM_HINT_T0);
    }
    transpose8x8(r);
}

// Half h (units 4h..4h + 3, stored vectors 2h and 2h + 1) of superblock s for the tile's columns: r[c][u] holds
// unit 4h + u of group pair c, as q4k_tile_vector lays it out.
SPECDEC_INLINE void q4k_tile_codes(const uint8_t* codes, int64_t k, const int64_t* col, int64_t s, int h, __m256i r[4][4]) {
    for (int v = 2 * h; v < 2 * h + 2; ++v) {
        __m256i t[8];
        q4k_tile_vector(codes, k, col, s, v, t);
        for (int c = 0; c < 4; ++c) {
            r[c][2 * (v - 2 * h)] = t[c];
            r[c][2 * (v - 2 * h) + 1] = t[c + 4];
        }
    }
}

// Q4_1's, Q8_0's and Q5_0's codes are stored tile by tile already transposed (formats.py, TILED): a tile's 32-byte
// chunk c (Q4_1: group pair c, as Q4_K's above; Q8_0, Q5_0: group c) is 8 vectors, int32 lane i of r[j] holding
// bytes 4j..4j+3 of column i, read as they are. The next tile's same chunk is prefetched into L2, not L1: a step of
// these formats does little work per byte, and prefetches into L1 held it to about 0.6x of the memory's bandwidth
// (docs/engines.md).
SPECDEC_INLINE void tile_chunk(const uint8_t* tile, int64_t tile_bytes, int64_t c, __m256i r[8]) {
    const uint8_t* chunk = tile + c * 8 * 32;
    for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_si256((const __m256i*)(chunk + j * 32));
    for (int line = 0; line < 4; ++line) _mm_prefetch((const char*)(chunk + tile_bytes + line * 64), _MM_HINT_T1);
}

SPECDEC_INLINE void q41_codes(const Q41& w, const int64_t* col, int64_t c, __m256i r[8]) {
    const int64_t groups = w.k / 32;
    if (!(c & 1)) {  // the next tile's 16 * groups bytes of each, a line per 2 calls
        _mm_prefetch((const char*)(w.d_tiles + (col[0] + kColumns) * groups) + c * 32, _MM_HINT_T1);
        _mm_prefetch((const char*)(w.m_tiles + (col[0] + kColumns) * groups) + c * 32, _MM_HINT_T1);
    }
    tile_chunk(w.codes + col[0] * (w.k / 2), kColumns * (w.k / 2), c, r);
}

// Q8_0's and Q5_0's int8 codes of group g, as q41_codes's.
SPECDEC_INLINE void q80_codes(const Q80& w, const int64_t* col, int64_t g, __m256i r[8]) {
    if (!(g & 3)) _mm_prefetch((const char*)(w.d_tiles + (col[0] + kColumns) * (w.k / 32)) + g * 16, _MM_HINT_T1);
    tile_chunk((const uint8_t*)w.codes + col[0] * w.k, kColumns * w.k, g, r);
}

// The whole tile unpacked, for calls of more rows than one row group: Q4_1's codes as bytes 0..15, 8 vectors per
// group; Q8_0's and Q5_0's magnitudes |code| (maddubs takes its first operand unsigned) then the codes themselves
// (whose signs go onto the activations), 16 vectors per group. The scales (and minimums) gathered by column.
template <class Codes>
inline void unpack_nibbles(Codes codes, ColumnTile& t) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t c = 0; c < t.groups / 2; ++c) {
        __m256i r[8];
        codes(c, r);
        for (int j = 0; j < 8; ++j) {
            t.codes[(2 * c) * 8 + j] = _mm256_and_si256(r[j], low);
            t.codes[(2 * c + 1) * 8 + j] = _mm256_and_si256(_mm256_srli_epi16(r[j], 4), low);
        }
    }
}

inline void unpack_q41(const Q41& w, const int64_t* col, ColumnTile& t) {
    unpack_nibbles([&](int64_t c, __m256i* r) { q41_codes(w, col, c, r); }, t);
}

inline void unpack_q80(const Q80& w, const int64_t* col, ColumnTile& t) {
    __m256i largest = _mm256_setzero_si256();
    for (int64_t g = 0; g < t.groups; ++g) {
        __m256i r[8];
        q80_codes(w, col, g, r);
        for (int j = 0; j < 8; ++j) {
            const __m256i magnitude = _mm256_sign_epi8(r[j], r[j]);  // -128 -> 0x80, read as 128 by maddubs
            largest = _mm256_max_epu8(largest, magnitude);
            t.codes[g * 16 + j] = magnitude;
            t.codes[g * 16 + 8 + j] = r[j];
        }
    }
    // Small when no magnitude exceeds 16: min(largest, 16) == largest in every byte.
    t.small = _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_min_epu8(largest, _mm256_set1_epi8(16)), largest)) == -1;
}

// Q4_1's, Q8_0's and Q5_0's scales need no gathering: they are stored tile by tile (Q41, Q80), and the tile points
// at its own.
inline void gather_q41(const Q41& w, const int64_t* col, ColumnTile& t) {
    t.d_tile = w.d_tiles + col[0] * t.groups;
    t.m_tile = w.m_tiles + col[0] * t.groups;
}
inline void gather_q80(const Q80& w, const int64_t* col, ColumnTile& t) { t.d_tile = w.d_tiles + col[0] * t.groups; }

// The 8 float16 values of group g of a tile's scales (or minimums), column i in lane i.
SPECDEC_INLINE __m256 tile_values(const uint16_t* tile, int64_t g) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(tile + g * kColumns)));
}

// A tile's rows: their int8 codes, scales (one per group) and group sums.
template <int R>
struct GroupRows {
    static constexpr int kRows = R;
    const int8_t* q[R];
    const float* scale[R];
    const float* scaled_sums[R];  // Q4_1 only
    const int16_t* sums[R];       // the code sums of each group of 32 (Q4_K's minimums' term)
    GroupRows(const QuantizedRows& a, int64_t first, const ColumnTile& t) {
        for (int r = 0; r < R; ++r) {
            q[r] = a.row_q(first + r);
            scale[r] = a.row_scale(first + r);
            sums[r] = a.row_sums(first + r);
            scaled_sums[r] = t.scaled_sums ? t.scaled_sums + (first + r) * t.groups : nullptr;
        }
    }
};

template <int R>
inline void store_columns(const __m256* acc, float** out, int64_t first, int64_t n0, int valid) {
    for (int r = 0; r < R; ++r) {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, acc[r]);
        for (int i = 0; i < valid; ++i) out[first + r][n0 + i] = lanes[i];
    }
}

// With VNNI, tiles of kDpbusdRows rows or more take each column's exact group total t from 8 dpbusd (column i's 4
// products of codes(j) into int32 lane i) instead of the maddubs, int16 adds and madd below: the same integer,
// so the same bits, in half the instructions. Tiles of one or two rows were no faster with it (measured,
// docs/results/2026-12-07-dpbusd-in-column-tiles.md) and keep the instructions AVX2 runs.
constexpr int kDpbusdRows = 3;

// Q4_1, group g of R rows against one tile; codes(j): the group's weights 4j..4j+3 of each column, as bytes 0..15.
// Per row r (lane i: column i):
//   p      = sum over j < 8 of maddubs(codes(j), q[4j..4j+3] broadcast)   16 int16: column i's products in lanes
//            2i, 2i + 1; each maddubs lane <= 2 * 15 * 127 = 3810, the 8 added <= 30480: no int16 overflow
//   t      = madd(p, 1)                                                    column i's exact total in int32 lane i
//   acc    = fma(float(t), d_g * as_g, acc)                                 the codes' term
//   acc    = fma(m_g, as_g * float(s_g), acc)                               the minimums' term (s_g: sum of q;
//                                                                           as_g * float(s_g) once per call)
// 8 maddubs, 7 adds, a madd, a conversion, a multiply and two fused multiply-adds per 256 multiply-adds and row.
template <int R, class Codes>
SPECDEC_INLINE void q41_group(Codes codes, const ColumnTile& t, const GroupRows<R>& x, int64_t g, __m256* acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p[R];
    if constexpr (kDpbusd && R >= kDpbusdRows) {
        for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
            const __m256i v = codes(j);
            for (int r = 0; r < R; ++r) p[r] = dot4_add(p[r], v, broadcast4(x.q[r] + g * 32 + 4 * j));
        }
    } else {
        {
            const __m256i v = codes(0);
            for (int r = 0; r < R; ++r) p[r] = _mm256_maddubs_epi16(v, broadcast4(x.q[r] + g * 32));
        }
        for (int j = 1; j < 8; ++j) {
            const __m256i v = codes(j);
            for (int r = 0; r < R; ++r) p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(v, broadcast4(x.q[r] + g * 32 + 4 * j)));
        }
        for (int r = 0; r < R; ++r) p[r] = _mm256_madd_epi16(p[r], ones);
    }
    const __m256 d = tile_values(t.d_tile, g), m = tile_values(t.m_tile, g);
    for (int r = 0; r < R; ++r) {
        const float as = x.scale[r][g];
        const __m256 total = _mm256_cvtepi32_ps(p[r]);
        acc[r] = _mm256_fmadd_ps(total, _mm256_mul_ps(d, _mm256_set1_ps(as)), acc[r]);
        acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.scaled_sums[r][g]), acc[r]);
    }
}

// Q8_0 and Q5_0, group g of R rows against one tile; magnitude(j), codes(j): |code| and code of the group's weights
// 4j..4j+3 of each column. Per row r (lane i: column i):
//   p_j    = maddubs(magnitude(j), sign(q[4j..4j+3] broadcast, codes(j)))  column i's 4 products, in int16 lanes
//   t      = sum over j < 8 of madd(p_j, 1)                                  2i, 2i + 1 (each <= 2 * 128 * 127)
//            (kSmall, every |code| <= 16: madd(sum over j of p_j, 1), the int16 sum <= 8 * 2 * 16 * 127 = 32512)
//   acc    = fma(float(t), d_g * as_g, acc)
// The integer total is exact either way, so the two paths give the same bits.
template <int R, bool kSmall, class Magnitude, class Codes>
SPECDEC_INLINE void q80_group(Magnitude magnitude, Codes codes, const ColumnTile& t, const GroupRows<R>& x, int64_t g, __m256* acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_si256();
    constexpr bool dp = kDpbusd && R >= kDpbusdRows;
    for (int j = 0; j < 8; ++j) {
        const __m256i u = magnitude(j), s = codes(j);
        for (int r = 0; r < R; ++r) {
            const __m256i signed_q = _mm256_sign_epi8(broadcast4(x.q[r] + g * 32 + 4 * j), s);
            if constexpr (dp) {
                sum[r] = dot4_add(sum[r], u, signed_q);
                continue;
            }
            const __m256i p = _mm256_maddubs_epi16(u, signed_q);
            sum[r] = kSmall ? _mm256_add_epi16(sum[r], p) : _mm256_add_epi32(sum[r], _mm256_madd_epi16(p, ones));
        }
    }
    const __m256 d = tile_values(t.d_tile, g);
    for (int r = 0; r < R; ++r) {
        const __m256i total = kSmall && !dp ? _mm256_madd_epi16(sum[r], ones) : sum[r];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(x.scale[r][g])), acc[r]);
    }
}

// Rows first..first+R-1 against one tile. Unpacked: the tile's codes from its buffer (unpack_q41, unpack_q80).
// Fused (a call of at most one row group, where one unpacking would serve only these rows): each group's codes
// transposed and used at once, never stored.
template <int R> struct Q41Columns {
    static constexpr int kRows = kColumnRows;
    static constexpr bool kFused = true;
    static void unpacked(const Q41&, const int64_t*, const ColumnTile& t, const QuantizedRows& a, int64_t first, float** out, int64_t n0, int valid) {
        const GroupRows<R> x(a, first, t);
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < t.groups; ++g) {
            const __m256i* w = &t.codes[g * 8];
            q41_group<R>([w](int j) { return _mm256_load_si256(w + j); }, t, x, g, acc);
        }
        store_columns<R>(acc, out, first, n0, valid);
    }
    static void fused(const Q41& w, const int64_t* col, const ColumnTile& t, const QuantizedRows& a, int64_t first, float** out, int64_t n0, int valid) {
        const GroupRows<R> x(a, first, t);
        const __m256i low = _mm256_set1_epi8(0x0F);
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t c = 0; c < t.groups / 2; ++c) {
            __m256i v[8];
            q41_codes(w, col, c, v);
            q41_group<R>([&](int j) { return _mm256_and_si256(v[j], low); }, t, x, 2 * c, acc);
            q41_group<R>([&](int j) { return _mm256_and_si256(_mm256_srli_epi16(v[j], 4), low); }, t, x, 2 * c + 1, acc);
        }
        store_columns<R>(acc, out, first, n0, valid);
    }
};

template <int R> struct Q80Columns {
    static constexpr int kRows = kColumnRows;
    static constexpr bool kFused = true;
    template <bool kSmall>
    static void unpacked_as(const ColumnTile& t, const QuantizedRows& a, int64_t first, float** out, int64_t n0, int valid) {
        const GroupRows<R> x(a, first, t);
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < t.groups; ++g) {
            const __m256i* w = &t.codes[g * 16];
            q80_group<R, kSmall>([w](int j) { return _mm256_load_si256(w + j); }, [w](int j) { return _mm256_load_si256(w + 8 + j); }, t, x, g, acc);
        }
        store_columns<R>(acc, out, first, n0, valid);
    }
    static void unpacked(const Q80&, const int64_t*, const ColumnTile& t, const QuantizedRows& a, int64_t first, float** out, int64_t n0, int valid) {
        if (t.small) unpacked_as<true>(t, a, first, out, n0, valid);
        else unpacked_as<false>(t, a, first, out, n0, valid);
    }
    static void fused(const Q80& w, const int64_t* col, const ColumnTile& t, const QuantizedRows& a, int64_t first, float** out, int64_t n0, int valid) {
        const GroupRows<R> x(a, first, t);
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < t.groups; ++g) {
            __m256i v[8];
            q80_codes(w, col, g, v);
            q80_group<R, false>([&](int j) { return _mm256_sign_epi8(v[j], v[j]); }, [&](int j) { return v[j]; }, t, x, g, acc);
        }
        store_columns<R>(acc, out, first, n0, valid);
    }
};

// ---- Q4_K: 4-bit codes in Q4_1's layout, per 32 weights a 6-bit scale sc and minimum mn, per 256 d and dmin ------
// w = d * sc_g * code - dmin * mn_g. The tile's codes as Q4_1's (q4k_tile_codes); per superblock s, row r and lane i
// (column i), in the Totals numerics of the row kernels (kernel_rows.h), so that both give the same bits:
//   p_g    = sum over j < 8 of maddubs(codes_g(j), q[32g + 4j..32g + 4j + 3] broadcast)   int16 <= 30480, as Q4_1's
//   T      = sum over the 8 groups g of madd(p_g, (sc_g, sc_g))     = sum of sc_g * code * q: the exact int32 total
//   M      = sum over h < 4 of madd((mn_2h, mn_2h+1), (sums_2h, sums_2h+1) broadcast)      the minimums' exact total
//   acc    = fma(float(T), d_s * as_s, acc);   acc_min = fma(float(M), dmin_s * as_s, acc_min)
// and the result is acc - acc_min. Per superblock, row and 8 columns: 64 maddubs, 56 int16 adds, 12 madd, 11 int32
// adds, 2 conversions, 2 multiplies and 2 fused multiply-adds for 2048 multiply-adds.

// Superblock s's sub-block scales and minimums for the tile's columns, as int16 pairs in int32 lane i (column i):
// v[g] = (sc_g, sc_g) for g < 8, v[8 + h] = (mn_2h, mn_2h+1) for h < 4. One 8 x 8 transpose: each column's 8 scales
// and 8 minimums as 16 int16, whose int32 element h < 4 is a pair of scales and 4 + h a pair of minimums.
SPECDEC_INLINE void q4k_scales(const Q4K& w, const int64_t* col, int64_t s, __m256i v[12]) {
    const int64_t groups = w.k / 32;
    __m256i r[8];
    for (int i = 0; i < 8; ++i) {
        const __m128i sc = _mm_loadl_epi64((const __m128i*)(w.sc + col[i] * groups + s * 8));
        const __m128i mn = _mm_loadl_epi64((const __m128i*)(w.mn + col[i] * groups + s * 8));
        r[i] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi64(sc, mn));
    }
    // The next tile's scales: 8 * groups bytes of each array, one line per superblock.
    _mm_prefetch((const char*)(w.sc + (col[0] + kColumns) * groups) + s * 64, _MM_HINT_T0);
    _mm_prefetch((const char*)(w.mn + (col[0] + kColumns) * groups) + s * 64, _MM_HINT_T0);
    _mm_prefetch((const char*)(w.d + (col[0] + kColumns) * (groups / 8)) + s * 32, _MM_HINT_T0);
    _mm_prefetch((const char*)(w.dmin + (col[0] + kColumns) * (groups / 8)) + s * 32, _MM_HINT_T0);
    transpose8x8(r);
    const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                          0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
    const __m256i odd = _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
                                         2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15);
    for (int h = 0; h < 4; ++h) {
        v[2 * h] = _mm256_shuffle_epi8(r[h], even);
        v[2 * h + 1] = _mm256_shuffle_epi8(r[h], odd);
        v[8 + h] = r[4 + h];
    }
}

// Group g (of the whole row) of R rows: total[r] += madd(p_g, scale), as above. With VNNI (kDpbusd) each column's
// exact group total comes from 8 dpbusd instead, t_g = sum over j of dpbusd(codes_g(j), q broadcast), and
// total += t_g * sc_g (mullo; sc_g the low int16 of scale): the same integer, a third of the instructions.
template <int R, class Codes>
SPECDEC_INLINE void q4k_group(Codes codes, __m256i scale, const GroupRows<R>& x, int64_t g, __m256i* total) {
    if constexpr (kDpbusd) {
        __m256i t[R];
        for (int r = 0; r < R; ++r) t[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) {
            const __m256i v = codes(j);
            for (int r = 0; r < R; ++r) t[r] = dot4_add(t[r], v, broadcast4(x.q[r] + g * 32 + 4 * j));
        }
        const __m256i sc = _mm256_and_si256(scale, _mm256_set1_epi32(0xFFFF));
        for (int r = 0; r < R; ++r) total[r] = _mm256_add_epi32(total[r], _mm256_mullo_epi32(t[r], sc));
        return;
    }
    __m256i p[R];
    {
        const __m256i v = codes(0);
        for (int r = 0; r < R; ++r) p[r] = _mm256_maddubs_epi16(v, broadcast4(x.q[r] + g * 32));
    }
    for (int j = 1; j < 8; ++j) {
        const __m256i v = codes(j);
        for (int r = 0; r < R; ++r) p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(v, broadcast4(x.q[r] + g * 32 + 4 * j)));
    }
    for (int r = 0; r < R; ++r) total[r] = _mm256_add_epi32(total[r], _mm256_madd_epi16(p[r], scale));
}

// Units 4h..4h + 3 of group g, codes(j) holding unit 4h + j: q4k_group's integer in halves (a group's total in
// parts is the same integer), for the fused tiles (VNNI's only). A half's t fits in int16 (|t| <= 16 * 15 * 127), so
// madd by (sc_g, 0) multiplies it, where a whole group's needs mullo.
template <int R, class Codes>
SPECDEC_INLINE void q4k_half_group(Codes codes, __m256i scale, const GroupRows<R>& x, int64_t g, int h, __m256i* total) {
    const int64_t at = g * 32 + 16 * h;
    __m256i t[R];
    for (int r = 0; r < R; ++r) t[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
        const __m256i v = codes(j);
        for (int r = 0; r < R; ++r) t[r] = dot4_add(t[r], v, broadcast4(x.q[r] + at + 4 * j));
    }
    const __m256i sc = _mm256_and_si256(scale, _mm256_set1_epi32(0xFFFF));
    for (int r = 0; r < R; ++r) total[r] = _mm256_add_epi32(total[r], _mm256_madd_epi16(t[r], sc));
}

// The end of superblock s for R rows: the minimums' total and both fused multiply-adds.
template <int R>
SPECDEC_INLINE void q4k_superblock_end(const __m256i* scales, const ColumnTile& t, const GroupRows<R>& x, int64_t s, const __m256i* total,
                               __m256* acc, __m256* acc_min) {
    const __m256 d = _mm256_loadu_ps(&t.d[s * kColumns]), dmin = _mm256_loadu_ps(&t.m[s * kColumns]);
    for (int r = 0; r < R; ++r) {
        const int8_t* sums = (const int8_t*)(x.sums[r] + s * 8);
        __m256i m = _mm256_madd_epi16(scales[8], broadcast4(sums));
        for (int h = 1; h < 4; ++h) m = _mm256_add_epi32(m, _mm256_madd_epi16(scales[8 + h], broadcast4(sums + 4 * h)));
        const __m256 as = _mm256_set1_ps(x.scale[r][s]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[r]), _mm256_mul_ps(d, as), acc[r]);
        acc_min[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(dmin, as), acc_min[r]);
    }
}

template <int R>
inline void store_difference(const __m256* acc, const __m256* acc_min, float** out, int64_t first, int64_t n0, int valid) {
    __m256 v[R];
    for (int r = 0; r < R; ++r) v[r] = _mm256_sub_ps(acc[r], acc_min[r]);
    store_columns<R>(v, out, first, n0, valid);
}

template <int R> struct Q4KColumns {
    static constexpr int kRows = kDpbusd ? kRowTile : kColumnRows;
    // AVX2 runs these tiles only from kQ4KColumnRows rows, more than a fused call takes (and its fused form, compiled
    // beside the unpacked one, made that one slower: docs/engines.md).
    static constexpr bool kFused = kDpbusd;
    static void unpacked(const Q4K&, const int64_t*, const ColumnTile& t, const QuantizedRows& a, int64_t first, float** out, int64_t n0, int valid) {
        const GroupRows<R> x(a, first, t);
        __m256 acc[R], acc_min[R];
        for (int r = 0; r < R; ++r) acc[r] = acc_min[r] = _mm256_setzero_ps();
        for (int64_t s = 0; s < t.groups / 8; ++s) {
            const __m256i* scales = &t.scales[s * 12];
            __m256i total[R];
            for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_si256();
            for (int g = 0; g < 8; ++g) {
                const __m256i* w = &t.codes[(s * 8 + g) * 8];
                q4k_group<R>([w](int j) { return _mm256_load_si256(w + j); }, scales[g], x, s * 8 + g, total);
            }
            q4k_superblock_end<R>(scales, t, x, s, total, acc, acc_min);
        }
        store_difference<R>(acc, acc_min, out, first, n0, valid);
    }
    static void fused(const Q4K& w, const int64_t* col, const ColumnTile& t, const QuantizedRows& a, int64_t first, float** out, int64_t n0, int valid) {
        const GroupRows<R> x(a, first, t);
        const __m256i low = _mm256_set1_epi8(0x0F);
        __m256 acc[R], acc_min[R];
        for (int r = 0; r < R; ++r) acc[r] = acc_min[r] = _mm256_setzero_ps();
        for (int64_t s = 0; s < t.groups / 8; ++s) {
            __m256i scales[12];
            q4k_scales(w, col, s, scales);
            __m256i total[R];
            for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_si256();
            for (int h = 0; h < 2; ++h) {  // half the units at a time: 16 vectors of codes live, not 32
                __m256i v[4][4];
                q4k_tile_codes(w.codes, w.k, col, s, h, v);
                for (int c = 0; c < 4; ++c) {
                    q4k_half_group<R>([&](int j) { return _mm256_and_si256(v[c][j], low); }, scales[2 * c], x, s * 8 + 2 * c, h, total);
                    q4k_half_group<R>([&](int j) { return _mm256_and_si256(_mm256_srli_epi16(v[c][j], 4), low); }, scales[2 * c + 1], x,
                                      s * 8 + 2 * c + 1, h, total);
                }
            }
            q4k_superblock_end<R>(scales, t, x, s, total, acc, acc_min);
        }
        store_difference<R>(acc, acc_min, out, first, n0, valid);
    }
};

inline void unpack_q4k(const Q4K& w, const int64_t* col, ColumnTile& t) {
    // As unpack_nibbles lays out Q4_1's: group g's unit j at t.codes[8g + j].
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t s = 0; s < t.groups / 8; ++s)
        for (int v = 0; v < 4; ++v) {
            __m256i r[8];
            q4k_tile_vector(w.codes, w.k, col, s, v, r);
            for (int c = 0; c < 4; ++c)
                for (int e = 0; e < 2; ++e) {
                    const int64_t g = 8 * s + 2 * c, j = 2 * v + e;
                    t.codes[g * 8 + j] = _mm256_and_si256(r[c + 4 * e], low);
                    t.codes[(g + 1) * 8 + j] = _mm256_and_si256(_mm256_srli_epi16(r[c + 4 * e], 4), low);
                }
        }
    t.scales.resize(t.groups / 8 * 12);
    for (int64_t s = 0; s < t.groups / 8; ++s) q4k_scales(w, col, s, &t.scales[s * 12]);
}

inline void gather_q4k(const Q4K& w, const int64_t* col, ColumnTile& t) {
    gather_columns(w.d, t.groups / 8, col, t.d.data());
    gather_columns(w.dmin, t.groups / 8, col, t.m.data());
}

// ---- Q6_K: 6-bit codes (weight = code - 32), per 16 weights an int8 scale sc, per 256 d -------------------------
// A 32-weight chunk c of superblock s (c = 4 * half + j) of the tile's columns transposed as the others' (register m:
// weights 4m..4m+3 of each column), its first 16 weights group 2c and its last 16 group 2c + 1. Per superblock s,
// row r and lane i (column i), in the Totals numerics of the row kernels:
//   p      = maddubs(codes(4h), q broadcast) + maddubs(codes(4h + 1), q broadcast)      int16 <= 2 * 2 * 63 * 127 = 32004
//   T      = sum over the chunks' halves of madd(p, (sc_g, sc_g)), two such p per group g   sum of sc_g * code * q, exact
//   M      = sum over h < 8 of madd((sc_2h, sc_2h+1), (sums_2h, sums_2h+1) broadcast)     the offset's sum_g sc_g * sums_g
//   acc    = fma(float(T - 32 M), d_s * as_s, acc)
// Per superblock, row and 8 columns: 64 maddubs, 32 int16 adds, 40 madd, 39 int32 adds, a shift and a subtraction, a
// conversion, a multiply and a fused multiply-add for 2048 multiply-adds.

// Chunk c = 4 * half + j of superblock s of the tile's columns, transposed (codes 0..63). The next tile's lines
// are prefetched.
inline void q6k_chunk_codes(const Q6K& w, const int64_t* col, int64_t s, int half, int j, __m256i r[8]) {
    const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(0x30);
    const int64_t at = s * 2 + half;
    for (int i = 0; i < 8; ++i) {
        const uint8_t* ql = w.ql + col[i] * (w.k / 2) + at * 64;
        const uint8_t* qh = w.qh + col[i] * (w.k / 4) + at * 32;
        const __m256i a = _mm256_loadu_si256((const __m256i*)(ql + (j & 1) * 32)), h = _mm256_loadu_si256((const __m256i*)qh);
        const __m256i lo = j < 2 ? _mm256_and_si256(a, low) : _mm256_and_si256(_mm256_srli_epi16(a, 4), low);
        const __m256i hi = j == 0 ? _mm256_slli_epi16(h, 4) : j == 1 ? _mm256_slli_epi16(h, 2) : j == 2 ? h : _mm256_srli_epi16(h, 2);
        r[i] = _mm256_or_si256(lo, _mm256_and_si256(hi, high));
        if (j == 0) {
            _mm_prefetch((const char*)(ql + kColumns * (w.k / 2)), _MM_HINT_T0);
            if (!(at & 1)) _mm_prefetch((const char*)(qh + kColumns * (w.k / 4)), _MM_HINT_T0);
        }
    }
    transpose8x8(r);
}

// Superblock s's scales for the tile's columns: v[g] = (sc_g, sc_g) for g < 16, v[16 + h] = (sc_2h, sc_2h+1).
inline void q6k_scales(const Q6K& w, const int64_t* col, int64_t s, __m256i v[24]) {
    __m256i r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w.sc + col[i] * (w.k / 16) + s * 16)));
    _mm_prefetch((const char*)(w.sc + (col[0] + kColumns) * (w.k / 16)) + s * 16, _MM_HINT_T0);
    transpose8x8(r);  // r[h] lane i: (sc_2h, sc_2h+1) of column i
    const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                          0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
    const __m256i odd = _mm256_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15,
                                         2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15);
    for (int h = 0; h < 8; ++h) {
        v[2 * h] = _mm256_shuffle_epi8(r[h], even);
        v[2 * h + 1] = _mm256_shuffle_epi8(r[h], odd);
        v[16 + h] = r[h];
    }
}

// Chunk c of superblock s for R rows: total[r] += its two groups' sc_g * code * q.
template <int R, class Codes>
SPECDEC_INLINE void q6k_chunk(Codes codes, const __m256i* scales, const GroupRows<R>& x, int64_t s, int c, __m256i* total) {
    for (int half = 0; half < 2; ++half) {
        const __m256i scale = scales[2 * c + half];
        const __m256i c0 = codes(4 * half), c1 = codes(4 * half + 1), c2 = codes(4 * half + 2), c3 = codes(4 * half + 3);
        for (int r = 0; r < R; ++r) {
            const int8_t* q = x.q[r] + s * 256 + c * 32 + half * 16;
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(c0, broadcast4(q)), _mm256_maddubs_epi16(c1, broadcast4(q + 4)));
            const __m256i p2 = _mm256_add_epi16(_mm256_maddubs_epi16(c2, broadcast4(q + 8)), _mm256_maddubs_epi16(c3, broadcast4(q + 12)));
            total[r] = _mm256_add_epi32(total[r], _mm256_add_epi32(_mm256_madd_epi16(p, scale), _mm256_madd_epi16(p2, scale)));
        }
    }
}

template <int R>
inline void q6k_superblock_end(const __m256i* scales, const ColumnTile& t, const GroupRows<R>& x, int64_t s, const __m256i* total, __m256* acc) {
    const __m256 d = _mm256_loadu_ps(&t.d[s * kColumns]);
    for (int r = 0; r < R; ++r) {
        const int8_t* sums = (const int8_t*)(x.sums[r] + s * 16);
        __m256i m = _mm256_madd_epi16(scales[16], broadcast4(sums));
        for (int h = 1; h < 8; ++h) m = _mm256_add_epi32(m, _mm256_madd_epi16(scales[16 + h], broadcast4(sums + 4 * h)));
        const __m256i exact = _mm256_sub_epi32(total[r], _mm256_slli_epi32(m, 5));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(d, _mm256_set1_ps(x.scale[r][s])), acc[r]);
    }
}

// Q6_K's tiles are always unpacked: unpacking its 6-bit codes costs too much to repeat for a few rows (the row
// kernels run those, q6k_columns).
template <int R> struct Q6KColumns {
    static constexpr int kRows = kColumnRows;
    static constexpr bool kFused = false;
    static void unpacked(const Q6K&, const int64_t*, const ColumnTile& t, const QuantizedRows& a, int64_t first, float** out, int64_t n0, int valid) {
        const GroupRows<R> x(a, first, t);
        __m256 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
        for (int64_t s = 0; s < t.groups / 8; ++s) {
            const __m256i* scales = &t.scales[s * 24];
            __m256i total[R];
            for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_si256();
            for (int c = 0; c < 8; ++c) {
                const __m256i* w = &t.codes[(s * 8 + c) * 8];
                q6k_chunk<R>([w](int m) { return _mm256_load_si256(w + m); }, scales, x, s, c, total);
            }
            q6k_superblock_end<R>(scales, t, x, s, total, acc);
        }
        store_columns<R>(acc, out, first, n0, valid);
    }
};

inline void unpack_q6k(const Q6K& w, const int64_t* col, ColumnTile& t) {
    t.scales.resize(t.groups / 8 * 24);
    for (int64_t s = 0; s < t.groups / 8; ++s) {
        q6k_scales(w, col, s, &t.scales[s * 24]);
        for (int c = 0; c < 8; ++c) q6k_chunk_codes(w, col, s, c / 4, c % 4, &t.codes[(s * 8 + c) * 8]);
    }
}

inline void gather_q6k(const Q6K& w, const int64_t* col, ColumnTile& t) { gather_columns(w.d, w.k / 256, col, t.d.data()); }

// Tile `tile`'s output columns into col (the last tile repeats its last column where fewer than 8 are left);
// returns how many are real.
inline int tile_columns(int64_t tile, int64_t out_features, int64_t col[kColumns]) {
    const int64_t n0 = tile * kColumns;
    for (int i = 0; i < kColumns; ++i) col[i] = std::min(n0 + i, out_features - 1);
    return (int)std::min<int64_t>(kColumns, out_features - n0);
}

// f(std::integral_constant<int, rows>()) for a run-time row count 1 <= rows <= R.
template <int R, class F>
inline void with_row_count(int rows, F f) {
    if constexpr (R > 1) {
        if (rows < R) return with_row_count<R - 1>(rows, f);
    }
    f(std::integral_constant<int, R>());
}

// Every output column for every row: tiles of 8 columns split over the threads. A call of up to kRows rows runs
// each tile fused. Q4_K's calls of up to 2 kRows rows run fused too, in two groups of rows of nearly equal sizes: a
// second transposition of the tile's weights, from L1, costs less than unpacking them to memory. A longer call
// unpacks each tile once, then runs its rows in groups of kRows (the last rows in one smaller group). Each output's
// operations are those above whichever path, group or tile it is in. The one-group call keeps a branch of its own:
// it is what every step and few-row pass of these formats runs, and its compiled code stays as it was measured.
template <class W, template <int> class Rows, class Unpack, class Gather>
void column_matmul(const W& w, const QuantizedRows& a, int64_t rows, int64_t out_features, float* base, int vectors, Unpack unpack, Gather gather) {
    const int64_t tiles = (out_features + kColumns - 1) / kColumns;
    constexpr int kRows = Rows<1>::kRows;
    constexpr int kFusedGroups = std::is_same_v<W, Q4K> ? 2 : 1;
    const bool fused = Rows<1>::kFused && rows <= kFusedGroups * kRows;
    const int64_t groups = w.k / 32;
    std::vector<float> scaled_sums;
    if constexpr (std::is_same_v<W, Q41>) {
        scaled_sums.resize(rows * groups);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t g = 0; g < groups; ++g) scaled_sums[r * groups + g] = a.row_scale(r)[g] * (float)a.row_sums(r)[g];
    }
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        ColumnTile t(groups, fused ? 0 : vectors);
        t.scaled_sums = scaled_sums.empty() ? nullptr : scaled_sums.data();
        std::vector<float*> out(rows);
        for (int64_t r = 0; r < rows; ++r) out[r] = base + r * out_features;
        for (int64_t tile = begin; tile < end; ++tile) {
            const int64_t n0 = tile * kColumns;
            int64_t col[kColumns];
            const int valid = tile_columns(tile, out_features, col);
            gather(w, col, t);
            if constexpr (Rows<1>::kFused) {
                if (fused && rows <= kRows) {
                    with_row_count<kRows>((int)rows, [&](auto r) { Rows<decltype(r)::value>::fused(w, col, t, a, 0, out.data(), n0, valid); });
                    continue;
                }
                if constexpr (kFusedGroups > 1) {
                    if (fused) {
                        const int64_t groups_of_rows = (rows + kRows - 1) / kRows;
                        for (int64_t i = 0, first = 0; i < groups_of_rows; ++i) {
                            const int size = (int)(rows / groups_of_rows + (i < rows % groups_of_rows));
                            with_row_count<kRows>(size, [&](auto r) { Rows<decltype(r)::value>::fused(w, col, t, a, first, out.data(), n0, valid); });
                            first += size;
                        }
                        continue;
                    }
                }
            }
            unpack(w, col, t);
            int64_t r = 0;
            for (; r + kRows <= rows; r += kRows) Rows<kRows>::unpacked(w, col, t, a, r, out.data(), n0, valid);
            if (r < rows)
                with_row_count<kRows - 1>((int)(rows - r), [&](auto n) { Rows<decltype(n)::value>::unpacked(w, col, t, a, r, out.data(), n0, valid); });
        }
    });
}
