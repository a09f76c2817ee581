/* What tandem's two CPU attention kernels share (paged_attention_cpu.c for decodes and short runs,
 * prefill_attention_cpu.c for prompts and long chunks): GCC's 16-float vector type (AVX-512 registers where
 * the CPU has them, pairs of AVX2 ones otherwise), bfloat16 conversions, the softmax's exponential,
 * which keys a query may attend, and how work items are numbered. */
#ifndef TANDEM_ATTENTION_CPU_H
#define TANDEM_ATTENTION_CPU_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define MAX_HEAD_DIM 256

typedef float vec __attribute__((vector_size(4 * LANES)));
typedef float vec_u __attribute__((vector_size(4 * LANES), aligned(4))); /* for unaligned loads and stores */
typedef int32_t ivec __attribute__((vector_size(4 * LANES)));
typedef uint16_t bf16_t;

enum { OK = 0, BAD_SHAPE = 1, NO_MEMORY = 3 };

static inline vec load(const float *p) { return *(const vec_u *)p; }
static inline void store(float *p, vec v) { *(vec_u *)p = v; }
static inline vec splat(float x) { return (vec){0} + x; }

/* e^x for x <= 0 (softmax weights after the max is subtracted), relative error ~2e-7; -inf gives 0. */
static inline vec exp_nonpositive(vec x) {
    const vec lo = splat(-87.0f);
    ivec dead = x < lo;
    x = (vec)(((ivec)x & ~dead) | ((ivec)lo & dead));
    vec n = x * 1.44269504f + 12582912.0f; /* round to nearest by the 1.5 * 2^23 trick */
    vec k = n - 12582912.0f;
    vec r = x - k * 0.693145752f - k * 1.42860677e-6f;
    vec p = splat(1.0f / 720);
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    ivec scale = ((ivec)n - (ivec)splat(12582912.0f) + 127) << 23;
    return (vec)((ivec)(p * (vec)scale) & ~dead);
}

static inline float bf16_to_float(bf16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

typedef struct {
    int bf16; /* storage: bfloat16 if set, else float32 */
    int64_t num_heads, num_kv_heads, head_dim, block_size;
    float scale, softcap; /* softcap <= 0: none */
    int64_t window;       /* <= 0: none */
    int64_t attn_chunk;   /* <= 0: none (not the 16-key chunks below: Llama 4's attention chunks) */
    const float *sinks;   /* [num_heads] or NULL */
} shape_t;

/* The first key position a query at `pos` may attend. */
static inline int64_t first_key(int64_t pos, const shape_t *sh) {
    int64_t first = sh->window > 0 ? pos - sh->window + 1 : 0;
    if (sh->attn_chunk > 0 && pos - pos % sh->attn_chunk > first) first = pos - pos % sh->attn_chunk;
    return first < 0 ? 0 : first;
}

typedef uint16_t half_vec __attribute__((vector_size(2 * LANES), aligned(2)));

/* 16 elements of a K, V or q row as float32 (bfloat16 is the top half of a float32's bits). */
static inline vec load_row(const void *row, int64_t d, int bf16) {
    if (!bf16) return load((const float *)row + d);
    ivec wide = __builtin_convertvector(*(const half_vec *)((const bf16_t *)row + d), ivec);
    return (vec)(wide << 16);
}

static inline const void *row_at(const void *base, int64_t index, const shape_t *sh) {
    return (const char *)base + index * sh->head_dim * (sh->bf16 ? 2 : 4);
}

/* Work items are numbered sequence by sequence, ceil(query_lens[s] / tile) x per_tile of them for sequence s:
 * how many there are, and which sequence item w falls in (*left: its number within that sequence's). */
static inline int64_t count_items(const int64_t *query_lens, int64_t num_seqs, int64_t tile, int64_t per_tile) {
    int64_t items = 0;
    for (int64_t s = 0; s < num_seqs; s++) items += (query_lens[s] + tile - 1) / tile * per_tile;
    return items;
}

static inline int64_t item_sequence(int64_t w, const int64_t *query_lens, int64_t tile, int64_t per_tile,
                                    int64_t *left) {
    int64_t s = 0;
    for (;; s++) {
        const int64_t n = (query_lens[s] + tile - 1) / tile * per_tile;
        if (w < n) break;
        w -= n;
    }
    *left = w;
    return s;
}

#endif
