/* Routed-MoE bookkeeping shared by native_q4.c's swa_q4_moe and native_k.c's swa_k_moe (plain C: the
   "scalar" build of native_k.c includes it too). */
#ifndef SWASERVE_NATIVE_MOE_H
#define SWASERVE_NATIVE_MOE_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The A = T * k (token, expert) assignments sorted by expert (counting sort): sorted slot s holds
   assignment order[s], assignment a sits in slot[a]; expert e owns slots [start[e], start[e + 1]);
   active[0 .. nact) are the experts with at least one assignment. */
typedef struct {
    int64_t *start, *order, *slot, *active;
    int64_t nact;
} ExpertSort;

static ExpertSort expert_sort(const int64_t* ids, int64_t A, int64_t E) {
    ExpertSort r;
    r.start = (int64_t*)calloc(E + 1, sizeof(int64_t));
    r.order = (int64_t*)malloc((A + 1) * sizeof(int64_t));
    r.slot = (int64_t*)malloc((A + 1) * sizeof(int64_t));
    r.active = (int64_t*)malloc((E + 1) * sizeof(int64_t));
    int64_t* fill = (int64_t*)malloc((E + 1) * sizeof(int64_t));
    for (int64_t a = 0; a < A; ++a) r.start[ids[a] + 1]++;
    for (int64_t e = 0; e < E; ++e) r.start[e + 1] += r.start[e];
    memcpy(fill, r.start, E * sizeof(int64_t));
    for (int64_t a = 0; a < A; ++a) { int64_t s = fill[ids[a]]++; r.order[s] = a; r.slot[a] = s; }
    r.nact = 0;
    for (int64_t e = 0; e < E; ++e) if (r.start[e + 1] > r.start[e]) r.active[r.nact++] = e;
    free(fill);
    return r;
}

static void expert_sort_free(ExpertSort* r) { free(r->start); free(r->order); free(r->slot); free(r->active); }

/* out[t] = sum_j weights[t, j] * ybuf[slot[t * k + j]], t < T, rows of H; a work-shared loop: call it
   from inside an OpenMP parallel region (every thread of the team). */
static void moe_combine(float* out, const float* ybuf, const int64_t* slot, const float* weights, int64_t T,
                        int64_t k, int64_t H) {
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        float* o = out + t * H;
        for (int64_t h = 0; h < H; ++h) o[h] = 0.f;
        for (int64_t j = 0; j < k; ++j) {
            const float wgt = weights[t * k + j];
            const float* yv = ybuf + slot[t * k + j] * H;
            for (int64_t h = 0; h < H; ++h) o[h] += wgt * yv[h];
        }
    }
}

#endif
