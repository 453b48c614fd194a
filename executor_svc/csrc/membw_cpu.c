/* A STREAM-style read of memory, for the roofline the CPU benchmarks report: every thread
 * sums its contiguous share of a float array (one pass, several independent accumulators so
 * the loads, not the adds, bound it). The result is returned so the loop cannot be elided. */
#include <stdint.h>

#include "ps_cpu.h"

double ps_read_sum(const float *a, int64_t n, int num_threads) {
    double total = 0.0;
#pragma omp parallel num_threads(num_threads > 0 ? num_threads : 1) reduction(+ : total)
    {
        const int tid = PS_TID(), nth = PS_NTH();
        const int64_t lo = n * tid / nth, hi = n * (tid + 1) / nth;
        float p[32] = {0};
        int64_t i = lo;
        for (; i + 32 <= hi; i += 32)
            for (int l = 0; l < 32; l++) p[l] += a[i + l];
        float s = 0.0f;
        for (int l = 0; l < 32; l++) s += p[l];
        for (; i < hi; i++) s += a[i];
        total += s;
    }
    return total;
}
