/* The order greedy picks are made in, torch's argmax: the first maximum, and where a row holds a NaN,
 * its first NaN. A pick covers some columns of a row; picks of consecutive column ranges fold left to
 * right into the row's pick (argmax.c's pieces of a long row, qlinear.c's 32-column tiles and the
 * threads' column runs). */
#ifndef TOKENOS_ARGMAX_H
#define TOKENOS_ARGMAX_H

#include <math.h>
#include <stdint.h>

typedef struct {
    float max;  /* the largest value (meaningless when nan) */
    int64_t at; /* the column of its first occurrence, or of the first NaN; < 0: no column yet */
    int nan;
} argmax_pick;

#define ARGMAX_NONE ((argmax_pick){-INFINITY, -1, 0})

/* best, then next (later columns): a NaN held stays; a NaN or a strictly larger maximum replaces. */
static inline void argmax_fold(argmax_pick *best, argmax_pick next) {
    if (best->nan || next.at < 0) return;
    if (best->at < 0 || next.nan || next.max > best->max) *best = next;
}

#endif
