/* Paged attention on the CPU that reads K and V from their cache blocks in place.
 *
 * Why: gathering a sequence's blocks into a padded copy before attending (the SDPA path) moves every
 * context byte three times per layer and step (read, write, read again) and pads to the longest
 * sequence; a decode step is bound by memory bandwidth, so that copy was most of its attention time.
 *
 * One call attends the query rows of several sequences. Sequence s has query_lens[s] query tokens at
 * rows query_starts[s].. of q and out, and context_lens[s] tokens in its cache (its queries are the last
 * ones): query i sits at position context_lens[s] - query_lens[s] + i and attends keys at positions
 * <= its own, within `window` of it when window > 0, and in its own chunk of `attn_chunk` positions when
 * attn_chunk > 0 (Llama 4's local layers: position p sees only p - p % attn_chunk .. p). K/V of key
 * position p live in block block_tables[s * max_blocks + p / block_size], row p % block_size. With `sinks`
 * (gpt-oss; NULL: none), query head h's softmax has one more logit, sinks[h], that attends nothing: a row
 * starts with it as its running max and a weight of 1 in its sum, so the keys' weights sum to less than 1.
 *
 * Work is split over (sequence, tile of query tokens, group of kv heads); every query head of the group
 * (GQA included) is a row of the same work item, so each K/V row is read once for all of them, and with
 * all kv heads in one group (the usual case) a block's K and V are read front to back, as the hardware
 * prefetcher likes. Softmax is the online kind (running max and sum per row), one rescale per chunk of
 * 16 keys; all sums in float32 whatever the storage type. The values are weighed for up to 4 rows of a kv
 * head at once (each V vector loaded once for them, their accumulators in registers). bfloat16: where the
 * CPU has AVX512-BF16 (and head_dim is a multiple of 32) q . k is summed by its dot-product instruction
 * straight from the bfloat16 rows; V rows, and K elsewhere, are widened to float32 as they load. Vectors
 * are GCC's 16-float vector type (AVX-512 registers where the CPU has them, pairs of AVX2 ones otherwise),
 * so head_dim must be a multiple of 16. Built by cpu_kernel.py with -O3 -march=native -ffp-contract=fast
 * -fopenmp.
 *
 * Measured on a 2-core AMD EPYC (Zen 4) VM, one thread, 16 sequences x 2,049 tokens in scattered blocks,
 * SmolLM2's heads, against the version before the changes above: bfloat16 0.5x its time, float32 0.9x
 * (which streams at the memory's rate on that box and is bound by it). Small changes to the code's shape
 * moved this kernel's time by 20% there (register allocation in the loops): time it after editing.
 */
#include <math.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_cpu.h"

#define MAX_ROWS 64  /* query rows per work item: tile tokens x query heads per kv head */
#define MAX_BLOCK 64 /* block_size */
#define MAX_KV_HEADS 16 /* kv heads per work item */
/* Blocks read ahead, into L2 (prefetcht2), a few rows at a time between the rows of arithmetic: measured on
 * a 2-core AMD EPYC (Zen 4) VM, 16 sequences x 2,048 tokens in scattered blocks, one thread, the whole next-
 * but-one block asked for at once took 1.8x as long, into L1 1.7x, no prefetch 2.3x; 1 to 4 blocks ahead
 * were alike, 8 slower. */
#define AHEAD 2
#define PREFETCH_LOCALITY 1

typedef struct { /* one thread's working rows, allocated once per thread */
    float q[MAX_ROWS][MAX_HEAD_DIM], acc[MAX_ROWS][MAX_HEAD_DIM];
    bf16_t qb[MAX_ROWS][MAX_HEAD_DIM]; /* bfloat16 queries as given (AVX512-BF16 dot products) */
    float weight[MAX_ROWS][LANES], max[MAX_ROWS], total[MAX_ROWS]; /* a chunk's softmax weights per row */
    int64_t pos[MAX_ROWS];
} scratch_t;

static _Thread_local scratch_t *thread_scratch;

/* Ask for one block's rows of the item's kv heads of one cache, some blocks before they are read: a
 * sequence's blocks are scattered over the cache, where the hardware prefetcher cannot guess the next. */
static inline void prefetch_rows(const void *cache, int64_t row0, int64_t kv_heads, const shape_t *sh, int64_t from,
                                 int64_t to) {
    const int64_t bytes = kv_heads * sh->head_dim * (sh->bf16 ? 2 : 4);
    const int64_t stride = sh->num_kv_heads * sh->head_dim * (sh->bf16 ? 2 : 4);
    const char *rows = row_at(cache, row0, sh);
    for (int64_t t = from; t < to; t++)
        for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(rows + t * stride + at, 0, PREFETCH_LOCALITY);
}

static inline void prefetch_block(const void *cache, int64_t row0, int64_t kv_heads, const shape_t *sh) {
    prefetch_rows(cache, row0, kv_heads, sh, 0, sh->block_size);
}

typedef struct { /* a later block's rows, asked for a few at a time while a chunk is computed */
    const void *k_cache, *v_cache;
    int64_t row0, kv_heads; /* row0 < 0: none */
} ahead_t;

/* out[t] = the sum of p[t]'s lanes, for 16 vectors at once: four rounds of folding halves together. */
static inline vec sum16(const vec p[LANES]) {
    vec c[8], d[4], e[2];
    for (int i = 0; i < 8; i++)
        c[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shufflevector(d[2 * i], d[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(d[2 * i], d[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* The largest and the sum of a vector's lanes, folding halves together (four steps, not fifteen). */
static inline vec lane_max2(vec a, vec b) {
    ivec more = a > b;
    return (vec)(((ivec)a & more) | ((ivec)b & ~more));
}

static inline float max_lane(vec v) {
    v = lane_max2(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = lane_max2(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = lane_max2(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = lane_max2(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
}

static inline float sum_lanes(vec v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

/* part[t] = lanes whose sum is q_r . k_t, for the chunk's n keys (the rest zero). bfloat16 rows where the
 * CPU has AVX512-BF16: one instruction multiplies 32 bfloat16 pairs and adds them into float32 lanes, with
 * no widening of K (the query row is kept in its own bfloat16 for it). */
static inline __attribute__((always_inline)) void dots(vec part[LANES], const scratch_t *x, int64_t r,
                                                       const void *const *kr, int64_t n, int bf16, const int64_t D) {
#if defined(__AVX512BF16__)
    if (bf16 && D % 32 == 0) {
        for (int64_t t = 0; t < LANES; t++) {
            __m512 dot = _mm512_setzero_ps();
            if (t < n)
                for (int64_t d = 0; d < D; d += 32)
                    dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(&x->qb[r][d]),
                                           (__m512bh)_mm512_loadu_si512((const bf16_t *)kr[t] + d));
            part[t] = (vec)dot;
        }
        return;
    }
#endif
    for (int64_t t = 0; t < LANES; t++) {
        vec dot = splat(0.0f);
        if (t < n)
            for (int64_t d = 0; d < D; d += LANES) dot += load(&x->q[r][d]) * load_row(kr[t], d, bf16);
        part[t] = dot;
    }
}

/* acc[r] += sum_t weight[r][t] * v_t over 16-lane columns d..d+16*C-1, for NR rows r0.. that share the
 * kv head: each V vector is loaded (and widened) once for all of them, and the NR * C accumulators stay
 * in registers, independent chains for the FMA units. */
static inline __attribute__((always_inline)) void weigh_values(scratch_t *x, int64_t r0, const int NR, const int C,
                                                               const void *const *vr, int64_t n, int64_t d, int bf16) {
    vec a[4][4];
    for (int i = 0; i < NR; i++)
        for (int c = 0; c < C; c++) a[i][c] = load(&x->acc[r0 + i][d + c * LANES]);
    for (int64_t t = 0; t < n; t++) {
        vec val[4];
        for (int c = 0; c < C; c++) val[c] = load_row(vr[t], d + c * LANES, bf16);
        for (int i = 0; i < NR; i++) {
            const float w = x->weight[r0 + i][t];
            for (int c = 0; c < C; c++) a[i][c] += w * val[c];
        }
    }
    for (int i = 0; i < NR; i++)
        for (int c = 0; c < C; c++) store(&x->acc[r0 + i][d + c * LANES], a[i][c]);
}

/* weigh_values over whole rows r0..r0+nr-1 (nr <= 4), with constant loop bounds. */
static inline __attribute__((always_inline)) void weigh_rows(scratch_t *x, int64_t r0, int64_t nr,
                                                             const void *const *vr, int64_t n, int bf16, const int64_t D) {
#define ROWS(NR) \
    for (int64_t d = 0; d < D; d += 4 * LANES) { \
        if (d + 4 * LANES <= D) weigh_values(x, r0, NR, 4, vr, n, d, bf16); \
        else for (int64_t e = d; e < D; e += LANES) weigh_values(x, r0, NR, 1, vr, n, e, bf16); \
    }
    switch (nr) {
    case 1: ROWS(1); break;
    case 2: ROWS(2); break;
    case 3: ROWS(3); break;
    default: ROWS(4); break;
    }
#undef ROWS
}

/* One chunk of up to 16 keys (positions p0..p0+n-1) into every row's running softmax: every row's scores
 * first (K's rows read in order), then the values (V's), a kv head's rows up to 4 at a time. k[j][t],
 * v[j][t]: the rows of the item's j-th kv head; rows r..r+group-1 (r a multiple of group) read kv head
 * (r % heads) / group. Measured against scoring a kv head's rows together too (each K row loaded once for
 * them, not once per row): as fast in cache, 5-10% slower streaming from memory (16 x 2,048 tokens). */
static inline __attribute__((always_inline)) void attend_chunk(
        scratch_t *x, int64_t R, int64_t heads, int64_t group, const void *(*k)[MAX_BLOCK], const void *(*v)[MAX_BLOCK],
        int64_t n, int64_t p0, const shape_t *sh, const ahead_t *ahead, const int64_t D) {
    const int bf16 = sh->bf16;
    const vec none = splat(-INFINITY);
    vec position = splat((float)p0);
    for (int t = 0; t < LANES; t++) position[t] += t;
    for (int64_t r = 0; r < R; r++) {
        if (ahead->row0 >= 0) { /* K and V of a later block, a share of its rows between the rows' work */
            prefetch_rows(ahead->k_cache, ahead->row0, ahead->kv_heads, sh, r * sh->block_size / R,
                          (r + 1) * sh->block_size / R);
            prefetch_rows(ahead->v_cache, ahead->row0, ahead->kv_heads, sh, r * sh->block_size / R,
                          (r + 1) * sh->block_size / R);
        }
        vec part[LANES];
        dots(part, x, r, k[(r % heads) / group], n, bf16, D);
        vec score = sum16(part) * sh->scale;
        if (sh->softcap > 0)
            for (int t = 0; t < LANES; t++) score[t] = tanhf(score[t] / sh->softcap) * sh->softcap;
        const float hi = (float)x->pos[r], lo = (float)first_key(x->pos[r], sh);
        ivec keep = (position >= lo) & (position <= hi) & (position < (float)(p0 + n));
        score = (vec)(((ivec)score & keep) | ((ivec)none & ~keep));
        const float chunk_max = max_lane(score);
        if (chunk_max == -INFINITY) { /* every key of the chunk is outside this row's reach */
            store(x->weight[r], splat(0.0f));
            continue;
        }
        if (chunk_max > x->max[r]) {
            const float correction = expf(x->max[r] - chunk_max); /* 0 for the first chunk */
            x->total[r] *= correction;
            for (int64_t d = 0; d < D; d += LANES) store(&x->acc[r][d], load(&x->acc[r][d]) * correction);
            x->max[r] = chunk_max;
        }
        const vec w = exp_nonpositive(score - x->max[r]);
        store(x->weight[r], w);
        x->total[r] += sum_lanes(w);
    }
    const int64_t groups = R / group;
    for (int64_t g = 0; g < groups; g++) {
        const void *const *vr = v[(g * group % heads) / group];
        for (int64_t r = g * group; r < (g + 1) * group; r += 4)
            weigh_rows(x, r, (g + 1) * group - r < 4 ? (g + 1) * group - r : 4, vr, n, bf16, D);
    }
}

/* Query tokens q_first..q_first+q_count-1 of one sequence (flat rows from q_start, positions from
 * q_pos0), query heads kvh0*G.. of kv heads kvh0..kvh0+kv_heads-1: R = q_count * kv_heads * G rows. */
static inline __attribute__((always_inline)) void attend_item_d(
        void *out, const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int64_t q_start,
        int64_t q_first, int64_t q_count, int64_t q_pos0, int64_t kvh0, int64_t kv_heads, const shape_t *sh,
        scratch_t *x, const int64_t D) {
    const int64_t G = sh->num_heads / sh->num_kv_heads, BS = sh->block_size;
    const int64_t heads = kv_heads * G, R = q_count * heads;
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = q_first + r / heads, h = kvh0 * G + r % heads;
        const void *src = row_at(q, (q_start + i) * sh->num_heads + h, sh);
        for (int64_t d = 0; d < D; d += LANES) {
            store(&x->q[r][d], load_row(src, d, sh->bf16));
            store(&x->acc[r][d], splat(0.0f));
        }
        if (sh->bf16) memcpy(x->qb[r], src, D * sizeof(bf16_t));
        x->max[r] = sh->sinks ? sh->sinks[h] : -INFINITY;
        x->total[r] = sh->sinks ? 1.0f : 0.0f;
        x->pos[r] = q_pos0 + i;
    }
    const int64_t last = q_pos0 + q_first + q_count - 1; /* the tile's last query: no key after it */
    const int64_t first = first_key(q_pos0 + q_first, sh); /* the tile's first query reaches furthest back */
    const void *k[MAX_KV_HEADS][MAX_BLOCK], *v[MAX_KV_HEADS][MAX_BLOCK];
    for (int64_t b = first / BS; b <= last / BS; b++) {
        const int64_t p0 = b * BS, n = last + 1 - p0 < BS ? last + 1 - p0 : BS;
        const int64_t row0 = (int64_t)table[b] * BS * sh->num_kv_heads + kvh0;
        if (b == first / BS) /* the first blocks, before the pipeline below fills */
            for (int64_t a = 1; a < AHEAD && b + a <= last / BS; a++) {
                prefetch_block(k_cache, (int64_t)table[b + a] * BS * sh->num_kv_heads + kvh0, kv_heads, sh);
                prefetch_block(v_cache, (int64_t)table[b + a] * BS * sh->num_kv_heads + kvh0, kv_heads, sh);
            }
        const int64_t ahead = b + AHEAD <= last / BS ? (int64_t)table[b + AHEAD] * BS * sh->num_kv_heads + kvh0 : -1;
        for (int64_t j = 0; j < kv_heads; j++)
            for (int64_t t = 0; t < n; t++) {
                k[j][t] = row_at(k_cache, row0 + t * sh->num_kv_heads + j, sh);
                v[j][t] = row_at(v_cache, row0 + t * sh->num_kv_heads + j, sh);
            }
        for (int64_t c = 0; c < n; c += LANES) {
            const void *kc[MAX_KV_HEADS][MAX_BLOCK], *vc[MAX_KV_HEADS][MAX_BLOCK];
            for (int64_t j = 0; j < kv_heads; j++)
                for (int64_t t = 0; t < LANES && c + t < n; t++) {
                    kc[j][t] = k[j][c + t];
                    vc[j][t] = v[j][c + t];
                }
            const ahead_t plan = {k_cache, v_cache, c == 0 ? ahead : -1, kv_heads};
            attend_chunk(x, R, heads, G, kc, vc, n - c < LANES ? n - c : LANES, p0 + c, sh, &plan, D);
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = q_first + r / heads, h = kvh0 * G + r % heads;
        const int64_t at = ((q_start + i) * sh->num_heads + h) * D;
        const float inv = x->total[r] > 0 ? 1.0f / x->total[r] : 0.0f;
        if (sh->bf16) {
            for (int64_t d = 0; d < D; d++) ((bf16_t *)out)[at + d] = float_to_bf16(x->acc[r][d] * inv);
        } else {
            for (int64_t d = 0; d < D; d += LANES) store((float *)out + at + d, load(&x->acc[r][d]) * inv);
        }
    }
}

/* attend_item_d with the common head sizes as constants, so its inner loops unroll. */
static void attend_item(void *out, const void *q, const void *k_cache, const void *v_cache, const int32_t *table,
                        int64_t q_start, int64_t q_first, int64_t q_count, int64_t q_pos0, int64_t kvh0,
                        int64_t kv_heads, const shape_t *sh, scratch_t *x) {
#define ITEM(D) attend_item_d(out, q, k_cache, v_cache, table, q_start, q_first, q_count, q_pos0, kvh0, kv_heads, sh, x, D)
    switch (sh->head_dim) {
    case 64: ITEM(64); break;
    case 128: ITEM(128); break;
    default: ITEM(sh->head_dim);
    }
#undef ITEM
}

int paged_attention(void *out, const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                    const int64_t *query_starts, const int64_t *query_lens, const int64_t *context_lens,
                    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                    int64_t max_blocks, float scale, int64_t window, int64_t attn_chunk, float softcap, int bf16,
                    int num_threads, const float *sinks) {
    if (head_dim > MAX_HEAD_DIM || head_dim % LANES || block_size > MAX_BLOCK || num_heads % num_kv_heads ||
        num_heads / num_kv_heads > MAX_ROWS)
        return BAD_SHAPE;
    const shape_t sh = {bf16, num_heads, num_kv_heads, head_dim, block_size, scale, softcap, window, attn_chunk, sinks};
    const int64_t G = num_heads / num_kv_heads;
    /* kv heads per item: all of them where the rows fit, unless too few items would keep threads busy. */
    int64_t group = num_kv_heads < MAX_ROWS / G ? num_kv_heads : MAX_ROWS / G;
    if (group > MAX_KV_HEADS) group = MAX_KV_HEADS;
    int64_t tile = MAX_ROWS / (group * G), tiles = 0;
    for (int64_t s = 0; s < num_seqs; s++) tiles += (query_lens[s] + tile - 1) / tile;
    if (tiles < 2 * num_threads) { /* one kv head per item: more, smaller items */
        group = 1;
        tile = MAX_ROWS / G;
    }
    const int64_t groups = (num_kv_heads + group - 1) / group;
    const int64_t items = count_items(query_lens, num_seqs, tile, groups);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        if (thread_scratch == NULL) thread_scratch = (scratch_t *)aligned_alloc(64, sizeof(scratch_t));
        scratch_t *x = thread_scratch;
        if (x == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < items; w++) {
            if (x == NULL) continue;
            int64_t left;
            const int64_t s = item_sequence(w, query_lens, tile, groups, &left);
            const int64_t q_first = left / groups * tile, kvh0 = left % groups * group;
            const int64_t q_count = query_lens[s] - q_first < tile ? query_lens[s] - q_first : tile;
            const int64_t kv_heads = num_kv_heads - kvh0 < group ? num_kv_heads - kvh0 : group;
            attend_item(out, q, k_cache, v_cache, block_tables + s * max_blocks, query_starts[s], q_first, q_count,
                        context_lens[s] - query_lens[s], kvh0, kv_heads, &sh, x);
        }
    }
    return failed ? NO_MEMORY : OK;
}
