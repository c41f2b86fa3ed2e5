// Full tiles of kRowTile rows on 512-bit vectors (AVX512-BW/VNNI), for Q4_K and Q6_K: included by kernels.cpp in the
// vnni namespace, after kernel_rows.h. With many rows a pass is bound by the integer products, not by memory;
// a 512-bit vector holds two 32-weight chunks, so each row's products take half the instructions.
//
// Bit for bit the same results as the 256-bit kernels: the low 256 bits accumulate exactly the int32 lanes the
// 256-bit kernel accumulates for one chunk of each pair, the high 256 bits those of the other. Their sum, taken
// once per superblock, is therefore the very integer vector the 256-bit kernel holds there (integer addition is
// exact in any order), and the float steps are the row kernels' (Q4KAcc, Q6KAcc in kernel_rows.h), but for Q4_K in
// Lanes, whose steps run on two rows per register (Q4KPairsAcc: row a's lanes in the low half of a register, row b's
// in the high half): each lane still runs Q4KAcc's operations, in its order, on its own values, so pairing changes
// no result (0.93-0.97x the time of a pass over 8, 16 and 64 rows of the 1.5B, measured against one row per
// register).

// The 8 int32 lanes of the 256-bit kernel: the low half's lanes plus the high half's.
inline __m256i halves_added(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

// [halves_added(a) | halves_added(b)]
inline __m512i pair_halves_added(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_i64x2(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}

// Q4KAcc<R, Lanes> for the tile's rows in pairs, two rows per register.
template <int R>
struct Q4KPairsAcc {
    static_assert(R % 2 == 0, "rows go in pairs");
    __m512 acc[R / 2];
    __m256 acc_min[R / 2];
    Q4KPairsAcc() {
        for (int p = 0; p < R / 2; ++p) { acc[p] = _mm512_setzero_ps(); acc_min[p] = _mm256_setzero_ps(); }
    }
    // isum[r]: row r's 512-bit int32 sums of superblock s (halves not yet added); mins: its 8 group mins as int16.
    void add(const __m512i* isum, __m128i mins, const RowTile<R>& x, int64_t s, float d, float dmin) {
        for (int p = 0; p < R / 2; ++p) {
            const int a = 2 * p, b = 2 * p + 1;
            const __m256i sums = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(x.sums[a] + s * 8))),
                                                         _mm_loadu_si128((const __m128i*)(x.sums[b] + s * 8)), 1);
            const __m256i imin = _mm256_madd_epi16(_mm256_broadcastsi128_si256(mins), sums);
            const __m512 d_scale = _mm512_castpd_ps(_mm512_insertf64x4(
                _mm512_castps_pd(_mm512_set1_ps(d * x.scale[a][s])), _mm256_castps_pd(_mm256_set1_ps(d * x.scale[b][s])), 1));
            const __m256 dmin_scale = _mm256_insertf128_ps(_mm256_set1_ps(dmin * x.scale[a][s]), _mm_set1_ps(dmin * x.scale[b][s]), 1);
            acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pair_halves_added(isum[a], isum[b])), d_scale, acc[p]);
            acc_min[p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin), dmin_scale, acc_min[p]);
        }
    }
    void store(float** out, int64_t n) const {
        for (int p = 0; p < R / 2; ++p) {
            out[2 * p][n] = q4k_lanes_result(_mm512_castps512_ps256(acc[p]), _mm256_castps256_ps128(acc_min[p]));
            out[2 * p + 1][n] = q4k_lanes_result(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[p]), 1)),
                                                 _mm256_extractf128_ps(acc_min[p], 1));
        }
    }
};

template <int R, class N>
void q4k_rows_wide(const Q4K& weights, int64_t n, const QuantizedRows& a, const int64_t* rows, float* out[R]) {
    const Q4K w = weights.row(n);
    const int64_t superblocks = w.k / 256;
    const __m512i low = _mm512_set1_epi8(0x0F);
    // A chunk's 32 code bytes in both halves: the low half keeps its low nibbles (weights 64c..64c+31), the high half
    // its high nibbles (64c+32..64c+63), so the activations of the whole chunk are one contiguous 64-byte load.
    const __m512i nibble = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const RowTile<R> x(a, rows);
    std::conditional_t<std::is_same_v<N, Lanes>, Q4KPairsAcc<R>, Q4KAcc<R, N>> acc;
    for (int64_t s = 0; s < superblocks; ++s) {
        __m512i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
        const __m512i scales = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(w.sc + s * 8))));
        for (int c = 0; c < 4; ++c) {
            const __m512i v = _mm512_and_si512(
                _mm512_srlv_epi16(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(w.codes + s * 128 + c * 32))), nibble), low);
            // Group 2c's scale in the low half, group 2c + 1's in the high half.
            const __m512i pick = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16((int16_t)(((4 * c + 1) << 8) | (4 * c)))),
                                                    _mm256_set1_epi16((int16_t)(((4 * c + 3) << 8) | (4 * c + 2))), 1);
            const __m512i sv = _mm512_shuffle_epi8(scales, pick);
            for (int r = 0; r < R; ++r) {
                const __m512i p = _mm512_maddubs_epi16(v, _mm512_loadu_si512((const void*)(x.q[r] + s * 256 + c * 64)));
                isum[r] = _mm512_dpwssd_epi32(isum[r], p, sv);
            }
        }
        const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(w.mn + s * 8)));
        if constexpr (std::is_same_v<N, Lanes>) {
            acc.add(isum, mins, x, s, w.d[s], w.dmin[s]);
        } else {
            __m256i lanes[R];
            for (int r = 0; r < R; ++r) lanes[r] = halves_added(isum[r]);
            acc.add(lanes, mins, x, s, w.d[s], w.dmin[s]);
        }
    }
    acc.store(out, n);
}

alignas(64) constexpr int16_t kLaneGroup[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                              2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};  // int16 lane / 8

template <int R, class N>
void q6k_rows_wide(const Q6K& weights, int64_t n, const QuantizedRows& a, const int64_t* rows, float* out[R]) {
    const Q6K w = weights.row(n);
    const int64_t superblocks = w.k / 256;
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i high = _mm512_set1_epi8(0x30);
    // The high bits of chunk pairs (0, 1) and (2, 3) of each 128 weights: qh shifted left by 4 | 2, right by 0 | 2.
    const __m512i left = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(4)), _mm256_set1_epi16(2), 1);
    const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i lane_group = _mm512_loadu_si512((const void*)kLaneGroup);
    const RowTile<R> x(a, rows);
    Q6KAcc<R, N> acc;
    for (int64_t s = 0; s < superblocks; ++s) {
        __m512i isum[R];
        for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
        const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w.sc + s * 16)));
        const __m512i scales_all = _mm512_castsi256_si512(scales16);
        for (int half = 0; half < 2; ++half) {
            const __m512i codes = _mm512_loadu_si512((const void*)(w.ql + (s * 2 + half) * 64));  // ql bytes a0 | a1
            const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(w.qh + (s * 2 + half) * 32)));
            const __m512i v[2] = {
                _mm512_or_si512(_mm512_and_si512(codes, low), _mm512_and_si512(_mm512_sllv_epi16(h, left), high)),
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(codes, 4), low), _mm512_and_si512(_mm512_srlv_epi16(h, right), high)),
            };
            for (int j = 0; j < 2; ++j) {
                const int c = half * 4 + 2 * j;  // chunks c and c + 1
                // int16 lanes 0..7, 8..15, 16..23, 24..31: the scales of groups 2c, 2c + 1, 2c + 2, 2c + 3.
                const __m512i index = _mm512_add_epi16(_mm512_set1_epi16((int16_t)(2 * c)), lane_group);
                const __m512i scales = _mm512_permutexvar_epi16(index, scales_all);
                for (int r = 0; r < R; ++r) {
                    const __m512i p = _mm512_maddubs_epi16(v[j], _mm512_loadu_si512((const void*)(x.q[r] + s * 256 + c * 32)));
                    isum[r] = _mm512_dpwssd_epi32(isum[r], p, scales);
                }
            }
        }
        __m256i lanes[R];
        for (int r = 0; r < R; ++r) lanes[r] = _mm256_add_epi32(q6k_offset(scales16, x.sums[r] + s * 16), halves_added(isum[r]));
        acc.add(lanes, x, s, w.d[s]);
    }
    acc.store(out, n);
}
