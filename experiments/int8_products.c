/* A study, not product: GGUF blocks (Q4_1, Q8_0) multiplied in integers against activations quantised to 8 bits per
 * block of 32 inputs (llama.cpp's Q8_0/Q8_1 activations), with AVX-512 VNNI (vpdpbusd), AVX2 (vpmaddubsw + vpmaddwd)
 * and plain C, all giving the same bits: the integer sums are exact, and each block's sum is folded into the output
 * by the same float operations in the same order, y = fma(m, s_x, fma(float(isum) * d, d_x, y)) (the minimum term for
 * Q4_1 only). experiments/int8_products.py builds it and times it against the float kernel.
 *
 * Panels of 16 outputs, block by block along the inputs: the block's 16 float16 scales d, (Q4_1) its 16 float16
 * minimums m, then its quants in 8 groups of 4 inputs, group g holding for each output i the 4 quants of inputs
 * 4g..4g+3 at bytes 4i..4i+3 (the operand layout of vpdpbusd: one 32-bit lane per output). Q8_0: 8 groups of 64 signed
 * bytes; Q4_1: 4 vectors of 64 bytes, vector v holding group v in the low nibbles and group v + 4 in the high ones.
 * Activations: q (n, in) int8, d_x (n, in / 32) float, s_x (n, in / 32) float = d_x * (sum of the block's q), and
 * for the Q8_0 path on VNNI, t_x (n, in / 32) int32 = the sum of the block's q (vpdpbusd reads its first operand
 * unsigned: the signed weights go in offset by 128 and 128 * t_x comes off, exactly). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32
#define PW 16 /* outputs per panel */
#define MAXN 16

static __attribute__((unused)) float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal */
            exp = 127 - 15 + 1;
            while (!(man & 1024)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 1023) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static long block_bytes(int q4) { return q4 ? PW * 4 + PW * QK / 2 : PW * 2 + PW * QK; }

long int8_panel_bytes(int q4, int in) { return in / QK * block_bytes(q4); }

/* The file's rows (out, in / 32 blocks of 20 (Q4_1) or 34 (Q8_0) bytes) into the panels above, zero past `out`. */
void int8_pack(const uint8_t *rows, int out, int in, int q4, uint8_t *panels) {
    const long blocks = in / QK, size = q4 ? 20 : 34, head = q4 ? 4 : 2, bb = block_bytes(q4);
    memset(panels, 0, (size_t)((out + PW - 1) / PW * blocks * bb));
    for (long r = 0; r < out; r++) {
        const long p = r / PW, i = r % PW;
        for (long b = 0; b < blocks; b++) {
            const uint8_t *src = rows + (r * blocks + b) * size;
            uint8_t *dst = panels + (p * blocks + b) * bb, *quants = dst + (q4 ? PW * 4 : PW * 2);
            memcpy(dst + i * 2, src, 2);
            if (q4) memcpy(dst + PW * 2 + i * 2, src + 2, 2);
            for (int k = 0; k < QK; k++) {
                const int g = k / 4, j = k % 4;
                if (q4) {
                    uint8_t q = k < QK / 2 ? src[head + k] & 15 : src[head + k - QK / 2] >> 4;
                    quants[(g % 4) * 64 + 4 * i + j] |= (uint8_t)(g < 4 ? q : q << 4);
                } else {
                    quants[g * 64 + 4 * i + j] = src[head + k];
                }
            }
        }
    }
}

/* Rows of x (n, in) quantised per block of 32: q = round(x / d_x), d_x = max |x| / 127 (0 for a block of zeros). */
void int8_quantise(const float *x, int n, int in, int8_t *q, float *dx, float *sx, int32_t *tx) {
    for (long b = 0; b < (long)n * in / QK; b++) {
        const float *v = x + b * QK;
        float amax = 0;
        for (int k = 0; k < QK; k++) amax = fmaxf(amax, fabsf(v[k]));
        const float d = amax / 127, inv = d ? 1 / d : 0;
        int32_t total = 0;
        for (int k = 0; k < QK; k++) {
            int v8 = (int)nearbyintf(v[k] * inv);
            q[b * QK + k] = (int8_t)v8;
            total += v8;
        }
        dx[b] = d;
        sx[b] = d * (float)total;
        tx[b] = total;
    }
}

/* One panel's 16 outputs for rows [0, n): y (n, out) at column `col`, `cols` of them real. */
static void panel(const int8_t *q, const float *dx, const float *sx, const int32_t *tx, int n, int in,
                  const uint8_t *pan, int q4, float *y, int out, int col, int cols) {
    const long blocks = in / QK, bb = block_bytes(q4);
    float acc[MAXN][PW];
    memset(acc, 0, sizeof(acc));
    for (long b = 0; b < blocks; b++) {
        const uint8_t *blk = pan + b * bb, *quants = blk + (q4 ? PW * 4 : PW * 2);
        int32_t isum[MAXN][PW];
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
        __m512i w[8];
        if (q4) {
            const __m512i low = _mm512_set1_epi8(15);
            for (int v = 0; v < 4; v++) {
                __m512i packed = _mm512_loadu_si512((const void *)(quants + v * 64));
                w[v] = _mm512_and_si512(packed, low);
                w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            }
        } else {
            const __m512i flip = _mm512_set1_epi8((char)0x80); /* w + 128, read unsigned */
            for (int g = 0; g < 8; g++) w[g] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(quants + g * 64)), flip);
        }
        for (int r = 0; r < n; r++) {
            const int32_t *xg = (const int32_t *)(q + (long)r * in + b * QK);
            __m512i s = _mm512_setzero_si512();
            for (int g = 0; g < 8; g++) s = _mm512_dpbusd_epi32(s, w[g], _mm512_set1_epi32(xg[g]));
            if (!q4) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * tx[(long)r * blocks + b]));
            _mm512_storeu_si512((void *)isum[r], s);
        }
#elif defined(__AVX2__)
        const __m256i ones = _mm256_set1_epi16(1);
        for (int h = 0; h < 2; h++) { /* outputs 8h..8h+7: bytes 32h..32h+31 of each group */
            __m256i w[8];
            if (q4) {
                const __m256i low = _mm256_set1_epi8(15);
                for (int v = 0; v < 4; v++) {
                    __m256i packed = _mm256_loadu_si256((const __m256i *)(quants + v * 64 + h * 32));
                    w[v] = _mm256_and_si256(packed, low);
                    w[v + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                }
            } else {
                for (int g = 0; g < 8; g++) w[g] = _mm256_loadu_si256((const __m256i *)(quants + g * 64 + h * 32));
            }
            for (int r = 0; r < n; r++) {
                const int32_t *xg = (const int32_t *)(q + (long)r * in + b * QK);
                __m256i s = _mm256_setzero_si256();
                for (int g = 0; g < 8; g++) {
                    __m256i x = _mm256_set1_epi32(xg[g]), pairs;
                    if (q4) { /* 15 * 127 * 2 fits a 16-bit pair sum */
                        pairs = _mm256_maddubs_epi16(w[g], x);
                    } else { /* |w| * sign(x, w): at most 128 * 127 * 2 */
                        pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w[g]), _mm256_sign_epi8(x, w[g]));
                    }
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(pairs, ones));
                }
                _mm256_storeu_si256((__m256i *)(isum[r] + 8 * h), s);
            }
        }
#else
        for (int r = 0; r < n; r++) {
            const int8_t *xb = q + (long)r * in + b * QK;
            for (int i = 0; i < PW; i++) {
                int32_t s = 0;
                for (int k = 0; k < QK; k++) {
                    const int g = k / 4, j = k % 4;
                    int wq = q4 ? (quants[(g % 4) * 64 + 4 * i + j] >> (g < 4 ? 0 : 4)) & 15
                                : (int8_t)quants[g * 64 + 4 * i + j];
                    s += wq * xb[k];
                }
                isum[r][i] = s;
            }
        }
#endif
        float d[PW], m[PW];
#if defined(__F16C__)
        for (int h = 0; h < 2; h++) { /* widened exactly, as half_to_float does */
            _mm256_storeu_ps(d + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h))));
            if (q4) _mm256_storeu_ps(m + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h))));
        }
#else
        for (int i = 0; i < PW; i++) {
            uint16_t h;
            memcpy(&h, blk + i * 2, 2);
            d[i] = half_to_float(h);
            if (q4) {
                memcpy(&h, blk + PW * 2 + i * 2, 2);
                m[i] = half_to_float(h);
            }
        }
#endif
        for (int r = 0; r < n; r++) {
            const float dxr = dx[(long)r * blocks + b], sxr = sx[(long)r * blocks + b];
            for (int i = 0; i < PW; i++) {
                float t = fmaf((float)isum[r][i] * d[i], dxr, acc[r][i]);
                acc[r][i] = q4 ? fmaf(m[i], sxr, t) : t;
            }
        }
    }
    for (int r = 0; r < n; r++) memcpy(y + (long)r * out + col, acc[r], (size_t)cols * sizeof(float));
}

/* y (n, out) = x @ W^T from quantised rows, n <= 16, the panels split among `threads`. */
void int8_gemm(const int8_t *q, const float *dx, const float *sx, const int32_t *tx, int n, int in,
               const uint8_t *panels, int q4, int out, float *y, int threads) {
    const long count = (out + PW - 1) / PW, bytes = int8_panel_bytes(q4, in);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long p = 0; p < count; p++)
        panel(q, dx, sx, tx, n, in, panels + p * bytes, q4, y, out, (int)(p * PW),
              out - p * PW < PW ? (int)(out - p * PW) : PW);
}

/* Read `bytes` (a multiple of 64) `reps` times with `threads` threads, each its share: the seconds of the fastest. */
double int8_read_seconds(const uint8_t *buffer, long bytes, int threads, int reps) {
    double best = 1e30;
    for (int rep = 0; rep < reps; rep++) {
        double start = omp_get_wtime();
        long total = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
        for (long at = 0; at < bytes; at += 64) total += buffer[at] + buffer[at + 32];
        double took = omp_get_wtime() - start;
        if (took < best && total >= 0) best = took;
    }
    return best;
}
