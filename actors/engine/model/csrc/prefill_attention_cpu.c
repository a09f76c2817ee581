/* Attention for prompts and long chunks on the CPU, reading K and V from their cache blocks in place.
 *
 * Why: the decode kernel (paged_attention_cpu.c) scores one query row at a time against each key, a dot
 * product folded across lanes per key, which suits a handful of queries that stream a long context;
 * a prompt has hundreds of queries per key. torch's SDPA (flash attention for the CPU) reached about a
 * third of this CPU's multiply-add rate on SmolLM2's 64-wide heads at 512 tokens and was a third of the
 * prefill's time.
 *
 * The same arguments as paged_attention (block tables, query_starts, query_lens, context_lens: a
 * sequence's queries are the last query_lens[s] of its context_lens[s] positions, with window, Llama 4's
 * attention chunks, Gemma 2's softcap and gpt-oss's sinks). A work item is one sequence, one kv head and
 * a tile of query tokens: its rows are every query head of that kv head for every token of the tile (GQA
 * without repeating K or V), up to 64 rows, held as vectors of 16 rows. The queries are stored transposed
 * (d-major, a row per lane), so a score vector is 16 rows' scores for one key: q . k sums d by
 * d as multiply-adds of one broadcast K element against a vector of query elements, with no folding
 * across lanes, and the softmax's running max and sum are per lane. The output is kept transposed the
 * same way and each value element is broadcast against 16 rows' weights. Keys go 32 at a time, their rows
 * widened to float32 first when the cache is bfloat16; every sum is float32. A chunk wholly inside every
 * row's reach is not masked.
 */
#include <math.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_cpu.h"

#define ROW_VECS 4 /* rows per work item: up to 4 vectors of 16 */
#define MAX_ROWS (ROW_VECS * LANES)
#define KEYS 32 /* keys per chunk */
#define KEY_STEP 4 /* keys scored at once: KEY_STEP x ROW_VECS accumulators in registers */
#define D_STEP 4 /* value elements weighed at once: D_STEP x ROW_VECS accumulators */

typedef struct { /* one thread's working rows, allocated once per thread */
    vec qt[MAX_HEAD_DIM][ROW_VECS]; /* queries transposed: qt[d][g] holds element d of rows 16g..16g+15 */
    vec ot[MAX_HEAD_DIM][ROW_VECS]; /* output sums, the same way */
    vec w[KEYS][ROW_VECS];          /* a chunk's scores, then its softmax weights */
    float k[KEYS][MAX_HEAD_DIM], v[KEYS][MAX_HEAD_DIM]; /* the chunk's rows in float32 (bfloat16 caches) */
    vec max[ROW_VECS], total[ROW_VECS], pos[ROW_VECS], first[ROW_VECS];
    /* AVX512-BF16: pairs of bfloat16 in 32-bit lanes. qp[d][g] lane l: elements 2d, 2d+1 of row 16g+l;
     * vp[t][d]: element d of keys 2t and 2t+1; wp[t][g] lane l: the weights of keys 2t and 2t+1 for row 16g+l. */
    uint32_t qp[MAX_HEAD_DIM / 2][ROW_VECS * LANES] __attribute__((aligned(64)));
    uint32_t vp[KEYS / 2][MAX_HEAD_DIM] __attribute__((aligned(64)));
    uint32_t wp[KEYS / 2][ROW_VECS * LANES] __attribute__((aligned(64)));
} scratch_t;

static _Thread_local scratch_t *thread_scratch;
static const float zero_row[MAX_HEAD_DIM]; /* zeros in either dtype */

/* Elements d and d+1 of a bfloat16 row, as one 32-bit lane holds them. */
static inline uint32_t pair_at(const void *row, int64_t d) {
    uint32_t pair;
    memcpy(&pair, (const bf16_t *)row + d, sizeof pair);
    return pair;
}

/* The cache rows of key positions p0..p0+n-1; up to a multiple of KEY_STEP the rest point at zeros. */
static inline void chunk_rows(const void **kr, const void **vr, const void *k_cache, const void *v_cache,
                              const int32_t *table, int64_t kvh, int64_t p0, int64_t n, const shape_t *sh) {
    const int64_t BS = sh->block_size;
    for (int64_t t = 0; t < n; t++) {
        const int64_t p = p0 + t, row = ((int64_t)table[p / BS] * BS + p % BS) * sh->num_kv_heads + kvh;
        kr[t] = row_at(k_cache, row, sh);
        vr[t] = row_at(v_cache, row, sh);
    }
    for (int64_t t = n; t % KEY_STEP; t++) kr[t] = vr[t] = zero_row;
}

/* A bfloat16 cache's rows widened into x's float32 copies (float32 rows are used where they are). */
static inline void widen_rows(const float **kf, const float **vf, const void *const *kr, const void *const *vr,
                              scratch_t *x, int64_t n, const shape_t *sh, const int64_t D) {
    for (int64_t t = 0; t < n; t++) {
        if (!sh->bf16) {
            kf[t] = (const float *)kr[t];
            vf[t] = (const float *)vr[t];
            continue;
        }
        for (int64_t d = 0; d < D; d += LANES) {
            store(&x->k[t][d], load_row(kr[t], d, 1));
            store(&x->v[t][d], load_row(vr[t], d, 1));
        }
        kf[t] = x->k[t];
        vf[t] = x->v[t];
    }
    for (int64_t t = n; t % KEY_STEP; t++) kf[t] = vf[t] = zero_row;
}

/* w[t][g] = the scores of keys t (rows as lanes), KEY_STEP keys at a time. */
static inline __attribute__((always_inline)) void score(scratch_t *x, const float *const *kr, int64_t n, float scale,
                                                        const int G, const int64_t D) {
    for (int64_t t0 = 0; t0 < n; t0 += KEY_STEP) {
        vec a[KEY_STEP][ROW_VECS];
        for (int j = 0; j < KEY_STEP; j++)
            for (int g = 0; g < G; g++) a[j][g] = splat(0.0f);
        for (int64_t d = 0; d < D; d++)
            for (int j = 0; j < KEY_STEP; j++) {
                const vec k = splat(kr[t0 + j][d]);
                for (int g = 0; g < G; g++) a[j][g] += k * x->qt[d][g];
            }
        for (int j = 0; j < KEY_STEP; j++)
            for (int g = 0; g < G; g++) x->w[t0 + j][g] = a[j][g] * scale;
    }
}

/* ot[d][g] = ot[d][g] * correction[g] + the sum over the chunk's keys of w[t][g] * v_t[d]. */
static inline __attribute__((always_inline)) void weigh(scratch_t *x, const float *const *vr, int64_t n,
                                                        const vec *correction, const int G, const int64_t D) {
    for (int64_t d0 = 0; d0 < D; d0 += D_STEP) {
        vec a[D_STEP][ROW_VECS];
        for (int j = 0; j < D_STEP; j++)
            for (int g = 0; g < G; g++) a[j][g] = x->ot[d0 + j][g] * correction[g];
        for (int64_t t = 0; t < n; t++)
            for (int j = 0; j < D_STEP; j++) {
                const vec v = splat(vr[t][d0 + j]);
                for (int g = 0; g < G; g++) a[j][g] += v * x->w[t][g];
            }
        for (int j = 0; j < D_STEP; j++)
            for (int g = 0; g < G; g++) x->ot[d0 + j][g] = a[j][g];
    }
}

/* The chunk's scores into softmax weights: masked where a row may not see a key (when `mask`), the
 * running max and sum moved on, the correction the earlier sums need returned in `correction`. */
static inline __attribute__((always_inline)) void soften(scratch_t *x, int64_t p0, int64_t n, int mask,
                                                         const shape_t *sh, vec *correction, const int G) {
    const vec none = splat(-INFINITY);
    if (sh->softcap > 0)
        for (int64_t t = 0; t < n; t++)
            for (int g = 0; g < G; g++)
                for (int l = 0; l < LANES; l++) x->w[t][g][l] = tanhf(x->w[t][g][l] / sh->softcap) * sh->softcap;
    for (int g = 0; g < G; g++) {
        vec top = x->max[g];
        for (int64_t t = 0; t < n; t++) {
            vec s = x->w[t][g];
            if (mask) {
                const vec key = splat((float)(p0 + t));
                ivec keep = (key <= x->pos[g]) & (key >= x->first[g]);
                s = (vec)(((ivec)s & keep) | ((ivec)none & ~keep));
                x->w[t][g] = s;
            }
            ivec more = s > top;
            top = (vec)(((ivec)s & more) | ((ivec)top & ~more));
        }
        /* A row that has seen no key yet keeps -inf as its max: weigh against 0 so that no -inf - -inf. */
        ivec seen = top > none;
        const vec base = (vec)((ivec)top & seen);
        correction[g] = exp_nonpositive(x->max[g] - base);
        vec sum = x->total[g] * correction[g];
        for (int64_t t = 0; t < n; t++) {
            const vec p = exp_nonpositive(x->w[t][g] - base);
            x->w[t][g] = p;
            sum += p;
        }
        x->total[g] = sum;
        x->max[g] = top;
    }
}

#if defined(__AVX512BF16__)
/* The same as score and weigh for bfloat16 caches where the CPU has AVX512-BF16 (head_dim a multiple of
 * 32): one instruction multiplies 32 bfloat16 pairs into 16 float32 sums, so the pairs run along d for the
 * scores (K read from the cache as it is) and along the keys for the values (the weights rounded to
 * bfloat16, as torch's own bfloat16 attention rounds them; the sums stay float32). Half the instructions
 * of the float32 path. */
static inline __attribute__((always_inline)) void score_bf16(scratch_t *x, const bf16_t *const *kr, int64_t n,
                                                             float scale, const int G, const int64_t D) {
    for (int64_t t0 = 0; t0 < n; t0 += KEY_STEP) {
        __m512 a[KEY_STEP][ROW_VECS];
        for (int j = 0; j < KEY_STEP; j++)
            for (int g = 0; g < G; g++) a[j][g] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D / 2; d++)
            for (int j = 0; j < KEY_STEP; j++) {
                const __m512bh k = (__m512bh)_mm512_set1_epi32((int)pair_at(kr[t0 + j], 2 * d));
                for (int g = 0; g < G; g++)
                    a[j][g] = _mm512_dpbf16_ps(a[j][g], (__m512bh)_mm512_load_si512(&x->qp[d][g * LANES]), k);
            }
        for (int j = 0; j < KEY_STEP; j++)
            for (int g = 0; g < G; g++) x->w[t0 + j][g] = (vec)a[j][g] * scale;
    }
}

static inline __attribute__((always_inline)) void weigh_bf16(scratch_t *x, const bf16_t *const *vr, int64_t n,
                                                             const vec *correction, const int G, const int64_t D) {
    uint16_t index[3][32]; /* 16-bit element indices that put a[i] and b[i] side by side */
    for (int i = 0; i < 16; i++) {
        index[0][2 * i] = (uint16_t)i, index[0][2 * i + 1] = (uint16_t)(32 + i);       /* low halves of two rows */
        index[1][2 * i] = (uint16_t)(16 + i), index[1][2 * i + 1] = (uint16_t)(48 + i); /* high halves */
        index[2][2 * i] = (uint16_t)i, index[2][2 * i + 1] = (uint16_t)(16 + i);       /* a vector's two halves */
    }
    const __m512i lo = _mm512_loadu_si512(index[0]), hi = _mm512_loadu_si512(index[1]);
    const __m512i mix = _mm512_loadu_si512(index[2]);
    const int64_t pairs = (n + 1) / 2;
    for (int64_t t = 0; t < pairs; t++) {
        const bf16_t *a = vr[2 * t], *b = vr[2 * t + 1]; /* past n: a zero row */
        for (int64_t d = 0; d < D; d += 32) {
            const __m512i ra = _mm512_loadu_si512(a + d), rb = _mm512_loadu_si512(b + d);
            _mm512_store_si512(&x->vp[t][d], _mm512_permutex2var_epi16(ra, lo, rb));
            _mm512_store_si512(&x->vp[t][d + 16], _mm512_permutex2var_epi16(ra, hi, rb));
        }
        for (int g = 0; g < G; g++) {
            const __m512 w0 = (__m512)x->w[2 * t][g];
            const __m512 w1 = 2 * t + 1 < n ? (__m512)x->w[2 * t + 1][g] : _mm512_setzero_ps();
            _mm512_store_si512(&x->wp[t][g * LANES],
                               _mm512_permutexvar_epi16(mix, (__m512i)_mm512_cvtne2ps_pbh(w1, w0)));
        }
    }
    for (int64_t d0 = 0; d0 < D; d0 += D_STEP) {
        __m512 acc[D_STEP][ROW_VECS];
        for (int j = 0; j < D_STEP; j++)
            for (int g = 0; g < G; g++) acc[j][g] = (__m512)(x->ot[d0 + j][g] * correction[g]);
        for (int64_t t = 0; t < pairs; t++)
            for (int j = 0; j < D_STEP; j++) {
                const __m512bh v = (__m512bh)_mm512_set1_epi32((int)x->vp[t][d0 + j]);
                for (int g = 0; g < G; g++)
                    acc[j][g] = _mm512_dpbf16_ps(acc[j][g], (__m512bh)_mm512_load_si512(&x->wp[t][g * LANES]), v);
            }
        for (int j = 0; j < D_STEP; j++)
            for (int g = 0; g < G; g++) x->ot[d0 + j][g] = (vec)acc[j][g];
    }
}
#endif

/* Query tokens q_first..q_first+q_count-1 of one sequence (rows from q_start, positions from q_pos0), the
 * query heads of kv head kvh: q_count x group rows, G vectors of them. */
static inline __attribute__((always_inline)) void attend_tile_d(
        void *out, const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int64_t q_start,
        int64_t q_first, int64_t q_count, int64_t q_pos0, int64_t kvh, const shape_t *sh, scratch_t *x, const int G,
        const int64_t D) {
    const int64_t group = sh->num_heads / sh->num_kv_heads, R = q_count * group;
#if defined(__AVX512BF16__)
    const int pairs = sh->bf16 && D % 32 == 0;
#else
    const int pairs = 0;
#endif
    for (int g = 0; g < G; g++) {
        x->max[g] = splat(-INFINITY);
        x->total[g] = splat(0.0f);
        x->pos[g] = splat(-1.0f); /* lanes past the rows: every key masked (their results are never read) */
        x->first[g] = splat(INFINITY);
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = q_first + r / group, h = kvh * group + r % group, g = r / LANES, l = r % LANES;
        const void *src = row_at(q, (q_start + i) * sh->num_heads + h, sh);
        if (pairs)
            for (int64_t d = 0; d < D / 2; d++) x->qp[d][r] = pair_at(src, 2 * d);
        else
            for (int64_t d = 0; d < D; d++)
                x->qt[d][g][l] = sh->bf16 ? bf16_to_float(((const bf16_t *)src)[d]) : ((const float *)src)[d];
        x->pos[g][l] = (float)(q_pos0 + i);
        x->first[g][l] = (float)first_key(q_pos0 + i, sh);
        if (sh->sinks) {
            x->max[g][l] = sh->sinks[h];
            x->total[g][l] = 1.0f;
        }
    }
    for (int64_t r = R; r < G * LANES; r++) /* zeros, not an earlier tile's queries, in the lanes past the rows */
        for (int64_t d = 0; d < D; d++) {
            if (pairs && d < D / 2) x->qp[d][r] = 0;
            x->qt[d][r / LANES][r % LANES] = 0.0f;
        }
    for (int64_t d = 0; d < D; d++)
        for (int g = 0; g < G; g++) x->ot[d][g] = splat(0.0f);
    const int64_t lowest = q_pos0 + q_first, last = lowest + q_count - 1;
    const int64_t reach = first_key(lowest, sh), nearest = first_key(last, sh);
    for (int64_t p0 = reach; p0 <= last; p0 += KEYS) {
        const int64_t n = last + 1 - p0 < KEYS ? last + 1 - p0 : KEYS;
        const void *kr[KEYS + KEY_STEP], *vr[KEYS + KEY_STEP];
        chunk_rows(kr, vr, k_cache, v_cache, table, kvh, p0, n, sh);
        vec correction[ROW_VECS];
        const int mask = p0 + n - 1 > lowest || p0 < nearest;
#if defined(__AVX512BF16__)
        if (pairs) {
            score_bf16(x, (const bf16_t *const *)kr, n, sh->scale, G, D);
            soften(x, p0, n, mask, sh, correction, G);
            weigh_bf16(x, (const bf16_t *const *)vr, n, correction, G, D);
            continue;
        }
#endif
        const float *kf[KEYS + KEY_STEP], *vf[KEYS + KEY_STEP];
        widen_rows(kf, vf, kr, vr, x, n, sh, D);
        score(x, kf, n, sh->scale, G, D);
        soften(x, p0, n, mask, sh, correction, G);
        weigh(x, vf, n, correction, G, D);
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = q_first + r / group, h = kvh * group + r % group, g = r / LANES, l = r % LANES;
        const int64_t at = ((q_start + i) * sh->num_heads + h) * D;
        const float inv = x->total[g][l] > 0 ? 1.0f / x->total[g][l] : 0.0f;
        if (sh->bf16)
            for (int64_t d = 0; d < D; d++) ((bf16_t *)out)[at + d] = float_to_bf16(x->ot[d][g][l] * inv);
        else
            for (int64_t d = 0; d < D; d++) ((float *)out)[at + d] = x->ot[d][g][l] * inv;
    }
}

/* attend_tile_d with the row vectors and the common head sizes as constants, so its loops unroll. */
static void attend_tile(void *out, const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                        int64_t q_start, int64_t q_first, int64_t q_count, int64_t q_pos0, int64_t kvh,
                        const shape_t *sh, scratch_t *x) {
    const int64_t rows = q_count * (sh->num_heads / sh->num_kv_heads), G = (rows + LANES - 1) / LANES;
#define TILE(G_, D) attend_tile_d(out, q, k_cache, v_cache, table, q_start, q_first, q_count, q_pos0, kvh, sh, x, G_, D)
#define HEADS(G_) \
    switch (sh->head_dim) { \
    case 64: TILE(G_, 64); break; \
    case 128: TILE(G_, 128); break; \
    default: TILE(G_, sh->head_dim); \
    }
    switch (G) {
    case 1: HEADS(1); break;
    case 2: HEADS(2); break;
    case 3: HEADS(3); break;
    default: HEADS(4); break;
    }
#undef HEADS
#undef TILE
}

int prefill_attention(void *out, const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                      const int64_t *query_starts, const int64_t *query_lens, const int64_t *context_lens,
                      int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t max_blocks, float scale, int64_t window, int64_t attn_chunk, float softcap, int bf16,
                      int num_threads, const float *sinks) {
    if (head_dim > MAX_HEAD_DIM || head_dim % LANES || head_dim % D_STEP || num_heads % num_kv_heads ||
        num_heads / num_kv_heads > MAX_ROWS)
        return BAD_SHAPE;
    const shape_t sh = {bf16, num_heads, num_kv_heads, head_dim, block_size, scale, softcap, window, attn_chunk, sinks};
    const int64_t tile = MAX_ROWS / (num_heads / num_kv_heads); /* query tokens per item */
    const int64_t items = count_items(query_lens, num_seqs, tile, num_kv_heads);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        if (thread_scratch == NULL) thread_scratch = (scratch_t *)aligned_alloc(64, sizeof(scratch_t));
        scratch_t *x = thread_scratch;
        if (x == NULL) failed = 1;
        /* The last tiles of a sequence attend the most keys: handing out items from the end keeps the
         * longest ones from being left to one thread at the finish. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = items - 1; w >= 0; w--) {
            if (x == NULL) continue;
            int64_t left;
            const int64_t s = item_sequence(w, query_lens, tile, num_kv_heads, &left);
            const int64_t q_first = left / num_kv_heads * tile, kvh = left % num_kv_heads;
            const int64_t q_count = query_lens[s] - q_first < tile ? query_lens[s] - q_first : tile;
            attend_tile(out, q, k_cache, v_cache, block_tables + s * max_blocks, query_starts[s], q_first, q_count,
                        context_lens[s] - query_lens[s], kvh, &sh, x);
        }
    }
    return failed ? NO_MEMORY : OK;
}
