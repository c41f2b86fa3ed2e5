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

// The activation rows in the layout of the B operand, padded to whole tiles of 16 rows (padding rows are zero and
// their results never stored): for tile t, the K / 4 rows of [16 activation rows x 4 bytes]; with each row's block
// scales and group sums transposed, one vector of 16 rows per block (per pair of groups for the sums).
struct AmxRows {
    int64_t tiles, k, blocks, pairs;
    std::vector<int8_t> b;      // [tile][k / 4][16][4]
    std::vector<float> scale;   // [tile][block][16]
    std::vector<int16_t> sums;  // [tile][pair of groups][16][2]
    AmxRows(const QuantizedRows& a, int64_t rows, bool with_sums)
        : tiles((rows + kTile - 1) / kTile), k(a.k), blocks(a.blocks), pairs(with_sums ? a.groups / 2 : 0),
          b(tiles * kTile * k, 0), scale(tiles * blocks * kTile, 0.f), sums(tiles * pairs * kTile * 2, 0) {
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t t = r / kTile, lane = r % kTile;
            const int32_t* q = (const int32_t*)a.row_q(r);  // four bytes at a time: one B element group
            int32_t* bt = (int32_t*)&b[t * kTile * k];
            for (int64_t i = 0; i < k / 4; ++i) bt[i * kTile + lane] = q[i];
            for (int64_t s = 0; s < blocks; ++s) scale[(t * blocks + s) * kTile + lane] = a.row_scale(r)[s];
            for (int64_t p = 0; p < pairs; ++p) {
                sums[((t * pairs + p) * kTile + lane) * 2] = a.row_sums(r)[2 * p];
                sums[((t * pairs + p) * kTile + lane) * 2 + 1] = a.row_sums(r)[2 * p + 1];
            }
        }
    }
    const int8_t* tile_b(int64_t t) const { return &b[t * kTile * k]; }
    const float* tile_scale(int64_t t, int64_t s) const { return &scale[(t * blocks + s) * kTile]; }
    const int16_t* tile_sums(int64_t t, int64_t p) const { return &sums[(t * pairs + p) * kTile * 2]; }
};

// The weights of a column tile, with the group scales folded in: each weight's scaled code (code * scale, the integer
// the row kernels multiply by the activation) as two parts, low + (high << shift), each a byte. Layout
// [superblock][chunk of 64][part][16 columns][64 bytes]: a chunk's part is one A operand.
constexpr int64_t kUnpackedPerSuperblock = 4 * 2 * kTile * kChunk;

// Column m of a last, partial column tile: zero weights, whose products are zero and never stored.
inline void zero_column(uint8_t* out, int64_t superblocks, int64_t m) {
    for (int64_t s = 0; s < superblocks; ++s)
        for (int i = 0; i < 8; ++i) std::memset(out + s * kUnpackedPerSuperblock + (i * kTile + m) * kChunk, 0, kChunk);
}

// One superblock's tile products for T (1 or 2) tiles of activation rows: the int32 sums of each part into
// low[t], high[t] (16 columns x 16 rows each).
template <bool kSigned, int T>
inline void superblock_products(const uint8_t* w, const int8_t* const* x, int32_t (*low)[kTile][kTile], int32_t (*high)[kTile][kTile]) {
    constexpr int64_t part = kTile * kChunk;
#define SPECDEC_DP(C, A, B) \
    if constexpr (kSigned) _tile_dpbssd(C, A, B); else _tile_dpbusd(C, A, B);
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (T == 2) { _tile_zero(2); _tile_zero(3); }
    for (int c = 0; c < 4; ++c) {
        _tile_loadd(4, w + (2 * c) * part, kChunk);
        _tile_loadd(5, w + (2 * c + 1) * part, kChunk);
        _tile_loadd(6, x[0] + c * kChunk * kTile, 64);
        SPECDEC_DP(0, 4, 6)
        SPECDEC_DP(1, 5, 6)
        if constexpr (T == 2) {
            _tile_loadd(7, x[1] + c * kChunk * kTile, 64);
            SPECDEC_DP(2, 4, 7)
            SPECDEC_DP(3, 5, 7)
        }
    }
#undef SPECDEC_DP
    _tile_stored(0, low[0], 64);
    _tile_stored(1, high[0], 64);
    if constexpr (T == 2) { _tile_stored(2, low[1], 64); _tile_stored(3, high[1], 64); }
}

// Where a tile's outputs go: y[row, column], rows and columns past the ends skipped.
inline void store_tile(const __m512* values, int64_t tile, int64_t rows, int64_t n0, int64_t cols, int64_t out_features, float* y) {
    alignas(64) float lanes[kTile];
    for (int64_t m = 0; m < cols; ++m) {
        _mm512_store_ps(lanes, values[m]);
        for (int64_t lane = 0; lane < kTile && tile * kTile + lane < rows; ++lane)
            y[(tile * kTile + lane) * out_features + n0 + m] = lanes[lane];
    }
}

// n values of T on 64-byte boundaries (std::vector does not align to the 64 bytes of __m512 members here).
template <typename T>
struct AlignedArray {
    T* data;
    explicit AlignedArray(int64_t n) : data(static_cast<T*>(std::aligned_alloc(64, ((n * sizeof(T) + 63) / 64) * 64))) {
        TORCH_CHECK(data, "out of memory");
    }
    ~AlignedArray() { std::free(data); }
    AlignedArray(const AlignedArray&) = delete;
    AlignedArray& operator=(const AlignedArray&) = delete;
    T& operator[](int64_t i) { return data[i]; }
};

// A superblock's integer total of output column m for the tile's 16 rows: low + (high << shift) (exact).
template <int kShift>
inline __m512i total(const int32_t (*low)[kTile], const int32_t (*high)[kTile], int64_t m) {
    return _mm512_add_epi32(_mm512_load_si512((const void*)low[m]), _mm512_slli_epi32(_mm512_load_si512((const void*)high[m]), kShift));
}

// The driver of both formats: column tiles split over threads; per column tile the weights unpacked once (and the
// per-column constants of every superblock, Format::Columns), then each pair of row tiles through every
// superblock's products and float steps. Format supplies unpack_column(n, m, out), columns(c, n0, cols, s), the float
// state of a row tile (State), step(state, columns, cols, s, low, high, x, t) for one superblock's sums and
// finish(state, m).
template <bool kSigned, typename Format>
void tile_matmul(const Format& f, const AmxRows& x, int64_t rows, int64_t out_features, float* y) {
    const int64_t superblocks = x.k / 256, col_tiles = (out_features + kTile - 1) / kTile;
    at::parallel_for(0, col_tiles, 1, [&](int64_t begin, int64_t end) {
        configure_tiles();
        std::vector<uint8_t> unpacked(superblocks * kUnpackedPerSuperblock);
        std::vector<typename Format::Columns> columns(superblocks);
        alignas(64) int32_t low[2][kTile][kTile], high[2][kTile][kTile];
        AlignedArray<typename Format::State> state(2);
        __m512 out[kTile];
        for (int64_t ct = begin; ct < end; ++ct) {
            const int64_t n0 = ct * kTile, cols = std::min<int64_t>(kTile, out_features - n0);
            for (int64_t m = 0; m < kTile; ++m) {
                if (m < cols) f.unpack_column(n0 + m, m, unpacked.data());
                else zero_column(unpacked.data(), superblocks, m);
            }
            for (int64_t s = 0; s < superblocks; ++s) f.columns(columns[s], n0, cols, s);
            for (int64_t t = 0; t < x.tiles; t += 2) {
                const int pair = x.tiles - t >= 2 ? 2 : 1;
                for (int i = 0; i < pair; ++i) state[i] = typename Format::State();
                for (int64_t s = 0; s < superblocks; ++s) {
                    const int8_t* b[2] = {x.tile_b(t) + s * 256 * kTile, x.tile_b(t + pair - 1) + s * 256 * kTile};
                    const uint8_t* w = unpacked.data() + s * kUnpackedPerSuperblock;
                    if (pair == 2) superblock_products<kSigned, 2>(w, b, low, high);
                    else superblock_products<kSigned, 1>(w, b, low, high);
                    for (int i = 0; i < pair; ++i) f.step(state[i], columns[s], cols, s, low[i], high[i], x, t + i);
                }
                for (int i = 0; i < pair; ++i) {
                    for (int64_t m = 0; m < cols; ++m) out[m] = f.finish(state[i], m);
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

    // Output column n into column m of the tile's unpacked weights.
    void unpack_column(int64_t n, int64_t m, uint8_t* out) const {
        const int64_t superblocks = w.k / 256;
        const __m512i low = _mm512_set1_epi8(0x0F);
        const __m512i nibble = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
        const __m512i codes_to_16 = _mm512_loadu_si512((const void*)kEveryCode);
        const Q4K col = w.row(n);
        for (int64_t s = 0; s < superblocks; ++s) {
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
                uint8_t* base = out + s * kUnpackedPerSuperblock + (2 * c * kTile + m) * kChunk;
                _mm512_storeu_si512((void*)base, _mm512_shuffle_epi8(table_lo, codes));
                _mm512_storeu_si512((void*)(base + kTile * kChunk), _mm512_shuffle_epi8(table_hi, codes));
            }
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
    void step(State& st, const Columns& c, int64_t cols, int64_t s, const int32_t (*low)[kTile], const int32_t (*high)[kTile],
              const AmxRows& x, int64_t t) const {
        __m512i pair_sums[4];
        for (int p = 0; p < 4; ++p) pair_sums[p] = _mm512_loadu_si512((const void*)x.tile_sums(t, s * 4 + p));
        const __m512 xs = _mm512_loadu_ps(x.tile_scale(t, s));
        for (int64_t m = 0; m < cols; ++m) {
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

    // Output column n into column m of the tile's unpacked weights.
    void unpack_column(int64_t n, int64_t m, uint8_t* out) const {
        const int64_t superblocks = w.k / 256;
        const __m256i offset = _mm256_set1_epi8(32);
        const __m512i seven_bits = _mm512_set1_epi16(127);
        const __m512i group_of_lane = _mm512_loadu_si512((const void*)kGroupOfLane);
        const Q6K col = w.row(n);
        for (int64_t s = 0; s < superblocks; ++s) {
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
                    uint8_t* base = out + s * kUnpackedPerSuperblock + (2 * (c / 2) * kTile + m) * kChunk + 32 * (c % 2);
                    _mm256_storeu_si256((__m256i*)base, _mm512_cvtepi16_epi8(_mm512_and_si512(scaled, seven_bits)));
                    _mm256_storeu_si256((__m256i*)(base + kTile * kChunk), _mm512_cvtepi16_epi8(_mm512_srai_epi16(scaled, 7)));
                }
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
    void step(State& st, const Columns& c, int64_t cols, int64_t s, const int32_t (*low)[kTile], const int32_t (*high)[kTile],
              const AmxRows& x, int64_t t) const {
        const __m512 xs = _mm512_loadu_ps(x.tile_scale(t, s));
        for (int64_t m = 0; m < cols; ++m)
            st.acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total<7>(low, high, m)), _mm512_mul_ps(_mm512_set1_ps(c.d[m]), xs), st.acc[m]);
    }
    __m512 finish(const State& st, int64_t m) const { return st.acc[m]; }
};

inline void q6k(const Q6K& w, const QuantizedRows& a, int64_t rows, int64_t out_features, float* y) {
    tile_matmul<true>(Q6KTiles{w}, AmxRows(a, rows, false), rows, out_features, y);
}
