/* float32 linear layers on the CPU: out[m][n] = x[m][:] . w[n][:] + bias[n], against a weight packed once.
 *
 * Why: at decode batch sizes (1-64 rows) a linear layer streams its weight once per step, and MKL's packed
 * GEMM ran at 37-43 GFLOP/s on the AMD EPYC boxes these benches use (MKL takes a slow path on CPUs that are
 * not Intel's); oneDNN's was 1.55x faster but its result for a row depends on how many rows share the call.
 * A row's result here never does: every output element is one chain of fused multiply-adds over k, in
 * order, whatever the number of rows, the tile the row falls in, or the threads. So a decode token's
 * logits are the same bits in a pure decode step, beside a prefill chunk, or alone, which is what keeps
 * greedy outputs identical across layouts (the parity tests).
 *
 * Layout of the packed weight: panels of 16 output features, panel p holding w[16p + l][kk] at
 * packed[(p * k + kk) * 16 + l], features past n zero. A tile is up to 6 rows x 4 panels (64 features):
 * 24 accumulators in vector registers; per kk it loads 4 weight vectors and broadcasts 6 inputs. Tiles walk
 * the rows inside a group of panels, so the group's weight (k x 64 floats, 147-393 KB at SmolLM2's shapes)
 * stays in L2 while every row passes over it and leaves memory once per call. Threads (OpenMP, torch's
 * runtime) split the groups of panels: each output element is still one thread's one chain.
 * Vectors are GCC's 16-float vector type (AVX-512 registers where the CPU has them, pairs of AVX2 ones
 * otherwise). Built by cpu_kernel.py with the attention kernel (-O3 -march=native -ffp-contract=fast).
 */
#include <stdint.h>
#include <string.h>

#define LANES 16
#define ROWS 6   /* rows of a tile */
#define PANELS 4 /* panels of a tile */

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

void linear_f32_pack(const float *w, int64_t n, int64_t k, float *packed, int num_threads) {
    int64_t panels = (n + LANES - 1) / LANES;
#pragma omp parallel for num_threads(num_threads) if (num_threads > 1)
    for (int64_t p = 0; p < panels; p++) {
        for (int64_t kk = 0; kk < k; kk++) {
            for (int l = 0; l < LANES; l++) {
                int64_t feature = p * LANES + l;
                packed[(p * k + kk) * LANES + l] = feature < n ? w[feature * k + kk] : 0.0f;
            }
        }
    }
}

/* One tile: rows x[0..R) against panels wp[0..P) (each `panel_stride` floats apart); `width` of its
 * 16 * P features are real (the last tile of a weight whose n is not a multiple of 64 has fewer). */
static inline __attribute__((always_inline)) void tile(const int R, const int P, const float *x, int64_t ldx,
                                                       int64_t k, const float *wp, int64_t panel_stride,
                                                       const float *bias, float *out, int64_t ldo, int64_t width) {
    v16 acc[ROWS][PANELS];
    for (int r = 0; r < R; r++)
        for (int p = 0; p < P; p++) acc[r][p] = (v16){0};
    for (int64_t kk = 0; kk < k; kk++) {
        v16 w[PANELS];
        for (int p = 0; p < P; p++) w[p] = *(const v16u *)(wp + p * panel_stride + kk * LANES);
        for (int r = 0; r < R; r++) {
            float s = x[r * ldx + kk];
            for (int p = 0; p < P; p++) acc[r][p] += s * w[p];
        }
    }
    for (int p = 0; p < P; p++) {
        int64_t left = width - p * LANES;
        int cols = left < LANES ? (int)left : LANES;
        v16 b = (v16){0};
        if (bias) {
            if (cols == LANES) b = *(const v16u *)(bias + p * LANES);
            else memcpy(&b, bias + p * LANES, cols * sizeof(float));
        }
        for (int r = 0; r < R; r++) {
            v16 y = acc[r][p] + b;
            if (cols == LANES) *(v16u *)(out + r * ldo + p * LANES) = y;
            else memcpy(out + r * ldo + p * LANES, &y, cols * sizeof(float));
        }
    }
}

#define TILE(R, P) \
    case (R) * 8 + (P): tile(R, P, x, ldx, k, wp, panel_stride, b, o, ldo, width); break;
#define TILES(R) TILE(R, 1) TILE(R, 2) TILE(R, 3) TILE(R, 4)

/* x [m][k] (rows `ldx` floats apart), packed as above for n features, bias [n] or NULL, out [m][n] (rows
 * `ldo` apart). Returns 0. */
int linear_f32(const float *x, int64_t m, int64_t ldx, int64_t k, const float *packed, int64_t n,
               const float *bias, float *out, int64_t ldo, int num_threads) {
    int64_t panels = (n + LANES - 1) / LANES;
    int64_t groups = (panels + PANELS - 1) / PANELS;
    int64_t panel_stride = k * LANES;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t g = 0; g < groups; g++) {
        int P = panels - g * PANELS < PANELS ? (int)(panels - g * PANELS) : PANELS;
        int64_t col = g * PANELS * LANES;
        int64_t width = n - col < PANELS * LANES ? n - col : PANELS * LANES;
        const float *wp = packed + g * PANELS * panel_stride;
        const float *b = bias ? bias + col : 0;
        for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
            int R = m - r0 < ROWS ? (int)(m - r0) : ROWS;
            const float *xr = x + r0 * ldx;
            float *o = out + r0 * ldo + col;
            {
                const float *x = xr;
                switch (R * 8 + P) {
                    TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6)
                }
            }
        }
    }
    return 0;
}
