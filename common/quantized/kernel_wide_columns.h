// Q4_K's fused column tiles on 512-bit vectors (AVX512-BW/VNNI): included by kernel_rows.h in the vnni namespace,
// after kernel_columns.h; they serve matrices of at least wide_columns_from weights (kernels.cpp). Two 8-column tiles
// run side by side, the first's columns in the low 256 bits of every vector and the second's in the high 256 bits,
// so each instruction of the 256-bit form (Q4KColumns::fused) does the work of two: the loads of 16 columns, their
// transposition, and every row's dpbusd, scale and float step. Passes of more than a row tile transpose each
// superblock's codes once into a buffer that every group of rows reads.
//
// Bit for bit the 256-bit form's results: every instruction here acts on each 256-bit half as the 256-bit one acts
// on its vector (the transposition's unpacks act within 128-bit lanes; its lane permutes pick within each half), so
// each column's integers and float operations are those of its lane there, in the same order:
//   t      = sum over the half group's 4 units of dpbusd(codes, q broadcast)           exact, as in q4k_half_group
//   T     += madd(t, (sc_g, 0))                                                       the exact int32 total
//   M      = sum over h < 4 of madd((mn_2h, mn_2h+1), (sums_2h, sums_2h+1) broadcast)  the minimums' exact total
//   acc    = fma(float(T), d_s * as_s, acc);   acc_min = fma(float(M), dmin_s * as_s, acc_min)
// and the result is acc - acc_min.

inline __m512i joined(__m256i low, __m256i high) { return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1); }
inline __m512 joined(__m256 low, __m256 high) {
    return _mm512_castsi512_ps(joined(_mm256_castps_si256(low), _mm256_castps_si256(high)));
}

// transpose8x8 on each 256-bit half: r[j]'s low half is column j of the 8 x 8 int32 matrix of the rows' low halves,
// its high half column j of the high halves'. The 256-bit form's last step (permute2x128 0x20 / 0x31: the low / high
// 128-bit lanes of u[j] and u[4 + j]) is one two-source permute of 64-bit elements per half.
SPECDEC_INLINE void transpose8x8_halves(__m512i r[8]) {
    __m512i t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    const __m512i lows = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), highs = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int j = 0; j < 4; ++j) {
        r[j] = _mm512_permutex2var_epi64(u[j], lows, u[4 + j]);
        r[j + 4] = _mm512_permutex2var_epi64(u[j], highs, u[4 + j]);
    }
}

// q4k_tile_vector for the tiles of columns a[0..7] and b[0..7]; the next pair's lines are prefetched.
SPECDEC_INLINE void q4k_wide_vector(const uint8_t* codes, int64_t k, const int64_t* a, const int64_t* b, int64_t s, int v, __m512i r[8]) {
    const int64_t bytes = k / 2, at = s * 128 + v * 32;
    for (int i = 0; i < 8; ++i) {
        r[i] = joined(_mm256_loadu_si256((const __m256i*)(codes + a[i] * bytes + at)), _mm256_loadu_si256((const __m256i*)(codes + b[i] * bytes + at)));
        if (!(v & 1)) {
            _mm_prefetch((const char*)(codes + (a[i] + 2 * kColumns) * bytes + at), _MM_HINT_T0);
            _mm_prefetch((const char*)(codes + (b[i] + 2 * kColumns) * bytes + at), _MM_HINT_T0);
        }
    }
    transpose8x8_halves(r);
}

// q4k_tile_codes for both tiles.
SPECDEC_INLINE void q4k_wide_codes(const uint8_t* codes, int64_t k, const int64_t* a, const int64_t* b, int64_t s, int h, __m512i r[4][4]) {
    for (int v = 2 * h; v < 2 * h + 2; ++v) {
        __m512i t[8];
        q4k_wide_vector(codes, k, a, b, s, v, t);
        for (int c = 0; c < 4; ++c) {
            r[c][2 * (v - 2 * h)] = t[c];
            r[c][2 * (v - 2 * h) + 1] = t[c + 4];
        }
    }
}

// q4k_scales for both tiles: v[g] = (sc_g, sc_g), v[8 + h] = (mn_2h, mn_2h+1), column i of the first tile in int32
// lane i, of the second in lane 8 + i.
SPECDEC_INLINE void q4k_wide_scales(const Q4K& w, const int64_t* a, const int64_t* b, int64_t s, __m512i v[12]) {
    const int64_t groups = w.k / 32;
    __m512i r[8];
    for (int i = 0; i < 8; ++i) {
        const __m128i first = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)(w.sc + a[i] * groups + s * 8)),
                                                 _mm_loadl_epi64((const __m128i*)(w.mn + a[i] * groups + s * 8)));
        const __m128i second = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)(w.sc + b[i] * groups + s * 8)),
                                                  _mm_loadl_epi64((const __m128i*)(w.mn + b[i] * groups + s * 8)));
        r[i] = _mm512_cvtepu8_epi16(_mm256_set_m128i(second, first));
    }
    for (int tile = 2; tile < 4; ++tile) {  // the next pair's scales, as q4k_scales prefetches the next tile's
        const int64_t next = a[0] + tile * kColumns;
        _mm_prefetch((const char*)(w.sc + next * groups) + s * 64, _MM_HINT_T0);
        _mm_prefetch((const char*)(w.mn + next * groups) + s * 64, _MM_HINT_T0);
        _mm_prefetch((const char*)(w.d + next * (groups / 8)) + s * 32, _MM_HINT_T0);
        _mm_prefetch((const char*)(w.dmin + next * (groups / 8)) + s * 32, _MM_HINT_T0);
    }
    transpose8x8_halves(r);
    const __m512i even = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13));
    const __m512i odd = _mm512_broadcast_i32x4(_mm_setr_epi8(2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15));
    for (int h = 0; h < 4; ++h) {
        v[2 * h] = _mm512_shuffle_epi8(r[h], even);
        v[2 * h + 1] = _mm512_shuffle_epi8(r[h], odd);
        v[8 + h] = r[4 + h];
    }
}

inline __m512i broadcast4_wide(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// q4k_half_group for both tiles.
template <int R, class Codes>
SPECDEC_INLINE void q4k_wide_half_group(Codes codes, __m512i scale, const GroupRows<R>& x, int64_t g, int h, __m512i* total) {
    const int64_t at = g * 32 + 16 * h;
    __m512i t[R];
    for (int r = 0; r < R; ++r) t[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
        const __m512i v = codes(j);
        for (int r = 0; r < R; ++r) t[r] = _mm512_dpbusd_epi32(t[r], v, broadcast4_wide(x.q[r] + at + 4 * j));
    }
    const __m512i sc = _mm512_and_si512(scale, _mm512_set1_epi32(0xFFFF));
    for (int r = 0; r < R; ++r) total[r] = _mm512_add_epi32(total[r], _mm512_madd_epi16(t[r], sc));
}

// Half h of superblock s for R rows: total[r] += the 4 groups' half totals times their scales; codes(c, j): unit 4h + j
// of group pair c, as q4k_wide_codes lays it out.
template <int R, class Codes>
SPECDEC_INLINE void q4k_wide_half(Codes codes, const __m512i* scales, const GroupRows<R>& x, int64_t s, int h, __m512i* total) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; ++c) {
        q4k_wide_half_group<R>([&](int j) { return _mm512_and_si512(codes(c, j), low); }, scales[2 * c], x, s * 8 + 2 * c, h, total);
        q4k_wide_half_group<R>([&](int j) { return _mm512_and_si512(_mm512_srli_epi16(codes(c, j), 4), low); }, scales[2 * c + 1], x,
                               s * 8 + 2 * c + 1, h, total);
    }
}

// q4k_superblock_end for both tiles (ta's d and dmin in the low halves, tb's in the high).
template <int R>
SPECDEC_INLINE void q4k_wide_superblock_end(const __m512i* scales, const ColumnTile& ta, const ColumnTile& tb, const GroupRows<R>& x, int64_t s,
                                            const __m512i* total, __m512* acc, __m512* acc_min) {
    const __m512 d = joined(_mm256_loadu_ps(&ta.d[s * kColumns]), _mm256_loadu_ps(&tb.d[s * kColumns]));
    const __m512 dmin = joined(_mm256_loadu_ps(&ta.m[s * kColumns]), _mm256_loadu_ps(&tb.m[s * kColumns]));
    for (int r = 0; r < R; ++r) {
        const int8_t* sums = (const int8_t*)(x.sums[r] + s * 8);
        __m512i m = _mm512_madd_epi16(scales[8], broadcast4_wide(sums));
        for (int h = 1; h < 4; ++h) m = _mm512_add_epi32(m, _mm512_madd_epi16(scales[8 + h], broadcast4_wide(sums + 4 * h)));
        const __m512 as = _mm512_set1_ps(x.scale[r][s]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[r]), _mm512_mul_ps(d, as), acc[r]);
        acc_min[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), _mm512_mul_ps(dmin, as), acc_min[r]);
    }
}

// acc - acc_min of rows first..first+count-1 into their output columns: the low half's from na (va of them real),
// the high half's from nb (vb).
inline void store_pair(const __m512* acc, const __m512* acc_min, int count, float** out, int64_t first, int64_t na, int va, int64_t nb,
                       int vb) {
    for (int r = 0; r < count; ++r) {
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, _mm512_sub_ps(acc[r], acc_min[r]));
        for (int i = 0; i < va; ++i) out[first + r][na + i] = lanes[i];
        for (int i = 0; i < vb; ++i) out[first + r][nb + i] = lanes[kColumns + i];
    }
}

// One pair of tiles (its columns a, b; their output columns from na, nb, of which va, vb real) for rows
// first..first+R-1.
template <int R>
void q4k_wide_fused(const Q4K& w, const int64_t* a, const int64_t* b, const ColumnTile& ta, const ColumnTile& tb, const QuantizedRows& rows,
                    int64_t first, float** out, int64_t na, int va, int64_t nb, int vb) {
    const GroupRows<R> x(rows, first, ta);
    __m512 acc[R], acc_min[R];
    for (int r = 0; r < R; ++r) acc[r] = acc_min[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < ta.groups / 8; ++s) {
        __m512i scales[12];
        q4k_wide_scales(w, a, b, s, scales);
        __m512i total[R];
        for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_si512();
        for (int h = 0; h < 2; ++h) {  // half the units at a time: 16 vectors of codes live, not 32
            __m512i v[4][4];
            q4k_wide_codes(w.codes, w.k, a, b, s, h, v);
            q4k_wide_half<R>([&](int c, int j) { return v[c][j]; }, scales, x, s, h, total);
        }
        q4k_wide_superblock_end<R>(scales, ta, tb, x, s, total, acc, acc_min);
    }
    store_pair(acc, acc_min, R, out, first, na, va, nb, vb);
}

// Passes of more than a row tile, up to kWideGroups of them: each superblock's codes transposed once into a buffer
// (2 KB, in L1) that every group of rows reads, where a fused call per group would transpose them again. The groups
// are of nearly equal sizes: `big` of R rows, then the rest of R - 1 (R >= 5 here, as rows > kRowTile).
constexpr int kWideGroups = 4;

template <int R>
void q4k_wide_groups(const Q4K& w, const int64_t* a, const int64_t* b, const ColumnTile& ta, const ColumnTile& tb, const QuantizedRows& rows,
                     int64_t count, int64_t groups, float** out, int64_t na, int va, int64_t nb, int vb) {
    const int64_t big = count - groups * (R - 1);
    const auto size = [&](int64_t g) { return g < big ? R : R - 1; };
    __m512 acc[kWideGroups][R], acc_min[kWideGroups][R];
    for (int64_t g = 0; g < groups; ++g)
        for (int r = 0; r < R; ++r) acc[g][r] = acc_min[g][r] = _mm512_setzero_ps();
    alignas(64) __m512i codes[2][4][4];
    for (int64_t s = 0; s < ta.groups / 8; ++s) {
        __m512i scales[12];
        q4k_wide_scales(w, a, b, s, scales);
        for (int h = 0; h < 2; ++h) q4k_wide_codes(w.codes, w.k, a, b, s, h, codes[h]);
        const auto group = [&](const auto& x, __m512* group_acc, __m512* group_min) {
            constexpr int N = std::remove_reference_t<decltype(x)>::kRows;
            __m512i total[N];
            for (int r = 0; r < N; ++r) total[r] = _mm512_setzero_si512();
            for (int h = 0; h < 2; ++h) q4k_wide_half<N>([&](int c, int j) { return codes[h][c][j]; }, scales, x, s, h, total);
            q4k_wide_superblock_end<N>(scales, ta, tb, x, s, total, group_acc, group_min);
        };
        for (int64_t g = 0, first = 0; g < groups; first += size(g), ++g) {
            if (g < big) group(GroupRows<R>(rows, first, ta), acc[g], acc_min[g]);
            else group(GroupRows<R - 1>(rows, first, ta), acc[g], acc_min[g]);
        }
    }
    for (int64_t g = 0, first = 0; g < groups; first += size(g), ++g) store_pair(acc[g], acc_min[g], size(g), out, first, na, va, nb, vb);
}

// Q4_K's passes of 2 to kWideGroups kRowTile rows, on pairs of 8-column tiles split over the threads: up to a row
// tile fused, more in groups of nearly equal sizes from the buffer (q4k_wide_groups). A lone last tile is computed
// as both of its pair and stored once.
inline void q4k_wide_columns(const Q4K& w, const QuantizedRows& a, int64_t rows, int64_t out_features, float* base) {
    const int64_t tiles = (out_features + kColumns - 1) / kColumns, pairs = (tiles + 1) / 2;
    const int64_t groups = w.k / 32, groups_of_rows = (rows + kRowTile - 1) / kRowTile;
    const int64_t size = (rows + groups_of_rows - 1) / groups_of_rows;  // of the first groups of rows, the rest 1 fewer
    at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
        ColumnTile ta(groups, 0), tb(groups, 0);
        std::vector<float*> out(rows);
        for (int64_t r = 0; r < rows; ++r) out[r] = base + r * out_features;
        for (int64_t pair = begin; pair < end; ++pair) {
            int64_t ca[kColumns], cb[kColumns];
            const int64_t tile = 2 * pair;
            const int va = tile_columns(tile, out_features, ca);
            const bool lone = tile + 1 == tiles;
            const int vb = lone ? 0 : tile_columns(tile + 1, out_features, cb);
            if (lone) std::copy(ca, ca + kColumns, cb);
            gather_q4k(w, ca, ta);
            gather_q4k(w, cb, tb);
            if (groups_of_rows == 1) {
                with_row_count<kRowTile>((int)rows, [&](auto r) {
                    q4k_wide_fused<decltype(r)::value>(w, ca, cb, ta, tb, a, 0, out.data(), tile * kColumns, va, (tile + 1) * kColumns, vb);
                });
                continue;
            }
            with_row_count<kRowTile>((int)size, [&](auto r) {
                constexpr int R = decltype(r)::value;
                if constexpr (R > 1)
                    q4k_wide_groups<R>(w, ca, cb, ta, tb, a, rows, groups_of_rows, out.data(), tile * kColumns, va, (tile + 1) * kColumns, vb);
            });
        }
    });
}
