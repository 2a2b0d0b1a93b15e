/* Float32 matrix products for the CPU forward: y (n, out) = x (n, in) @ W^T, with W prepacked in panels.
 *
 * Why it exists: a verifying forward over 2-16 tokens is what every fast decoding algorithm pays per step, and on
 * a 2-core CPU PyTorch's kernels for so few rows either stream the weights at a fraction of the memory bandwidth
 * (MKL's GEMV-like paths) or stay far below the FMA peak (oneDNN). Here each weight panel is read from memory once
 * per call and used for up to NB rows held in registers, so up to NB rows cost about what one row costs.
 *
 * Layout (see playground/models/native.py): panel p holds output rows [p * PANEL, (p + 1) * PANEL) of W, transposed
 * to (in, PANEL) and contiguous, zero past `out`. Each output is a dot product summed over k in order with fused
 * multiply-adds, whatever n is: a row's result does not depend on which other rows share the call.
 *
 * Built by native.py with `cc -O3 -march=native -fopenmp`; the vector width follows the target's registers.
 */
#include <string.h>

#if defined(__AVX512F__)
#define VEC 16
#define NB 12 /* 12 rows x 2 vectors = 24 accumulators of the 32 vector registers */
#elif defined(__AVX__)
#define VEC 8
#define NB 6 /* 12 accumulators of 16 */
#else
#define VEC 4
#define NB 6
#endif
#define NV 2 /* vectors per panel row */
#define PANEL (NV * VEC)

typedef float vf __attribute__((vector_size(VEC * 4), aligned(4)));

int playground_panel_width(void) { return PANEL; }

/* Rows x[0..nb) of one panel; nb is a compile-time constant at every call site (see `rows`), so the accumulators
 * stay in registers. `cols` < PANEL only for the last panel of a W whose out is not a multiple of PANEL. */
static inline __attribute__((always_inline)) void panel_rows(const float *x, long in, const float *panel, float *y,
                                                               long out, int nb, int cols) {
    vf acc[NB][NV];
    for (int i = 0; i < NB; i++)
        for (int j = 0; j < NV; j++) acc[i][j] = (vf){0};
    for (long k = 0; k < in; k++) {
        const vf *w = (const vf *)(panel + k * PANEL); /* vf is declared 4-byte aligned: unaligned loads */
        vf wv[NV];
        for (int j = 0; j < NV; j++) wv[j] = w[j];
#pragma GCC unroll 16
        for (int i = 0; i < NB; i++) {
            if (i < nb) {
                float b = x[i * in + k];
                for (int j = 0; j < NV; j++) acc[i][j] += b * wv[j];
            }
        }
    }
    for (int i = 0; i < nb; i++) {
        if (cols == PANEL) {
            for (int j = 0; j < NV; j++) *(vf *)(y + i * out + j * VEC) = acc[i][j];
        } else {
            float row[PANEL];
            memcpy(row, acc[i], sizeof(row));
            memcpy(y + i * out, row, (size_t)cols * sizeof(float));
        }
    }
}

#define ROWS_CASE(k) \
    case k: panel_rows(x, in, panel, y, out, k, cols); break;

static void rows(const float *x, long in, const float *panel, float *y, long out, int nb, int cols) {
    switch (nb) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5)
#if NB > 6
        ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11)
#endif
        default: panel_rows(x, in, panel, y, out, NB, cols); break;
    }
}

/* x (n, in) and y (n, out) row-major and contiguous; packed (ceil(out / PANEL), in, PANEL). The panels are split
 * among `threads` threads in contiguous runs, so each thread streams its own part of the weights once. */
void playground_gemm(const float *x, int n, int in, const float *packed, int out, float *y, int threads) {
    long panels = (out + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long p = 0; p < panels; p++) {
        const float *panel = packed + p * (long)in * PANEL;
        int cols = out - p * PANEL < PANEL ? (int)(out - p * PANEL) : PANEL;
        for (int i0 = 0; i0 < n; i0 += NB) {
            int nb = n - i0 < NB ? n - i0 : NB;
            rows(x + (long)i0 * in, in, panel, y + (long)i0 * out + p * PANEL, out, nb, cols);
        }
    }
}
