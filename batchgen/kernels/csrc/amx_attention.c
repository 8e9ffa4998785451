/*
 * Attention on AMX tiles: causal attention of a step's prefill chunks over the paged KV pool
 * (soft-capped where `softcap` > 0: the raw scores capped before the softmax, cap_scores; with a
 * `window`, each row attends from its window's start: an item stages each member's own keys
 * from its first row's window on, and a row block skips the key blocks before all its rows'
 * windows; with `sinks`, each row's softmax starts from its head's sink logit: start_with_sinks),
 * and
 * decode rows over it (the "decode" section below), bfloat16, built where the CPU has AMX-BF16
 * (elsewhere every call returns STATUS_UNSUPPORTED and bg_amx_attention_available says 0).
 * Prefill takes head_dim 64, 128, 192 or 256, decode 64.
 *
 * Layout, signature and statuses: attention_kernel.h, status.h (dtype bfloat16).
 *
 * Units and segments. A group (first, end, prefix) is adjacent sequences whose contexts hold
 * the same blocks for their first `prefix` positions and whose queries all come after them
 * (decode rows among them: one query each): their rows, member by member, are one unit, and that
 * prefix one key segment which every row of the unit sees.
 * Any other sequence is a unit of its own with no prefix. Each member's positions past the
 * prefix are its own segment, which its rows alone see, causally.
 *
 * Work. An item's rows are (unit row, query head) pairs of one kv head, unit row by unit row:
 * an item is (unit, kv head, up to ITEM_BLOCKS row blocks of 16 such rows). The items of a unit
 * and kv head go together, costliest first, those whose cheapest item costs most first.
 * A decode row alone is then one block of `group` rows, whose K/V tiles all its heads share.
 * It stages the keys its rows see (the prefix, and the own positions of the members whose rows
 * it holds, up to its last row's) from the pool into the thread's buffer in tile order, keeping
 * what the thread's item before staged of the same unit and kv head (the prefix; a lone prompt's
 * own keys, which all its items see from the same first key), in key
 * blocks of 32: K as the B operands of the score product (per 16 keys and 32 dims a tile of 16
 * dim pairs x 16 keys, a transpose in 32-bit pairs), then V as the B operands of the value
 * product (per 16 dims a tile of 16 key pairs x 16 dims, the two keys' values side by side);
 * keys past a segment's end are zero and masked. Then every query head of the kv head attends
 * them, row block by row block, while they are in the core's cache (staged for the whole step
 * first, a step of 64 grouped decode rows took 1.7 ms a layer, its staging past the cache).
 * At head_dim 64 a row block keeps its queries in two tiles and its 16 x 64 output in four
 * float32 accumulator tiles across all its key blocks; per key block: two 16 x 16 score tiles,
 * the softmax in AVX-512 over the stored scores, then one product of the probabilities (bf16)
 * with the four V tiles. A larger head keeps its queries and accumulators in memory: each score
 * tile loads the query tiles 32 dims at a time, and the value product runs 64 dims at a time,
 * its four accumulator tiles loaded before and stored after.
 *
 * Softmax. Scores are in log2 units (scale * log2(e)). A row's probabilities are
 * 2^(score - m) for a reference m that moves only when a score exceeds it by more than
 * RESCALE_LOG2: then m becomes the row's max so far, and its sum and accumulator row are
 * multiplied by 2^(old m - new m) (the tiles stored, scaled, loaded back). Probabilities stay
 * below 2^RESCALE_LOG2, so nothing overflows, and the result is the same softmax.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_kernel.h"
#include "vector_math.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "amx.h"
#include "lanes16.h"

#define HEAD_DIM 64                            /* the decode's head size; the prefill's with its queries and
                                                  accumulators in tile registers */
#define MAX_HEAD_DIM 256                       /* the prefill's largest (a multiple of HEAD_DIM) */
#define BLOCK_ROWS 16                          /* query rows of a row block: one tile's rows */
#define BLOCK_KEYS 32                          /* keys of a key block: one bf16 A tile's row */
#define ITEM_BLOCKS 24                         /* row blocks of a work item: 128 unit rows of a kv head with 3 query heads */
#define RESCALE_LOG2 8.0f                      /* the reference max moves past this excess */
#define TILE_BYTES 1024                        /* 16 rows of 64 bytes */

/* Tile registers: the row block's output (dims 16j .. 16j + 15 in tmm j), its queries (dims
 * 0-31, 32-63), the scores then probabilities, and one K or V operand. */
#define Q_LOW 4
#define Q_HIGH 5
#define SCORES 6
#define OPERAND 7

typedef struct {
    const uint16_t *q;
    uint16_t *out;
    const char *k_cache, *v_cache; /* bf16 rows, or int8 rows with their scale where int8_rows */
    const int32_t *block_tables, *context_lens, *query_starts, *query_lens;
    int64_t *unit_rows; /* [num_seqs] each sequence's first row among its unit's rows */
    int num_heads, num_kv_heads, num_blocks, block_size, max_blocks;
    float scale_log2; /* the softmax scale times log2(e) */
    float softcap;    /* 0: none; else each raw score s becomes c tanh(s / c), c = softcap / scale */
    int window;       /* 0: none; else a row at position t sees positions t - window + 1 .. t */
    const float *sinks; /* NULL: none; else [num_heads] one more logit per query head, no value with it */
    int head_dim;       /* a multiple of HEAD_DIM, at most MAX_HEAD_DIM */
    int int8_rows;      /* the pool holds kv_int8's rows: head_dim int8 values, then their float32 scale */
} Problem;

/* The bytes of a staged key block: head_dim / 16 K tiles (key half x 32 dims), then head_dim / 16
 * V tiles (16 dims each). */
static inline int64_t key_block_bytes(const Problem *p) { return (int64_t)p->head_dim / 8 * TILE_BYTES; }

/* The offset of a staged key block's V tiles, after its K tiles. */
static inline int64_t value_offset(const Problem *p) { return key_block_bytes(p) / 2; }

/* Whether a row block's queries and accumulators stay in tile registers (head_dim HEAD_DIM);
 * larger heads keep them in memory, loading each tile as a product needs it. */
static inline int in_tiles(const Problem *p) { return p->head_dim == HEAD_DIM; }

typedef struct {
    int first, end, prefix;   /* member sequences first .. end - 1, sharing positions [0, prefix) */
    int64_t num_rows;         /* the members' query rows */
} Unit;

/* A thread's staged keys, of unit `unit` and kv head `kv_head` (-1: none yet): the prefix, then
 * the own keys of members first .. end - 1 (those whose rows meet the item's) as far as the
 * item's rows see them, or further where an item before it of the same unit and kv head staged
 * more (rows attend to their own keys alone, so more staged keys change nothing). */
typedef struct {
    int unit, kv_head;
    int first, end;
    int *own_from;            /* [end - first] the first own key staged (the item's first row's window) */
    int *own_keys;            /* [end - first] own keys staged, from own_from on */
    int64_t *own_offsets;     /* [end - first] byte offsets of their segments */
    char *keys;               /* the tile-order buffer */
    int64_t capacity;         /* its bytes */
} Staged;

/* A row block's state across its key blocks. */
typedef struct {
    _Alignas(64) float scores[2][BLOCK_ROWS * BLOCK_KEYS]; /* a key block's, and the next one's */
    _Alignas(64) uint16_t probs[BLOCK_ROWS * BLOCK_KEYS];
    _Alignas(64) float acc[BLOCK_ROWS * MAX_HEAD_DIM]; /* the accumulators (row stride head_dim) */
    _Alignas(64) float sums[BLOCK_ROWS * 16];       /* each row's sum, as 16 partial sums */
    _Alignas(64) uint16_t q[BLOCK_ROWS * MAX_HEAD_DIM];
    float max[BLOCK_ROWS];                          /* each row's reference max (-inf: none yet) */
    float bound[BLOCK_ROWS];                        /* the raw score past which it moves */
    float factor[BLOCK_ROWS];                       /* the accumulator factor of a row whose max moved */
    int is_empty;                                   /* no key block accumulated yet */
} BlockState;

/* Every tile register 64 bytes wide; tmm0-3 (the prefill's accumulators, the decode's
 * accumulators and probabilities) `low_rows` rows, tmm4-7 16. */
static void configure_tiles(int low_rows) {
    TileConfig config = {.palette_id = 1};
    for (int t = 0; t < 8; t++) config.rows[t] = (uint8_t)(t < 4 ? low_rows : 16), config.bytes_per_row[t] = 64;
    _tile_loadconfig(&config);
}

/* ---- staging ---- */

/* The pool row of position `pos` of the sequence with `table`, kv head `kv_head`; NULL where the
 * block id is outside the pool. */
static const char *pool_row(const Problem *p, const char *cache, const int32_t *table, int pos, int kv_head) {
    int32_t block = table[pos / p->block_size];
    if (block < 0 || block >= p->num_blocks) return NULL;
    int64_t slot = (int64_t)block * p->block_size + pos % p->block_size;
    int64_t row_bytes = p->int8_rows ? p->head_dim + SCALE_BYTES : 2 * p->head_dim;
    return cache + (slot * p->num_kv_heads + kv_head) * row_bytes;
}

/* A row's dims d .. d + 15 as bf16 (zero for a NULL row). */
static inline __m256i row_dims16(const Problem *p, const char *row, int d) {
    if (row == NULL) return _mm256_setzero_si256();
    if (!p->int8_rows) return _mm256_loadu_si256((const __m256i *)(row + 2 * d));
    float scale;
    memcpy(&scale, row + p->head_dim, sizeof scale);
    return dequantize16((const int8_t *)row + d, _mm512_set1_ps(scale));
}

/* A row's dims d .. d + 31 as bf16 (zero for a NULL row). */
static inline __m512i row_dims32(const Problem *p, const char *row, int d) {
    if (row == NULL) return _mm512_setzero_si512();
    if (!p->int8_rows) return _mm512_loadu_si512(row + 2 * d);
    return _mm512_inserti64x4(_mm512_castsi256_si512(row_dims16(p, row, d)), row_dims16(p, row, d + 16), 1);
}

/* Positions first .. first + n - 1 of the sequence with `table` (kv head `kv_head`) into tile
 * order at `dst` (ceil(n / 32) key blocks). Returns STATUS_BAD_BLOCK_ID for a block id outside
 * the pool. */
static int stage_segment(const Problem *p, const int32_t *table, int first, int n, int kv_head, char *dst) {
    __m512i interleave_index;
    {
        uint16_t index[32];
        for (int c = 0; c < 16; c++) index[2 * c] = (uint16_t)c, index[2 * c + 1] = (uint16_t)(16 + c);
        interleave_index = _mm512_loadu_si512(index);
    }
    const int dim_tiles = p->head_dim / 32;
    for (int k0 = 0; k0 < n; k0 += BLOCK_KEYS, dst += key_block_bytes(p)) {
        const char *k_rows[BLOCK_KEYS], *v_rows[BLOCK_KEYS];
        for (int i = 0; i < BLOCK_KEYS; i++) {
            k_rows[i] = v_rows[i] = NULL;
            if (k0 + i >= n) continue;
            k_rows[i] = pool_row(p, p->k_cache, table, first + k0 + i, kv_head);
            v_rows[i] = pool_row(p, p->v_cache, table, first + k0 + i, kv_head);
            if (k_rows[i] == NULL) return STATUS_BAD_BLOCK_ID;
        }
        for (int half = 0; half < 2; half++)     /* keys 16 half .. + 15 */
            for (int dims = 0; dims < dim_tiles; dims++) { /* dims 32 dims .. + 31 */
                __m512i r[16];
                for (int i = 0; i < 16; i++) r[i] = row_dims32(p, k_rows[16 * half + i], 32 * dims);
                transpose_dwords(r);
                char *tile = dst + (half * dim_tiles + dims) * TILE_BYTES;
                for (int i = 0; i < 16; i++) _mm512_store_si512(tile + 64 * i, r[i]);
            }
        for (int pair = 0; pair < 16; pair++) {
            const char *a = v_rows[2 * pair], *b = v_rows[2 * pair + 1];
            for (int j = 0; j < p->head_dim / 16; j++) {
                __m256i first_key = row_dims16(p, a, 16 * j), second_key = row_dims16(p, b, 16 * j);
                __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(first_key), second_key, 1);
                _mm512_store_si512(dst + value_offset(p) + j * TILE_BYTES + 64 * pair,
                                   _mm512_permutexvar_epi16(interleave_index, both));
            }
        }
    }
    return STATUS_OK;
}

static int key_blocks(int n) { return (n + BLOCK_KEYS - 1) / BLOCK_KEYS; }

/* The length of member `seq`'s own segment (its positions from the unit's prefix on). */
static int own_length(const Problem *p, const Unit *u, int seq) { return p->context_lens[seq] - u->prefix; }

/* The own keys member `seq` of unit `u` sees from its rows up to unit row `end_row` (exclusive). */
static int own_keys_seen(const Problem *p, const Unit *u, int seq, int64_t end_row) {
    int64_t past = p->unit_rows[seq] + p->query_lens[seq] - end_row; /* its rows past end_row */
    return own_length(p, u, seq) - (past > 0 ? (int)past : 0);
}

/* The first key of a row at `position` that its window lets it see (0 without a window). */
static inline int window_start(const Problem *p, int64_t position) {
    return p->window > 0 && position - p->window + 1 > 0 ? (int)(position - p->window + 1) : 0;
}

/* The first own key of member `seq` of unit `u` that its rows from unit row `first_row` on see:
 * its first such row's window start (0 without a window). */
static int own_keys_from(const Problem *p, const Unit *u, int seq, int64_t first_row) {
    int64_t row = first_row > p->unit_rows[seq] ? first_row : p->unit_rows[seq];
    return window_start(p, own_length(p, u, seq) - p->query_lens[seq] + (row - p->unit_rows[seq])); /* its own key */
}

/* Positions first .. first + count - 1 of the sequence with `table` into the segment at `dst`,
 * which holds the first `kept` of them already: none staged where kept >= count, else those from
 * the last whole key block of the kept on. */
static int stage_rest(const Problem *p, const int32_t *table, int first, int kept, int count, int kv_head, char *dst) {
    const int done = kept / BLOCK_KEYS * BLOCK_KEYS;
    if (kept >= count) return STATUS_OK;
    return stage_segment(p, table, first + done, count - done, kv_head,
                         dst + (int64_t)(done / BLOCK_KEYS) * key_block_bytes(p));
}

/* The keys seen by unit rows first_row .. end_row - 1 of unit `unit_index` (`u`) for `kv_head`,
 * into `staged` (its buffer grown as needed): the prefix, and each member's own keys from its
 * first row's window on. What the thread's item before staged of the same unit and kv head is
 * kept: the prefix, and where both items hold one member's rows, its own keys from the same
 * first key (a lone prompt's items: a later one that sees more keys stages only those past the
 * last whole key block). Returns a STATUS_* code. */
static int stage_item(const Problem *p, const Unit *u, int unit_index, int kv_head, int64_t first_row, int64_t end_row,
                      Staged *staged) {
    const int same_unit = staged->unit == unit_index && staged->kv_head == kv_head;
    staged->unit = staged->kv_head = -1; /* until it is all staged */
    int first = u->end, end = u->first;
    for (int seq = u->first; seq < u->end; seq++)
        if (p->unit_rows[seq] < end_row && p->unit_rows[seq] + p->query_lens[seq] > first_row) {
            first = seq < first ? seq : first;
            end = seq + 1;
        }
    int kept = 0; /* own keys of member `first` kept, where it is the only one, as before */
    if (same_unit && end - first == 1 && staged->first == first && staged->end == end &&
        staged->own_from[0] == own_keys_from(p, u, first, first_row))
        kept = staged->own_keys[0];
    int64_t bytes = (int64_t)key_blocks(u->prefix) * key_block_bytes(p);
    for (int seq = first; seq < end; seq++) {
        const int i = seq - first, from = own_keys_from(p, u, seq, first_row), count = own_keys_seen(p, u, seq, end_row) - from;
        staged->own_offsets[i] = bytes;
        staged->own_from[i] = from;
        staged->own_keys[i] = count > kept ? count : kept;
        bytes += (int64_t)key_blocks(staged->own_keys[i]) * key_block_bytes(p);
    }
    staged->first = first, staged->end = end;
    if (bytes > staged->capacity) {
        char *keys = (char *)aligned_alloc(64, (size_t)bytes);
        if (keys == NULL) return STATUS_NO_MEMORY;
        if (same_unit) memcpy(keys, staged->keys, (size_t)staged->capacity);
        free(staged->keys);
        staged->keys = keys, staged->capacity = bytes;
    }
    int code = same_unit ? STATUS_OK
                         : stage_segment(p, p->block_tables + (int64_t)u->first * p->max_blocks, 0, u->prefix, kv_head,
                                         staged->keys);
    for (int seq = first; seq < end && code == STATUS_OK; seq++)
        code = stage_rest(p, p->block_tables + (int64_t)seq * p->max_blocks, u->prefix + staged->own_from[seq - first],
                          kept, staged->own_keys[seq - first], kv_head, staged->keys + staged->own_offsets[seq - first]);
    if (code == STATUS_OK) staged->unit = unit_index, staged->kv_head = kv_head;
    return code;
}

/* ---- one row block ---- */

/* A row block: up to 16 of its item's rows, each a unit row with one query head of the kv head
 * (row i of a unit: unit row i / group, head i % group of the kv head's). */
typedef struct {
    int rows;
    int64_t unit_row[BLOCK_ROWS];
    int64_t packed[BLOCK_ROWS]; /* the unit row's packed row of q and out */
    int head[BLOCK_ROWS];
} RowBlock;

static void row_block(const Problem *p, const Unit *u, int kv_head, int64_t first, int rows, RowBlock *block) {
    int group = p->num_heads / p->num_kv_heads;
    block->rows = rows;
    for (int r = 0; r < rows; r++)
        block->unit_row[r] = (first + r) / group, block->head[r] = kv_head * group + (int)((first + r) % group);
    for (int seq = u->first; seq < u->end; seq++) {
        int64_t start = p->unit_rows[seq], end = start + p->query_lens[seq];
        if (start > block->unit_row[rows - 1] || end <= block->unit_row[0]) continue;
        for (int r = 0; r < rows; r++)
            if (block->unit_row[r] >= start && block->unit_row[r] < end)
                block->packed[r] = p->query_starts[seq] + (block->unit_row[r] - start);
    }
}

static void load_queries(const Problem *p, const RowBlock *block, BlockState *b) {
    const int d = p->head_dim;
    for (int r = 0; r < BLOCK_ROWS; r++) {
        uint16_t *dst = b->q + r * d;
        if (r < block->rows) memcpy(dst, p->q + (block->packed[r] * p->num_heads + block->head[r]) * d, 2 * d);
        else memset(dst, 0, 2 * d);
    }
    if (in_tiles(p)) {
        _tile_loadd(Q_LOW, b->q, 2 * HEAD_DIM);
        _tile_loadd(Q_HIGH, b->q + 32, 2 * HEAD_DIM);
    }
}

static void reset_state(const Problem *p, BlockState *b) {
    if (in_tiles(p)) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        memset(b->acc, 0, sizeof(float) * BLOCK_ROWS * p->head_dim);
    }
    for (int r = 0; r < BLOCK_ROWS; r++) b->max[r] = b->bound[r] = -INFINITY;
    memset(b->sums, 0, sizeof(b->sums));
    b->is_empty = 1;
}

/* Scores of the row block's queries with the key block's 32 keys, into `scores` [16][32]: per
 * 16 keys, the products of 32 dims at a time (the query tiles loaded for each where they are not
 * held in tiles). */
static void score_tiles(const Problem *p, const char *key_block, const BlockState *b, float *scores) {
    const int dim_tiles = p->head_dim / 32, q_stride = 2 * p->head_dim;
    for (int half = 0; half < 2; half++) {
        _tile_zero(SCORES);
        for (int d = 0; d < dim_tiles; d += 2) {
            const char *k_tiles = key_block + (half * dim_tiles + d) * TILE_BYTES;
            if (!in_tiles(p)) _tile_loadd(Q_LOW, b->q + 32 * d, q_stride);
            _tile_loadd(OPERAND, k_tiles, 64);
            _tile_dpbf16ps(SCORES, Q_LOW, OPERAND);
            if (!in_tiles(p)) _tile_loadd(Q_HIGH, b->q + 32 * (d + 1), q_stride);
            _tile_loadd(OPERAND, k_tiles + TILE_BYTES, 64);
            _tile_dpbf16ps(SCORES, Q_HIGH, OPERAND);
        }
        _tile_stored(SCORES, scores + 16 * half, 4 * BLOCK_KEYS);
    }
}

static inline __mmask16 first_lanes(int count) {
    return count >= 16 ? (__mmask16)0xffff : count <= 0 ? (__mmask16)0 : (__mmask16)((1u << count) - 1);
}

/* The softmax step of a key block of which row r sees keys hidden[r] .. visible[r] - 1 (none
 * where visible[r] <= max(hidden[r], 0), all for hidden[r] <= 0 and visible[r] >= 32): the
 * probabilities into b->probs (bf16, 0 where masked), the sums, and the factor of each row whose
 * reference max moved. Returns those rows as a bit mask. */
static unsigned softmax_block(const float *scores, const int *hidden, const int *visible, float scale_log2,
                              BlockState *b) {
    unsigned moved = 0;
    const __m512 scale = _mm512_set1_ps(scale_log2), none = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < BLOCK_ROWS; r++) {
        if (visible[r] <= 0 || visible[r] <= hidden[r]) {
            _mm512_store_si512(b->probs + r * BLOCK_KEYS, _mm512_setzero_si512());
            continue;
        }
        int is_partial = visible[r] < BLOCK_KEYS || hidden[r] > 0;
        __mmask16 low = first_lanes(visible[r]) & ~first_lanes(hidden[r]);
        __mmask16 high = first_lanes(visible[r] - 16) & ~first_lanes(hidden[r] - 16);
        __m512 s0 = _mm512_load_ps(scores + r * BLOCK_KEYS), s1 = _mm512_load_ps(scores + r * BLOCK_KEYS + 16);
        if (is_partial) s0 = _mm512_mask_mov_ps(none, low, s0), s1 = _mm512_mask_mov_ps(none, high, s1);
        __m512 row_max = _mm512_max_ps(s0, s1);
        if (_mm512_cmp_ps_mask(row_max, _mm512_set1_ps(b->bound[r]), _CMP_GT_OQ)) {
            float reference = b->max[r], new_max = fmaxf(reference, _mm512_reduce_max_ps(row_max) * scale_log2);
            float factor = reference == -INFINITY ? 0.0f : exp2f(reference - new_max);
            float *sums = b->sums + 16 * r;
            _mm512_store_ps(sums, _mm512_mul_ps(_mm512_load_ps(sums), _mm512_set1_ps(factor)));
            b->factor[r] = factor, b->max[r] = new_max, b->bound[r] = (new_max + RESCALE_LOG2) / scale_log2;
            moved |= 1u << r;
        }
        __m512 shift = _mm512_set1_ps(b->max[r]);
        __m512 e0 = exp2_16(_mm512_fmsub_ps(s0, scale, shift)), e1 = exp2_16(_mm512_fmsub_ps(s1, scale, shift));
        if (is_partial) e0 = _mm512_maskz_mov_ps(low, e0), e1 = _mm512_maskz_mov_ps(high, e1);
        float *sums = b->sums + 16 * r;
        _mm512_store_ps(sums, _mm512_add_ps(_mm512_load_ps(sums), _mm512_add_ps(e0, e1)));
        _mm512_store_si512(b->probs + r * BLOCK_KEYS, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)); /* e0's 16, then e1's */
    }
    return moved;
}

/* Accumulator tiles 0-3 (64 dims) to and from `acc`, rows `row_bytes` apart. */
static void store_accumulators(float *acc, int row_bytes) {
    _tile_stored(0, acc, row_bytes);
    _tile_stored(1, acc + 16, row_bytes);
    _tile_stored(2, acc + 32, row_bytes);
    _tile_stored(3, acc + 48, row_bytes);
}

static void load_accumulators(const float *acc, int row_bytes) {
    _tile_loadd(0, acc, row_bytes);
    _tile_loadd(1, acc + 16, row_bytes);
    _tile_loadd(2, acc + 32, row_bytes);
    _tile_loadd(3, acc + 48, row_bytes);
}

/* Each `moved` row's accumulator row times its factor (tiles held in registers stored, scaled,
 * loaded back). */
static void rescale_accumulators(const Problem *p, unsigned moved, BlockState *b) {
    const int d = p->head_dim;
    if (in_tiles(p)) store_accumulators(b->acc, 4 * HEAD_DIM);
    for (int r = 0; r < BLOCK_ROWS; r++) {
        if (!(moved >> r & 1)) continue;
        __m512 factor = _mm512_set1_ps(b->factor[r]);
        for (int j = 0; j < d; j += 16)
            _mm512_store_ps(b->acc + r * d + j, _mm512_mul_ps(_mm512_load_ps(b->acc + r * d + j), factor));
    }
    if (in_tiles(p)) load_accumulators(b->acc, 4 * HEAD_DIM);
}

/* The accumulators += the probabilities' product with the key block's values, 64 dims (four
 * accumulator tiles) at a time; accumulators not held in tiles are loaded and stored around it. */
static void value_tiles(const Problem *p, const char *key_block, BlockState *b) {
    const char *v_tiles = key_block + value_offset(p);
    _tile_loadd(SCORES, b->probs, 2 * BLOCK_KEYS);
    for (int j = 0; j < p->head_dim; j += HEAD_DIM, v_tiles += 4 * TILE_BYTES) {
        if (!in_tiles(p)) load_accumulators(b->acc + j, 4 * p->head_dim);
        _tile_loadd(OPERAND, v_tiles, 64);
        _tile_dpbf16ps(0, SCORES, OPERAND);
        _tile_loadd(OPERAND, v_tiles + TILE_BYTES, 64);
        _tile_dpbf16ps(1, SCORES, OPERAND);
        _tile_loadd(OPERAND, v_tiles + 2 * TILE_BYTES, 64);
        _tile_dpbf16ps(2, SCORES, OPERAND);
        _tile_loadd(OPERAND, v_tiles + 3 * TILE_BYTES, 64);
        _tile_dpbf16ps(3, SCORES, OPERAND);
        if (!in_tiles(p)) store_accumulators(b->acc + j, 4 * p->head_dim);
    }
}

/* The soft-cap on a key block's raw scores in place: s -> c tanh(s / c), c = p->softcap (the
 * scaled score x then becomes softcap tanh(x / softcap)); tanh(y) = 1 - 2 / (2^(2 y log2(e)) + 1)
 * through exp2_16 (|y| clamped at 9, where tanh is 1 in float32). */
static void cap_scores(const Problem *p, float *scores) {
    const __m512 inverse = _mm512_set1_ps(1.0f / p->softcap), cap = _mm512_set1_ps(p->softcap);
    const __m512 limit = _mm512_set1_ps(9.0f), one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f);
    const __m512 two_log2e = _mm512_set1_ps(2.0f * LOG2E);
    for (int i = 0; i < BLOCK_ROWS * BLOCK_KEYS; i += 16) {
        __m512 y = _mm512_mul_ps(_mm512_load_ps(scores + i), inverse);
        y = _mm512_min_ps(_mm512_max_ps(y, _mm512_sub_ps(_mm512_setzero_ps(), limit)), limit);
        __m512 e = exp2_16(_mm512_mul_ps(y, two_log2e));
        __m512 tanh = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(e, one)));
        _mm512_store_ps(scores + i, _mm512_mul_ps(cap, tanh));
    }
}

/* The row block attends to a staged segment of which row r sees keys start[r] .. limit[r] - 1
 * (none where limit[r] <= start[r]); key blocks before every row's start are skipped. The next
 * key block's scores are asked of the tiles before this one's softmax, which does not wait for
 * them: the two overlap. */
static void attend_segment(const Problem *p, const char *segment, const int *start, const int *limit,
                           BlockState *b) {
    int most = 0, least = INT32_MAX;
    for (int r = 0; r < BLOCK_ROWS; r++)
        if (limit[r] > start[r]) {
            most = limit[r] > most ? limit[r] : most;
            least = start[r] < least ? start[r] : least;
        }
    if (most == 0) return;
    int first = least / BLOCK_KEYS * BLOCK_KEYS;
    score_tiles(p, segment + (first / BLOCK_KEYS) * key_block_bytes(p), b, b->scores[0]);
    for (int k0 = first, i = 0; k0 < most; k0 += BLOCK_KEYS, i ^= 1) {
        const char *key_block = segment + (k0 / BLOCK_KEYS) * key_block_bytes(p);
        if (k0 + BLOCK_KEYS < most) score_tiles(p, key_block + key_block_bytes(p), b, b->scores[i ^ 1]);
        int hidden[BLOCK_ROWS], visible[BLOCK_ROWS];
        for (int r = 0; r < BLOCK_ROWS; r++) hidden[r] = start[r] - k0, visible[r] = limit[r] - k0;
        if (p->softcap > 0.0f) cap_scores(p, b->scores[i]);
        unsigned moved = softmax_block(b->scores[i], hidden, visible, p->scale_log2, b);
        if (moved && !b->is_empty) rescale_accumulators(p, moved, b);
        value_tiles(p, key_block, b);
        b->is_empty = 0;
    }
}

/* Each real row's output: its accumulator row over its sum, as bf16. */
static void store_rows(const Problem *p, const RowBlock *block, BlockState *b) {
    const int d = p->head_dim;
    if (in_tiles(p)) store_accumulators(b->acc, 4 * HEAD_DIM);
    for (int r = 0; r < block->rows; r++) {
        __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(b->sums + 16 * r)));
        uint16_t *dst = p->out + (block->packed[r] * p->num_heads + block->head[r]) * d;
        for (int j = 0; j < d; j += 16)
            _mm256_storeu_si256((__m256i *)(dst + j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(b->acc + r * d + j), inverse)));
    }
}

/* Each real row's softmax state before any key where the heads have sinks: its head's sink
 * logit as the reference max, with a sum of 1 (the sink's own term, which no value goes with). */
static void start_with_sinks(const Problem *p, const RowBlock *block, BlockState *b) {
    for (int r = 0; r < block->rows; r++) {
        b->max[r] = p->sinks[block->head[r]] * LOG2E;
        b->bound[r] = (b->max[r] + RESCALE_LOG2) / p->scale_log2;
        b->sums[16 * r] = 1.0f;
    }
}

/* Rows first .. first + rows - 1 (rows <= 16) of an item of unit `u` and kv head `kv_head`,
 * over the keys `staged` for them: the prefix, then each member's own keys (staged from
 * own_from on), each row from its window's start. */
static void attend_block(const Problem *p, const Unit *u, const Staged *staged, int kv_head, int64_t first, int rows,
                         BlockState *b) {
    int start[BLOCK_ROWS], limit[BLOCK_ROWS];
    int64_t own[BLOCK_ROWS]; /* each real row's own key (its position past the prefix); -1: padding */
    RowBlock block;
    row_block(p, u, kv_head, first, rows, &block);
    load_queries(p, &block, b);
    reset_state(p, b);
    if (p->sinks) start_with_sinks(p, &block, b);
    for (int r = 0; r < BLOCK_ROWS; r++) own[r] = -1;
    for (int seq = staged->first; seq < staged->end; seq++) {
        int64_t member_first = p->unit_rows[seq], member_end = member_first + p->query_lens[seq];
        for (int r = 0; r < rows; r++) /* unit row member_first + i sits at own key length - query_len + i */
            if (block.unit_row[r] >= member_first && block.unit_row[r] < member_end)
                own[r] = own_length(p, u, seq) - p->query_lens[seq] + (block.unit_row[r] - member_first);
    }
    if (u->prefix > 0) {
        for (int r = 0; r < BLOCK_ROWS; r++)
            start[r] = own[r] < 0 ? 0 : window_start(p, u->prefix + own[r]), limit[r] = own[r] < 0 ? 0 : u->prefix;
        attend_segment(p, staged->keys, start, limit, b);
    }
    for (int seq = staged->first; seq < staged->end; seq++) {
        int64_t member_first = p->unit_rows[seq], member_end = member_first + p->query_lens[seq];
        if (member_first > block.unit_row[rows - 1] || member_end <= block.unit_row[0]) continue;
        int from = staged->own_from[seq - staged->first];
        for (int r = 0; r < BLOCK_ROWS; r++) {
            int is_member = r < rows && block.unit_row[r] >= member_first && block.unit_row[r] < member_end;
            start[r] = is_member ? window_start(p, own[r]) - from : 0;
            limit[r] = is_member ? (int)(own[r] + 1 - from) : 0;
            start[r] = start[r] > 0 ? start[r] : 0;
        }
        attend_segment(p, staged->keys + staged->own_offsets[seq - staged->first], start, limit, b);
    }
    store_rows(p, &block, b);
}

/* ---- planning ---- */

typedef struct {
    int unit, kv_head, first_block;
    int64_t cost, least_cost; /* its own; the cheapest of its unit's items for its kv head */
} Item;

/* The work order: a unit and kv head's items together (a thread's items in a row keep what it
 * staged), those whose cheapest item costs most first, and each one's items costliest first. */
static int in_work_order(const void *a, const void *b) {
    const Item *x = (const Item *)a, *y = (const Item *)b;
    if (x->least_cost != y->least_cost) return x->least_cost < y->least_cost ? 1 : -1;
    if (x->unit != y->unit) return x->unit - y->unit;
    if (x->kv_head != y->kv_head) return x->kv_head - y->kv_head;
    return (x->cost < y->cost) - (x->cost > y->cost);
}

/* Checks the sequences and groups and lays out the units (as many as returned, into `units`),
 * each sequence's first row among its unit's rows into p->unit_rows. Returns the unit count, or
 * -STATUS_* when an input is refused. */
static int plan_units(Problem *p, int num_seqs, const int32_t *groups, int num_groups, Unit *units) {
    for (int seq = 0; seq < num_seqs; seq++)
        if (p->query_lens[seq] < 1 || p->query_lens[seq] > p->context_lens[seq] ||
            p->context_lens[seq] > (int64_t)p->max_blocks * p->block_size)
            return -STATUS_BAD_CONTEXT_LEN;
    int num_units = 0, g = 0;
    for (int seq = 0; seq < num_seqs;) {
        Unit u = {seq, seq + 1, 0, 0};
        if (g < num_groups && groups[3 * g] == seq) {
            u.end = groups[3 * g + 1], u.prefix = groups[3 * g + 2], g++;
            if (u.end > num_seqs || u.end - u.first < 2 || u.prefix < 1) return -STATUS_BAD_GROUP;
        }
        for (int member = u.first; member < u.end; member++) {
            const int32_t *table = p->block_tables + (int64_t)member * p->max_blocks;
            int own = own_length(p, &u, member);
            if (own < p->query_lens[member] || memcmp(table, p->block_tables + (int64_t)u.first * p->max_blocks,
                       sizeof(int32_t) * ((u.prefix + p->block_size - 1) / p->block_size)))
                return -STATUS_BAD_GROUP;
            p->unit_rows[member] = u.num_rows;
            u.num_rows += p->query_lens[member];
        }
        units[num_units++] = u;
        seq = u.end;
    }
    return g == num_groups ? num_units : -STATUS_BAD_GROUP; /* a group out of order or overlapping */
}

/* The keys unit row `row` of unit `u` sees: its member's context up to it. */
static int64_t keys_seen(const Problem *p, const Unit *u, int64_t row) {
    int seq = u->first;
    while (seq + 1 < u->end && p->unit_rows[seq + 1] <= row) seq++;
    return p->context_lens[seq] - (p->unit_rows[seq] + p->query_lens[seq] - 1 - row);
}

/* Work items of every unit, in `in_work_order`: (unit, kv head, first row block), each costing
 * its rows times the keys its last unit row sees; returns their count. */
static int plan_items(const Problem *p, const Unit *units, int num_units, Item *items) {
    int num_items = 0, group = p->num_heads / p->num_kv_heads;
    for (int u = 0; u < num_units; u++) {
        int64_t blocks = (units[u].num_rows * group + BLOCK_ROWS - 1) / BLOCK_ROWS, least_cost = INT64_MAX;
        for (int64_t block = 0; block < blocks; block += ITEM_BLOCKS) {
            int64_t rows = blocks - block < ITEM_BLOCKS ? blocks - block : ITEM_BLOCKS;
            int64_t last = (block + rows) * BLOCK_ROWS / group;
            int64_t seen = keys_seen(p, &units[u], (last < units[u].num_rows ? last : units[u].num_rows) - 1);
            int64_t cost = rows * (seen > 1 ? seen : 1);
            for (int kv_head = 0; kv_head < p->num_kv_heads; kv_head++)
                items[num_items++] = (Item){u, kv_head, (int)block, cost, 0};
            least_cost = cost < least_cost ? cost : least_cost;
        }
        for (int i = num_items - 1; i >= 0 && items[i].unit == u; i--) items[i].least_cost = least_cost;
    }
    qsort(items, num_items, sizeof(Item), in_work_order);
    return num_items;
}

static int item_count(const Unit *units, int num_units, int num_heads, int num_kv_heads) {
    int count = 0, group = num_heads / num_kv_heads;
    for (int u = 0; u < num_units; u++)
        count += (int)((units[u].num_rows * group + BLOCK_ROWS * ITEM_BLOCKS - 1) / (BLOCK_ROWS * ITEM_BLOCKS)) *
                 num_kv_heads;
    return count;
}

/* One item: stage its keys, then its rows attend them, row block by row block. */
static int run_item(const Problem *p, const Unit *u, const Item *item, Staged *staged, BlockState *b) {
    int group = p->num_heads / p->num_kv_heads;
    int64_t first = (int64_t)item->first_block * BLOCK_ROWS, end = first + ITEM_BLOCKS * BLOCK_ROWS;
    end = end < u->num_rows * group ? end : u->num_rows * group;
    int code = stage_item(p, u, item->unit, item->kv_head, first / group, (end + group - 1) / group, staged);
    for (; first < end && code == STATUS_OK; first += BLOCK_ROWS)
        attend_block(p, u, staged, item->kv_head, first, end - first < BLOCK_ROWS ? (int)(end - first) : BLOCK_ROWS, b);
    return code;
}

/* Every item, on num_threads threads, each with its own staging buffer and block state. */
static int run(const Problem *p, const Unit *units, const Item *items, int num_items, int max_members,
               int num_threads) {
    int status = STATUS_OK;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_items > 1)
    {
        Staged staged = {-1, -1, 0, 0, (int *)malloc(sizeof(int) * (size_t)max_members),
                         (int *)malloc(sizeof(int) * (size_t)max_members),
                         (int64_t *)malloc(sizeof(int64_t) * (size_t)max_members), NULL, 0};
        BlockState *b = (BlockState *)aligned_alloc(64, sizeof(BlockState));
        int is_ready = b && staged.own_from && staged.own_keys && staged.own_offsets;
        if (!is_ready) {
#pragma omp atomic write
            status = STATUS_NO_MEMORY;
        }
        configure_tiles(BLOCK_ROWS);
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_items; i++) {
            int code = is_ready ? run_item(p, &units[items[i].unit], &items[i], &staged, b) : STATUS_OK;
            if (code != STATUS_OK) {
#pragma omp atomic write
                status = code;
            }
        }
        _tile_release();
        free(b), free(staged.own_from), free(staged.own_keys), free(staged.own_offsets), free(staged.keys);
    }
    return status;
}

/* ---- decode ---- */

/*
 * Decode on tiles: one query token per sequence. A column is a (sequence, query head) pair of
 * one kv head; up to 16 columns attend together. Nothing is staged: per kv head and key tile
 * (16 positions inside one block),
 * - scores: the 16 K rows as they lie in the pool are the A operand (rows = keys, dims 0-31
 *   then 32-63), the columns' queries in dim pairs the B operand, so the product is keys x
 *   columns;
 * - values: the 16 V rows as they lie are the B operand (rows = keys, 16 dim pairs each), the
 *   columns' probabilities the A operand with a zero beside each: pairs (p, 0) sum the even
 *   dims, (0, p) the odd dims, into two accumulator tiles per 32 dims.
 * A work item is one kv head of a lone sequence, or of up to MAX_SETS * (16 / group) members of
 * a group (sequences holding the same blocks for their first `prefix` positions). A group's
 * members are in column sets of up to 16 columns (16 / group members each): all the sets
 * attend the prefix together, set after set on each chunk of it while its K/V are in the core's
 * cache, so the prefix comes from memory once for all of them; then each member's columns go
 * on over its own positions. A group's items are one kv head each, so a step with one group
 * still runs on every thread. (With one set of 16 / group members per item, a step of 4 groups
 * x 16 members with 1,024 shared positions read each prefix four times, waiting on memory:
 * the 30 layers' calls took 28.5 ms with the K/V in the last-level cache, 46 ms with them in
 * memory; with the sets, 21-23 and 35-39 ms.)
 * Positions go DECODE_TILES key tiles at a time: the chunk's scores, the online softmax (log2
 * units, float32) of the attending columns, then the products with the values, added to their
 * float32 accumulators with the chunk's correction. Rows of a partial key tile outside the
 * attended positions are masked from the scores, and their V rows replaced by zeros (a stale
 * slot may hold anything, and 0 x NaN is NaN).
 */

#define DECODE_TILES 4         /* key tiles of 16 positions per chunk */
#define KEY_TILE 16
#define MAX_COLUMNS 16         /* one tile's rows: a column set */
#define MAX_SETS 4             /* column sets of an item */
#define MIN_DECODE_WORK 4096   /* (position, kv head) pairs below which one thread runs the call */

/* Decode tile registers: the even- and odd-dim accumulators, the probabilities as (p, 0) and
 * (0, p) pairs, a V operand, the scores, a K operand, a query operand. */
#define ACC_EVEN 0
#define ACC_ODD 1
#define PROBS_EVEN 2
#define PROBS_ODD 3
#define V_OPERAND 4
#define KEY_SCORES 5
#define K_OPERAND 6
#define Q_OPERAND 7

/* A column set's queries and softmax state. */
typedef struct {
    _Alignas(64) uint32_t q_pairs[2][16 * 16];                       /* per 32 dims: [dim pair][column] */
    _Alignas(64) float acc[MAX_COLUMNS][4][16];                      /* as products, per column */
    _Alignas(64) float max[MAX_COLUMNS];                             /* log2 units; -inf: nothing attended */
    _Alignas(64) float correction[MAX_COLUMNS];                      /* the chunk's factor of acc and sum */
    float sum[MAX_COLUMNS];
} ColumnSet;

typedef struct {
    _Alignas(64) float scores[2][DECODE_TILES][KEY_TILE * 16];      /* [key][column] per key tile, two passes */
    _Alignas(64) uint32_t probs[2][DECODE_TILES][MAX_COLUMNS * 16];  /* (p, 0) / (0, p) pairs [column][key] */
    _Alignas(64) float products[4][MAX_COLUMNS * 16];                /* [32-dim half x even / odd][column][16] */
    _Alignas(64) uint16_t zeroed_values[2][KEY_TILE * HEAD_DIM];     /* partial key tiles' V rows */
    _Alignas(64) float column_scores[MAX_COLUMNS][DECODE_TILES * 16]; /* a chunk's scores per column, log2 units */
    ColumnSet sets[MAX_SETS];
} DecodeState;

typedef struct {
    const uint16_t *q;
    uint16_t *out;
    const uint16_t *k_cache, *v_cache;
    const int32_t *block_tables, *context_lens;
    int num_heads, num_kv_heads, group, num_blocks, block_size, max_blocks;
    float scale_log2;
} DecodeProblem;

/* Kv heads first_head .. end_head - 1 of sequences first .. first + count - 1, which hold the
 * same blocks for their first `prefix` positions (a lone sequence: count 1, prefix 0). */
typedef struct {
    int first, count, prefix, first_head, end_head;
} DecodeItem;

/* A key tile of a chunk: its first slot in the pool and the rows of it that are attended. */
typedef struct {
    int64_t slot;
    int first, end; /* rows first .. end - 1 */
} KeyTile;

/* The attending columns first .. end - 1 of column set `set`. */
typedef struct {
    int set, first, end;
} ColumnRange;

/* Members of an item per column set. */
static int set_members(const DecodeProblem *p) { return MAX_COLUMNS / p->group; }

/* The queries of the item's members first .. first + count - 1 (a column set) as B operands
 * (column m * group + g: member m, the item's kv head's query head g): per 32 dims, row k holds
 * each column's dims (2k, 2k + 1); columns past the set's are zero. Every column's softmax state
 * starts empty. */
static void start_set(const DecodeProblem *p, const DecodeItem *item, int kv_head, int first, int count,
                      ColumnSet *set) {
    memset(set->q_pairs, 0, sizeof(set->q_pairs));
    memset(set->acc, 0, sizeof(set->acc));
    for (int c = 0; c < MAX_COLUMNS; c++) set->max[c] = -INFINITY, set->sum[c] = 0.0f;
    for (int c = 0; c < count * p->group; c++) {
        int64_t row = (int64_t)(item->first + first + c / p->group) * p->num_heads + kv_head * p->group
                    + c % p->group;
        const uint32_t *pairs = (const uint32_t *)(p->q + row * HEAD_DIM);
        for (int k = 0; k < HEAD_DIM / 2; k++) set->q_pairs[k / 16][(k % 16) * 16 + c] = pairs[k];
    }
}

/* Asks for the rows of kv head `kv_head` of key tile `tile` (if any) in `cache`: two lines each. */
static inline void fetch_key_tile(const DecodeProblem *p, const uint16_t *cache, const KeyTile *tile, int kv_head) {
    if (tile == NULL) return;
    int64_t stride = (int64_t)p->num_kv_heads * HEAD_DIM * 2;
    const char *row = (const char *)(cache + (tile->slot * p->num_kv_heads + kv_head) * HEAD_DIM) + tile->first * stride;
    for (int r = tile->first; r < tile->end; r++, row += stride) {
        _mm_prefetch(row, _MM_HINT_T0);
        _mm_prefetch(row + 64, _MM_HINT_T0);
    }
}

/* The next chunk's tile t, or NULL. */
static inline const KeyTile *next_tile(const KeyTile *next, int num_next, int t) { return t < num_next ? next + t : NULL; }

/* Scores of the chunk's key tiles with every column's query, each into scores[t] [key][column]. */
static void decode_scores(const DecodeProblem *p, const KeyTile *tiles, int num_tiles, int kv_head, const ColumnSet *set,
                          float (*scores)[KEY_TILE * 16]) {
    int64_t stride = (int64_t)p->num_kv_heads * HEAD_DIM * 2;
    for (int t = 0; t < num_tiles; t++) {
        const uint16_t *keys = p->k_cache + (tiles[t].slot * p->num_kv_heads + kv_head) * HEAD_DIM;
        _tile_zero(KEY_SCORES);
        _tile_loadd(K_OPERAND, keys, stride);
        _tile_loadd(Q_OPERAND, set->q_pairs[0], 64);
        _tile_dpbf16ps(KEY_SCORES, K_OPERAND, Q_OPERAND);
        _tile_loadd(K_OPERAND, keys + 32, stride);
        _tile_loadd(Q_OPERAND, set->q_pairs[1], 64);
        _tile_dpbf16ps(KEY_SCORES, K_OPERAND, Q_OPERAND);
        _tile_stored(KEY_SCORES, scores[t], 64);
    }
}

/* The online softmax of the attending columns over the chunk: each one's new max, its
 * correction of the accumulator and sum, and its probabilities (bf16, 0 outside each tile's
 * attended rows) as (p, 0) and (0, p) pairs. The chunk's scores of each column are gathered
 * from `scores` into d->column_scores first, then the corrections computed for all columns
 * at once. */
static void decode_softmax(const KeyTile *tiles, int num_tiles, const float (*scores)[KEY_TILE * 16], ColumnRange columns,
                           float scale_log2, DecodeState *d) {
    ColumnSet *set = &d->sets[columns.set];
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 none = _mm512_set1_ps(-INFINITY);
    __mmask16 rows[DECODE_TILES];
    for (int t = 0; t < num_tiles; t++)
        rows[t] = first_lanes(tiles[t].end) & ~first_lanes(tiles[t].first);
    _Alignas(64) float new_max[MAX_COLUMNS];
    memcpy(new_max, set->max, sizeof(new_max));
    for (int c = columns.first; c < columns.end; c++) {
        __m512i column = _mm512_add_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32(16)), _mm512_set1_epi32(c));
        __m512 top = none;
        for (int t = 0; t < num_tiles; t++) {
            __m512 gathered = _mm512_mul_ps(_mm512_mask_i32gather_ps(none, rows[t], column, scores[t], 4),
                                            _mm512_set1_ps(scale_log2));
            _mm512_store_ps(d->column_scores[c] + 16 * t, gathered);
            top = _mm512_max_ps(top, gathered);
        }
        new_max[c] = fmaxf(new_max[c], _mm512_reduce_max_ps(top));
    }
    __m512 old_max = _mm512_load_ps(set->max), moved_max = _mm512_load_ps(new_max);
    __mmask16 started = _mm512_cmp_ps_mask(old_max, none, _CMP_NEQ_OQ);
    _mm512_store_ps(set->correction, _mm512_maskz_mov_ps(started, exp2_16(_mm512_sub_ps(old_max, moved_max))));
    _mm512_store_ps(set->max, moved_max);
    for (int c = columns.first; c < columns.end; c++) {
        __m512 total = _mm512_setzero_ps(), shift = _mm512_set1_ps(new_max[c]);
        for (int t = 0; t < num_tiles; t++) {
            __m512 probs = _mm512_maskz_mov_ps(rows[t], exp2_16(_mm512_sub_ps(_mm512_load_ps(d->column_scores[c] + 16 * t),
                                                                               shift)));
            total = _mm512_add_ps(total, probs);
            __m512i low = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(probs));
            _mm512_store_si512(d->probs[0][t] + 16 * c, low);
            _mm512_store_si512(d->probs[1][t] + 16 * c, _mm512_slli_epi32(low, 16));
        }
        set->sum[c] = set->sum[c] * set->correction[c] + _mm512_reduce_add_ps(total);
    }
}

/* The chunk's probabilities times its values, added to the attending columns' corrected
 * accumulators (the other columns' product rows are ignored); the next chunk's V rows asked for
 * meanwhile. */
static void decode_values(const DecodeProblem *p, const KeyTile *tiles, int num_tiles, const KeyTile *next,
                          int num_next, int kv_head, ColumnRange columns, DecodeState *d) {
    int64_t stride = (int64_t)p->num_kv_heads * HEAD_DIM * 2;
    const uint16_t *values[DECODE_TILES];
    int64_t strides[DECODE_TILES];
    for (int t = 0; t < num_tiles; t++) {
        fetch_key_tile(p, p->v_cache, next_tile(next, num_next, t), kv_head);
        values[t] = p->v_cache + (tiles[t].slot * p->num_kv_heads + kv_head) * HEAD_DIM, strides[t] = stride;
        if (tiles[t].first == 0 && tiles[t].end == KEY_TILE) continue;
        uint16_t *copy = d->zeroed_values[t == 0 ? 0 : 1]; /* only a chunk's first and last tile are partial */
        memset(copy, 0, sizeof(d->zeroed_values[0]));
        for (int r = tiles[t].first; r < tiles[t].end; r++)
            memcpy(copy + r * HEAD_DIM, values[t] + r * (stride / 2), 2 * HEAD_DIM);
        values[t] = copy, strides[t] = 2 * HEAD_DIM;
    }
    for (int half = 0; half < 2; half++) {
        _tile_zero(ACC_EVEN);
        _tile_zero(ACC_ODD);
        for (int t = 0; t < num_tiles; t++) {
            _tile_loadd(V_OPERAND, values[t] + 32 * half, strides[t]);
            _tile_loadd(PROBS_EVEN, d->probs[0][t], 64);
            _tile_dpbf16ps(ACC_EVEN, PROBS_EVEN, V_OPERAND);
            _tile_loadd(PROBS_ODD, d->probs[1][t], 64);
            _tile_dpbf16ps(ACC_ODD, PROBS_ODD, V_OPERAND);
        }
        _tile_stored(ACC_EVEN, d->products[2 * half], 64);
        _tile_stored(ACC_ODD, d->products[2 * half + 1], 64);
    }
    ColumnSet *set = &d->sets[columns.set];
    for (int c = columns.first; c < columns.end; c++) {
        __m512 correction = _mm512_set1_ps(set->correction[c]);
        for (int j = 0; j < 4; j++)
            _mm512_store_ps(set->acc[c][j], _mm512_fmadd_ps(_mm512_load_ps(set->acc[c][j]), correction,
                                                            _mm512_load_ps(d->products[j] + 16 * c)));
    }
}

/* The key tiles of positions [*pos, end) of a chunk (at most DECODE_TILES), *pos moved past them.
 * Returns their count, or -STATUS_BAD_BLOCK_ID. */
static int next_key_tiles(const DecodeProblem *p, const int32_t *table, int *pos, int end, KeyTile *tiles) {
    int count = 0;
    while (*pos < end && count < DECODE_TILES) {
        int tile_start = *pos - *pos % KEY_TILE;
        int32_t block = table[*pos / p->block_size];
        if (block < 0 || block >= p->num_blocks) return -STATUS_BAD_BLOCK_ID;
        tiles[count].slot = (int64_t)block * p->block_size + tile_start % p->block_size;
        tiles[count].first = *pos - tile_start;
        tiles[count].end = end - tile_start < KEY_TILE ? end - tile_start : KEY_TILE;
        *pos = tile_start + tiles[count++].end;
    }
    return count;
}

/* Column sets `columns[0 .. num_sets - 1]` attend positions [start, end) of the sequence with
 * `table`, kv head `kv_head`, chunk by chunk, every set on a chunk before the next chunk. A
 * pass is one set on one chunk; the next pass's scores are asked of the tiles before this
 * pass's softmax, which does not wait for them: the two overlap. Not inlined: inlined at its two
 * calls, with the passes' functions then left apart, lone sequences' decode ran 9% slower. */
__attribute__((noinline)) static int attend_positions(const DecodeProblem *p, const int32_t *table, int start,
                                                      int end, int kv_head, const ColumnRange *columns,
                                                      int num_sets, DecodeState *d) {
    KeyTile chunks[2][DECODE_TILES];
    int num_tiles[2], pos = start, current = 0, buffer = 0;
    num_tiles[0] = next_key_tiles(p, table, &pos, end, chunks[0]);
    if (num_tiles[0] > 0) decode_scores(p, chunks[0], num_tiles[0], kv_head, &d->sets[columns[0].set], d->scores[0]);
    while (num_tiles[current] > 0) {
        int next = current ^ 1;
        num_tiles[next] = next_key_tiles(p, table, &pos, end, chunks[next]);
        if (num_tiles[next] < 0) return -num_tiles[next];
        for (int s = 0; s < num_sets; s++, buffer ^= 1) {
            if (s + 1 < num_sets)
                decode_scores(p, chunks[current], num_tiles[current], kv_head, &d->sets[columns[s + 1].set],
                              d->scores[buffer ^ 1]);
            else if (num_tiles[next] > 0)
                decode_scores(p, chunks[next], num_tiles[next], kv_head, &d->sets[columns[0].set],
                              d->scores[buffer ^ 1]);
            decode_softmax(chunks[current], num_tiles[current], (const float (*)[KEY_TILE * 16])d->scores[buffer],
                           columns[s], p->scale_log2, d);
            /* the first pass on a chunk asks for the next chunk's V rows */
            decode_values(p, chunks[current], num_tiles[current], chunks[next], s == 0 ? num_tiles[next] : 0, kv_head,
                          columns[s], d);
        }
        current = next;
    }
    return num_tiles[current] < 0 ? -num_tiles[current] : STATUS_OK;
}

/* Sequence `seq`'s output rows of kv head `kv_head`, from columns first ..: each one's
 * accumulator over its sum, dims back in order, bf16. */
static void store_decode_rows(const DecodeProblem *p, int seq, int kv_head, int first, const ColumnSet *set) {
    const __m512i low = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
    for (int g = 0; g < p->group; g++) {
        int c = first + g;
        __m512 inverse = _mm512_set1_ps(1.0f / set->sum[c]);
        uint16_t *dst = p->out + ((int64_t)seq * p->num_heads + kv_head * p->group + g) * HEAD_DIM;
        for (int half = 0; half < 2; half++) {
            __m512 even = _mm512_load_ps(set->acc[c][2 * half]), odd = _mm512_load_ps(set->acc[c][2 * half + 1]);
            __m512 first_dims = _mm512_mul_ps(_mm512_permutex2var_ps(even, low, odd), inverse);
            __m512 second_dims = _mm512_mul_ps(_mm512_permutex2var_ps(even, high, odd), inverse);
            _mm256_storeu_si256((__m256i *)(dst + 32 * half), (__m256i)_mm512_cvtneps_pbh(first_dims));
            _mm256_storeu_si256((__m256i *)(dst + 32 * half + 16), (__m256i)_mm512_cvtneps_pbh(second_dims));
        }
    }
}

/* One item, kv head by kv head: the shared prefix for all its column sets, then each member's
 * own positions for its columns. */
static int decode_item(const DecodeProblem *p, const DecodeItem *item, DecodeState *d) {
    int per_set = set_members(p), num_sets = (item->count + per_set - 1) / per_set;
    int columns = item->count * p->group;
    configure_tiles(columns < MAX_COLUMNS ? columns : MAX_COLUMNS); /* ACC_* and PROBS_* are tmm0-3: a row per column */
    const int32_t *tables = p->block_tables;
    for (int kv_head = item->first_head; kv_head < item->end_head; kv_head++) {
        ColumnRange sets[MAX_SETS];
        for (int s = 0; s < num_sets; s++) {
            int count = item->count - s * per_set < per_set ? item->count - s * per_set : per_set;
            start_set(p, item, kv_head, s * per_set, count, &d->sets[s]);
            sets[s] = (ColumnRange){s, 0, count * p->group};
        }
        int code = attend_positions(p, tables + (int64_t)item->first * p->max_blocks, 0, item->prefix, kv_head, sets,
                                    num_sets, d);
        for (int m = 0; m < item->count && code == STATUS_OK; m++) {
            int seq = item->first + m;
            ColumnRange own = {m / per_set, m % per_set * p->group, (m % per_set + 1) * p->group};
            code = attend_positions(p, tables + (int64_t)seq * p->max_blocks, item->prefix, p->context_lens[seq],
                                    kv_head, &own, 1, d);
            store_decode_rows(p, seq, kv_head, own.first, &d->sets[own.set]);
        }
        if (code != STATUS_OK) return code;
    }
    return STATUS_OK;
}

/* Checks the sequences and groups, and lays out the work items (as many as returned, into
 * `items`, which holds num_seqs * num_kv_heads): each group's members in runs of MAX_SETS
 * column sets, every other sequence alone, each run or sequence once per kv head. Returns
 * -STATUS_* when an input is refused. */
static int plan_decode_items(const DecodeProblem *p, int num_seqs, const int32_t *groups, int num_groups,
                             DecodeItem *items) {
    int num_items = 0, g = 0, per_item = MAX_SETS * set_members(p), bs = p->block_size;
    for (int seq = 0; seq < num_seqs; seq++)
        if (p->context_lens[seq] < 1 || p->context_lens[seq] > (int64_t)p->max_blocks * bs) return -STATUS_BAD_CONTEXT_LEN;
    for (int seq = 0; seq < num_seqs;) {
        if (g == num_groups || groups[3 * g] != seq) {
            items[num_items++] = (DecodeItem){seq++, 1, 0, 0, p->num_kv_heads};
            continue;
        }
        int end = groups[3 * g + 1], prefix = groups[3 * g + 2];
        if (!decode_group_holds(p->block_tables, p->context_lens, num_seqs, bs, p->max_blocks, seq, end, prefix))
            return -STATUS_BAD_GROUP;
        for (int first = seq; first < end; first += per_item)
            for (int kv_head = 0; kv_head < p->num_kv_heads; kv_head++)
                items[num_items++] = (DecodeItem){first, end - first < per_item ? end - first : per_item, prefix,
                                                  kv_head, kv_head + 1};
        seq = end, g++;
    }
    return g == num_groups ? num_items : -STATUS_BAD_GROUP; /* a group out of order or overlapping */
}

static int run_decode_items(const DecodeProblem *p, const DecodeItem *items, int num_items, int num_threads) {
    int status = STATUS_OK;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_items > 1)
    {
        DecodeState *d = (DecodeState *)aligned_alloc(64, sizeof(DecodeState));
        if (d == NULL) {
#pragma omp atomic write
            status = STATUS_NO_MEMORY;
        } else {
            memset(d->probs, 0, sizeof(d->probs)); /* rows no column writes stay finite */
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_items; i++) {
            int code = d ? decode_item(p, &items[i], d) : STATUS_OK;
            if (code != STATUS_OK) {
#pragma omp atomic write
                status = code;
            }
        }
        _tile_release();
        free(d);
    }
    return status;
}

/* Decode entry point: out[s] = the attention of q[s] (one token per sequence) over sequence s's
 * context_lens[s] positions, bf16, head_dim 64; block_size a multiple of 16 and at most 16 query
 * heads per kv head (else STATUS_UNSUPPORTED, nothing written). `groups` holds num_groups rows
 * (first, end, prefix), in order and disjoint: sequences first .. end - 1 (at least two) hold
 * the same blocks for positions [0, prefix), 0 < prefix < each one's context; the prefix is
 * attended once for up to 16 / group of them. On STATUS_OK every element of `out` is written. */
int bg_amx_decode_attention(ATTENTION_KERNEL_PARAMS) {
    (void)query_starts, (void)query_lens; /* decode: query row s is sequence s's */
    int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
    if (dtype != DTYPE_BF16 || head_dim != HEAD_DIM || block_size % KEY_TILE || group < 1 || group > MAX_COLUMNS
        || window || softcap || sinks || !amx_tiles_granted())
        return STATUS_UNSUPPORTED;
    DecodeProblem p = {(const uint16_t *)q, (uint16_t *)out, (const uint16_t *)k_cache, (const uint16_t *)v_cache,
                       block_tables, context_lens, num_heads, num_kv_heads, group, num_blocks, block_size,
                       max_blocks, scale * LOG2E};
    size_t max_items = num_seqs > 0 ? (size_t)num_seqs * (size_t)num_kv_heads : 1; /* see plan_decode_items */
    DecodeItem *items = (DecodeItem *)malloc(sizeof(DecodeItem) * max_items);
    if (items == NULL) return STATUS_NO_MEMORY;
    int num_items = plan_decode_items(&p, num_seqs, groups, num_groups, items);
    int64_t work = 0;
    for (int seq = 0; seq < num_seqs && num_items >= 0; seq++) work += (int64_t)context_lens[seq] * num_kv_heads;
    int status = num_items < 0 ? -num_items
                               : run_decode_items(&p, items, num_items, work >= MIN_DECODE_WORK ? num_threads : 1);
    free(items);
    return status;
}

int bg_amx_attention_available(void) { return amx_tiles_granted(); }

/* Entry point: see the top of this file. `groups` holds num_groups rows (first, end, prefix), in
 * order and disjoint, over sequences 0 .. num_seqs - 1: members first .. end - 1 (at least two)
 * hold the same blocks for positions [0, prefix), prefix >= 1, and every query after it. Returns
 * a STATUS_* code; on STATUS_OK every element of every query row of `out` is written. */
int bg_amx_prefill_attention(ATTENTION_KERNEL_PARAMS) {
    if ((dtype != DTYPE_BF16 && dtype != DTYPE_BF16_INT8_POOL) || head_dim % HEAD_DIM || head_dim < HEAD_DIM ||
        head_dim > MAX_HEAD_DIM || !amx_tiles_granted())
        return STATUS_UNSUPPORTED;
    Problem p = {(const uint16_t *)q, (uint16_t *)out, (const char *)k_cache, (const char *)v_cache,
                 block_tables, context_lens, query_starts, query_lens, NULL, num_heads, num_kv_heads, num_blocks,
                 block_size, max_blocks, scale * LOG2E, softcap > 0.0f ? softcap / scale : 0.0f,
                 window, sinks, head_dim, dtype == DTYPE_BF16_INT8_POOL};
    Unit *units = (Unit *)malloc(sizeof(Unit) * (size_t)(num_seqs > 0 ? num_seqs : 1));
    p.unit_rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_seqs > 0 ? num_seqs : 1));
    if (units == NULL || p.unit_rows == NULL) {
        free(units), free(p.unit_rows);
        return STATUS_NO_MEMORY;
    }
    int num_units = plan_units(&p, num_seqs, groups, num_groups, units);
    if (num_units < 0) {
        free(units), free(p.unit_rows);
        return -num_units;
    }
    int num_items = item_count(units, num_units, num_heads, num_kv_heads), max_members = 1;
    for (int u = 0; u < num_units; u++)
        max_members = units[u].end - units[u].first > max_members ? units[u].end - units[u].first : max_members;
    Item *items = (Item *)malloc(sizeof(Item) * (size_t)(num_items > 0 ? num_items : 1));
    int status = STATUS_NO_MEMORY;
    if (items != NULL)
        status = run(&p, units, items, plan_items(&p, units, num_units, items), max_members, num_threads);
    free(units), free(items), free(p.unit_rows);
    return status;
}

#else

int bg_amx_attention_available(void) { return 0; }

int bg_amx_prefill_attention(ATTENTION_KERNEL_PARAMS) { return STATUS_UNSUPPORTED; }

int bg_amx_decode_attention(ATTENTION_KERNEL_PARAMS) { return STATUS_UNSUPPORTED; }

#endif
