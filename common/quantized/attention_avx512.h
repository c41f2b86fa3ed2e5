// Attention's products on 512-bit registers, for AVX-512 machines (included by kernels.cpp, used by decoder_ops.h's
// attend_vectors): the same float operations as its 256-bit ones, in the same order, so a row's bits do not depend on
// the instruction set. A register holds two 8-lane chains side by side (two query vectors against one key, or one
// vector's 16 dimensions of a weighted sum), each lane running the very fused multiply-adds it runs on AVX2, and the
// horizontal sums add the same pairs in the same tree as hsum_f32.
namespace wide {

// Query vectors in pairs, 8 floats at a time side by side, for dot_pairs:
//   pairs[u * 2 dim + 16 t .. + 7] = q[2u][8 t .. 8 t + 7],  pairs[u * 2 dim + 16 t + 8 .. + 15] = q[2u + 1][8 t ..]
// (q[2u] in both halves where count is odd).
inline void pair_vectors(int64_t count, const float* const* q, int64_t dim, float* pairs) {
    for (int64_t u = 0; 2 * u < count; ++u) {
        const float *low = q[2 * u], *high = q[std::min(2 * u + 1, count - 1)];
        for (int64_t i = 0; i < dim; i += 8) {
            _mm256_storeu_ps(pairs + u * 2 * dim + 2 * i, _mm256_loadu_ps(low + i));
            _mm256_storeu_ps(pairs + u * 2 * dim + 2 * i + 8, _mm256_loadu_ps(high + i));
        }
    }
}

// The 8 floats at p in both halves of a register.
inline __m512 twice(const float* p) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p)))); }

// hsum_f32 of both halves of a, b, c, d (keys k .. k + 3 of a pair of vectors, the low vector's chains in lanes 0-7)
// into low[0 .. 3] and high[0 .. 3] (none where high is null). hsum_f32 adds lanes l and l + 4, then lanes 0 and 2,
// 1 and 3, then 0 and 1: the same additions, sixteen chains' at once.
//   g = [a0 + a1 | a2 + a3 | b0 + b1 | b2 + b3] in 128-bit quarters (the first addition of chains (low, k), (high, k),
//   (low, k + 1), (high, k + 1)); h likewise of c and d; s = [g0 + g2, g1 + g3, h0 + h2, h1 + h3] in each quarter
//   (the second); t = s + s's odd lanes (the third): chain q of g in lane 4q, of h in lane 4q + 2.
inline void sums_of_halves(__m512 a, __m512 b, __m512 c, __m512 d, float* low, float* high) {
    const __m512 g = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 h = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(g, h, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(g, h, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 t = _mm512_add_ps(s, _mm512_movehdup_ps(s));
    const __m512 keys_in_order = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 8, 2, 10, 4, 12, 6, 14, 0, 0, 0, 0, 0, 0, 0, 0), t);
    _mm_storeu_ps(low, _mm512_castps512_ps128(keys_in_order));
    if (high) _mm_storeu_ps(high, _mm512_extractf32x4_ps(keys_in_order, 1));
}

// score[v][j .. j + 3] = dot(q[v], keys + p * d, d) for the n <= 2U vectors paired in `pairs` and 4 keys: each lane
// of each chain as dot_vectors runs it, 2U x 4 chains in U x 4 registers, each 8 floats of a key loaded once for
// the U pairs and of a pair once for the 4 keys.
template <int U>
inline void dot_pairs(const float* pairs, int64_t n, const float* keys, int64_t d, float* const* score, int64_t j) {
    __m512 acc[U][4];
    for (int u = 0; u < U; ++u)
        for (int p = 0; p < 4; ++p) acc[u][p] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m512 key[4];
        for (int p = 0; p < 4; ++p) key[p] = twice(keys + p * d + i);
        for (int u = 0; u < U; ++u) {
            const __m512 x = _mm512_loadu_ps(pairs + u * 2 * d + 2 * i);
            for (int p = 0; p < 4; ++p) acc[u][p] = _mm512_fmadd_ps(x, key[p], acc[u][p]);
        }
    }
    for (int u = 0; u < U; ++u)
        sums_of_halves(acc[u][0], acc[u][1], acc[u][2], acc[u][3], score[2 * u] + j, 2 * u + 1 < n ? score[2 * u + 1] + j : nullptr);
}

// decoder_ops.h's weighted_values on 16 dimensions a register: each lane's sum over the positions in their order.
template <int V, int N>
inline void weighted_values(const float* const* w, const float* value, int64_t first, int64_t last, int64_t dim, float* const* sums) {
    __m512 acc[V][N];
    for (int v = 0; v < V; ++v)
        for (int t = 0; t < N; ++t) acc[v][t] = _mm512_loadu_ps(sums[v] + 16 * t);
    for (int64_t j = first; j < last; ++j) {
        __m512 x[N];
        for (int t = 0; t < N; ++t) x[t] = _mm512_loadu_ps(value + j * dim + 16 * t);
        for (int v = 0; v < V; ++v) {
            const __m512 weight = _mm512_set1_ps(w[v][j]);
            for (int t = 0; t < N; ++t) acc[v][t] = _mm512_fmadd_ps(weight, x[t], acc[v][t]);
        }
    }
    for (int v = 0; v < V; ++v)
        for (int t = 0; t < N; ++t) _mm512_storeu_ps(sums[v] + 16 * t, acc[v][t]);
}

// decoder_ops.h's exp8 on 16 lanes, operation for operation (the same bits in each lane).
inline __m512 exp16(__m512 x) {
    const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-87.3365447504f);
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
    __m512 fx = _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f));
    fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(0.693359375f)));
    x = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(-2.12194440e-4f)));
    const __m512 z = _mm512_mul_ps(x, x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_add_ps(_mm512_mul_ps(y, x), _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(y, z), x), _mm512_set1_ps(1.f));
    const __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(0x7f)), 23);
    return _mm512_maskz_mul_ps(_mm512_knot(underflow), y, _mm512_castsi512_ps(n));  // 0 where exp8 masks to 0
}

// softmax_numerators' exponentials of score[j] - top, in place, 16 positions at a time while 16 are left before
// padded; total[0..7] (8 lanes, as on AVX2) adds each 8 of them in the positions' order. Returns the first position
// left.
inline int64_t exponentials(float* score, int64_t padded, float top, float* total) {
    __m256 sum = _mm256_loadu_ps(total);
    int64_t j = 0;
    for (; j + 16 <= padded; j += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(&score[j]), _mm512_set1_ps(top)));
        _mm512_storeu_ps(&score[j], e);
        sum = _mm256_add_ps(sum, _mm512_castps512_ps256(e));
        sum = _mm256_add_ps(sum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    _mm256_storeu_ps(total, sum);
    return j;
}

// The scores of positions [first, last), 4 at a time, for the n <= 8 vectors paired in `pairs`; returns the first
// position left (fewer than 4 before last) for the 256-bit kernels.
inline int64_t scores_of(const float* pairs, int64_t n, const float* key, int64_t first, int64_t last, int64_t d, float* const* score) {
    int64_t j = first;
    auto run = [&](auto pairs_count) {
        constexpr int U = decltype(pairs_count)::value;
        for (; j + 4 <= last; j += 4) dot_pairs<U>(pairs, n, key + j * d, d, score, j);
    };
    switch ((n + 1) / 2) {
        case 1: run(std::integral_constant<int, 1>()); break;
        case 2: run(std::integral_constant<int, 2>()); break;
        case 3: run(std::integral_constant<int, 3>()); break;
        default: run(std::integral_constant<int, 4>()); break;
    }
    return j;
}

// sums[v] += the weighted values of positions [first, last) for n <= 8 vectors, dim a multiple of 16: in slices of
// 64 dimensions for up to 6 vectors (24 registers of sums), 32 for more.
inline void values_of(int64_t n, const float* const* w, const float* value, int64_t first, int64_t last, int64_t dim, float* const* sums) {
    auto run = [&](auto vectors) {
        constexpr int C = decltype(vectors)::value, N = C <= 6 ? 4 : 2;
        float* at[C];
        int64_t i = 0;
        for (; i + 16 * N <= dim; i += 16 * N) {
            for (int v = 0; v < C; ++v) at[v] = sums[v] + i;
            weighted_values<C, N>(w, value + i, first, last, dim, at);
        }
        for (; i < dim; i += 16) {
            for (int v = 0; v < C; ++v) at[v] = sums[v] + i;
            weighted_values<C, 1>(w, value + i, first, last, dim, at);
        }
    };
    switch (n) {
        case 1: run(std::integral_constant<int, 1>()); break;
        case 2: run(std::integral_constant<int, 2>()); break;
        case 3: run(std::integral_constant<int, 3>()); break;
        case 4: run(std::integral_constant<int, 4>()); break;
        case 5: run(std::integral_constant<int, 5>()); break;
        case 6: run(std::integral_constant<int, 6>()); break;
        case 7: run(std::integral_constant<int, 7>()); break;
        default: run(std::integral_constant<int, 8>()); break;
    }
}

}  // namespace wide
