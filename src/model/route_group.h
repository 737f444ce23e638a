/* route_group.h: the router's group limit, shared by the CPU (src/model/moe.c) and the CUDA
 * router (src/cuda/kernels.cu) so both choose alike: a group's score is the sum of its top-2
 * choice values (its top-1 when groups hold one expert); the topk_group best groups stay (ties:
 * the lower group), the others' choice values become 0.0 (as the HF reference does, not -inf). */
#ifndef PETREL_MODEL_ROUTE_GROUP_H
#define PETREL_MODEL_ROUTE_GROUP_H
#include <math.h>

#ifdef __CUDACC__
#define RG_FN __host__ __device__ static inline
#else
#define RG_FN static inline
#endif

/* rank order: larger value first, then lower index */
RG_FN int route_better(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

/* ch[E]: choice values (score + bias), masked in place; G <= 256 groups of E / G experts. */
RG_FN void route_group_limit(float *ch, int E, int G, int topk_group) {
    if (G <= 1 || topk_group >= G || G > 256) return;
    int gs = E / G;
    float gsc[256];
    unsigned char keep[256];
    for (int g = 0; g < G; g++) {
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int e = g * gs; e < (g + 1) * gs; e++) {
            if (ch[e] > b1) b2 = b1, b1 = ch[e];
            else if (ch[e] > b2) b2 = ch[e];
        }
        gsc[g] = gs >= 2 ? b1 + b2 : b1;
        keep[g] = 0;
    }
    for (int k = 0; k < topk_group; k++) {
        int best = -1;
        for (int g = 0; g < G; g++)
            if (!keep[g] && (best < 0 || route_better(gsc[g], g, gsc[best], best))) best = g;
        keep[best] = 1;
    }
    for (int g = 0; g < G; g++)
        if (!keep[g])
            for (int e = g * gs; e < (g + 1) * gs; e++) ch[e] = 0.0f;
}
#endif
