/*
 * The experts of a grouped (mixture-of-experts) kernel call that have rows, shared by the INT8/INT4
 * (quant_gemv.c) and float32 (dense_gemm.c) grouped GEMMs.
 */
#ifndef PDSERVE_EXPERTS_H
#define PDSERVE_EXPERTS_H

#include <stdint.h>
#include <stdlib.h>

/* The experts that have rows (offsets[e] < offsets[e + 1]), in order, in an array the caller frees (NULL when
 * out of memory); their number in *count. The grouped kernels' parallel loops run over these alone, so that
 * the threads' equal shares of (expert, tile) units are equal shares of work, wherever the routed experts
 * fall among all of them. */
static int64_t *active_experts(const int64_t *offsets, int64_t num_experts, int64_t *count)
{
    int64_t *active = malloc(sizeof(int64_t) * (size_t)(num_experts > 0 ? num_experts : 1));
    *count = 0;
    if (active == NULL) {
        return NULL;
    }
    for (int64_t e = 0; e < num_experts; ++e) {
        if (offsets[e + 1] > offsets[e]) {
            active[(*count)++] = e;
        }
    }
    return active;
}

#endif
