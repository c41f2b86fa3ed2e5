// The machine's ceilings for the gguf engine's products, as JSON on stdout (bench/roofline.py compiles and runs it):
//   int8_macs   int8 multiply-adds/s: vpdpbusd on 512-bit registers where the CPU has AVX512-VNNI, else AVX2's
//               maddubs + madd + add, the instructions the row kernels run;
//   fma_flops   float32 FLOP/s of 256-bit fused multiply-adds;
//   read_bytes  memory read bandwidth over a 1 GiB buffer.
// Each for 1 thread and for `threads` threads (every thread runs the same work; figures are totals, best of 3).
// Build:  cc -O3 -fopenmp machine_peaks.c -o machine_peaks;  run:  machine_peaks THREADS [SCALE]
// SCALE (default 1) multiplies the work of each measurement: a smaller one is quicker and noisier.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// 8 independent chains of 64 multiply-adds each per iteration: the latency of one chain (5 cycles) is hidden.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double vnni512(long iters) {
    __m512i a0 = _mm512_set1_epi32(0), a1 = _mm512_set1_epi32(1), a2 = _mm512_set1_epi32(2), a3 = _mm512_set1_epi32(3),
            a4 = _mm512_set1_epi32(4), a5 = _mm512_set1_epi32(5), a6 = _mm512_set1_epi32(6), a7 = _mm512_set1_epi32(7);
    __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(5);
    for (long i = 0; i < iters; ++i) {
        __asm__ volatile("" : "+v"(u), "+v"(s));  // opaque operands: nothing is hoisted or folded
        a0 = _mm512_dpbusd_epi32(a0, u, s); a1 = _mm512_dpbusd_epi32(a1, u, s);
        a2 = _mm512_dpbusd_epi32(a2, u, s); a3 = _mm512_dpbusd_epi32(a3, u, s);
        a4 = _mm512_dpbusd_epi32(a4, u, s); a5 = _mm512_dpbusd_epi32(a5, u, s);
        a6 = _mm512_dpbusd_epi32(a6, u, s); a7 = _mm512_dpbusd_epi32(a7, u, s);
    }
    __m512i t = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                 _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
    return (double)_mm512_reduce_add_epi32(t) + 8.0 * 64 * iters;  // returns the multiply-adds done (and a sink)
}

// 6 chains of acc + madd(maddubs(u_c, s), 1): 32 multiply-adds each per iteration. Each chain's unsigned operand
// is its own vector loaded from L1 (as the kernels load activations), so that no product is shared between chains
// and no register is spilled: with the operands in registers (6 accumulators, 6 operands and 2 constants) the loop
// ran at half this rate on an AMD Zen 3, whose two multiply pipes then sat half idle.
__attribute__((target("avx2"))) static double avx2_int8(long iters) {
    __m256i operands[6];
    for (int c = 0; c < 6; ++c) operands[c] = _mm256_set1_epi8((char)(c + 1));
    const __m256i* u = operands;
    __m256i a0 = _mm256_set1_epi32(0), a1 = _mm256_set1_epi32(1), a2 = _mm256_set1_epi32(2), a3 = _mm256_set1_epi32(3),
            a4 = _mm256_set1_epi32(4), a5 = _mm256_set1_epi32(5);
    __m256i s = _mm256_set1_epi8(5), one = _mm256_set1_epi16(1);
#define STEP(a, c) a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_load_si256(u + c), s), one))
    for (long i = 0; i < iters; ++i) {
        __asm__ volatile("" : "+r"(u), "+x"(s));  // opaque: the operands are loaded again every iteration
        STEP(a0, 0); STEP(a1, 1); STEP(a2, 2); STEP(a3, 3); STEP(a4, 4); STEP(a5, 5);
    }
#undef STEP
    int out[8];
    __m256i t = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)), _mm256_add_epi32(a4, a5));
    _mm256_storeu_si256((__m256i*)out, t);
    return (double)(out[0] & 1) + 6.0 * 32 * iters;
}

// 8 chains of 256-bit FMAs: 16 FLOP each per iteration.
__attribute__((target("avx2,fma"))) static double fma256(long iters) {
    __m256 a0 = _mm256_set1_ps(0), a1 = _mm256_set1_ps(1), a2 = _mm256_set1_ps(2), a3 = _mm256_set1_ps(3),
           a4 = _mm256_set1_ps(4), a5 = _mm256_set1_ps(5), a6 = _mm256_set1_ps(6), a7 = _mm256_set1_ps(7);
    __m256 b = _mm256_set1_ps(1.0001f), c = _mm256_set1_ps(0.9999f);
    for (long i = 0; i < iters; ++i) {
        __asm__ volatile("" : "+x"(b), "+x"(c));
        a0 = _mm256_fmadd_ps(a0, b, c); a1 = _mm256_fmadd_ps(a1, b, c); a2 = _mm256_fmadd_ps(a2, b, c);
        a3 = _mm256_fmadd_ps(a3, b, c); a4 = _mm256_fmadd_ps(a4, b, c); a5 = _mm256_fmadd_ps(a5, b, c);
        a6 = _mm256_fmadd_ps(a6, b, c); a7 = _mm256_fmadd_ps(a7, b, c);
    }
    float t[8];
    _mm256_storeu_ps(t, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                      _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7))));
    return (double)(t[0] != t[0]) + 8.0 * 16 * iters;
}

// Bytes read: each thread sums its share of the buffer with 256-bit loads.
__attribute__((target("avx2"))) static double read_share(const char* buffer, size_t bytes) {
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (size_t i = 0; i < bytes; i += 64) {
        s0 = _mm256_add_epi64(s0, _mm256_load_si256((const __m256i*)(buffer + i)));
        s1 = _mm256_add_epi64(s1, _mm256_load_si256((const __m256i*)(buffer + i + 32)));
    }
    long out[4];
    _mm256_storeu_si256((__m256i*)out, _mm256_add_epi64(s0, s1));
    return (double)(out[0] & 1) + (double)bytes;
}

enum kind { VNNI, AVX2, FMA };

static double compute_rate(int threads, enum kind kind, long iters) {
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
        double work = 0, t0 = now();
#pragma omp parallel num_threads(threads) reduction(+ : work)
        work += kind == VNNI ? vnni512(iters) : kind == AVX2 ? avx2_int8(iters) : fma256(iters);
        double rate = work / (now() - t0);
        if (rate > best) best = rate;
    }
    return best;
}

static double read_rate(int threads, const char* buffer, size_t bytes) {
    double best = 0;
    for (int rep = 0; rep < 3; ++rep) {
        double read = 0, t0 = now();
#pragma omp parallel num_threads(threads) reduction(+ : read)
        {
            size_t share = bytes / threads;
            read += read_share(buffer + share * omp_get_thread_num(), share);
        }
        double rate = read / (now() - t0);
        if (rate > best) best = rate;
    }
    return best;
}

int main(int argc, char** argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : omp_get_max_threads();
    const int vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
    const double scale = argc > 2 ? atof(argv[2]) : 1.0;
    const long iters = (long)(50000000 * scale);
    // At least 128 MiB, four times the largest L3 in sight; a multiple of a page per thread.
    size_t bytes = (size_t)((double)(1 << 30) * scale);
    if (bytes < ((size_t)128 << 20)) bytes = (size_t)128 << 20;
    bytes -= bytes % (4096 * (size_t)threads);
    char* buffer = aligned_alloc(64, bytes);
    memset(buffer, 1, bytes);  // touch every page before timing
    printf("{\"int8_isa\": \"%s\", \"threads\": %d", vnni ? "avx512-vnni" : "avx2", threads);
    int counts[2] = {1, threads};
    const char* names[2] = {"one_thread", "all_threads"};
    for (int i = 0; i < 2; ++i) {
        printf(", \"%s\": {\"int8_macs\": %.4g, \"fma_flops\": %.4g, \"read_bytes\": %.4g}", names[i],
               compute_rate(counts[i], vnni ? VNNI : AVX2, iters), compute_rate(counts[i], FMA, iters),
               read_rate(counts[i], buffer, bytes));
    }
    printf("}\n");
    free(buffer);
    return 0;
}
