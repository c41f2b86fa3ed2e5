// The gguf engine's decoder pieces beside its products (included by kernels.cpp): RMS norm, rotary embedding and
// causal attention over a session's cache. Each is a handful of torch ops in transformers, paid per layer in
// Python and in torch's dispatch; here one call each.
//
// Every output row is computed on its own, in one fixed order that does not depend on how many rows the call has
// or which other rows (or sessions) are in it: a query row attends exactly as a one-token step at its position
// would, bit for bit, so a verification scores its rows as target-only decoding does.

// e^x for 8 floats: Cephes' range reduction (x = n ln2 + r, |r| <= ln2 / 2) and degree-5 polynomial, as
// avx_mathfun's exp256_ps; relative error about 2e-7. Below -87.3 it returns 0.
inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365447504f);
    const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    __m256 fx = _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
    x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, z), x), _mm256_set1_ps(1.f));
    const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(n)));
}

inline float dot(const float* a, const float* b, int64_t d) {  // d a multiple of 8
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum_f32(acc);
}

// score[v][j + p] = dot(q[v], keys + p * d, d) for V query vectors and P keys at once: each key's products in dot's
// own order (the same bits), in V x P independent chains so that their fused multiply-adds overlap, each 8 floats of
// a key loaded once for the V vectors and of a vector once for the P keys (V x P <= 12 accumulators, with the keys
// and a vector within AVX2's 16 registers).
template <int V, int P>
inline void dot_vectors(const float* const* q, const float* keys, int64_t d, float* const* score, int64_t j) {
    __m256 acc[V][P];
    for (int v = 0; v < V; ++v)
        for (int p = 0; p < P; ++p) acc[v][p] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m256 key[P];
        for (int p = 0; p < P; ++p) key[p] = _mm256_loadu_ps(keys + p * d + i);
        for (int v = 0; v < V; ++v) {
            const __m256 x = _mm256_loadu_ps(q[v] + i);
            for (int p = 0; p < P; ++p) acc[v][p] = _mm256_fmadd_ps(x, key[p], acc[v][p]);
        }
    }
    for (int v = 0; v < V; ++v)
        for (int p = 0; p < P; ++p) score[v][j + p] = hsum_f32(acc[v][p]);
}

// The scores of positions [first, last) for V vectors, P keys at a time (the rest one at a time: the same bits).
template <int V, int P>
inline void scores_of(const float* const* q, const float* key, int64_t first, int64_t last, int64_t d, float* const* score) {
    int64_t j = first;
    for (; j + P <= last; j += P) dot_vectors<V, P>(q, key + j * d, d, score, j);
    for (; j < last; ++j) dot_vectors<V, 1>(q, key + j * d, d, score, j);
}

// sums[v][8 t ..] += sum over positions j in [first, last) of w[v][j] * value[j * dim + 8 t ..] for V vectors and
// t < N, each lane summed over the positions in their order (fused multiply-adds; a sum carried on through memory
// is the same float): each 8 floats of a value loaded once for the V vectors, the V x N sums in registers meanwhile.
template <int V, int N>
inline void weighted_values(const float* const* w, const float* value, int64_t first, int64_t last, int64_t dim, float* const* sums) {
    __m256 acc[V][N];
    for (int v = 0; v < V; ++v)
        for (int t = 0; t < N; ++t) acc[v][t] = _mm256_loadu_ps(sums[v] + 8 * t);
    for (int64_t j = first; j < last; ++j) {
        __m256 x[N];
        for (int t = 0; t < N; ++t) x[t] = _mm256_loadu_ps(value + j * dim + 8 * t);
        for (int v = 0; v < V; ++v) {
            const __m256 weight = _mm256_set1_ps(w[v][j]);
            for (int t = 0; t < N; ++t) acc[v][t] = _mm256_fmadd_ps(weight, x[t], acc[v][t]);
        }
    }
    for (int v = 0; v < V; ++v)
        for (int t = 0; t < N; ++t) _mm256_storeu_ps(sums[v] + 8 * t, acc[v][t]);
}

// Calls f(std::integral_constant<int, n>()) for a count n in 1..6, the vectors of a call in registers.
template <typename F>
inline void with_count(int64_t n, F f) {
    switch (n) {
        case 1: f(std::integral_constant<int, 1>()); break;
        case 2: f(std::integral_constant<int, 2>()); break;
        case 3: f(std::integral_constant<int, 3>()); break;
        case 4: f(std::integral_constant<int, 4>()); break;
        case 5: f(std::integral_constant<int, 5>()); break;
        default: f(std::integral_constant<int, 6>()); break;
    }
}

// A vector's scores of positions 0 .. seen - 1 into their softmax's numerators, in place (the positions up to the
// next multiple of 8 set to 0); returns 1 / their total. on_512_bits: the exponentials 16 at a time (the same bits).
inline float softmax_numerators(float* score, int64_t seen, double scale, double softcap, bool on_512_bits) {
    const int64_t padded = (seen + 7) & ~int64_t(7);
    // The scaled scores and their largest (max is exact: any order finds it), in 4 chains of 8 lanes.
    __m256 most[4];
    for (auto& m : most) m = _mm256_set1_ps(-INFINITY);
    int64_t done = 0;
    if (softcap == 0) {
        const __m256 factor = _mm256_set1_ps((float)scale);
        for (; done + 32 <= seen; done += 32)
            for (int c = 0; c < 4; ++c) {
                const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(&score[done + 8 * c]), factor);
                _mm256_storeu_ps(&score[done + 8 * c], x);
                most[c] = _mm256_max_ps(most[c], x);
            }
    }
    for (int64_t j = done; j < seen; ++j) {
        score[j] = score[j] * (float)scale;
        if (softcap > 0) score[j] = (float)softcap * std::tanh(score[j] / (float)softcap);
    }
    for (int64_t j = seen; j < padded; ++j) score[j] = -INFINITY;
    for (int64_t j = done; j < padded; j += 8) most[0] = _mm256_max_ps(most[0], _mm256_loadu_ps(&score[j]));
    const __m256 all = _mm256_max_ps(_mm256_max_ps(most[0], most[1]), _mm256_max_ps(most[2], most[3]));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const __m256 top = _mm256_set1_ps(std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_movehdup_ps(m))));
    alignas(32) float totals[8] = {};
    const int64_t done_16 = on_512_bits ? wide::exponentials(score, padded, _mm256_cvtss_f32(top), totals) : 0;
    __m256 total = _mm256_load_ps(totals);
    for (int64_t j = done_16; j < seen; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(&score[j]), top));
        _mm256_storeu_ps(&score[j], e);
        total = _mm256_add_ps(total, e);
    }
    return 1.f / hsum_f32(total);
}

// One key-value group's attention for `count` query vectors (a row's heads, or the heads of a few consecutive rows
// of one session): vector v reads q[v], sees positions 0 .. seen[v] - 1 of key and value, and writes o[v]; seen[0]
// is the fewest. Positions are taken kBlock at a time, and each block of keys and values, read into L1 once, serves
// every vector (6 at a time in registers, 8 on 512-bit ones); the positions beyond seen[0] go vector by vector. Per
// vector every product, sum and rounding is in the one order of a row alone: the same bits in any pass, on either
// register width (attention_avx512.h, for two vectors or more: a lone vector's scores would fill half of each
// register). pairs: room for wide::pair_vectors' (count + 1) x dim floats.
constexpr int64_t kBlock = 32;  // positions: 16 KB of 128-wide keys, or values
inline void attend_vectors(int64_t count, const float* const* q, const int64_t* seen, const float* key, const float* value,
                           int64_t dim, double scale, double softcap, float* const* score, float* const* sums, float* inv,
                           float* pairs, float* const* o) {
    const bool on_512_bits = isa_in_use != Isa::avx2 && dim % 16 == 0 && count > 1;
    const int64_t chunk = on_512_bits ? 8 : 6;
    // A single chunk of vectors reads each key and value once anyway: one block.
    const int64_t common = seen[0], block = count > chunk ? kBlock : common;
    if (on_512_bits) wide::pair_vectors(count, q, dim, pairs);
    for (int64_t b = 0; b < common; b += block)
        for (int64_t v = 0; v < count; v += chunk) {
            const int64_t n = std::min(chunk, count - v), last = std::min(common, b + block);
            if (on_512_bits) {
                const int64_t rest = wide::scores_of(pairs + v * dim, n, key, b, last, dim, score + v);
                for (int64_t u = v; u < v + n; ++u) scores_of<1, 8>(q + u, key, rest, last, dim, score + u);
                continue;
            }
            with_count(n, [&](auto c) {
                // Keys 8 at a time for one vector, 4 for two, else 2: 8-12 chains.
                constexpr int C = decltype(c)::value, P = C == 1 ? 8 : C == 2 ? 4 : 2;
                scores_of<C, P>(q + v, key, b, last, dim, score + v);
            });
        }
    for (int64_t v = 0; v < count; ++v) scores_of<1, 8>(q + v, key, common, seen[v], dim, score + v);
    for (int64_t v = 0; v < count; ++v) {
        inv[v] = softmax_numerators(score[v], seen[v], scale, softcap, isa_in_use != Isa::avx2);
        std::fill(sums[v], sums[v] + dim, 0.f);
    }
    // On 256-bit registers, values in slices of 64 dimensions for one vector (8 registers of sums), 32 for two, 16
    // beyond; 8 at the end.
    auto values_of = [&](int64_t v, int64_t n, int64_t first, int64_t last) {
        if (on_512_bits) return wide::values_of(n, score + v, value, first, last, dim, sums + v);
        with_count(n, [&](auto c) {
            constexpr int C = decltype(c)::value, N = C == 1 ? 8 : C == 2 ? 4 : 2;
            float* at[C];
            int64_t i = 0;
            for (; i + 8 * N <= dim; i += 8 * N) {
                for (int u = 0; u < C; ++u) at[u] = sums[v + u] + i;
                weighted_values<C, N>(score + v, value + i, first, last, dim, at);
            }
            for (; i < dim; i += 8) {
                for (int u = 0; u < C; ++u) at[u] = sums[v + u] + i;
                weighted_values<C, 1>(score + v, value + i, first, last, dim, at);
            }
        });
    };
    for (int64_t b = 0; b < common; b += block)
        for (int64_t v = 0; v < count; v += chunk) values_of(v, std::min(chunk, count - v), b, std::min(common, b + block));
    for (int64_t v = 0; v < count; ++v) {
        if (seen[v] > common) values_of(v, 1, common, seen[v]);
        for (int64_t i = 0; i < dim; i += 8)
            _mm256_storeu_ps(o[v] + i, _mm256_mul_ps(_mm256_loadu_ps(sums[v] + i), _mm256_set1_ps(inv[v])));
    }
}

void check_rows(const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name, " must be contiguous float32");
}

// y = x / sqrt(mean(x^2) + eps) * w for each row of x [rows, d].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
    check_rows(x, "x");
    check_rows(w, "w");
    const int64_t d = x.size(-1), rows = x.numel() / d;
    TORCH_CHECK(d % 8 == 0 && w.numel() == d, "rms_norm: ", d, " features, ", w.numel(), " weights");
    auto y = torch::empty_like(x);
    const float *xs = x.data_ptr<float>(), *ws = w.data_ptr<float>();
    float* ys = y.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float* xr = xs + r * d;
            const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(dot(xr, xr, d) / (float)d + (float)eps));
            for (int64_t i = 0; i < d; i += 8)
                _mm256_storeu_ps(ys + r * d + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), inv), _mm256_loadu_ps(ws + i)));
        }
    });
    return y;
}

// In place, x [rows, heads, dim]: x * cos + rotate_half(x) * sin, with cos and sin [rows, dim] (transformers'
// rotary embedding, so that any rope scaling it implements applies), rotate_half(x) = (-x[dim/2:], x[:dim/2]).
void rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
    check_rows(x, "x");
    check_rows(cos, "cos");
    check_rows(sin, "sin");
    TORCH_CHECK(x.dim() == 3 && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) && sin.sizes() == cos.sizes(),
                "rotary: x [rows, heads, dim], cos and sin [rows, dim]");
    const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
    float* xs = x.data_ptr<float>();
    const float *cs = cos.data_ptr<float>(), *ss = sin.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
        const float *c = cs + r * dim, *s = ss + r * dim;
        for (int64_t h = 0; h < heads; ++h) {
            float* v = xs + (r * heads + h) * dim;
            for (int64_t i = 0; i < half; ++i) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + (-b) * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

// Appends each session's new keys and values to its cache buffers and returns every query row's causal attention
// against its session's cache up to its own position.
//   q [rows, heads, dim]; k, v [rows, kv_heads, dim]: the pass's rows, session after session (lengths[s] each);
//   keys[s], values[s] [1, kv_heads, capacity, dim]: session s's buffers, holding starts[s] tokens before the pass
//   (capacity >= starts[s] + lengths[s]); returns [rows, heads * dim].
//   window: a row at position p sees positions p - window + 1 .. p only (a sliding-window layer: transformers'
//   sliding_window_overlay, llama.cpp's n_swa); 0 sees them all. The cache keeps every position, so a rollback
//   that re-enters the window finds the keys it needs.
//   softcap: scores become softcap * tanh(score / softcap) before the softmax (Gemma 2's attention); 0 for none.
// A row's scores, softmax and weighted sum run in one order over its visible positions, whatever else is in the call.
torch::Tensor attend_sessions(torch::Tensor q, torch::Tensor k, torch::Tensor v, std::vector<torch::Tensor> keys,
                              std::vector<torch::Tensor> values, std::vector<int64_t> starts, std::vector<int64_t> lengths,
                              double scale, int64_t window, double softcap) {
    check_rows(q, "q");
    check_rows(k, "k");
    check_rows(v, "v");
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2),
                "attend_sessions: q [rows, heads, dim], k and v [rows, kv_heads, dim]");
    const int64_t rows = q.size(0), heads = q.size(1), kv_heads = k.size(1), dim = q.size(2);
    const int64_t sessions = (int64_t)lengths.size();
    TORCH_CHECK(dim % 8 == 0 && dim <= 256 && heads % kv_heads == 0, "attend_sessions: unsupported head shape");
    TORCH_CHECK(window >= 0 && softcap >= 0, "attend_sessions: window and softcap must not be negative");
    TORCH_CHECK((int64_t)keys.size() == sessions && (int64_t)values.size() == sessions && (int64_t)starts.size() == sessions,
                "attend_sessions: one buffer pair and start per session");
    std::vector<int64_t> session_of(rows), position_of(rows);
    std::vector<float*> key_base(sessions), value_base(sessions);
    std::vector<int64_t> capacity(sessions);
    int64_t row = 0, longest = 0;
    for (int64_t s = 0; s < sessions; ++s) {
        check_rows(keys[s], "keys");
        check_rows(values[s], "values");
        capacity[s] = keys[s].size(2);
        TORCH_CHECK(keys[s].dim() == 4 && keys[s].size(1) == kv_heads && keys[s].size(3) == dim && values[s].sizes() == keys[s].sizes() &&
                        starts[s] >= 0 && starts[s] + lengths[s] <= capacity[s],
                    "attend_sessions: session ", s, "'s buffers do not fit the pass");
        key_base[s] = keys[s].data_ptr<float>();
        value_base[s] = values[s].data_ptr<float>();
        for (int64_t i = 0; i < lengths[s]; ++i, ++row) {
            TORCH_CHECK(row < rows, "attend_sessions: lengths exceed the rows");
            session_of[row] = s;
            position_of[row] = starts[s] + i;
        }
        longest = std::max(longest, starts[s] + lengths[s]);
    }
    TORCH_CHECK(row == rows, "attend_sessions: lengths add up to ", row, ", not ", rows);
    const float *qs = q.data_ptr<float>(), *ks = k.data_ptr<float>(), *vs = v.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t s = session_of[r], p = position_of[r];
        for (int64_t g = 0; g < kv_heads; ++g) {
            std::memcpy(key_base[s] + (g * capacity[s] + p) * dim, ks + (r * kv_heads + g) * dim, dim * sizeof(float));
            std::memcpy(value_base[s] + (g * capacity[s] + p) * dim, vs + (r * kv_heads + g) * dim, dim * sizeof(float));
        }
    }
    auto out = torch::empty({rows, heads * dim}, q.options());
    float* os = out.data_ptr<float>();
    // An item is a key-value group of a block of up to kRows consecutive rows of one session (their query heads
    // together: each block of keys and values read once for all of them), or, where a call has too few rows to give
    // every thread work that way (or a sliding window gives each row its own first position), of one row, or one
    // head of a row.
    constexpr int64_t kRows = 8;
    const int64_t group = heads / kv_heads, threads = at::get_num_threads();
    const int64_t per_row = rows * kv_heads >= 2 * threads ? group : 1;
    const int64_t block_rows = !window && per_row == group && rows * kv_heads >= 2 * threads * kRows ? kRows : 1;
    std::vector<int64_t> block_first;  // each block's first row; blocks never span two sessions
    for (int64_t r = 0; r < rows; ++r)
        if (r == 0 || session_of[r] != session_of[r - 1] || r - block_first.back() == block_rows) block_first.push_back(r);
    block_first.push_back(rows);
    const int64_t blocks = (int64_t)block_first.size() - 1, parts = heads / per_row, items = blocks * parts;
    // Few rows over a short cache are cheaper on one thread than a fork and join.
    const int64_t grain = rows * heads * longest * dim < (1 << 18) ? items : 1;
    at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
        const int64_t most = block_rows * per_row;
        std::vector<float> scores(most * (longest + 8)), sums(most * dim), inv(most), pairs((most + 1) * dim);
        std::vector<const float*> q(most);
        std::vector<float*> score(most), sum(most), o(most);
        std::vector<int64_t> seen(most);
        for (int64_t v = 0; v < most; ++v) {
            score[v] = &scores[v * (longest + 8)];
            sum[v] = &sums[v * dim];
        }
        for (int64_t item = begin; item < end; ++item) {
            const int64_t r0 = block_first[item / parts], h0 = item % parts * per_row, s = session_of[r0];
            const int64_t count = (block_first[item / parts + 1] - r0) * per_row;
            // The visible positions first .. first + seen - 1; score[v][j] is position first + j's.
            const int64_t first = window ? std::max<int64_t>(0, position_of[r0] + 1 - window) : 0;
            for (int64_t v = 0; v < count; ++v) {
                const int64_t r = r0 + v / per_row, h = h0 + v % per_row;
                q[v] = qs + (r * heads + h) * dim;
                o[v] = os + (r * heads + h) * dim;
                seen[v] = position_of[r] + 1 - first;
            }
            const float* key = key_base[s] + ((h0 / group) * capacity[s] + first) * dim;
            const float* value = value_base[s] + ((h0 / group) * capacity[s] + first) * dim;
            attend_vectors(count, q.data(), seen.data(), key, value, dim, scale, softcap, score.data(), sum.data(), inv.data(), pairs.data(), o.data());
        }
    });
    return out;
}
