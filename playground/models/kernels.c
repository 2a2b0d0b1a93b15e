/* The CPU forward's float32 kernels: matrix products with prepacked weights, and attention.
 *
 * Matrix products: y (n, out) = x (n, in) @ W^T, with W prepacked in panels. Why they exist: a verifying forward
 * over 2-16 tokens is what every fast decoding algorithm pays per step, and on a 2-core CPU PyTorch's kernels for so
 * few rows either stream the weights at a fraction of the memory bandwidth (MKL's GEMV-like paths) or stay far below
 * the FMA peak (oneDNN). Here each weight panel is read from memory once per call and used for up to NB rows held in
 * registers, so up to NB rows cost about what one row costs. More rows take further passes over each panel from the
 * cache while the next panels are fetched; fewer rows than fill the FMA pipelines take several panels per pass
 * (see `plan`).
 *
 * Layout (see playground/models/native.py): panel p holds output rows [p * PANEL, (p + 1) * PANEL) of W, transposed
 * to (in, PANEL) and contiguous, zero past `out`. Each output is a dot product summed over k in order with fused
 * multiply-adds, whatever n is: a row's result does not depend on which other rows share the call.
 *
 * Built by native.py with `cc -O3 -march=native -fopenmp -ffp-contract=off`; the vector width follows the target's
 * registers. Fused multiply-adds are explicit (`vfma`) and the compiler may fuse nothing else: left free to fuse
 * (GCC's default), GCC 12 fused a product into its sum in one inlined copy of a loop and not in another on an AVX2
 * build, so the same dot product gave different last bits depending on where a key sat among the others.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
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
#define GROUP 4 /* most panels one pass serves: see `plan` */
/* Panel rows fetched ahead of use. With several rows the loop is busy with FMAs and the hardware prefetcher fell
 * behind: on a 2-core Xeon (Emerald Rapids) a 12-token forward of SmolLM2-135M cost 1.67 one-token forwards without
 * this and 1.32 with it (16 to 192 rows ahead measured alike), a one-token forward the same; on a 2-core Zen 3
 * EPYC (AVX2) 9 tokens cost 52-57 ms with it and 59-65 without, one token alike. Hint 2 (to L2, not L1): on a
 * 2-core AVX-512 Xeon with AMX whose products gained little from rows sharing a pass (6 rows 1.25 times one row's
 * time, 12 rows 1.45), all of SmolLM2-135M's products over 6, 7, 9 and 12 rows took 0.88, 0.92, 0.88 and 0.94 of
 * hint 3's time, one row the same (medians of 6 interleaved rounds; hint 1 alike; presumably lines fetched into
 * L1 that early evicted ones the FMAs still read). The non-temporal hint 0 made one-token forwards 40% slower on the
 * Emerald Rapids Xeon. 128 rows, not 64: on a 2-core Zen 4 EPYC the integer products of one row and of several
 * read their weights sooner, the AVX2 build's one-row products too (the results log, 2026-12-07). */
#define PREFETCH 128

typedef float vf __attribute__((vector_size(VEC * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(VEC * 4), aligned(4)));

#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* a * b + c rounded once where the CPU has fused multiply-add, else rounded twice; the same in every copy of a loop. */
static inline __attribute__((always_inline)) vf vfma(vf a, vf b, vf c) {
#if VEC == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif VEC == 8 && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else /* 4-wide vectors: no AVX, so no FMA3 on x86 either */
    return a * b + c;
#endif
}

/* Weight formats. Panels hold float32, or 16-bit floats where every weight of the product is exactly one (a
 * checkpoint saved in float16 or bfloat16 and run in float32): widened to float32 as they are loaded, they give
 * the same sums bit for bit from half the bytes, and a product over a few rows is bound by reading its weights.
 * 16-bit panels need AVX2 with F16C, or AVX-512; `playground_formats` says which this build serves.
 *
 * GGUF blocks (the same builds): Q8_0 and Q4_1 keep the file's blocks of QK weights along `in`, each with its
 * float16 scale d (and, for Q4_1, float16 minimum m), and the panel regroups them by block: block b of a panel is
 * its PANEL scales, then (Q4_1) its PANEL minimums, then for each of the QK inputs its PANEL quants (Q8_0: one
 * signed byte per output; Q4_1: PANEL / 2 bytes, output i in the low nibble of byte i, output i + PANEL / 2 in the
 * high nibble). A product sums each block apart, factored as the format is: d * (sum of q * x) for Q8_0, and
 * d * (sum of q * x) + m * (sum of x) for Q4_1, the sums of q * x over the block's inputs in order (q widened to
 * float32 exactly) and folded into the output's sum block by block in order. Against widening every weight to
 * gguf's dequantised float32 first, a weight read costs no multiply, and the block's small sums round less (a
 * product's error against float64 is a half to a fifth of the float32 panels'); the bits are not those of the
 * float32 panels, but again depend on one output and one row alone, and are the same on every build. */
#define FMT_F32 0
#define FMT_F16 1
#define FMT_BF16 2
#define FMT_Q8_0 3
#define FMT_Q4_1 4
#define FMT_Q8_0_X8 5 /* the same blocks, multiplied in integers against 8-bit activations: see "Integer products" */
#define FMT_Q4_1_X8 6
#define FMT_Q4_K_X8 7 /* llama.cpp's K-quant blocks, integer products only: see "Integer products" */
#define FMT_Q5_K_X8 8
#define FMT_Q6_K_X8 9
#define FMT_Q4_0_X8 10 /* llama.cpp's other block formats of 32 weights, integer products only */
#define FMT_Q5_0_X8 11
#define FMT_Q5_1_X8 12
#define FMT_PARTS 13 /* a product of parts in different formats: see `struct parts` */
#define QK 32 /* weights per GGUF block */
#define QK_K 256 /* weights per K-quant super-block */
#if VEC == 16 || (VEC == 8 && defined(__AVX2__) && defined(__F16C__))
#define HALF_PANELS 1
#else
#define HALF_PANELS 0
#endif

static inline int quantised(int fmt) { return fmt == FMT_Q8_0 || fmt == FMT_Q4_1; }
static inline int kquant(int fmt) { return fmt == FMT_Q4_K_X8 || fmt == FMT_Q5_K_X8 || fmt == FMT_Q6_K_X8; }
static inline int integer(int fmt) { return fmt >= FMT_Q8_0_X8 && fmt <= FMT_Q5_1_X8; }
/* Integer formats whose quants have a fifth bit (in a bit plane), and whose blocks carry a minimum. */
static inline int five_bits(int fmt) { return fmt == FMT_Q5_0_X8 || fmt == FMT_Q5_1_X8 || fmt == FMT_Q5_K_X8; }
static inline int has_minimum(int fmt) {
    return fmt == FMT_Q4_1_X8 || fmt == FMT_Q5_1_X8 || fmt == FMT_Q4_K_X8 || fmt == FMT_Q5_K_X8;
}

/* Bytes of one block of QK inputs in a GGUF panel (for the K-quants, besides their super-block's header). */
static inline long block_bytes_of(int fmt) {
    if (fmt == FMT_Q8_0 || fmt == FMT_Q8_0_X8) return PANEL * 2 + QK * PANEL;
    /* scales (Q4_1, Q5_1: and minimums; the K-quants: their integer scales), nibbles, bit planes */
    const long scales = fmt == FMT_Q4_1 || fmt == FMT_Q4_1_X8 || fmt == FMT_Q5_1_X8 ? PANEL * 4 : PANEL * 2;
    return scales + QK * PANEL / 2 + (five_bits(fmt) ? PANEL * 4 : fmt == FMT_Q6_K_X8 ? PANEL * 8 : 0);
}

/* Bytes of a K-quant super-block's header in a panel: the PANEL float16 d (and dmin, but for Q6_K). */
static inline long header_bytes_of(int fmt) { return fmt == FMT_Q6_K_X8 ? PANEL * 2 : kquant(fmt) ? PANEL * 4 : 0; }

/* Bytes of a panel over `in` inputs (a multiple of QK for the GGUF formats, of QK_K for the K-quants). */
static inline long panel_bytes_of(int fmt, long in) {
    if (kquant(fmt)) return in / QK_K * (header_bytes_of(fmt) + QK_K / QK * block_bytes_of(fmt));
    if (fmt >= FMT_Q8_0) return in / QK * block_bytes_of(fmt);
    return in * PANEL * (fmt == FMT_F32 ? 4 : 2);
}

/* Block b (of QK inputs) of a panel in GGUF format fmt, and its super-block's header (K-quants). */
static inline const uint8_t *block_at(const void *panel, int fmt, long b) {
    if (!kquant(fmt)) return (const uint8_t *)panel + b * block_bytes_of(fmt);
    const long per = QK_K / QK;
    return (const uint8_t *)panel + b / per * (header_bytes_of(fmt) + per * block_bytes_of(fmt)) +
           header_bytes_of(fmt) + b % per * block_bytes_of(fmt);
}
static inline const uint8_t *header_at(const void *panel, int fmt, long b) {
    const long per = QK_K / QK;
    return (const uint8_t *)panel + b / per * (header_bytes_of(fmt) + per * block_bytes_of(fmt));
}

long playground_panel_bytes(int fmt, int in) { return panel_bytes_of(fmt, in); }

/* The vector of weights at element `index` of a panel in format fmt (a compile-time constant at every call). */
static inline __attribute__((always_inline)) vf load_weights(const void *panel, long index, int fmt) {
    (void)fmt; /* unread where this build serves float32 panels only */
#if HALF_PANELS
    const uint16_t *half = (const uint16_t *)panel + index;
#if VEC == 16
    if (fmt == FMT_F16) return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)half));
    if (fmt == FMT_BF16)
        return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)half)), 16);
#else
    if (fmt == FMT_F16) return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)half));
    if (fmt == FMT_BF16)
        return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)half)), 16);
#endif
#endif
    return *((const vf *)panel + index / VEC); /* vf is 4-byte aligned: an unaligned load */
}

#if HALF_PANELS
/* VEC float16 values at `at`, widened (exactly). */
static inline __attribute__((always_inline)) vf load_halves(const void *at) {
#if VEC == 16
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)at));
#else
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at));
#endif
}

/* VEC quants of vector j at one input of a GGUF block (`at`: that input's quant bytes), as float32 (exactly). */
static inline __attribute__((always_inline)) vf load_quants(const uint8_t *at, int j, int fmt) {
#if VEC == 16
    if (fmt == FMT_Q8_0)
        return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(at + j * VEC))));
    /* 0..15 as floats, looked up by each lane's low four bits: one shuffle instead of a mask and a conversion,
     * both on the port the multiply-adds need */
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)at));
    return (vf)_mm512_permutexvar_ps(j == 0 ? q : _mm512_srli_epi32(q, 4), values);
#else
    if (fmt == FMT_Q8_0)
        return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(at + j * VEC))));
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)at));
    q = j == 0 ? _mm256_and_si256(q, _mm256_set1_epi32(15)) : _mm256_srli_epi32(q, 4);
    return (vf)_mm256_cvtepi32_ps(q);
#endif
}
#endif

/* b in every lane (x - +0 is x for every x, -0 included, so this compiles to a broadcast alone). */
static inline __attribute__((always_inline)) vf splat(float b) { return b - (vf){0}; }

int playground_panel_width(void) { return PANEL; }
int playground_vector_width(void) { return VEC; }
int playground_rows_per_pass(void) { return NB; }
int playground_formats(void) {
    int every_build = 1 << FMT_F32;
    for (int fmt = FMT_Q8_0_X8; fmt <= FMT_PARTS; fmt++) every_build |= 1 << fmt;
    return HALF_PANELS ? every_build | (1 << FMT_F16) | (1 << FMT_BF16) | (1 << FMT_Q8_0) | (1 << FMT_Q4_1)
                       : every_build;
}

/* Quant k (0..31) of output i of a block into the integer formats' quant rows at `quants` (see "Integer products"):
 * nibble formats as 4 rows of PANEL * 4 bytes, row r holding inputs 4r .. 4r + 3 in its low nibbles and 16 + 4r ..
 * 16 + 4r + 3 in its high ones; above 4 bits, bit plane words of output i at `plane` + 4i (Q6_K's second word at
 * `plane` + PANEL * 4): input 4g + c's fifth bit at bit 8c + g (Q5_0, Q5_1, Q5_K), its two top bits at bit
 * 8c + 2 (g % 4) of the first word (g < 4) or the second (Q6_K). */
static void put_quant(uint8_t *quants, uint8_t *plane, int fmt, long i, long k, unsigned q) {
    const long group = k / 4, c = k % 4, at = (group % 4) * PANEL * 4 + i * 4 + c;
    quants[at] |= (uint8_t)(group < 4 ? q & 15 : (q & 15) << 4);
    uint32_t word, bits = 0;
    if (five_bits(fmt)) bits = (uint32_t)(q >> 4 & 1) << (8 * c + group);
    if (fmt == FMT_Q6_K_X8) bits = (uint32_t)(q >> 4 & 3) << (8 * c + 2 * (group % 4));
    if (fmt == FMT_Q6_K_X8 && group >= 4) plane += PANEL * 4;
    if (bits == 0) return;
    memcpy(&word, plane + i * 4, 4);
    word |= bits;
    memcpy(plane + i * 4, &word, 4);
}

/* K-quant super-blocks as the file stores them (rows (out, in / QK_K super-blocks of 144, 176 or 210 bytes)) into
 * the panels: per super-block its header (PANEL float16 d, then for Q4_K and Q5_K PANEL float16 dmin), then 8 blocks
 * of QK inputs, each its PANEL 6-bit scales and PANEL 6-bit minimums as bytes (Q6_K: the PANEL signed 8-bit scales of
 * its first 16 inputs, then of its last 16), its quant rows and bit planes (`put_quant`). */
static void pack_k_blocks(const uint8_t *rows, int out, int in, int fmt, uint8_t *panels) {
    const long supers = in / QK_K, size = fmt == FMT_Q4_K_X8 ? 144 : fmt == FMT_Q5_K_X8 ? 176 : 210;
    const long panel_count = (out + PANEL - 1) / PANEL;
    memset(panels, 0, (size_t)(panel_count * panel_bytes_of(fmt, in)));
    for (long r = 0; r < out; r++) {
        const long p = r / PANEL, i = r % PANEL;
        uint8_t *panel = panels + p * panel_bytes_of(fmt, in);
        for (long s = 0; s < supers; s++) {
            const uint8_t *src = rows + (r * supers + s) * size;
            uint8_t *head = (uint8_t *)header_at(panel, fmt, s * (QK_K / QK));
            if (fmt == FMT_Q6_K_X8) {
                memcpy(head + i * 2, src + 208, 2); /* d */
            } else {
                memcpy(head + i * 2, src, 2);                 /* d */
                memcpy(head + PANEL * 2 + i * 2, src + 2, 2); /* dmin */
            }
            for (long j = 0; j < QK_K / QK; j++) {
                uint8_t *dst = (uint8_t *)block_at(panel, fmt, s * (QK_K / QK) + j);
                uint8_t *quants = dst + PANEL * 2, *plane = quants + QK * PANEL / 2;
                if (fmt == FMT_Q6_K_X8) {
                    dst[i] = src[192 + 2 * j];
                    dst[PANEL + i] = src[192 + 2 * j + 1];
                } else { /* llama.cpp's 12 bytes of 6-bit scales and minimums */
                    const uint8_t *sm = src + 4;
                    dst[i] = j < 4 ? sm[j] & 63 : (uint8_t)((sm[j + 4] & 15) | (sm[j - 4] >> 6) << 4);
                    dst[PANEL + i] = j < 4 ? sm[j + 4] & 63 : (uint8_t)((sm[j + 4] >> 4) | (sm[j] >> 6) << 4);
                }
                for (long k = 0; k < QK; k++) {
                    const long w = j * QK + k; /* the weight's place in its super-block */
                    unsigned q;
                    if (fmt == FMT_Q6_K_X8) { /* per half of 128: low nibbles by w % 64, top pairs by w % 32 */
                        const long h = w / 128, u = w % 128;
                        const uint8_t low = src[64 * h + u % 64], top = src[128 + 32 * h + u % 32];
                        q = (u < 64 ? low & 15u : (unsigned)low >> 4) | ((top >> (2 * (u / 32))) & 3u) << 4;
                    } else { /* nibbles: blocks 2m and 2m + 1 share 32 bytes; Q5_K's fifth bits, bit j of byte k */
                        const uint8_t *qs = src + (fmt == FMT_Q5_K_X8 ? 48 : 16) + 32 * (j / 2);
                        q = j % 2 ? (unsigned)qs[k] >> 4 : qs[k] & 15u;
                        if (fmt == FMT_Q5_K_X8) q |= ((src[16 + k] >> j) & 1u) << 4;
                    }
                    put_quant(quants, plane, fmt, i, k, q);
                }
            }
        }
    }
}

/* A GGUF matrix as the file stores it, rows (out, in / QK blocks, or in / QK_K super-blocks), regrouped into the
 * panels described above (zero past `out`, so padded outputs read zero scales and minimums), or, for the integer
 * formats, into the layout of "Integer products" below. */
void playground_pack_blocks(const uint8_t *rows, int out, int in, int fmt, uint8_t *panels) {
    if (kquant(fmt)) {
        pack_k_blocks(rows, out, in, fmt, panels);
        return;
    }
    /* a file's block of 32: float16 d, (Q4_1, Q5_1) float16 m, (Q5_0, Q5_1) 4 bytes of fifth bits (bit k: quant
     * k's), then the quants: Q8_0's 32 signed bytes, or 16 bytes of nibbles (byte j: quant j low, j + 16 high) */
    const int q8 = fmt == FMT_Q8_0 || fmt == FMT_Q8_0_X8, minimum = fmt == FMT_Q4_1 || has_minimum(fmt);
    const long heads = minimum ? 4 : 2, high = five_bits(fmt) ? 4 : 0, size = heads + high + (q8 ? QK : QK / 2);
    const long blocks = in / QK, block_bytes = block_bytes_of(fmt), panel_count = (out + PANEL - 1) / PANEL;
    memset(panels, 0, (size_t)(panel_count * blocks * block_bytes));
    for (long r = 0; r < out; r++) {
        const long p = r / PANEL, i = r % PANEL;
        for (long b = 0; b < blocks; b++) {
            const uint8_t *src = rows + (r * blocks + b) * size, *qs = src + heads + high;
            uint8_t *dst = panels + (p * blocks + b) * block_bytes, *quants = dst + heads * PANEL;
            memcpy(dst + i * 2, src, 2); /* d */
            if (minimum) memcpy(dst + PANEL * 2 + i * 2, src + 2, 2); /* m */
            uint32_t fifth = 0;
            if (high) memcpy(&fifth, src + heads, 4);
            for (long k = 0; k < QK; k++) {
                const unsigned q = q8 ? qs[k] : (k < QK / 2 ? qs[k] & 15u : (unsigned)qs[k - QK / 2] >> 4) |
                                                    (fifth >> k & 1u) << 4;
                if (fmt == FMT_Q8_0) quants[k * PANEL + i] = (uint8_t)q;
                else if (fmt == FMT_Q4_1)
                    quants[k * (PANEL / 2) + i % (PANEL / 2)] |= (uint8_t)(i < PANEL / 2 ? q : q << 4);
                else if (fmt == FMT_Q8_0_X8) quants[k / 4 * PANEL * 4 + i * 4 + k % 4] = (uint8_t)q;
                else put_quant(quants, quants + QK * PANEL / 2, fmt, i, k, q);
            }
        }
    }
}

/* Rows x[0..nb) of G adjacent panels (panel g at panel + g * panel_bytes_of(fmt, in), `cols` outputs in the last
 * one); for Q4_1, sums (nb, in / QK) holds each row's block sums of x (`block_sums`; unread otherwise). nb and G are compile-time constants at every call site (see `rows`), so the accumulators stay in registers.
 * Why several
 * panels: each output's sum is one chain of FMAs, each waiting on the one before (4 cycles on Zen 3 and 4), so a
 * pass over one panel with few rows is bound by that latency, not by the FMA units; G panels give G times the
 * independent chains in the same pass. Each sum still runs over k in order from zero, whatever G and nb are.
 *
 * Prefetch: G streams, stream g at fetch + g * stride advancing step bytes per k; both cache lines at each.
 * Reading a panel from memory, stream g runs PREFETCH rows ahead in panel g (past its end that is the next panel,
 * which this thread reads next; past the last panel, a harmless prefetch of unowned memory: an address computed as
 * an integer, since a pointer past the array would be undefined behaviour). Re-reading panels from the cache, the
 * streams fetch the next panels instead (see `playground_gemm`). */
static inline __attribute__((always_inline)) void panel_rows(const float *x, const float *sums, long in,
                                                               const void *panel, int fmt, float *y, long out, int nb,
                                                               int G, int cols, uintptr_t fetch, uintptr_t stride,
                                                               uintptr_t step) {
    /* Every loop over the accumulators is unrolled: one left rolled indexes acc at run time, which keeps it in
     * memory, stored to on every k. */
    vf acc[GROUP][NB][NV];
    /* GGUF formats: acc holds a block's sums of q * x, folded into `total` (through memory: the registers hold
     * acc) at the block's end. The others take `in` as one block and sum into acc directly. */
    float total[GROUP][NB][PANEL];
    (void)total, (void)sums;
    const long block = quantised(fmt) ? QK : in, panel_bytes = panel_bytes_of(fmt, in);
    const long block_bytes = panel_bytes / (in / block), quant_at = fmt == FMT_Q4_1 ? PANEL * 4 : PANEL * 2;
    const long quant_row = fmt == FMT_Q4_1 ? PANEL / 2 : PANEL;
    (void)block_bytes, (void)quant_at, (void)quant_row;
    for (long k0 = 0; k0 < in; k0 += block) {
#pragma GCC unroll 16
        for (int g = 0; g < G; g++)
#pragma GCC unroll 16
            for (int i = 0; i < nb; i++)
                for (int j = 0; j < NV; j++) acc[g][i][j] = (vf){0};
        for (long k = k0; k < k0 + block; k++) {
            uintptr_t at = fetch + k * step;
#pragma GCC unroll 16
            for (int g = 0; g < GROUP; g++) {
                if (g < G) {
                    __builtin_prefetch((const void *)(at + g * stride), 0, 2);
                    if (!quantised(fmt)) __builtin_prefetch((const void *)(at + g * stride + 64), 0, 2);
                    vf wv[NV];
                    for (int j = 0; j < NV; j++) {
#if HALF_PANELS
                        if (quantised(fmt)) {
                            const uint8_t *q = (const uint8_t *)panel + g * panel_bytes + k0 / QK * block_bytes +
                                               quant_at + (k - k0) * quant_row;
                            wv[j] = load_quants(q, j, fmt);
                        } else
#endif
                            wv[j] = load_weights(panel, (g * in + k) * PANEL + j * VEC, fmt);
                        /* In a register: left free, GCC folded the load into each of nb FMAs, and the extra loads
                         * made 3-4 rows up to 1.9x slower on Zen 3. */
                        __asm__("" : "+x"(wv[j]));
                    }
#pragma GCC unroll 16
                    for (int i = 0; i < NB; i++) {
                        if (i < nb) {
                            vf b = splat(x[i * in + k]);
                            for (int j = 0; j < NV; j++) acc[g][i][j] = vfma(b, wv[j], acc[g][i][j]);
                        }
                    }
                    /* x is read again for the next panel, not kept: keeping 3 rows' broadcasts across 2 panels
                     * took 17 registers, and the accumulator spilled to the stack cost a store and a load every k. */
                    if (G > 1) __asm__ volatile("" ::: "memory");
                }
            }
        }
#if HALF_PANELS
        if (quantised(fmt)) { /* total = (acc * d + total) [+ sum(x) * m], each rounded once */
#pragma GCC unroll 16
            for (int g = 0; g < G; g++) {
                /* loaded once here: the stores to `total` below could alias the panel's bytes */
                const uint8_t *head = (const uint8_t *)panel + g * panel_bytes + k0 / QK * block_bytes;
                vf scale[NV], low[NV];
                for (int j = 0; j < NV; j++) {
                    scale[j] = load_halves(head + j * VEC * 2);
                    low[j] = fmt == FMT_Q4_1 ? load_halves(head + PANEL * 2 + j * VEC * 2) : (vf){0};
                }
#pragma GCC unroll 16
                for (int i = 0; i < nb; i++) {
                    vf x_sum = fmt == FMT_Q4_1 ? splat(sums[i * (in / QK) + k0 / QK]) : (vf){0};
                    for (int j = 0; j < NV; j++) {
                        vf *t = (vf *)&total[g][i][j * VEC];
                        vf sum = vfma(acc[g][i][j], scale[j], k0 == 0 ? (vf){0} : *t);
                        *t = fmt == FMT_Q4_1 ? vfma(x_sum, low[j], sum) : sum;
                    }
                }
            }
        }
#endif
    }
#if HALF_PANELS
    if (quantised(fmt)) {
#pragma GCC unroll 16
        for (int g = 0; g < G; g++)
#pragma GCC unroll 16
            for (int i = 0; i < nb; i++)
                for (int j = 0; j < NV; j++) acc[g][i][j] = *(vf *)&total[g][i][j * VEC];
    }
#endif
#pragma GCC unroll 16
    for (int g = 0; g < G; g++) {
        float *yg = y + g * PANEL;
#pragma GCC unroll 16
        for (int i = 0; i < nb; i++) {
            if (g < G - 1 || cols == PANEL) {
                for (int j = 0; j < NV; j++) *(vf *)(yg + i * out + j * VEC) = acc[g][i][j];
            } else {
                /* through a copy, not acc's own address: taking it kept every accumulator in memory */
                float row[PANEL];
                for (int j = 0; j < NV; j++) *(vf *)(row + j * VEC) = acc[g][i][j];
                memcpy(yg + i * out, row, (size_t)cols * sizeof(float));
            }
        }
    }
}

/* How a product over n rows runs: passes of up to `chunk` rows, each over a group of G adjacent panels. Enough
 * independent sums keep both FMA units busy through their latency (2 x 4 = 8 chains), within the 16 vector registers
 * of AVX2 (3 rows of 2 panels: 12 accumulators). All of SmolLM2-135M's products on a 2-core Zen 3 EPYC (AVX2), against
 * one panel per pass and prefetching only ahead in it (medians of 12 interleaved rounds): 1, 2, 3, 4, 5, 6, 7, 9, 11
 * and 12 rows took 0.86, 0.86, 0.94, 0.93, 0.90, 0.95, 0.95, 0.88, 0.77 and 0.76 of the time (1 row 24.9 -> 21.4 ms,
 * 12 rows 40.7 -> 31.1). */
static inline void plan(int n, int fmt, int *chunk, int *G) {
    if (NB <= 6 && (quantised(fmt) || integer(fmt))) {
        /* GGUF blocks with AVX2's 16 registers: even passes of up to NB rows over one panel, not the float formats'
         * 2-3 rows over 2 panels, which took up to 1.2x the time with the blocks summed apart (and spilled their
         * scales when every weight was widened to its float); one row as theirs, over GROUP panels, which reads
         * memory best (docs/results.md, 2026-12-04: the kernel's products against the FMA bound) */
        int passes = (n + NB - 1) / NB;
        *chunk = (n + passes - 1) / passes;
        *G = n == 1 ? GROUP : 1;
        return;
    }
    if (n <= 3) {
        *chunk = n;
        *G = n == 1 ? GROUP : 2;
    } else if (n <= NB && NB <= 6) {
        *chunk = (n + 1) / 2; /* 4-6 rows as two passes of 2-3 rows over 2 panels */
        *G = 2;
    } else {
        *chunk = NB;
        *G = 1;
    }
}

#define ROWS_CASE(k) \
    case k: panel_rows(x, sums, in, panel, fmt, y, out, k, 1, cols, fetch, stride, step); break;

/* One pass of nb rows over G panels of format fmt (a constant at each call, see `rows`): G is 1 for any nb, GROUP
 * for 1 row, 2 for 2 or 3 rows (see `plan`). */
static inline __attribute__((always_inline)) void rows_in(const float *x, const float *sums, long in,
                                                            const void *panel, int fmt, float *y, long out, int nb,
                                                            int G, int cols, uintptr_t fetch, uintptr_t stride,
                                                            uintptr_t step) {
    if (G == GROUP && nb == 1) {
        panel_rows(x, sums, in, panel, fmt, y, out, 1, GROUP, cols, fetch, stride, step);
    } else if (G == 2 && nb == 2) {
        panel_rows(x, sums, in, panel, fmt, y, out, 2, 2, cols, fetch, stride, step);
    } else if (G == 2) {
        panel_rows(x, sums, in, panel, fmt, y, out, 3, 2, cols, fetch, stride, step);
    } else {
        switch (nb) {
            ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5)
#if NB > 6
            ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11)
#endif
            default: panel_rows(x, sums, in, panel, fmt, y, out, NB, 1, cols, fetch, stride, step); break;
        }
    }
}

static void rows(const float *x, const float *sums, long in, const void *panel, int fmt, float *y, long out, int nb,
                 int G, int cols, uintptr_t fetch, uintptr_t stride, uintptr_t step) {
    /* one copy of the loop per format, each with its format a constant */
#define FORMAT_CASE(f) \
    case f: rows_in(x, sums, in, panel, f, y, out, nb, G, cols, fetch, stride, step); return;
    switch (fmt) {
#if HALF_PANELS
        FORMAT_CASE(FMT_F16) FORMAT_CASE(FMT_BF16) FORMAT_CASE(FMT_Q8_0) FORMAT_CASE(FMT_Q4_1)
#endif
        default: rows_in(x, sums, in, panel, FMT_F32, y, out, nb, G, cols, fetch, stride, step);
    }
}

/* Thread t of nt's items [first, end) of n, split evenly: the panels of a product, the query rows of the attention,
 * the token rows of row-wise work (norms, RoPE, SiLU, residual adds). An item's arithmetic is the same whichever
 * thread does it. */
static inline void row_share(long n, int t, int nt, long *first, long *end) {
    *first = n * t / nt;
    *end = n * (t + 1) / nt;
}

typedef float v8 __attribute__((vector_size(32), aligned(4)));

/* The sum of each block of QK inputs of x (n, in), s (n, in / QK): the four 8-float runs of a block added as
 * vectors in order, then the 8 lanes pairwise; 8-float vectors on every build, so AVX2 and AVX-512 agree. */
static void block_sums(const float *x, long n, long in, float *s) {
    for (long b = 0; b < n * in / QK; b++) {
        const v8 *v = (const v8 *)(x + b * QK);
        v8 a = ((v[0] + v[1]) + v[2]) + v[3];
        s[b] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    }
}

/* ---- Integer products on 8-bit activations ----
 * FMT_Q8_0_X8 and FMT_Q4_1_X8 hold the same GGUF blocks as FMT_Q8_0 and FMT_Q4_1 (the other FMT_*_X8 those of their
 * formats, in integer products only); a product quantises each row of x per block of QK inputs to 8-bit integers
 * (`quantise_rows`, as llama.cpp's Q8_0 activations) and multiplies them against the weights' quants in 32-bit
 * integer dot products: with AVX-512 VNNI or AVX-VNNI one instruction does 4 multiply-adds for each of 16 (8)
 * outputs, against one float multiply-add per weight after widening it. A block's
 * integer sum isum = sum of q * q_x is exact whatever the instructions, so every build folds the same integers into
 * the output, block by block in order from y = 0:
 *     Q8_0: y = fma(float(isum) * d, d_x, y)
 *     Q4_1: y = fma(fma(m, float(qsum), float(isum) * d), d_x, y)
 * (d, m the weights' scale and minimum, d_x the activations' scale, qsum the block's sum of q_x). Q4_1's minimum
 * meets the quantised activations, not x itself, as llama.cpp's Q8_1 has it: the weights d * q + m are centred near
 * zero, so the activations' rounding errors mostly cancel across a block; summing m * x exactly instead leaves
 * d * q, all of one sign, to carry those errors, which was four times further from float32 (the results log).
 * Q4_0 and Q5_0 (w = d * (q - 8), d * (q - 16)) fold as Q8_0, the offset times the block's sum of q_x taken off
 * isum in integers; Q5_1 as Q4_1; the fifth bits of Q5_0, Q5_1 and Q5_K sit in a bit plane beside the nibbles.
 * The K-quants (llama.cpp's Q4_K, Q5_K, Q6_K) fold the same way per block of 32 inputs, their scales formed as the
 * format defines them: Q4_K and Q5_K (w = d * sc * q - dmin * m, q of 4 or 5 bits) as Q4_1 with d * sc and
 * -(dmin * m); Q6_K (w = d * sc * (q - 32), q of 6 bits, a scale per 16 inputs) as Q8_0 once per 16 inputs, with
 * d * sc and isum = sum of q * q_x - 32 * (those inputs' sum of q_x), both halves under the block's d_x. Each such
 * scale, a float16 times an integer of at most 8 bits, is exact in float32, so the K-quants' panels keep the file's
 * integer scales and their float16 factors, not a float per block.
 * The bits depend on one output and one row alone, and are the same on AVX-512 VNNI, AVX-512 without VNNI, AVX2
 * (with or without AVX-VNNI) and plain C.
 *
 * Panel layout, per block of QK inputs: the PANEL float16 scales d, (Q4_1) the PANEL float16 minimums m, then the
 * quants as the dot-product instructions read them, 4 inputs of an output in one 32-bit lane: group g (inputs 4g ..
 * 4g + 3) holds output i's 4 quants at bytes 4i .. 4i + 3 of a PANEL * 4-byte row. Q8_0: 8 such rows of signed
 * bytes. Q4_1: 4 rows, row r holding group r in the low nibbles and group r + 4 in the high ones. The K-quants: per
 * super-block of QK_K inputs a header of float16 factors, then 8 blocks of their integer scales, 4 rows of nibbles
 * as Q4_1's and the quants' bits above 4 (see `pack_k_blocks`): 4.6 bits a weight for Q4_K (the file's 4.5), 5.6 for
 * Q5_K (5.5), 6.6 for Q6_K (6.6). */
#if VEC == 16 && defined(__AVX512VNNI__)
#define DOT "AVX-512 VNNI"
#elif VEC == 16 && defined(__AVX512BW__)
#define DOT "AVX-512BW"
#elif VEC == 8 && defined(__AVXVNNI__)
#define DOT "AVX-VNNI"
#elif VEC == 8 && defined(__AVX2__) && defined(__FMA__)
#define DOT "AVX2"
#else
#define DOT "plain C"
#define DOT_PLAIN 1
#endif
#if VEC == 16 && defined(__AVX512VNNI__) || VEC == 8 && defined(__AVXVNNI__)
/* The VNNI instruction reads the weights unsigned: a Q8_0 quant q goes in as q + 128 (its sign bit flipped), and
 * 128 times the block's sum of x's quants starts the sum below zero, which makes it exact again. */
#define DOT_OFFSET 1
#else
#define DOT_OFFSET 0
#endif

const char *playground_dot_products(void) { return DOT; }

/* Each row of x (n, in) per block of QK inputs: q = round(x / d) (to nearest, ties to even) with d = max |x| / 127,
 * so q is in [-127, 127] (d = 0 and q = 0 for a block of zeros); qsum the sums of q over each 16 inputs. In vectors
 * of IEEE operations that give every lane what the scalar ones give it, so the bits are the same on every build:
 * the largest |x| whatever the lanes' order (a NaN never replaces it), then (v + 1.5 * 2^23) - 1.5 * 2^23, which
 * rounds |v| < 2^22 to an integer as nearbyintf does (a NaN input counts as 0). Every thread quantises every row
 * of a product, so a scalar loop here costs a forward of several tokens dearly (the results log, 2026-12-07). */
typedef int8_t vq __attribute__((vector_size(VEC), aligned(1)));

/* The largest lane of m (none of them NaN): the same in any order. */
static inline __attribute__((always_inline)) float lanes_max(vf m) {
#if VEC == 16
    return _mm512_reduce_max_ps((__m512)m);
#elif VEC == 8 && defined(__AVX__)
    __m256 a = _mm256_max_ps((__m256)m, _mm256_permute2f128_ps((__m256)m, (__m256)m, 1));
    a = _mm256_max_ps(a, _mm256_shuffle_ps(a, a, 0x4e));
    return _mm256_cvtss_f32(_mm256_max_ps(a, _mm256_shuffle_ps(a, a, 0xb1)));
#else
    float top = m[0];
    for (int l = 1; l < VEC; l++) top = m[l] > top ? m[l] : top;
    return top;
#endif
}

/* The sum of v's lanes: exact in any order. */
static inline __attribute__((always_inline)) int32_t lanes_sum(vi v) {
#if VEC == 16
    return _mm512_reduce_add_epi32((__m512i)v);
#else
    int32_t total = 0;
    for (int l = 0; l < VEC; l++) total += v[l];
    return total;
#endif
}

/* v's lanes (each in [-127, 127]) as VEC bytes at q. */
static inline __attribute__((always_inline)) void store_bytes(int8_t *q, vi v) {
#if VEC == 8 && defined(__AVX2__)
    const __m128i pairs = _mm_packs_epi32(_mm256_castsi256_si128((__m256i)v), _mm256_extracti128_si256((__m256i)v, 1));
    _mm_storel_epi64((__m128i *)q, _mm_packs_epi16(pairs, pairs));
#else
    const vq bytes = __builtin_convertvector(v, vq);
    memcpy(q, &bytes, sizeof(bytes));
#endif
}

static void quantise_rows(const float *x, long n, long in, int8_t *q, float *d, int32_t *qsum) {
    const vi magnitude = (vi){0} + 0x7fffffff;
    const vf magic = (vf){0} + 12582912.0f;
    for (long b = 0; b < n * in / QK; b++) {
        const float *v = x + b * QK;
        vf most = (vf){0};
#pragma GCC unroll 8
        for (int k = 0; k < QK / VEC; k++) {
            const vi a = *(const vi *)(v + k * VEC) & magnitude, bigger = (vf)a > most; /* |x| > most: not a NaN */
            most = (vf)((a & bigger) | ((vi)most & ~bigger));
        }
        const float top = lanes_max(most);
        const float scale = top / 127.0f, inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        vi sums[2] = {(vi){0}, (vi){0}};
#pragma GCC unroll 8
        for (int k = 0; k < QK / VEC; k++) {
            const vf scaled = *(const vf *)(v + k * VEC) * inverse;
            const vi value = __builtin_convertvector((scaled + magic) - magic, vi) & (scaled == scaled);
            store_bytes(q + b * QK + k * VEC, value);
            sums[k * VEC / 16] += value;
        }
        d[b] = scale;
        qsum[2 * b] = lanes_sum(sums[0]);
        qsum[2 * b + 1] = lanes_sum(sums[1]);
    }
}

/* How `dot4` reads a weight's quants: signed bytes (Q8_0), unsigned nibbles (Q4_0, Q4_1, Q4_K: 16-bit pair sums stay
 * in 16 bits over a block without VNNI, see `settle`), or unsigned 5 or 6 bits (Q5_0, Q5_1, Q5_K, Q6_K: pair sums up
 * to 2 * 63 * 127, widened at once). */
#define SIGNED 0
#define NIBBLES 1
#define WIDE 2

/* acc + the dot products of 4 inputs for each of VEC outputs: w holds output l's 4 quants in lane l (unsigned
 * bytes, but for SIGNED: Q8_0's signed bytes, flipped to unsigned where DOT_OFFSET), x4 the row's 4 quants of
 * those inputs. Exact: every product and sum fits its integer. */
static inline __attribute__((always_inline)) vi dot4(vi acc, vi w, int32_t x4, int kind) {
    (void)kind;
#if VEC == 16 && defined(__AVX512VNNI__)
    return (vi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, _mm512_set1_epi32(x4));
#elif VEC == 8 && defined(__AVXVNNI__)
    return (vi)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)w, _mm256_set1_epi32(x4));
#elif VEC == 16 && defined(__AVX512BW__)
    /* pairs summed in 16 bits: nibbles at most 2 * 15 * 127, kept in 16 bits over the whole block (`settle`); the
     * others widened to 32 bits at once, Q8_0 as |w| times x with w's sign, at most 2 * 128 * 127 */
    __m512i x = _mm512_set1_epi32(x4);
    if (kind == NIBBLES) return (vi)_mm512_add_epi16((__m512i)acc, _mm512_maddubs_epi16((__m512i)w, x));
    __m512i pairs = kind == WIDE ? _mm512_maddubs_epi16((__m512i)w, x)
                  : _mm512_maddubs_epi16(_mm512_abs_epi8((__m512i)w),
                                         _mm512_mask_sub_epi8(x, _mm512_movepi8_mask((__m512i)w),
                                                              _mm512_setzero_si512(), x));
    return acc + (vi)_mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
#elif !defined(DOT_PLAIN)
    __m256i x = _mm256_set1_epi32(x4);
    if (kind == NIBBLES) return (vi)_mm256_add_epi16((__m256i)acc, _mm256_maddubs_epi16((__m256i)w, x));
    __m256i pairs = kind == WIDE ? _mm256_maddubs_epi16((__m256i)w, x)
                  : _mm256_maddubs_epi16(_mm256_abs_epi8((__m256i)w), _mm256_sign_epi8(x, (__m256i)w));
    return acc + (vi)_mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#else
    int8_t xs[4];
    memcpy(xs, &x4, 4);
    for (int l = 0; l < VEC; l++) {
        uint8_t wb[4];
        memcpy(wb, (const char *)&w + 4 * l, 4);
        for (int j = 0; j < 4; j++) acc[l] += (kind != SIGNED ? (int32_t)wb[j] : (int32_t)(int8_t)wb[j]) * xs[j];
    }
    return acc;
#endif
}

/* A block's sums as 32-bit integers, from what `dot4` accumulated over the block: on the builds without VNNI,
 * nibbles' sums stay in 16-bit pairs (at most 8 * 2 * 15 * 127 = 30480 over a block's 32 inputs: no overflow) and
 * are widened here, once a block instead of once every 4 inputs. */
static inline __attribute__((always_inline)) vi settle(vi acc, int kind) {
    (void)kind;
#if VEC == 16 && !defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (kind == NIBBLES) return (vi)_mm512_madd_epi16((__m512i)acc, _mm512_set1_epi16(1));
#elif VEC == 8 && !defined(__AVXVNNI__) && !defined(DOT_PLAIN)
    if (kind == NIBBLES) return (vi)_mm256_madd_epi16((__m256i)acc, _mm256_set1_epi16(1));
#endif
    return acc;
}

/* a * b + c rounded once on every build (the plain-C build with the C library's fmaf). */
static inline __attribute__((always_inline)) vf fma_once(vf a, vf b, vf c) {
#if VEC == 16 || (VEC == 8 && defined(__FMA__))
    return vfma(a, b, c);
#else
    for (int l = 0; l < VEC; l++) c[l] = fmaf(a[l], b[l], c[l]);
    return c;
#endif
}

/* VEC float16 values at `at`, widened exactly. */
static inline __attribute__((always_inline)) vf widen_halves(const uint8_t *at) {
#if HALF_PANELS
    return load_halves(at);
#else
    vf r;
    for (int l = 0; l < VEC; l++) {
        uint16_t h;
        memcpy(&h, at + 2 * l, 2);
        const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 31, mantissa = h & 1023;
        /* normal: rebias; subnormal: the mantissa times 2^-24, exact in float32; infinity and NaN as such */
        float value = exponent == 0 ? (float)mantissa * 0x1p-24f
                    : exponent == 31 ? (mantissa ? NAN : INFINITY)
                    : ldexpf((float)(mantissa | 1024), (int)exponent - 25);
        uint32_t bits;
        memcpy(&bits, &value, 4);
        bits |= sign;
        memcpy(&r[l], &bits, 4);
    }
    return r;
#endif
}

/* VEC bytes at `at` as floats (exactly): unsigned, or signed where `is_signed`. */
static inline __attribute__((always_inline)) vf bytes_as_floats(const uint8_t *at, int is_signed) {
    vi v;
    for (int l = 0; l < VEC; l++) v[l] = is_signed ? (int32_t)(int8_t)at[l] : (int32_t)at[l];
    return __builtin_convertvector(v, vf);
}

typedef uint32_t vu __attribute__((vector_size(VEC * 4), aligned(4)));

/* One pass of rows [0, nb) over G adjacent panels in an integer format (as `panel_rows` for the others): xq (nb, in)
 * the rows' quants, xd (nb, in / QK) their scales, xt (nb, in / 16) their sums over each 16 inputs. Per block (Q6_K:
 * per half block, its scales' span): the integer sums in registers, then folded into `total`. */
static inline __attribute__((always_inline)) void integer_rows(const int8_t *xq, const float *xd, const int32_t *xt,
                                                               long in, const void *panel,
                                                               int fmt, float *y, long out, int nb, int G, int cols,
                                                               uintptr_t fetch, uintptr_t stride, uintptr_t step) {
    const int nibbles = fmt != FMT_Q8_0_X8, rows_per_block = nibbles ? 4 : 8, halves = fmt == FMT_Q6_K_X8;
    const int kind = !nibbles ? SIGNED : five_bits(fmt) || halves ? WIDE : NIBBLES, mins = has_minimum(fmt);
    /* quants read offset by a constant (Q4_0's q - 8, Q5_0's q - 16, Q6_K's q - 32; Q8_0 flipped to unsigned
     * under VNNI: + 128): the sum is that constant times the quants' sum of x short, added back at the fold */
    const int offset = fmt == FMT_Q4_0_X8   ? 8
                     : fmt == FMT_Q5_0_X8   ? 16
                     : halves               ? 32
                     : DOT_OFFSET && !nibbles ? 128
                                              : 0;
    const long blocks = in / QK, panel_bytes = panel_bytes_of(fmt, in);
    const long quant_at = fmt == FMT_Q4_1_X8 || fmt == FMT_Q5_1_X8 ? PANEL * 4 : PANEL * 2; /* past the scales */
    const long plane_at = quant_at + QK * PANEL / 2;
    const uintptr_t span = step * (QK / rows_per_block); /* bytes each stream fetches per row of quants */
    float total[GROUP][NB][PANEL];
    for (long b = 0; b < blocks; b++) {
        for (int h = 0; h < 1 + halves; h++) { /* Q6_K: the block's first 16 inputs, then its last 16 */
            vi acc[GROUP][NB][NV];
#pragma GCC unroll 16
            for (int g = 0; g < G; g++)
#pragma GCC unroll 16
                for (int i = 0; i < nb; i++)
                    for (int j = 0; j < NV; j++) acc[g][i][j] = (vi){0};
            for (int r = 0; r < rows_per_block; r++) {
                uintptr_t at = fetch + (b * QK + r * (QK / rows_per_block)) * step;
#pragma GCC unroll 16
                for (int g = 0; g < GROUP; g++) {
                    if (g < G) {
                        if (h == 0)
                            for (uintptr_t o = 0; o < span; o += 64)
                                __builtin_prefetch((const void *)(at + g * stride + o), 0, 2);
                        const uint8_t *blk = block_at((const uint8_t *)panel + g * panel_bytes, fmt, b);
                        const uint8_t *qs = blk + quant_at + r * PANEL * 4, *plane = blk + plane_at;
                        vi w[NV], high[NV];
                        for (int j = 0; j < NV; j++) {
                            vu raw, top;
                            memcpy(&raw, qs + j * VEC * 4, sizeof(raw));
                            if (!nibbles) {
                                w[j] = (vi)(DOT_OFFSET ? raw ^ 0x80808080u : raw);
                                high[j] = w[j];
                            } else if (halves) { /* Q6_K: this half's nibbles and its top two bits, at bits 4-5 */
                                memcpy(&top, plane + h * PANEL * 4 + j * VEC * 4, sizeof(top));
                                top = r < 2 ? top << (4 - 2 * r) : top >> (2 * r - 4);
                                w[j] = (vi)(((h ? raw >> 4 : raw) & 0x0f0f0f0fu) | (top & 0x30303030u));
                                high[j] = w[j];
                            } else { /* each byte's two nibbles; Q5_K: their fifth bits at bit 4 */
                                vu low_bits = raw & 0x0f0f0f0fu, high_bits = (raw >> 4) & 0x0f0f0f0fu;
                                if (five_bits(fmt)) {
                                    memcpy(&top, plane + j * VEC * 4, sizeof(top));
                                    low_bits |= (top << (4 - r)) & 0x10101010u;
                                    high_bits |= (top >> r) & 0x10101010u;
                                }
                                w[j] = (vi)low_bits;
                                high[j] = (vi)high_bits;
                            }
                            __asm__("" : "+x"(w[j]));
                            if (nibbles && !halves) __asm__("" : "+x"(high[j]));
                        }
#pragma GCC unroll 16
                        for (int i = 0; i < NB; i++) {
                            if (i < nb) {
                                const int8_t *xb = xq + i * in + b * QK;
                                int32_t x4, x4_high = 0;
                                memcpy(&x4, xb + 4 * (r + 4 * h), 4);
                                if (nibbles && !halves) memcpy(&x4_high, xb + 4 * (r + 4), 4);
                                for (int j = 0; j < NV; j++) {
                                    acc[g][i][j] = dot4(acc[g][i][j], w[j], x4, kind);
                                    if (nibbles && !halves)
                                        acc[g][i][j] = dot4(acc[g][i][j], high[j], x4_high, kind);
                                }
                            }
                        }
                        if (G > 1) __asm__ volatile("" ::: "memory");
                    }
                }
            }
            /* the fold: Q8_0, Q4_0, Q5_0 and Q6_K y = fma(float(isum) * d, d_x, y); with a minimum
             * y = fma(fma(m, float(qsum), float(isum) * d), d_x, y); the K-quants' d = d * sc and m = -(dmin * m)
             * (exact in float32: a float16 times a 6- or 8-bit integer) */
#pragma GCC unroll 16
            for (int g = 0; g < G; g++) {
                const uint8_t *blk = block_at((const uint8_t *)panel + g * panel_bytes, fmt, b);
                const uint8_t *head = header_at((const uint8_t *)panel + g * panel_bytes, fmt, b);
                vf scale[NV], low[NV];
                for (int j = 0; j < NV; j++) {
                    if (kquant(fmt)) {
                        const vf d = widen_halves(head + j * VEC * 2);
                        scale[j] = d * bytes_as_floats(blk + h * PANEL + j * VEC, halves);
                        low[j] = halves ? (vf){0}
                                        : -widen_halves(head + PANEL * 2 + j * VEC * 2) *
                                              bytes_as_floats(blk + PANEL + j * VEC, 0);
                    } else {
                        scale[j] = widen_halves(blk + j * VEC * 2);
                        low[j] = mins ? widen_halves(blk + PANEL * 2 + j * VEC * 2) : (vf){0};
                    }
                }
#pragma GCC unroll 16
                for (int i = 0; i < nb; i++) {
                    const vf x_scale = splat(xd[i * blocks + b]);
                    const int32_t *sums = xt + i * 2 * blocks + 2 * b, quants = halves ? sums[h] : sums[0] + sums[1];
                    const vf quant_sum = mins ? splat((float)quants) : (vf){0};
                    for (int j = 0; j < NV; j++) {
                        vf *t = (vf *)&total[g][i][j * VEC];
                        const vi isum = settle(acc[g][i][j], kind) - offset * quants;
                        vf block = __builtin_convertvector(isum, vf) * scale[j];
                        if (mins) block = fma_once(low[j], quant_sum, block);
                        *t = fma_once(block, x_scale, b == 0 && h == 0 ? (vf){0} : *t);
                    }
                }
            }
        }
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; g++) {
        float *yg = y + g * PANEL;
        const int width = g < G - 1 ? PANEL : cols;
#pragma GCC unroll 16
        for (int i = 0; i < nb; i++) memcpy(yg + i * out, total[g][i], (size_t)width * sizeof(float));
    }
}

#define INTEGER_CASE(k) \
    case k: integer_rows(xq, xd, xt, in, panel, fmt, y, out, k, 1, cols, fetch, stride, step); break;

/* One pass of nb rows over G panels of integer format fmt (a constant at each call): G as `rows_in` takes it. */
static inline __attribute__((always_inline)) void integer_in(const int8_t *xq, const float *xd, const int32_t *xt,
                                                             long in, const void *panel, int fmt,
                                                             float *y, long out, int nb, int G, int cols,
                                                             uintptr_t fetch, uintptr_t stride, uintptr_t step) {
    if (G == GROUP && nb == 1) {
        integer_rows(xq, xd, xt, in, panel, fmt, y, out, 1, GROUP, cols, fetch, stride, step);
    } else if (G == 2 && nb == 2) {
        integer_rows(xq, xd, xt, in, panel, fmt, y, out, 2, 2, cols, fetch, stride, step);
    } else if (G == 2) {
        integer_rows(xq, xd, xt, in, panel, fmt, y, out, 3, 2, cols, fetch, stride, step);
    } else {
        switch (nb) {
            INTEGER_CASE(1) INTEGER_CASE(2) INTEGER_CASE(3) INTEGER_CASE(4) INTEGER_CASE(5)
#if NB > 6
            INTEGER_CASE(6) INTEGER_CASE(7) INTEGER_CASE(8) INTEGER_CASE(9) INTEGER_CASE(10) INTEGER_CASE(11)
#endif
            default: integer_rows(xq, xd, xt, in, panel, fmt, y, out, NB, 1, cols, fetch, stride, step); break;
        }
    }
}

static void integer_pass(const int8_t *xq, const float *xd, const int32_t *xt, long in, const void *panel, int fmt,
                         float *y, long out, int nb, int G, int cols, uintptr_t fetch, uintptr_t stride,
                         uintptr_t step) {
    switch (fmt) {
    case FMT_Q4_1_X8: integer_in(xq, xd, xt, in, panel, FMT_Q4_1_X8, y, out, nb, G, cols, fetch, stride, step); break;
    case FMT_Q4_K_X8: integer_in(xq, xd, xt, in, panel, FMT_Q4_K_X8, y, out, nb, G, cols, fetch, stride, step); break;
    case FMT_Q5_K_X8: integer_in(xq, xd, xt, in, panel, FMT_Q5_K_X8, y, out, nb, G, cols, fetch, stride, step); break;
    case FMT_Q6_K_X8: integer_in(xq, xd, xt, in, panel, FMT_Q6_K_X8, y, out, nb, G, cols, fetch, stride, step); break;
    case FMT_Q4_0_X8: integer_in(xq, xd, xt, in, panel, FMT_Q4_0_X8, y, out, nb, G, cols, fetch, stride, step); break;
    case FMT_Q5_0_X8: integer_in(xq, xd, xt, in, panel, FMT_Q5_0_X8, y, out, nb, G, cols, fetch, stride, step); break;
    case FMT_Q5_1_X8: integer_in(xq, xd, xt, in, panel, FMT_Q5_1_X8, y, out, nb, G, cols, fetch, stride, step); break;
    default: integer_in(xq, xd, xt, in, panel, FMT_Q8_0_X8, y, out, nb, G, cols, fetch, stride, step); break;
    }
}

/* x (n, in) as the products that read it need it, each thread its own copy: FMT_Q4_1's block sums of every row
 * (`block_sums`), or the integer formats' quants, scales and sums over each 16 inputs (`quantise_rows`); NULL where
 * no product reads them. */
struct prepared {
    float *sums, *xd;
    int8_t *xq;
    int32_t *xt;
};

static struct prepared prepare(const float *x, int n, int in, int sums, int quants) {
    const long blocks = in / QK;
    struct prepared p = {NULL, NULL, NULL, NULL};
    if (sums) {
        p.sums = malloc((size_t)n * blocks * sizeof(float));
        if (p.sums == NULL) abort(); /* a few hundred kilobytes at most: the process is out of memory */
        block_sums(x, n, in, p.sums);
    }
    if (quants) {
        p.xq = malloc((size_t)n * in);
        p.xd = malloc((size_t)n * blocks * sizeof(float));
        p.xt = malloc((size_t)n * blocks * 2 * sizeof(int32_t));
        if (p.xq == NULL || p.xd == NULL || p.xt == NULL) abort();
        quantise_rows(x, n, in, p.xq, p.xd, p.xt);
    }
    return p;
}

static void release(struct prepared *p) {
    free(p->sums);
    free(p->xq);
    free(p->xd);
    free(p->xt);
}

/* Thread t of nt's share of y = x @ W^T, inside a parallel region: x (n, in) row-major and contiguous (`pre` its
 * prepared forms), y (n, out) rows ldy floats apart; packed (ceil(out / PANEL), in, PANEL). Each thread takes a contiguous run of panels, so it
 * streams its own part of the weights once, a group of G panels at a time, with every pass of rows over the group
 * before the next group (see `plan`). */
static void gemm_part(const float *x, const struct prepared *pre, int n, int in, const void *packed, int fmt, int out,
                      float *y, long ldy, int t, int nt) {
    const float *sums = pre->sums, *xd = pre->xd;
    const int8_t *xq = pre->xq;
    const int32_t *xt = pre->xt;
    const long blocks = in / QK;
    long panels = (out + PANEL - 1) / PANEL;
    uintptr_t panel_bytes = panel_bytes_of(fmt, in), row_bytes = panel_bytes / in; /* per input, on average */
    int chunk, G;
    plan(n, fmt, &chunk, &G);
    int passes = (n + chunk - 1) / chunk; /* per group */
    /* One pass reads each panel from memory: every stream runs ahead in its own panel. Several passes read the
     * group again from the cache: each pass prefetches its share of the next group instead, split among its
     * streams, so that memory keeps streaming while they compute (without this, 7-12 rows cost 1.1-1.25x more). */
    uintptr_t share = G * panel_bytes / passes;
    uintptr_t stride = passes == 1 ? panel_bytes : share / G;
    uintptr_t step = passes == 1 ? row_bytes : (stride + in - 1) / in;
    long begin, end;
    row_share(panels, t, nt, &begin, &end);
    for (long p0 = begin; p0 < end; p0 += G) {
        long count = end - p0 < G ? end - p0 : G;
        const char *group = (const char *)packed + p0 * panel_bytes;
        int cols = out - (p0 + count - 1) * PANEL < PANEL ? (int)(out - (p0 + count - 1) * PANEL) : PANEL;
        uintptr_t next = (uintptr_t)group + G * panel_bytes;
        for (int i0 = 0, pass = 0; i0 < n; i0 += chunk, pass++) {
            int nb = n - i0 < chunk ? n - i0 : chunk;
            const float *xr = x + (long)i0 * in, *sr = sums ? sums + (long)i0 * blocks : NULL;
            float *yr = y + (long)i0 * ldy + p0 * PANEL;
            uintptr_t fetch = passes == 1 ? (uintptr_t)group + PREFETCH * row_bytes : next + pass * share;
            if (integer(fmt)) {
                const int8_t *qr = xq + (long)i0 * in;
                const float *dr = xd + (long)i0 * blocks;
                const int32_t *tr = xt + (long)i0 * blocks * 2;
                if (count == G) {
                    integer_pass(qr, dr, tr, in, group, fmt, yr, ldy, nb, G, cols, fetch, stride, step);
                } else {
                    for (long g = 0; g < count; g++)
                        integer_pass(qr, dr, tr, in, group + g * panel_bytes, fmt, yr + g * PANEL, ldy, nb, 1,
                                     g == count - 1 ? cols : PANEL, fetch + g * stride, stride, step);
                }
            } else if (count == G) {
                rows(xr, sr, in, group, fmt, yr, ldy, nb, G, cols, fetch, stride, step);
            } else { /* a thread's last panels, fewer than a group */
                for (long g = 0; g < count; g++)
                    rows(xr, sr, in, group + g * panel_bytes, fmt, yr + g * PANEL, ldy, nb, 1,
                         g == count - 1 ? cols : PANEL, fetch + g * stride, stride, step);
            }
        }
    }
}

/* A product whose output rows come in parts stored in different formats (a GGUF file's q, k and v, or gate and up,
 * each in its own): each part its own panels in its own format, writing its own columns of y. */
#define MAX_PARTS 4
struct parts {
    int32_t count;
    int32_t formats[MAX_PARTS];
    int32_t outs[MAX_PARTS];
    const void *data[MAX_PARTS];
};

/* Thread t of nt's share of y = x @ W^T, inside a parallel region: x (n, in) and y (n, out) row-major and
 * contiguous; packed in format fmt (`gemm_part`), or for FMT_PARTS a `struct parts`. */
static void gemm_share(const float *x, int n, int in, const void *packed, int fmt, int out, float *y, int t,
                       int nt) {
    if (n <= 0) return;
    const struct parts whole = {1, {fmt}, {out}, {packed}}, *p = fmt == FMT_PARTS ? packed : &whole;
    int sums = 0, quants = 0; /* x prepared once for every part */
    for (int i = 0; i < p->count; i++) {
        sums |= p->formats[i] == FMT_Q4_1;
        quants |= integer(p->formats[i]);
    }
    struct prepared pre = prepare(x, n, in, sums, quants);
    for (int i = 0, column = 0; i < p->count; column += p->outs[i], i++)
        gemm_part(x, &pre, n, in, p->data[i], p->formats[i], p->outs[i], y + column, out, t, nt);
    release(&pre);
}

void playground_gemm(const float *x, int n, int in, const void *packed, int fmt, int out, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    gemm_share(x, n, in, packed, fmt, out, y, omp_get_thread_num(), omp_get_num_threads());
}

/* ---- RMSNorm ----
 * y (n, d) = x * (1 / sqrt(mean(x^2) + eps)) * w, row by row (d a multiple of VEC). A row's sum of squares runs in
 * a fixed order over its own values (one accumulator per lane, then the lanes in order), so a token's result does
 * not depend on the other rows. Why here: PyTorch's CPU rms_norm is a chain of small kernels (pow, mean, add,
 * rsqrt, two products), about 30 us a call inside a forward, 61 calls per SmolLM2 forward. */
static void rms_norm_rows(const float *x, const float *w, float *y, long first, long end, int d, float eps) {
    for (long i = first; i < end; i++) {
        const float *xr = x + i * d;
        float *yr = y + i * d;
        vf acc = {0};
        for (int k = 0; k < d; k += VEC) {
            vf v = *(const vf *)(xr + k);
            acc = vfma(v, v, acc);
        }
        float sum = 0.0f;
        for (int l = 0; l < VEC; l++) sum += acc[l];
        float r = 1.0f / sqrtf(sum / (float)d + eps);
        for (int k = 0; k < d; k += VEC) *(vf *)(yr + k) = *(const vf *)(xr + k) * r * *(const vf *)(w + k);
    }
}

void playground_rms_norm(const float *x, const float *w, float *y, int n, int d, float eps) {
    rms_norm_rows(x, w, y, 0, n, d, eps);
}

/* ---- Attention ----
 * Every sum a query's result is made of runs over the keys it sees in key order (a key's dot product over its own
 * lanes, the softmax normaliser and the weighted values over the visible keys' ranks), so the result depends on the
 * query and its visible keys alone: a token gives the same bits in a one-token decode step, in a verifying forward
 * beside other tokens, at any position of a tree with hidden keys between its ancestors, and in any batch. */
#define KEY_BLOCK 32 /* keys per block: a block of K or V stays in L1 while every row of a task reads it */
#define ROW_CHUNK 8  /* query rows per task */
#define MAX_ND 16    /* head_dim up to 16 vectors */

/* The sum of each of four vectors' lanes, each in a fixed order that involves only its own lanes. */
static inline __attribute__((always_inline)) void lane_sums4(vf a0, vf a1, vf a2, vf a3, float *out) {
#if VEC == 16
    vf b01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
           + __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf b23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
           + __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf c = __builtin_shufflevector(b01, b23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
         + __builtin_shufflevector(b01, b23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    vf e = c + __builtin_shufflevector(c, c, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    e = e + __builtin_shufflevector(e, e, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    out[0] = e[0]; out[1] = e[4]; out[2] = e[8]; out[3] = e[12];
#elif VEC == 8
    /* the same tree on half the lanes; summing each vector's lanes one by one took twice as long on a Zen 3 core */
    vf b01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11)
           + __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
    vf b23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11)
           + __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
    vf c = __builtin_shufflevector(b01, b23, 0, 1, 4, 5, 8, 9, 12, 13)
         + __builtin_shufflevector(b01, b23, 2, 3, 6, 7, 10, 11, 14, 15);
    vf e = c + __builtin_shufflevector(c, c, 1, 0, 3, 2, 5, 4, 7, 6);
    out[0] = e[0]; out[1] = e[2]; out[2] = e[4]; out[3] = e[6];
#else
    vf a[4] = {a0, a1, a2, a3};
    for (int u = 0; u < 4; u++) {
        float s = 0.0f;
        for (int l = 0; l < VEC; l++) s += a[u][l];
        out[u] = s;
    }
#endif
}

/* Lane by lane: a where mask is all ones, b where it is zero. */
static inline vf vselect(vi mask, vf a, vf b) {
    vi ab, bb;
    memcpy(&ab, &a, sizeof(ab));
    memcpy(&bb, &b, sizeof(bb));
    ab = (ab & mask) | (bb & ~mask);
    memcpy(&a, &ab, sizeof(a));
    return a;
}

/* exp(x) lane by lane (Cephes' single-precision polynomial, about 1 ulp); 0 below -87 and for -inf or NaN. Lanes
 * below -87 are computed at -87 and then zeroed, so no lane converts an out-of-range float to an integer. */
static inline vf vexp(vf x) {
    vf xc = vselect(x < -87.0f, (vf){0} - 87.0f, x);
    const vf round = (vf){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = vfma(xc, splat(1.44269504088896341f), round) - round;
    vf r = vfma(n, splat(-0.693359375f), xc);
    r = vfma(n, splat(2.12194440e-4f), r);
    vf p = splat(1.9875691500e-4f);
    p = vfma(p, r, splat(1.3981999507e-3f));
    p = vfma(p, r, splat(8.3334519073e-3f));
    p = vfma(p, r, splat(4.1665795894e-2f));
    p = vfma(p, r, splat(1.6666665459e-1f));
    p = vfma(p, r, splat(5.0000001201e-1f));
    p = vfma(p * r, r, r) + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23; /* 2^n */
    vf two_n;
    memcpy(&two_n, &bits, sizeof(two_n));
    return vselect(x >= -87.0f, p * two_n, (vf){0}); /* kept where not below -87 and not NaN */
}

/* Lane u of the result: the sum of a[u]'s lanes, in the same tree as `lane_sums4` (lane l + lane l + VEC / 2, then
 * half that apart, ..., then neighbours), so a key's score has the same bits as before this was vectorised. One
 * score per lane instead of one per vector: the pairs of every level are gathered across the VEC vectors by
 * two-source shuffles, VEC - 1 additions in all, where summing four vectors at a time and reading their sums out
 * lane by lane had cost about 12 cycles per key and query row on an AVX-512 Xeon, most of the attention's time. */
static inline __attribute__((always_inline)) vf key_sums(const vf *a) {
#if VEC == 16
    vf b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#elif VEC == 8
    vf b[4], c[2];
    for (int i = 0; i < 4; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11)
             + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13)
             + __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14)
         + __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
    float sums[4];
    lane_sums4(a[0], a[1], a[2], a[3], sums);
    return (vf){sums[0], sums[1], sums[2], sums[3]};
#endif
}

/* Scaled scores of rows [0, rows) against keys [0, limit[row]): s (rows, stride), stride >= keys + VEC - 1. Each
 * key's dot product with q (nd vectors) is summed lane by lane over q's vectors in order and then over its lanes
 * (see `key_sums`), VEC keys at a time, every row of the task against one group of keys before the next (the
 * keys' addresses are worked out once for the rows that see the whole block). A row's last group repeats its last
 * key where fewer are left and writes scores past the row's end that nothing reads. Every key's score takes the
 * same FMAs in the same order and the same lane tree, whether its group reads the keys in place or through
 * pointers, so a score never depends on the key's position. On the AVX-512 Xeon of Benchmark run 12 this took
 * 7.0 cycles per key and query row against 10.0 for four keys at a time summed by `lane_sums4` (8 rows, 600 keys
 * in L2), the same bits. */
static inline __attribute__((always_inline)) void scores_nd(const float *q, int rows, const float *k,
                                                            long key_stride, int keys, const int *limit, float scale,
                                                            long stride, float *s, const int nd) {
    const int d = nd * VEC;
    /* Keys one after another (the layer stack's cache, a contiguous K): a whole group's keys lie at constant
     * offsets from its first, which the FMAs read in place. Through 16 pointers, most of them spilled to the stack
     * and reloaded before each FMA, a score had cost about 12 cycles per key and query row in an 11-token forward
     * at 250 keys (perf samples, AVX-512 Xeon), in place about 9.6. */
    const int packed = key_stride == d;
    for (int jb = 0; jb < keys; jb += KEY_BLOCK) {
        int block_end = jb + KEY_BLOCK < keys ? jb + KEY_BLOCK : keys;
        for (int j = jb; j < block_end; j += VEC) {
            const vf *whole[VEC], *cut[VEC]; /* the group's keys up to the block's end, or up to a row's own end */
            for (int u = 0; u < VEC; u++)
                whole[u] = (const vf *)(k + (j + u < block_end ? j + u : block_end - 1) * key_stride);
            for (int r = 0; r < rows; r++) {
                int end = block_end < limit[r] ? block_end : limit[r];
                if (j >= end) continue;
                const vf *qr = (const vf *)(q + (long)r * d);
                vf acc[VEC];
                for (int u = 0; u < VEC; u++) acc[u] = (vf){0};
                if (packed && j + VEC <= end) {
                    const float *kj = k + j * key_stride;
#pragma GCC unroll 16
                    for (int c = 0; c < nd; c++) {
                        vf qc = qr[c];
#pragma GCC unroll 16
                        for (int u = 0; u < VEC; u++) acc[u] = vfma(qc, ((const vf *)(kj + (long)u * d))[c], acc[u]);
                    }
                } else {
                    const vf **kk = whole;
                    if (end != block_end) {
                        for (int u = 0; u < VEC; u++)
                            cut[u] = (const vf *)(k + (j + u < end ? j + u : end - 1) * key_stride);
                        kk = cut;
                    }
                    for (int c = 0; c < nd; c++) {
                        vf qc = qr[c];
#pragma GCC unroll 16
                        for (int u = 0; u < VEC; u++) acc[u] = vfma(qc, kk[u][c], acc[u]);
                    }
                }
                *(vf *)(s + (long)r * stride + j) = key_sums(acc) * scale;
            }
        }
    }
}

static void attention_scores(const float *q, int rows, int d, const float *k, long key_stride, int keys,
                             const int *limit, float scale, long stride, float *s) {
    switch (d / VEC) { /* the common head sizes with nd a constant: 64 and 128 with AVX-512 */
        case 4: scores_nd(q, rows, k, key_stride, keys, limit, scale, stride, s, 4); break;
        case 8: scores_nd(q, rows, k, key_stride, keys, limit, scale, stride, s, 8); break;
        default: scores_nd(q, rows, k, key_stride, keys, limit, scale, stride, s, d / VEC); break;
    }
}

/* Softmax weights of one row over the keys it sees, in key order, in place: s[0..n) become the weights of keys
 * idx[0..n) (compacted: n <= j, so no score is overwritten before it is read), summing to 1 after the scale `*inv`.
 * Every sum runs over the visible keys' order alone, so a token's row gives the same bits whatever else shares its
 * forward and wherever hidden keys sit among the visible ones. Returns n; *prefix: how many keys come before the
 * first hidden one (their ranks are their indices). */
static int softmax_row(float *s, const uint8_t *visible, int limit, int *idx, float *inv, int *prefix) {
    /* Keys [0, run) are all visible (the prefix, usually most of them): already in place, no test per key. */
    const uint8_t *hidden = visible ? memchr(visible, 0, (size_t)limit) : NULL;
    int run = hidden ? (int)(hidden - visible) : limit;
    *prefix = run;
    vf tops = (vf){0} - INFINITY;
    int n = 0;
    for (; n + VEC <= run; n += VEC) {
        vf x = *(const vf *)(s + n);
        tops = vselect(x > tops, x, tops);
    }
    float top = lanes_max(tops); /* no lane is NaN: a NaN score never replaced one */
    for (; n < run; n++) top = s[n] > top ? s[n] : top;
    for (int i = 0; i < run; i++) idx[i] = i;
    for (int j = run; j < limit; j++) {
        int seen = visible[j] != 0;
        idx[n] = j;
        s[n] = s[j];
        top = seen && s[j] > top ? s[j] : top;
        n += seen;
    }
    int padded = (n + VEC - 1) / VEC * VEC;
    for (int i = n; i < padded; i++) s[i] = -INFINITY;
    vf total = {0};
    for (int i = 0; i < padded; i += VEC) {
        vf e = vexp(*(vf *)(s + i) - top);
        *(vf *)(s + i) = e;
        total += e;
    }
    float sums[4];
    lane_sums4(total, total, total, total, sums);
    *inv = 1.0f / sums[0];
    return n;
}

/* Row r's visible keys in [.., block_end), from its next one on, into two accumulators taking alternate visible
 * keys; nd is a constant at every call site (see `attention_values`), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) int values_block(const float *v, long key_stride, const float *w,
                                                              const int *idx, int i, int n, int block_end,
                                                              vf *even_acc, vf *odd_acc, const int nd) {
    vf even[MAX_ND], odd[MAX_ND];
    for (int c = 0; c < nd; c++) {
        even[c] = even_acc[c];
        odd[c] = odd_acc[c];
    }
    if (i < n && (i & 1) && idx[i] < block_end) {
        const vf *vj = (const vf *)(v + idx[i] * key_stride);
        vf wi = splat(w[i]);
        for (int c = 0; c < nd; c++) odd[c] = vfma(wi, vj[c], odd[c]);
        i++;
    }
    for (; i + 1 < n && idx[i + 1] < block_end; i += 2) {
        const vf *v0 = (const vf *)(v + idx[i] * key_stride), *v1 = (const vf *)(v + idx[i + 1] * key_stride);
        vf w0 = splat(w[i]), w1 = splat(w[i + 1]);
        for (int c = 0; c < nd; c++) {
            even[c] = vfma(w0, v0[c], even[c]);
            odd[c] = vfma(w1, v1[c], odd[c]);
        }
    }
    if (i < n && idx[i] < block_end) {
        const vf *vj = (const vf *)(v + idx[i] * key_stride);
        vf wi = splat(w[i]);
        for (int c = 0; c < nd; c++) even[c] = vfma(wi, vj[c], even[c]);
        i++;
    }
    for (int c = 0; c < nd; c++) {
        even_acc[c] = even[c];
        odd_acc[c] = odd[c];
    }
    return i;
}

/* Rows a and b's ranks [i, end), keys whose rank is their index (both rows see every key before them): each V row
 * loaded once for both, each row's two accumulators taking alternate ranks as in `values_block`, so the sums are
 * the same. Where registers allow (see `attention_values`): on the AVX-512 Xeon of Benchmark run 12 one row at a
 * time had cost 6 cycles per key and query row. */
static inline __attribute__((always_inline)) int values_pair(const float *v, long key_stride, const float *wa,
                                                             const float *wb, int i, int end, vf *acc_a, vf *acc_b,
                                                             const int nd) {
    vf even_a[MAX_ND], odd_a[MAX_ND], even_b[MAX_ND], odd_b[MAX_ND];
    for (int c = 0; c < nd; c++) {
        even_a[c] = acc_a[c];
        odd_a[c] = acc_a[MAX_ND + c];
        even_b[c] = acc_b[c];
        odd_b[c] = acc_b[MAX_ND + c];
    }
    if (i < end && (i & 1)) {
        const vf *vj = (const vf *)(v + i * key_stride);
        vf xa = splat(wa[i]), xb = splat(wb[i]);
        for (int c = 0; c < nd; c++) {
            odd_a[c] = vfma(xa, vj[c], odd_a[c]);
            odd_b[c] = vfma(xb, vj[c], odd_b[c]);
        }
        i++;
    }
    for (; i + 1 < end; i += 2) {
        const vf *v0 = (const vf *)(v + i * key_stride), *v1 = (const vf *)(v + (i + 1) * key_stride);
        vf a0 = splat(wa[i]), a1 = splat(wa[i + 1]), b0 = splat(wb[i]), b1 = splat(wb[i + 1]);
        for (int c = 0; c < nd; c++) {
            vf x0 = v0[c], x1 = v1[c];
            even_a[c] = vfma(a0, x0, even_a[c]);
            odd_a[c] = vfma(a1, x1, odd_a[c]);
            even_b[c] = vfma(b0, x0, even_b[c]);
            odd_b[c] = vfma(b1, x1, odd_b[c]);
        }
    }
    if (i < end) {
        const vf *vj = (const vf *)(v + i * key_stride);
        vf xa = splat(wa[i]), xb = splat(wb[i]);
        for (int c = 0; c < nd; c++) {
            even_a[c] = vfma(xa, vj[c], even_a[c]);
            even_b[c] = vfma(xb, vj[c], even_b[c]);
        }
        i++;
    }
    for (int c = 0; c < nd; c++) {
        acc_a[c] = even_a[c];
        acc_a[MAX_ND + c] = odd_a[c];
        acc_b[c] = even_b[c];
        acc_b[MAX_ND + c] = odd_b[c];
    }
    return i;
}

/* out[r] = sum over row r's visible keys of w * V, blocked over keys so that a block of V serves every row from
 * L1. Each accumulator adds its keys in key order, so the sum depends on the visible keys alone. */
static void attention_values(int rows, int d, const float *v, long key_stride, int keys, const float *w,
                             const int *idx, const int *count, const int *prefix, const float *inv, long stride,
                             float *out) {
    const int nd = d / VEC;
    /* Two rows at a time hold four accumulators of nd vectors and two V rows in registers: 6 nd + 4 of the 32
     * AVX-512 registers (nd 4: head size 64); with fewer registers they would spill, and each row goes alone. */
    const int pairs = VEC == 16 && nd <= 4;
    vf acc[ROW_CHUNK][2 * MAX_ND];
    int next[ROW_CHUNK];
    for (int r = 0; r < rows; r++) {
        next[r] = 0;
        for (int c = 0; c < 2 * MAX_ND; c++) acc[r][c] = (vf){0};
    }
    for (int jb = 0; jb < keys; jb += KEY_BLOCK) {
        int block_end = jb + KEY_BLOCK;
        for (int r = 0; pairs && r + 1 < rows; r += 2) {
            /* the ranks both rows reach in this block that are their keys' indices */
            int shared = prefix[r] < prefix[r + 1] ? prefix[r] : prefix[r + 1];
            int end = shared < block_end ? shared : block_end;
            if (next[r] != next[r + 1] || next[r] >= end) continue;
            const float *wa = w + (long)r * stride, *wb = w + (long)(r + 1) * stride;
#define PAIR_CASE(k) \
    case k: next[r] = next[r + 1] = values_pair(v, key_stride, wa, wb, next[r], end, acc[r], acc[r + 1], k); break;
            switch (nd) {
                PAIR_CASE(1) PAIR_CASE(2) PAIR_CASE(3) PAIR_CASE(4)
            }
        }
        for (int r = 0; r < rows; r++) {
            const float *wr = w + (long)r * stride;
            const int *ir = idx + (long)r * stride;
#define VALUES_CASE(k) \
    case k: \
        next[r] = values_block(v, key_stride, wr, ir, next[r], count[r], block_end, acc[r], acc[r] + MAX_ND, k); \
        break;
            switch (nd) {
                VALUES_CASE(4) VALUES_CASE(8)
                default: next[r] = values_block(v, key_stride, wr, ir, next[r], count[r], block_end, acc[r],
                                                acc[r] + MAX_ND, nd); break;
            }
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < nd; c++)
            ((vf *)(out + (long)r * d))[c] = (acc[r][c] + acc[r][MAX_ND + c]) * inv[r];
}

/* Per-row scratch length of the attention over `keys` keys: padded to whole vectors. */
static inline long score_stride(int keys) { return keys + VEC; }

/* A thread's scratch for attention_share, ROW_CHUNK rows of score_stride(keys) each: s, the scores and then the
 * softmax weights in place, and idx, the visible keys' indices. The caller frees both. */
static void attention_scratch(int keys, float **s, int **idx) {
    *s = malloc(sizeof(float) * ROW_CHUNK * score_stride(keys));
    *idx = malloc(sizeof(int) * ROW_CHUNK * score_stride(keys));
}

/* Thread t of nt's share of the attention, inside a parallel region; s and idx: the thread's own scratch
 * (`attention_scratch`). */
static void attention_share(const float *q, const float *k, const float *v, const uint8_t *visible, float *out,
                            int batch, int kv_heads, int rows, int new_tokens, int keys, int d, long batch_stride,
                            long head_stride, long key_stride, float scale, int t, int nt, float *s, int *idx) {
    long total = (long)batch * kv_heads * rows; /* query rows of every (batch, kv head), one after another */
    long stride = score_stride(keys);
    const uint8_t *seen[ROW_CHUNK];
    int limit[ROW_CHUNK], count[ROW_CHUNK], prefix[ROW_CHUNK];
    float inv[ROW_CHUNK];
    /* Each thread takes an equal share of the rows, in chunks of up to ROW_CHUNK within one (batch, kv head).
     * Chunks per head, dealt out whole, left one thread with 34 of 54 rows in a 6-token forward of 3 KV heads
     * (chunks 8, 8, 2 per head): the other waited. A row's result does not depend on its chunk. */
    long first, end;
    row_share(total, t, nt, &first, &end);
    for (long at = first; at < end;) {
        long bh = at / rows, r0 = at % rows, b = bh / kv_heads, h = bh % kv_heads;
        long left = (rows - r0 < end - at ? rows - r0 : end - at);
        int n = left < ROW_CHUNK ? (int)left : ROW_CHUNK;
        const float *kh = k + b * batch_stride + h * head_stride, *vh = v + b * batch_stride + h * head_stride;
        const float *qt = q + (bh * rows + r0) * d;
        for (int r = 0; r < n; r++) {
            seen[r] = visible ? visible + (b * new_tokens + (r0 + r) % new_tokens) * keys : NULL;
            int last = keys;
            if (seen[r])
                while (last > 0 && !seen[r][last - 1]) last--;
            limit[r] = last;
        }
        attention_scores(qt, n, d, kh, key_stride, keys, limit, scale, stride, s);
        for (int r = 0; r < n; r++)
            count[r] = softmax_row(s + r * stride, seen[r], limit[r], idx + r * stride, &inv[r], &prefix[r]);
        attention_values(n, d, vh, key_stride, keys, s, idx, count, prefix, inv, stride, out + (bh * rows + r0) * d);
        at += n;
    }
}

/* Attention of the new tokens' queries over the cached keys, for the CPU forward in float32.
 *
 * q, out (batch, kv_heads, rows, d) contiguous, rows = group * new_tokens, row r belonging to new token
 * r % new_tokens; key/value element (b, h, j, c) at b * batch_stride + h * head_stride + j * key_stride + c;
 * visible (batch, new_tokens, keys) bytes, nonzero where a token sees a key, or NULL: every key. d a multiple of
 * the vector width, at most MAX_ND vectors.
 *
 * Why not PyTorch's kernel: its result for a query depends on how many queries share the call and where hidden keys
 * sit, so a token's logits in a verifying forward differed from its plain decode step's in the last bits (4e-5),
 * and greedy exactness held only where no two tokens came that close. Here a query's result depends on its own
 * visible keys alone, and the few queries of a decode or verify step cost less. */
void playground_attention(const float *q, const float *k, const float *v, const uint8_t *visible, float *out,
                          int batch, int kv_heads, int rows, int new_tokens, int keys, int d, long batch_stride,
                          long head_stride, long key_stride, float scale, int threads) {
#pragma omp parallel num_threads(threads)
    {
        float *s;
        int *idx;
        attention_scratch(keys, &s, &idx);
        attention_share(q, k, v, visible, out, batch, kv_heads, rows, new_tokens, keys, d, batch_stride, head_stride,
                        key_stride, scale, omp_get_thread_num(), omp_get_num_threads(), s, idx);
        free(s);
        free(idx);
    }
}

/* ---- Row maxima ----
 * Greedy decoding reads each logits row's argmax, and the trace the probability of the tokens it shows: on a 2-core
 * CPU torch.argmax took ~240 us over the 5 rows of a lookahead step's 49,152-token vocabulary, this ~40 us. */

/* For each row of x (rows, cols), rows `stride` floats apart: argmax, the index of the largest value (the first of
 * equal ones; the first NaN where there is one, as torch.argmax), top, that value, and unless total is NULL, the
 * sum over the row of exp(x - top) (0 for a row of -inf; NaN with a NaN). The sum's pass of exponentials costs
 * four to five times the argmax's pass: a step asks for it on the rows whose probabilities it shows. */
void playground_row_top(const float *x, int rows, int cols, long stride, int32_t *argmax, float *top, float *total,
                        int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + r * stride;
        int full = cols / (2 * VEC) * (2 * VEC);
        /* Two interleaved vectors per step, each lane keeping its largest value (strictly greater: its first one)
         * and the step it came from; two chains of compare and blend instead of one wait half as long. */
        vf best[2] = {(vf){0} - INFINITY, (vf){0} - INFINITY}, from[2] = {{0}, {0}}, step = {0};
        vi nan = {0};
        for (int c = 0; c < full; c += 2 * VEC, step += 1.0f) {
            for (int u = 0; u < 2; u++) {
                vf v = *(const vf *)(xr + c + u * VEC);
                vi greater = v > best[u];
                best[u] = vselect(greater, v, best[u]);
                from[u] = vselect(greater, step, from[u]);
                nan |= v != v;
            }
        }
        float m = -INFINITY;
        long at = -1;
        for (int u = 0; u < 2 && full; u++)
            for (int l = 0; l < VEC; l++) {
                long index = (long)from[u][l] * 2 * VEC + u * VEC + l;
                if (at < 0 || best[u][l] > m || (best[u][l] == m && index < at)) {
                    m = best[u][l];
                    at = index;
                }
            }
        int any_nan = 0;
        for (int l = 0; l < VEC; l++) any_nan |= nan[l] != 0;
        for (int c = full; c < cols; c++) {
            any_nan |= xr[c] != xr[c];
            if (at < 0 || xr[c] > m) {
                m = xr[c];
                at = c;
            }
        }
        if (any_nan) {
            at = 0;
            while (xr[at] == xr[at]) at++;
            argmax[r] = (int32_t)at;
            top[r] = NAN;
            if (total) total[r] = NAN;
            continue;
        }
        argmax[r] = (int32_t)at;
        top[r] = m;
        if (!total) continue;
        if (m == -INFINITY) {
            total[r] = 0.0f;
            continue;
        }
        vf sums[2] = {{0}, {0}};
        for (int c = 0; c < full; c += 2 * VEC)
            for (int u = 0; u < 2; u++) sums[u] += vexp(*(const vf *)(xr + c + u * VEC) - m);
        float sum = 0.0f;
        for (int l = 0; l < VEC; l++) sum += sums[0][l] + sums[1][l];
        for (int c = full; c < cols; c++) sum += expf(xr[c] - m);
        total[r] = sum;
    }
}

/* ---- Decoder layer halves ----
 * Each half of a Llama decoder layer in one call instead of a dozen PyTorch ops: on a 2-core CPU the Python and
 * dispatch time between the kernels above was a fifth to a third of a one-token forward. Everything around the
 * matrix products is elementwise or row by row, so a token's result still depends on its own row alone. The
 * halves run inside one parallel region (`*_share`): each thread takes its share of the products and of the
 * token rows, with barriers where a step needs every row of the step before. Run by one thread, the row-wise
 * steps (norms, RoPE, SiLU, residual adds, cache writes) of an 11-token forward had cost about 1.5 ms of its 30
 * (0.5 for one token) while the other thread waited. */

/* y (count,) = x + y, as PyTorch's add rounds it. */
static void add_rows(const float *x, float *y, long count) {
    for (long i = 0; i < count; i++) y[i] = x[i] + y[i];
}

/* RoPE in place on heads [0, heads) of rows [first, end) of qkv (n, stride): h * cos + roll(h, D/2) * sin_signed,
 * cos and sin_signed (n, D). Each product and the sum are rounded apart (nothing is contracted in this file), as
 * apply_rope's three PyTorch ops round them, so the bits equal PyTorch's. */
static void rope_rows(float *qkv, long first, long end, long stride, int heads, int d, const float *cos,
                      const float *sin) {
    int half = d / 2;
    float head[MAX_ND * VEC];
    for (long i = first; i < end; i++) {
        const float *c = cos + i * d, *s = sin + i * d;
        for (int h = 0; h < heads; h++) {
            float *x = qkv + i * stride + (long)h * d;
            memcpy(head, x, sizeof(float) * d);
            for (int j = 0; j < d; j++) {
                float a = head[j] * c[j];
                float b = head[j < half ? j + half : j - half] * s[j];
                x[j] = a + b;
            }
        }
    }
}

/* silu(gate) * up for rows [first, end) of gate_up (n, 2 * inter) = [gate | up] per row: act (n, inter).
 * silu(g) = g * sigmoid(g), the sigmoid from e = exp(-|g|) <= 1 (1 / (1 + e) for g >= 0, e / (1 + e) below), so no
 * lane overflows. */
static void silu_mul_rows(const float *gate_up, long first, long end, int inter, float *act) {
    for (long i = first; i < end; i++) {
        const float *g = gate_up + i * 2L * inter, *u = g + inter;
        float *a = act + i * (long)inter;
        int k = 0;
        for (; k + VEC <= inter; k += VEC) {
            vf gv = *(const vf *)(g + k);
            vi negative = gv < 0.0f;
            vf e = vexp(vselect(negative, gv, (vf){0} - gv));
            vf sig = vselect(negative, e, (vf){0} + 1.0f) / (e + 1.0f);
            *(vf *)(a + k) = gv * sig * *(const vf *)(u + k);
        }
        for (; k < inter; k++) {
            float e = expf(-fabsf(g[k]));
            a[k] = g[k] * ((g[k] < 0.0f ? e : 1.0f) / (e + 1.0f)) * u[k];
        }
    }
}

/* Thread t of nt's share of the half before attention, inside a parallel region: normed (n, d) = rms_norm(x);
 * qkv (n, out) = normed @ W^T (+ bias (out,) or NULL); RoPE on its first rope_heads heads of head_dim. On return
 * the thread's own token rows of qkv are done (`row_share`); the others may not be. */
static void attention_in_share(const float *x, int n, int d, const float *norm_w, float eps, float *normed,
                               const void *packed, int fmt, int out, const float *bias, float *qkv,
                               const float *cos, const float *sin, int rope_heads, int head_dim, int t, int nt) {
    long first, end;
    row_share(n, t, nt, &first, &end);
    rms_norm_rows(x, norm_w, normed, first, end, d, eps);
#pragma omp barrier
    gemm_share(normed, n, d, packed, fmt, out, qkv, t, nt);
#pragma omp barrier
    for (long i = first; bias && i < end; i++) add_rows(bias, qkv + i * out, out);
    rope_rows(qkv, first, end, out, rope_heads, head_dim, cos, sin);
}

void playground_attention_in(const float *x, int n, int d, const float *norm_w, float eps, float *normed,
                             const void *packed, int fmt, int out, const float *bias, float *qkv, const float *cos,
                             const float *sin, int rope_heads, int head_dim, int threads) {
#pragma omp parallel num_threads(threads)
    attention_in_share(x, n, d, norm_w, eps, normed, packed, fmt, out, bias, qkv, cos, sin, rope_heads, head_dim,
                       omp_get_thread_num(), omp_get_num_threads());
}

/* Thread t of nt's share of the half after attention, inside a parallel region, every row of attn (n, attn_dim)
 * written: x (n, d) updated in place, x += attn @ Wo^T; x += down(silu(gate) * up) of rms_norm(x). scratch:
 * n * (2 d + 3 inter) floats. On return the thread's own token rows of x are done. */
static void mlp_block_share(float *x, int n, int d, const float *attn, int attn_dim, const void *o_packed,
                            const float *norm_w, float eps, const void *gate_up_packed, int inter,
                            const void *down_packed, const int *fmt, float *scratch, int t, int nt) {
    float *delta = scratch, *normed = delta + (long)n * d, *gate_up = normed + (long)n * d;
    float *act = gate_up + (long)n * 2 * inter;
    long first, end;
    row_share(n, t, nt, &first, &end);
    gemm_share(attn, n, attn_dim, o_packed, fmt[0], d, delta, t, nt);
#pragma omp barrier
    add_rows(delta + first * d, x + first * d, (end - first) * d);
    rms_norm_rows(x, norm_w, normed, first, end, d, eps);
#pragma omp barrier
    gemm_share(normed, n, d, gate_up_packed, fmt[1], 2 * inter, gate_up, t, nt);
#pragma omp barrier
    silu_mul_rows(gate_up, first, end, inter, act);
#pragma omp barrier
    gemm_share(act, n, inter, down_packed, fmt[2], d, delta, t, nt);
#pragma omp barrier
    add_rows(delta + first * d, x + first * d, (end - first) * d);
}

void playground_mlp_block(float *x, int n, int d, const float *attn, int attn_dim, const void *o_packed,
                          const float *norm_w, float eps, const void *gate_up_packed, int inter,
                          const void *down_packed, int o_fmt, int gate_up_fmt, int down_fmt, float *scratch,
                          int threads) {
    const int fmt[3] = {o_fmt, gate_up_fmt, down_fmt};
#pragma omp parallel num_threads(threads)
    mlp_block_share(x, n, d, attn, attn_dim, o_packed, norm_w, eps, gate_up_packed, inter, down_packed, fmt, scratch,
                    omp_get_thread_num(), omp_get_num_threads());
}

/* ---- The whole layer stack ----
 * Every decoder layer of a forward in one call, over a KV cache of either kind: the two halves above around attention,
 * with the new keys and values written into the cache and the queries regrouped here, all in one parallel region
 * (one start of the threads per forward instead of five per layer). A small draft model's one-token forward spent
 * most of its time in the Python between those calls (about 0.2 ms a layer on a 2-core Zen 3 EPYC, against a few
 * microseconds of arithmetic). The arithmetic and its order are those of the layer-by-layer path, so the bits are
 * the same.
 *
 * x (batch * new, d) the residual stream, updated in place. weights: 7 pointers per layer, [input norm, qkv panels,
 * qkv bias or NULL, o panels, post-attention norm, gate/up panels, down panels]; formats: 4 per layer, those of
 * the qkv, o, gate/up and down panels. cos, sin (batch * new, head_dim).
 * keys: slots each row attends over, visible (batch, new, keys) or NULL as in playground_attention.
 * Two layouts of the cache. Contiguous rows (write_slots NULL): element (l, b, h, j, c) of the first cache row used
 * at l * layer_stride + b * seq_stride + h * head_stride + j * head_dim + c; row b's new tokens go to slots
 * starts[b].... A paged pool (write_slots given): element (l, slot, h, c) at l * layer_stride + slot * slot_stride +
 * h * head_dim + c; token i = b * new + t goes to slot write_slots[i], and row b's key j is read from slot
 * read_slots[b * keys + j], copied first into `gathered` (2 * batch * kv_heads * keys * head_dim floats) in the
 * contiguous-rows order, so that attention runs the same arithmetic in the same order on either cache.
 * scratch: batch * new * (3 d + qkv_out + 3 heads * head_dim + 3 inter) floats, qkv_out = (heads + 2 kv_heads) *
 * head_dim. */
void playground_layers(float *x, int batch, int new_tokens, int d, int layers, const void *const *weights,
                       const int *formats, int heads, int kv_heads, int head_dim, int inter, float eps, const float *cos,
                       const float *sin, float *k_cache, float *v_cache, long layer_stride, long seq_stride,
                       long head_stride, const int *starts, const int64_t *write_slots, const int64_t *read_slots,
                       long slot_stride, float *gathered, int keys, const uint8_t *visible, float scale,
                       float *scratch, int threads) {
    int n = batch * new_tokens, group = heads / kv_heads, qkv_out = (heads + 2 * kv_heads) * head_dim;
    long hd = (long)heads * head_dim;
    size_t bytes = sizeof(float) * head_dim;
    float *normed = scratch, *qkv = normed + (long)n * d, *q = qkv + (long)n * qkv_out, *out = q + n * hd;
    float *attn = out + n * hd, *mlp = attn + n * hd;
#pragma omp parallel num_threads(threads)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        long first, end;
        row_share(n, t, nt, &first, &end);
        float *s;
        int *idx;
        attention_scratch(keys, &s, &idx);
        for (int l = 0; l < layers; l++) {
            const void *const *w = weights + 7L * l;
            const int *fmt = formats + 4L * l;
            float *kl = k_cache + l * layer_stride, *vl = v_cache + l * layer_stride;
            attention_in_share(x, n, d, w[0], eps, normed, w[1], fmt[0], qkv_out, w[2], qkv, cos, sin,
                               heads + kv_heads, head_dim, t, nt);
            /* the thread's token rows (b, tt): qkv row = [q heads | k heads | v heads]; keys and values into the
             * cache; q (batch, kv_heads, group * new, head_dim) with row g * new + tt the query of head
             * h * group + g, as attention_share reads it */
            for (long i = first; i < end; i++) {
                long b = i / new_tokens, tt = i % new_tokens;
                const float *row = qkv + i * qkv_out;
                for (int h = 0; h < kv_heads; h++) {
                    long slot = write_slots ? write_slots[i] * slot_stride + h * head_dim
                                            : b * seq_stride + h * head_stride + (starts[b] + tt) * head_dim;
                    memcpy(kl + slot, row + (long)(heads + h) * head_dim, bytes);
                    memcpy(vl + slot, row + (long)(heads + kv_heads + h) * head_dim, bytes);
                    for (int g = 0; g < group; g++)
                        memcpy(q + ((b * kv_heads + h) * group * new_tokens + (long)g * new_tokens + tt) * head_dim,
                               row + (long)(h * group + g) * head_dim, bytes);
                }
            }
#pragma omp barrier
            const float *ka = kl, *va = vl;
            long sa = seq_stride, ha = head_stride;
            if (write_slots) {
                /* the pool's keys and values of every row into contiguous rows (b, h, j), a share per thread */
                float *gk = gathered, *gv = gathered + (long)batch * kv_heads * keys * head_dim;
                long pairs = (long)batch * keys, p0, p1;
                row_share(pairs, t, nt, &p0, &p1);
                for (long p = p0; p < p1; p++) {
                    long b = p / keys, j = p % keys, from = read_slots[p] * slot_stride;
                    for (int h = 0; h < kv_heads; h++) {
                        long to = ((b * kv_heads + h) * keys + j) * head_dim;
                        memcpy(gk + to, kl + from + h * head_dim, bytes);
                        memcpy(gv + to, vl + from + h * head_dim, bytes);
                    }
                }
                ka = gk, va = gv, ha = (long)keys * head_dim, sa = kv_heads * ha;
#pragma omp barrier
            }
            attention_share(q, ka, va, visible, out, batch, kv_heads, group * new_tokens, new_tokens, keys,
                            head_dim, sa, ha, head_dim, scale, t, nt, s, idx);
#pragma omp barrier
            /* back to one row per token, heads in order: attn (batch * new, heads * head_dim) */
            for (long i = first; i < end; i++) {
                long b = i / new_tokens, tt = i % new_tokens;
                for (int h = 0; h < kv_heads; h++)
                    for (int g = 0; g < group; g++)
                        memcpy(attn + i * hd + (long)(h * group + g) * head_dim,
                               out + ((b * kv_heads + h) * group * new_tokens + (long)g * new_tokens + tt) * head_dim,
                               bytes);
            }
#pragma omp barrier
            mlp_block_share(x, n, d, attn, (int)hd, w[3], w[4], eps, w[5], inter, w[6], fmt + 1, mlp, t, nt);
        }
        free(s);
        free(idx);
    }
}

/* ---- The FMA bound ----
 * What this processor's arithmetic can do at most, against which the products' efficiency is read: per thread,
 * `reps` times ACC independent chains of vector fused multiply-adds held in registers (enough chains to cover the
 * instruction's latency on both FMA ports of any x86 core). Returns the accumulators' sum, so that nothing is
 * optimised away. */
#define ACC 12
float playground_fma_peak(long reps, int threads) {
    float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        vf acc[ACC], a = splat(1.0f - 1e-7f), b = splat(1e-7f);
        for (int i = 0; i < ACC; i++)
            acc[i] = splat((float)i);
        for (long r = 0; r < reps; r++)
            for (int i = 0; i < ACC; i++)
                acc[i] = vfma(acc[i], a, b);
        for (int i = 0; i < ACC; i++)
            for (int l = 0; l < VEC; l++)
                total += acc[i][l];
    }
    return total;
}

/* ---- The integer bound ----
 * As playground_fma_peak, for the integer products' step (`dot4` as Q4_1 runs it): `reps` times ACC independent
 * chains of 4-input dot products over VEC lanes each (4 * VEC multiply-adds a step: one instruction with VNNI, two
 * without). Returns a sum of the accumulators, so that nothing is optimised away. */
long playground_dot_peak(long reps, int threads) {
    long total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        vi acc[ACC], w = (vi){0} + 0x01020304;
        int32_t x4 = 0x01010101 * (1 + omp_get_thread_num());
        for (int i = 0; i < ACC; i++) acc[i] = (vi){0} + i;
        for (long r = 0; r < reps; r++) {
            for (int i = 0; i < ACC; i++) acc[i] = dot4(acc[i], w, x4, 1);
            __asm__("" : "+r"(x4)); /* a fresh operand each round: the loop is not folded into one multiply */
        }
        for (int i = 0; i < ACC; i++)
            for (int l = 0; l < VEC; l++) total += acc[i][l];
    }
    return total;
}

/* ---- The memory bound ----
 * Seconds `threads` threads take to read `bytes` (a multiple of 64) once, each its contiguous share, one load a
 * cache line: the fastest of `reps` passes. Returns through `sink` a sum of what was read, so the loads stay. */
double playground_read_seconds(const uint8_t *buffer, long bytes, int threads, int reps, long *sink) {
    double best = 1e30;
    long total = 0;
    for (int rep = 0; rep < reps; rep++) {
        double start = omp_get_wtime();
#pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
        for (long at = 0; at < bytes; at += 64) total += buffer[at];
        double took = omp_get_wtime() - start;
        if (took < best) best = took;
    }
    *sink = total;
    return best;
}
