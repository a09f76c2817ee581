/* bfloat16 linear layers on CPUs with AVX512-BF16: out[m][n] = x[m][:] . w[n][:] + bias[n], products of
 * bfloat16 pairs summed in float32 lanes, the sum rounded to bfloat16 once at the end.
 *
 * The same plan as linear_f32_cpu.c (read it first): a weight packed once into panels of 16 output
 * features, tiles of up to 6 rows x 4 panels with their 24 float32 accumulators in registers, every output
 * element one chain over k in order, so a row's result is the same bits whatever rows or threads share the
 * call. Here one instruction (vdpbf16ps) multiplies a pair of k's for 16 features and adds both products
 * into their float32 lanes: the panel holds w[16p + l][2j], w[16p + l][2j + 1] side by side at
 * packed[((p * K2 + j) * 16 + l) * 2], K2 = ceil(k / 2), a missing k (odd k) or feature zero; the input's
 * pair is broadcast as one 32-bit word.
 *
 * Without AVX512-BF16 the functions are built but `linear_bf16_supported` answers 0 and cpu_linear.py keeps
 * oneDNN's GEMM.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#define LANES 16
#define ROWS 6
#define PANELS 4

typedef uint16_t bf16_t;

int linear_bf16_supported(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

void linear_bf16_pack(const bf16_t *w, int64_t n, int64_t k, bf16_t *packed, int num_threads) {
    int64_t panels = (n + LANES - 1) / LANES, k2 = (k + 1) / 2;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t j = 0; j < k2; j++) {
            for (int l = 0; l < LANES; l++) {
                int64_t feature = p * LANES + l;
                for (int h = 0; h < 2; h++) {
                    int64_t kk = 2 * j + h;
                    packed[((p * k2 + j) * LANES + l) * 2 + h] = feature < n && kk < k ? w[feature * k + kk] : 0;
                }
            }
        }
    }
}

#if defined(__AVX512BF16__)
/* The pair x[2j], x[2j + 1] as one word (the second zero past k). */
static inline __attribute__((always_inline)) uint32_t pair(const bf16_t *x, int64_t j, int64_t k) {
    uint32_t word;
    if (2 * j + 1 < k) {
        memcpy(&word, x + 2 * j, sizeof word);
    } else {
        word = x[2 * j];
    }
    return word;
}

static inline __attribute__((always_inline)) void tile(const int R, const int P, const bf16_t *x, int64_t ldx,
                                                       int64_t k, const bf16_t *wp, int64_t panel_stride,
                                                       const bf16_t *bias, bf16_t *out, int64_t ldo, int64_t width) {
    __m512 acc[ROWS][PANELS];
    int64_t k2 = (k + 1) / 2, whole = k / 2;
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k2; j++) {
        __m512bh w[PANELS];
        for (int p = 0; p < P; p++) w[p] = (__m512bh)_mm512_loadu_si512(wp + p * panel_stride + j * 2 * LANES);
        for (int r = 0; r < R; r++) {
            uint32_t word;
            if (j < whole) memcpy(&word, x + r * ldx + 2 * j, sizeof word);
            else word = pair(x + r * ldx, j, k);
            __m512bh s = (__m512bh)_mm512_set1_epi32((int)word);
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], s, w[p]);
        }
    }
    for (int p = 0; p < P; p++) {
        int64_t left = width - p * LANES;
        int cols = left < LANES ? (int)left : LANES;
        __mmask16 mask = (__mmask16)((1u << cols) - 1u);
        __m512 b = _mm512_setzero_ps();
        if (bias) {
            __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + p * LANES);
            b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
        }
        for (int r = 0; r < R; r++) {
            __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][p], b));
            _mm256_mask_storeu_epi16(out + r * ldo + p * LANES, mask, (__m256i)y);
        }
    }
}

#define TILE(R, P) \
    case (R) * 8 + (P): tile(R, P, x, ldx, k, wp, panel_stride, b, o, ldo, width); break;
#define TILES(R) TILE(R, 1) TILE(R, 2) TILE(R, 3) TILE(R, 4)
#endif

/* x bfloat16 [m][k] (rows `ldx` apart), packed as above for n features, bias bfloat16 [n] or NULL, out
 * bfloat16 [m][n] (rows `ldo` apart). Returns 0, or 1 where the CPU has no AVX512-BF16. */
int linear_bf16(const bf16_t *xin, int64_t m, int64_t ldx, int64_t k, const bf16_t *packed, int64_t n,
                const bf16_t *bias, bf16_t *out, int64_t ldo, int num_threads) {
#if defined(__AVX512BF16__)
    int64_t panels = (n + LANES - 1) / LANES;
    int64_t groups = (panels + PANELS - 1) / PANELS;
    int64_t panel_stride = ((k + 1) / 2) * 2 * LANES;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t g = 0; g < groups; g++) {
        int P = panels - g * PANELS < PANELS ? (int)(panels - g * PANELS) : PANELS;
        int64_t col = g * PANELS * LANES;
        int64_t width = n - col < PANELS * LANES ? n - col : PANELS * LANES;
        const bf16_t *wp = packed + g * PANELS * panel_stride;
        const bf16_t *b = bias ? bias + col : 0;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            int R = m - r0 < ROWS ? (int)(m - r0) : ROWS;
            const bf16_t *x = xin + r0 * ldx;
            bf16_t *o = out + r0 * ldo + col;
            switch (R * 8 + P) {
                TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6)
            }
        }
    }
    return 0;
#else
    (void)xin; (void)m; (void)ldx; (void)k; (void)packed; (void)n; (void)bias; (void)out; (void)ldo; (void)num_threads;
    return 1;
#endif
}
