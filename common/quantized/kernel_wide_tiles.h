// Full tiles of kRowTile rows on 512-bit vectors (AVX512-BW/VNNI), for Q6_K: included by kernels.cpp in the vnni
// namespace, after kernel_rows.h. With many rows a pass is bound by the integer products, not by memory; a 512-bit
// vector holds two 32-weight chunks, so each row's products take half the instructions.
//
// Bit for bit the same results as the 256-bit kernels: the low 256 bits accumulate exactly the int32 lanes the
// 256-bit kernel accumulates for one chunk of each pair, the high 256 bits those of the other. Their sum, taken
// once per superblock, is therefore the very integer vector the 256-bit kernel holds there (integer addition is
// exact in any order), and the float steps are the row kernels' (Q6KAcc in kernel_rows.h).

// The 8 int32 lanes of the 256-bit kernel: the low half's lanes plus the high half's.
inline __m256i halves_added(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

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
