// Q4_K and Q6_K products on AMX tiles (Intel Sapphire Rapids and later): included by kernels.cpp in the amx
// namespace, compiled for AMX-INT8 and AVX-512.
//
// A tile product is exact: TDPBUSD/TDPBSSD add int8 x int8 products into int32. The weights are the A operand: 16
// output columns x 64 weights, each weight its code times its group's scale (the integer the row kernels multiply
// by the activation), split into two bytes, unpacked once per column tile and reused for every tile of activation
// rows. The activations are the B operand: 64 values of 16 rows in AMX's four-byte interleaved layout, laid out
// once per call. A superblock's two int32 sums make its exact total (low + (high << shift)), the very integer
// every other kernel computes, and the float steps are rows_step's (kernel_rows.h) on 16 rows at once, one per
// lane: so every row's result is bit-identical to the row kernels', whatever the number of rows.

// AMX's tile configuration (the 64-byte operand of LDTILECFG), palette 1.
struct TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Every tile 16 x 64 bytes: 0-3 accumulate the two parts' sums (below) for two tiles of activation rows, 4-5 hold
// the two parts of a chunk of weights, 6-7 the chunk's activations of the two row tiles.
inline void configure_tiles() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

constexpr int kTile = 16;  // rows and output columns per tile
constexpr int kChunk = 64;  // weights (K) per tile product

// n values of T on 64-byte boundaries, not initialised (std::vector does not align to the 64 bytes of __m512 members
// here, and zeroes what it allocates). At least 64 bytes, so that no count gives a null pointer.
template <typename T>
struct AlignedArray {
    T* data;
    explicit AlignedArray(int64_t n)
        : data(static_cast<T*>(std::aligned_alloc(64, std::max<int64_t>(1, (n * sizeof(T) + 63) / 64) * 64))) {
        TORCH_CHECK(data, "out of memory");
    }
    ~AlignedArray() { std::free(data); }
    AlignedArray(const AlignedArray&) = delete;
    AlignedArray& operator=(const AlignedArray&) = delete;
    T& operator[](int64_t i) { return data[i]; }
    const T& operator[](int64_t i) const { return data[i]; }
};

// The activation rows in the layout of the B operand, padded to whole tiles of 16 rows (padding rows are zero and
// their results never stored): for tile t, the K / 4 rows of [16 activation rows x 4 bytes]; with each row's block
// scales and group sums transposed, one vector of 16 rows per block (per pair of groups for the sums).
struct AmxRows {
    int64_t tiles, k, blocks, pairs;
    // Left uninitialised at allocation (a single thread's memset of 4.6 MB for 512 rows of ffn_down's input) and
    // written in full by the threads, padding rows as zeros.
    AlignedArray<int8_t> b;      // [tile][k / 4][16][4]
    AlignedArray<float> scale;   // [tile][block][16]
    AlignedArray<int16_t> sums;  // [tile][pair of groups][16][2]
    AmxRows(const QuantizedRows& a, int64_t rows, bool with_sums)
        : tiles((rows + kTile - 1) / kTile), k(a.k), blocks(a.blocks), pairs(with_sums ? a.groups / 2 : 0),
          b(tiles * kTile * k), scale(tiles * blocks * kTile), sums(tiles * pairs * kTile * 2) {
        at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t)
                for (int64_t lane = 0; lane < kTile; ++lane) {
                    const int64_t r = t * kTile + lane;
                    int32_t* bt = (int32_t*)&b[t * kTile * k];
                    if (r >= rows) {
                        for (int64_t i = 0; i < k / 4; ++i) bt[i * kTile + lane] = 0;
                        for (int64_t s = 0; s < blocks; ++s) scale[(t * blocks + s) * kTile + lane] = 0.f;
                        for (int64_t p = 0; p < 2 * pairs; ++p) sums[((t * pairs + p / 2) * kTile + lane) * 2 + p % 2] = 0;
                        continue;
                    }
                    const int32_t* q = (const int32_t*)a.row_q(r);  // four bytes at a time: one B element group
                    for (int64_t i = 0; i < k / 4; ++i) bt[i * kTile + lane] = q[i];
                    for (int64_t s = 0; s < blocks; ++s) scale[(t * blocks + s) * kTile + lane] = a.row_scale(r)[s];
                    for (int64_t p = 0; p < pairs; ++p) {
                        sums[((t * pairs + p) * kTile + lane) * 2] = a.row_sums(r)[2 * p];
                        sums[((t * pairs + p) * kTile + lane) * 2 + 1] = a.row_sums(r)[2 * p + 1];
                    }
                }
        });
    }
    const int8_t* tile_b(int64_t t) const { return &b[t * kTile * k]; }
    const float* tile_scale(int64_t t, int64_t s) const { return &scale[(t * blocks + s) * kTile]; }
    const int16_t* tile_sums(int64_t t, int64_t p) const { return &sums[(t * pairs + p) * kTile * 2]; }
};

// A superblock of a column tile's weights, with the group scales folded in: each weight's scaled code (code * scale,
// the integer the row kernels multiply by the activation) as two parts, low + (high << shift), each a byte. Layout
// [chunk of 64][part][16 columns][64 bytes]: a chunk's part is one A operand.
constexpr int64_t kUnpackedPerSuperblock = 4 * 2 * kTile * kChunk;

// Column m of a last, partial column tile: zero weights, whose products are zero and never stored.
inline void zero_column(uint8_t* out, int64_t m) {
    for (int i = 0; i < 8; ++i) std::memset(out + (i * kTile + m) * kChunk, 0, kChunk);
}

// The tile products of a superblock for one or two tiles of activation rows, chunk by chunk (64 weights each): the
// two parts' sums of the first row tile in tiles 0 and 1, of the second in tiles 2 and 3, which store_sums writes to
// low[i], high[i] (16 columns x 16 rows each).
inline void zero_sums(bool two) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) { _tile_zero(2); _tile_zero(3); }
}

template <bool kSigned>
inline void chunk_products(const uint8_t* w, const int8_t* const* x, bool two, int c) {
    constexpr int64_t part = kTile * kChunk;
#define SPECDEC_DP(C, A, B) \
    if constexpr (kSigned) _tile_dpbssd(C, A, B); else _tile_dpbusd(C, A, B);
    _tile_loadd(4, w + (2 * c) * part, kChunk);
    _tile_loadd(5, w + (2 * c + 1) * part, kChunk);
    _tile_loadd(6, x[0] + c * kChunk * kTile, 64);
    SPECDEC_DP(0, 4, 6)
    SPECDEC_DP(1, 5, 6)
    if (two) {
        _tile_loadd(7, x[1] + c * kChunk * kTile, 64);
        SPECDEC_DP(2, 4, 7)
        SPECDEC_DP(3, 5, 7)
    }
#undef SPECDEC_DP
}

inline void store_sums(bool two, int32_t (*low)[kTile][kTile], int32_t (*high)[kTile][kTile]) {
    _tile_stored(0, low[0], 64);
    _tile_stored(1, high[0], 64);
    if (two) { _tile_stored(2, low[1], 64); _tile_stored(3, high[1], 64); }
}

// A 16 x 16 transpose in registers: v[i] lane j becomes v[j] lane i (pairs of lanes, then of 64-bit lanes, then of
// 128-bit lanes, twice).
inline void transpose16(__m512* v) {
    __m512 t[kTile];
    for (int i = 0; i < kTile; i += 2) {
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int i = 0; i < kTile; i += 4) {
        v[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        v[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        v[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        v[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < kTile; i += 8)
        for (int j = 0; j < 4; ++j) {
            t[i + j] = _mm512_shuffle_f32x4(v[i + j], v[i + j + 4], 0x88);
            t[i + j + 4] = _mm512_shuffle_f32x4(v[i + j], v[i + j + 4], 0xdd);
        }
    for (int j = 0; j < 8; ++j) {
        v[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
        v[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
    }
}

// Where a tile's outputs go: values[m] holds column m of the tile's 16 rows, transposed so that each row's columns
// are stored at once (a scalar store per value cost a 512-row pass a fifth of its time); rows and columns past the
// ends are skipped.
inline void store_tile(__m512* values, int64_t tile, int64_t rows, int64_t n0, int64_t cols, int64_t out_features, float* y) {
    transpose16(values);
    const __mmask16 valid = (__mmask16)((1u << cols) - 1);
    for (int64_t lane = 0; lane < kTile && tile * kTile + lane < rows; ++lane)
        _mm512_mask_storeu_ps(y + (tile * kTile + lane) * out_features + n0, valid, values[lane]);
}

// A superblock's integer total of output column m for the tile's 16 rows: low + (high << shift) (exact).
template <int kShift>
inline __m512i total(const int32_t (*low)[kTile], const int32_t (*high)[kTile], int64_t m) {
    return _mm512_add_epi32(_mm512_load_si512((const void*)low[m]), _mm512_slli_epi32(_mm512_load_si512((const void*)high[m]), kShift));
}

// A pair of row tiles from row tile t (or the last tile alone) through every superblock's products and float steps.
// Each superblock's float steps are interleaved with the next one's tile products, a quarter of the columns after
// each chunk, so that the tile unit computes while the vector units run the steps: the out-of-order window holds less
// than a superblock's steps, and each waited for the other when all the products preceded the steps.
template <bool kSigned, typename Format>
void pair_through_superblocks(const Format& f, const AmxRows& x, int64_t t, int64_t cols, const uint8_t* unpacked,
                              const typename Format::Columns* columns, typename Format::State* state) {
    const int64_t superblocks = x.k / 256;
    const bool two = t + 1 < x.tiles;
    alignas(64) int32_t low[2][2][kTile][kTile], high[2][2][kTile][kTile];  // [superblock % 2][row tile of the pair]
    auto inputs = [&](int64_t s, const int8_t** b) {
        b[0] = x.tile_b(t) + s * 256 * kTile;
        b[1] = x.tile_b(two ? t + 1 : t) + s * 256 * kTile;
        return unpacked + s * kUnpackedPerSuperblock;
    };
    const int8_t* b[2];
    const uint8_t* w = inputs(0, b);
    zero_sums(two);
    for (int c = 0; c < 4; ++c) chunk_products<kSigned>(w, b, two, c);
    for (int64_t s = 0; s < superblocks; ++s) {
        store_sums(two, low[s % 2], high[s % 2]);
        const bool next = s + 1 < superblocks;
        if (next) {
            w = inputs(s + 1, b);
            zero_sums(two);
        }
        for (int c = 0; c < 4; ++c) {
            if (next) chunk_products<kSigned>(w, b, two, c);
            const int64_t m0 = std::min<int64_t>(cols, 4 * c), m1 = std::min<int64_t>(cols, 4 * c + 4);
            for (int i = 0; i < 1 + two; ++i) f.step(state[i], columns[s], m0, m1, s, low[s % 2][i], high[s % 2][i], x, t + i);
        }
    }
}

// The driver of both formats: column tiles split over threads; per column tile the weights unpacked once (and the
// per-column constants of every superblock, Format::Columns), then each pair of row tiles through every
// superblock's products and float steps. Format supplies unpack(n, m, s, out) (column n's superblock s into column m
// of a tile's unpacked superblock), columns(c, n0, cols, s), the float state of a row tile (State), step(state,
// columns, m0, m1, s, low, high, x, t) for one superblock's sums of columns m0 .. m1 - 1, and finish(state, m).
template <bool kSigned, typename Format>
void tile_matmul(const Format& f, const AmxRows& x, int64_t rows, int64_t out_features, float* y) {
    const int64_t superblocks = x.k / 256, col_tiles = (out_features + kTile - 1) / kTile;
    at::parallel_for(0, col_tiles, 1, [&](int64_t begin, int64_t end) {
        configure_tiles();
        std::vector<uint8_t> unpacked(superblocks * kUnpackedPerSuperblock);
        std::vector<typename Format::Columns> columns(superblocks);
        AlignedArray<typename Format::State> state(2);
        __m512 out[kTile];
        for (int64_t ct = begin; ct < end; ++ct) {
            const int64_t n0 = ct * kTile, cols = std::min<int64_t>(kTile, out_features - n0);
            for (int64_t s = 0; s < superblocks; ++s) {
                uint8_t* superblock = unpacked.data() + s * kUnpackedPerSuperblock;
                for (int64_t m = 0; m < kTile; ++m) {
                    if (m < cols) f.unpack(n0 + m, m, s, superblock);
                    else zero_column(superblock, m);
                }
                f.columns(columns[s], n0, cols, s);
            }
            for (int64_t t = 0; t < x.tiles; t += 2) {
                const int pair = x.tiles - t >= 2 ? 2 : 1;
                for (int i = 0; i < pair; ++i) state[i] = typename Format::State();
                pair_through_superblocks<kSigned>(f, x, t, cols, unpacked.data(), columns.data(), &state[0]);
                for (int i = 0; i < pair; ++i) {
                    for (int64_t m = 0; m < kTile; ++m) out[m] = m < cols ? f.finish(state[i], m) : _mm512_setzero_ps();
                    store_tile(out, t + i, rows, n0, cols, out_features, y);
                }
            }
        }
        _tile_release();
    });
}

// ---- Q4_K -----------------------------------------------------------------------------------------------------
// code * sc <= 15 * 63 = 945: low byte (unsigned, TDPBUSD) and high byte (<= 3): total<8>.

alignas(64) constexpr int16_t kEveryCode[32] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
                                               0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

struct Q4KTiles {
    const Q4K& w;
    struct State {
        __m512 acc[kTile], acc_min[kTile];
        State() { for (int m = 0; m < kTile; ++m) acc[m] = acc_min[m] = _mm512_setzero_ps(); }
    };

    // Superblock s of output column n into column m of a tile's unpacked superblock.
    void unpack(int64_t n, int64_t m, int64_t s, uint8_t* out) const {
        const __m512i low = _mm512_set1_epi8(0x0F);
        const __m512i nibble = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        const __m512i codes_to_16 = _mm512_loadu_si512((const void*)kEveryCode);
        const Q4K col = w.row(n);
        const __m512i scales = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i*)(col.sc + s * 8))));
        __m256i chunks[4];  // the file's order (the codes are stored in grouped-lane order)
        q4k_file_chunks(col.codes + s * 128, chunks);
        for (int c = 0; c < 4; ++c) {
            // Chunk c: weights 64c..64c+31 (group 2c) as the low nibbles, 64c+32.. (group 2c + 1) the high ones.
            const __m512i codes = _mm512_and_si512(_mm512_srlv_epi16(_mm512_broadcast_i64x4(chunks[c]), nibble), low);
            // The products code * sc of every code 0..15 for both groups, as two 16-byte tables per part.
            const __m512i pick = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((int16_t)(2 * c))),
                                                    _mm256_set1_epi16((int16_t)(2 * c + 1)), 1);
            const __m512i products = _mm512_mullo_epi16(codes_to_16, _mm512_permutexvar_epi16(pick, scales));
            const __m512i lo = _mm512_castsi256_si512(_mm512_cvtepi16_epi8(products));
            const __m512i hi = _mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srli_epi16(products, 8)));
            // Group 2c's table in 128-bit lanes 0-1 (its codes), group 2c + 1's in lanes 2-3.
            const __m512i table_lo = _mm512_shuffle_i64x2(lo, lo, _MM_SHUFFLE(1, 1, 0, 0));
            const __m512i table_hi = _mm512_shuffle_i64x2(hi, hi, _MM_SHUFFLE(1, 1, 0, 0));
            uint8_t* base = out + (2 * c * kTile + m) * kChunk;
            _mm512_storeu_si512((void*)base, _mm512_shuffle_epi8(table_lo, codes));
            _mm512_storeu_si512((void*)(base + kTile * kChunk), _mm512_shuffle_epi8(table_hi, codes));
        }
    }

    // Per column of the tile: d and dmin of the superblock, and its 8 mins as 4 int16 pairs.
    struct Columns {
        float d[kTile], dmin[kTile];
        int32_t min_pairs[kTile][4];
    };
    void columns(Columns& c, int64_t n0, int64_t cols, int64_t s) const {
        for (int64_t m = 0; m < cols; ++m) {
            const Q4K col = w.row(n0 + m);
            c.d[m] = col.d[s];
            c.dmin[m] = col.dmin[s];
            for (int p = 0; p < 4; ++p) c.min_pairs[m][p] = (int32_t)col.mn[s * 8 + 2 * p] | ((int32_t)col.mn[s * 8 + 2 * p + 1] << 16);
        }
    }

    // rows_step for 16 rows, one per lane, of both terms (the mins' subtracted at the end, as q4k_rows does).
    void step(State& st, const Columns& c, int64_t m0, int64_t m1, int64_t s, const int32_t (*low)[kTile], const int32_t (*high)[kTile],
              const AmxRows& x, int64_t t) const {
        __m512i pair_sums[4];
        for (int p = 0; p < 4; ++p) pair_sums[p] = _mm512_loadu_si512((const void*)x.tile_sums(t, s * 4 + p));
        const __m512 xs = _mm512_loadu_ps(x.tile_scale(t, s));
        for (int64_t m = m0; m < m1; ++m) {
            __m512i imin = _mm512_setzero_si512();
            for (int p = 0; p < 4; ++p) imin = _mm512_dpwssd_epi32(imin, pair_sums[p], _mm512_set1_epi32(c.min_pairs[m][p]));
            st.acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total<8>(low, high, m)), _mm512_mul_ps(_mm512_set1_ps(c.d[m]), xs), st.acc[m]);
            st.acc_min[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(imin), _mm512_mul_ps(_mm512_set1_ps(c.dmin[m]), xs), st.acc_min[m]);
        }
    }
    __m512 finish(const State& st, int64_t m) const { return _mm512_sub_ps(st.acc[m], st.acc_min[m]); }
};

inline void q4k(const Q4K& w, const QuantizedRows& a, int64_t rows, int64_t out_features, float* y) {
    tile_matmul<false>(Q4KTiles{w}, AmxRows(a, rows, true), rows, out_features, y);
}

// ---- Q6_K -----------------------------------------------------------------------------------------------------
// (code - 32) * sc in [-4064, 4096]: low 7 bits (0..127) and the rest (arithmetic shift: -32..32), both signed
// bytes (TDPBSSD): total<7>. The codes' offset is thereby in the weights: no correction term.

alignas(64) constexpr int16_t kGroupOfLane[32] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

struct Q6KTiles {
    const Q6K& w;
    struct State {
        __m512 acc[kTile];
        State() { for (int m = 0; m < kTile; ++m) acc[m] = _mm512_setzero_ps(); }
    };

    // Superblock s of output column n into column m of a tile's unpacked superblock.
    void unpack(int64_t n, int64_t m, int64_t s, uint8_t* out) const {
        const __m256i offset = _mm256_set1_epi8(32);
        const __m512i seven_bits = _mm512_set1_epi16(127);
        const __m512i group_of_lane = _mm512_loadu_si512((const void*)kGroupOfLane);
        const Q6K col = w.row(n);
        const __m512i scales = _mm512_cvtepi8_epi16(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(col.sc + s * 16))));
        for (int half = 0; half < 2; ++half) {
            __m256i v[4];  // weights 32j..32j+31 of this 128
            q6k_codes(col, s, half, v);
            for (int j = 0; j < 4; ++j) {
                const int c = half * 4 + j;  // 32 weights: groups 2c and 2c + 1
                const __m512i codes = _mm512_cvtepi8_epi16(_mm256_sub_epi8(v[j], offset));
                const __m512i scaled = _mm512_mullo_epi16(
                    codes, _mm512_permutexvar_epi16(_mm512_add_epi16(group_of_lane, _mm512_set1_epi16((int16_t)(2 * c))), scales));
                // Chunk c / 2 of 64 weights, its bytes 32 (c % 2) onwards.
                uint8_t* base = out + (2 * (c / 2) * kTile + m) * kChunk + 32 * (c % 2);
                _mm256_storeu_si256((__m256i*)base, _mm512_cvtepi16_epi8(_mm512_and_si512(scaled, seven_bits)));
                _mm256_storeu_si256((__m256i*)(base + kTile * kChunk), _mm512_cvtepi16_epi8(_mm512_srai_epi16(scaled, 7)));
            }
        }
    }

    struct Columns {
        float d[kTile];  // of the superblock, per column
    };
    void columns(Columns& c, int64_t n0, int64_t cols, int64_t s) const {
        for (int64_t m = 0; m < cols; ++m) c.d[m] = w.row(n0 + m).d[s];
    }

    // rows_step for 16 rows, one per lane.
    void step(State& st, const Columns& c, int64_t m0, int64_t m1, int64_t s, const int32_t (*low)[kTile], const int32_t (*high)[kTile],
              const AmxRows& x, int64_t t) const {
        const __m512 xs = _mm512_loadu_ps(x.tile_scale(t, s));
        for (int64_t m = m0; m < m1; ++m)
            st.acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total<7>(low, high, m)), _mm512_mul_ps(_mm512_set1_ps(c.d[m]), xs), st.acc[m]);
    }
    __m512 finish(const State& st, int64_t m) const { return st.acc[m]; }
};

inline void q6k(const Q6K& w, const QuantizedRows& a, int64_t rows, int64_t out_features, float* y) {
    tile_matmul<true>(Q6KTiles{w}, AmxRows(a, rows, false), rows, out_features, y);
}
