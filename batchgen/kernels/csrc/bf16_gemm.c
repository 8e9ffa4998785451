/*
 * The bfloat16 linear layers of a step on a CPU with AVX512-BF16, through AMX tiles where the
 * CPU has AMX-BF16.
 *
 *   bg_bf16_gemm_available       1 where this build holds a kernel and may run it, else 0
 *   bg_bf16_gemm_input_multiple  the multiple of k the kernel takes (2; 32 on the AMX path)
 *   bg_bf16_gemm_max_rows        the most rows of a product for which the kernel beats oneDNN
 *                                (no limit on the AVX512-BF16 path; 1,024 on the AMX path)
 *   bg_bf16_gemm_panel_columns   output columns per panel of the weight layout (96; 32 on the
 *                                AMX path)
 *   bg_bf16_linear               out[m, n] = bf16(x[m, k] @ w.T + bias): float32 sums of exact
 *                                bf16 products, rounded to nearest even once, as torch's GEMM does
 *   bg_bf16_linear_groups        the same for consecutive row groups of x, each group through its
 *                                own weight (a mixture of experts' products), in one parallel region
 *   bg_bf16_linear_int8_weight   out[m, n] = bf16((x[m, k] @ v.T) * scales) for int8 values v
 *                                (`quantization: int8-weight`): float32 sums of the exact
 *                                products of x with v, each column times its bf16 scale, rounded
 *                                once
 *
 * Weight layout (`bf16_gemm.pack`): panel p holds output columns [Pp, Pp + P) (P =
 * PANEL_COLUMNS), zero past n; within it, for each input pair (2i, 2i + 1), the P columns'
 * two bf16 values side by side. A panel is one contiguous stream of k / 2 runs of P / 16
 * vectors, the operand layout of vdpbf16ps, which adds two products per lane, and of an AMX B
 * tile (16 input pairs of 16 columns, a row stride of one pair's P columns). Each thread owns a
 * contiguous range of panels.
 *
 * AVX512-BF16 path (no AMX): oneDNN runs a decode step's products (tens of rows against each
 * weight) well below this CPU's bf16 rate; this path runs them near it (docs/performance.md).
 * A tile of 4 rows x 96 columns is 24 float32 accumulators; for each input pair it loads the
 * panel's 6 vectors once and broadcasts each row's pair (4 x 96 measured faster than 8 x 48,
 * 6 x 64 and 12 x 32 tiles).
 * Rows past m read row m - 1 (kept in registers, never stored). With few row tiles (a decode
 * step), a panel is used by few tiles after it comes from memory, so the tiles ask for the
 * thread's next panel as they go, a line or so per input pair, and its reads overlap their
 * compute.
 *
 * AMX path: a block of 32 rows x 32 columns is four 16 x 16 float32 accumulator tiles, fed per
 * 32 inputs by two tiles of x rows and two of the panel (tmm0-7, all eight). A panel is one
 * block's 32 columns, so a block reads its weight as one contiguous stream (faster than 96-column
 * panels, of which a block read a third of each row). The row blocks of a panel (one at 32
 * rows, eight at 256) ask for the next panel's whole weight into L2 (prefetcht2), each block an
 * equal share spread over its chunks: the weight streams from memory while every block
 * computes, where asking two chunks ahead into L1 kept memory busy only during a panel's first
 * block, and a software prefetch into L1 holds one of the core's few line-fill buffers until its
 * line arrives. Rows go SUPER_ROWS at a time over
 * the thread's panels, so their x (768 KB at 1,536 inputs) stays in L2 while the weight passes.
 * The rows past the last multiple of 32 run after the full blocks, with tiles configured to
 * their count (nothing past row m is read). Against oneDNN on the same weights this path is
 * faster up to 1,024 rows; oneDNN changes its method past that and wins (docs/performance.md),
 * so `bg_bf16_gemm_max_rows` is 1,024.
 *
 * int8 weights (bg_bf16_linear_int8_weight): their panels are laid out as bf16 ones, one byte a
 * value. Each panel is widened to bf16 (exact: |v| <= 127) into the thread's buffer just before
 * its rows use it, while the next int8 panel is asked for as a bf16 one is: the products are
 * the bf16 path's on half the weight bytes.
 */
#include <stdint.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#include "lanes16.h"

#define BLOCK_COLUMNS 16                  /* one vector of float32 accumulators */
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define PANEL_BLOCKS 2                    /* one AMX block's columns: its weight is one stream */
#else
#define PANEL_BLOCKS 6
#endif
#define PANEL_COLUMNS (BLOCK_COLUMNS * PANEL_BLOCKS)
#define LINE_BYTES 64

/* An int8 weight's panels (laid out as bf16 ones, a byte a value), its columns' bf16 scales, and
 * the thread's buffer for one panel widened to bf16. */
typedef struct {
    const int8_t *values;
    const uint16_t *scales;
    uint16_t *widened;
} Int8Panels;

/* float32 accumulators of one row block times their columns' scales (where given: an int8
 * weight's), bias added, rounded to bf16 and stored; columns past n left alone. */
static inline void store_block(uint16_t *out, __m512 sum, const uint16_t *bias, const uint16_t *scales, int64_t col,
                               int64_t n) {
    int64_t left = n - col;
    __mmask16 mask = left >= BLOCK_COLUMNS ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    if (scales != 0) sum = _mm512_mul_ps(sum, load_bf16x16(scales + col, mask));
    if (bias != 0) sum = _mm512_add_ps(sum, load_bf16x16(bias + col, mask));
    _mm256_mask_storeu_epi16(out + col, mask, (__m256i)_mm512_cvtneps_pbh(sum));
}

/* `count` int8 values (a multiple of 32) as bf16, exactly, in the same order. */
static void widen(const int8_t *values, int64_t count, uint16_t *out) {
    for (int64_t i = 0; i < count; i += 32) {
        __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(values + i))));
        __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(values + i + 16))));
        _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(high, low));
    }
}

/* Panel p of the weight as bf16: the packed bf16 weight's, or an int8 weight's widened into its
 * buffer; with the first byte of panel p + 1 (for asking ahead) and its bytes. */
static const uint16_t *panel_at(const uint16_t *weight, const Int8Panels *int8, int64_t p, int64_t panel_elements,
                                const char **next, int64_t *next_bytes) {
    if (int8 == 0) {
        *next = (const char *)(weight + (p + 1) * panel_elements), *next_bytes = panel_elements * 2;
        return weight + p * panel_elements;
    }
    *next = (const char *)(int8->values + (p + 1) * panel_elements), *next_bytes = panel_elements;
    widen(int8->values + p * panel_elements, panel_elements, int8->widened);
    return int8->widened;
}

#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include "amx.h"

#define CHUNK_INPUTS 32                   /* inputs per tile product: 16 pairs */
#define BLOCK_ROWS 32                     /* two tiles of 16 x rows */
#define INPUT_MULTIPLE CHUNK_INPUTS
#define MAX_ROWS 1024
#define SUPER_ROWS 512                    /* rows whose x stays in L2 while the thread's panels pass */
/* One block: rows [0, top + bottom) of x (row stride k) times the 32 panel columns at `w`, into
 * `sums` as four 16 x 16 float32 tiles (top left, top right, bottom left, bottom right); its
 * chunks ask for `ahead_lines` lines from `ahead` into L2, evenly. */
static void block(const uint16_t *x, int64_t k, int bottom, const uint16_t *w, const char *ahead,
                  int64_t ahead_lines, float *sums) {
    const int64_t x_stride = k * 2, w_stride = PANEL_COLUMNS * 4, w_chunk = CHUNK_INPUTS * PANEL_COLUMNS;
    _tile_zero(C_TOP_LEFT);
    _tile_zero(C_TOP_RIGHT);
    if (bottom) {
        _tile_zero(C_BOTTOM_LEFT);
        _tile_zero(C_BOTTOM_RIGHT);
    }
    const int64_t chunks = k / CHUNK_INPUTS, per_chunk = (ahead_lines + chunks - 1) / chunks;
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *chunk = w + c * w_chunk;
        for (int64_t line = c * per_chunk; line < (c + 1) * per_chunk && line < ahead_lines; line++)
            _mm_prefetch(ahead + line * LINE_BYTES, _MM_HINT_T2);
        _tile_loadd(X_TOP, x + c * CHUNK_INPUTS, x_stride);
        _tile_loadd(W_LEFT, chunk, w_stride);
        _tile_dpbf16ps(C_TOP_LEFT, X_TOP, W_LEFT);
        _tile_loadd(W_RIGHT, chunk + BLOCK_COLUMNS * 2, w_stride);
        _tile_dpbf16ps(C_TOP_RIGHT, X_TOP, W_RIGHT);
        if (bottom) {
            _tile_loadd(X_BOTTOM, x + 16 * k + c * CHUNK_INPUTS, x_stride);
            _tile_dpbf16ps(C_BOTTOM_LEFT, X_BOTTOM, W_LEFT);
            _tile_dpbf16ps(C_BOTTOM_RIGHT, X_BOTTOM, W_RIGHT);
        }
    }
    _tile_stored(C_TOP_LEFT, sums, 64);
    _tile_stored(C_TOP_RIGHT, sums + 256, 64);
    if (bottom) {
        _tile_stored(C_BOTTOM_LEFT, sums + 512, 64);
        _tile_stored(C_BOTTOM_RIGHT, sums + 768, 64);
    }
}

/* Rows [first_row, last_row) of the product over panels [first, last), in blocks of `rows`
 * (the tiles are configured for it; every block but none past last_row is full). The blocks of
 * a panel ask for the next panel's weight (its k lines) into L2, each block an equal share. */
static void row_pass(const uint16_t *x, int64_t k, const uint16_t *weight, const Int8Panels *int8,
                     const uint16_t *bias, int64_t n, uint16_t *out, int64_t first, int64_t last, int64_t first_row,
                     int64_t last_row, int rows) {
    float sums[4 * 256] __attribute__((aligned(64)));
    int top = rows < 16 ? rows : 16, bottom = rows - top;
    int64_t panel_elements = k * PANEL_COLUMNS; /* one block's 32 columns */
    const uint16_t *scales = int8 != 0 ? int8->scales : 0;
    const int64_t blocks = (last_row - first_row + rows - 1) / rows;
    for (int64_t p = first, col = first * PANEL_COLUMNS; p < last && col < n; p++, col += PANEL_COLUMNS) {
        const char *next;
        int64_t next_bytes;
        const uint16_t *w = panel_at(weight, int8, p, panel_elements, &next, &next_bytes);
        int64_t next_lines = p + 1 < last && col + PANEL_COLUMNS < n ? next_bytes / LINE_BYTES : 0;
        for (int64_t row = first_row, b = 0; row < last_row; row += rows, b++) {
            int64_t from = next_lines * b / blocks, to = next_lines * (b + 1) / blocks;
            block(x + row * k, k, bottom, w, next + from * LINE_BYTES, to - from, sums);
            for (int r = 0; r < rows; r++) {
                const float *tile_row = sums + (r < 16 ? r * 16 : 512 + (r - 16) * 16);
                store_block(out + (row + r) * n, _mm512_load_ps(tile_row), bias, scales, col, n);
                if (col + BLOCK_COLUMNS < n)
                    store_block(out + (row + r) * n, _mm512_load_ps(tile_row + 256), bias, scales, col + BLOCK_COLUMNS,
                                n);
            }
        }
    }
}

/* Panels [first, last) of the product: the full blocks of 32 rows, SUPER_ROWS at a time over
 * all the panels, then the rows past them. */
static void panel_range(const uint16_t *x, int64_t m, int64_t k, const uint16_t *weight, const Int8Panels *int8,
                        const uint16_t *bias, int64_t n, uint16_t *out, int64_t first, int64_t last) {
    int64_t full_rows = m / BLOCK_ROWS * BLOCK_ROWS;
    if (full_rows > 0) {
        configure_block_tiles(16, 16);
        for (int64_t start = 0; start < full_rows; start += SUPER_ROWS)
            row_pass(x, k, weight, int8, bias, n, out, first, last, start,
                     start + SUPER_ROWS < full_rows ? start + SUPER_ROWS : full_rows, BLOCK_ROWS);
    }
    if (m > full_rows) {
        int rows = (int)(m - full_rows);
        configure_block_tiles(rows < 16 ? rows : 16, rows < 16 ? 0 : rows - 16);
        row_pass(x, k, weight, int8, bias, n, out, first, last, full_rows, m, rows);
    }
    _tile_release();
}

/* The process may use the tile registers once Linux grants them (asked once). */
int bg_bf16_gemm_available(void) { return amx_tiles_granted(); }

#else

#define TILE_ROWS 4
#define MAX_PREFETCH_TILES 16             /* more tiles per panel: its later tiles hit cache */
#define INPUT_MULTIPLE 2
#define MAX_ROWS INT64_MAX                /* bf16_gemm.UNLIMITED_ROWS */

typedef struct {
    const char *start;                    /* first line this tile asks for */
    int64_t lines;                        /* how many */
    int64_t per_pair;                     /* lines asked for per input pair */
} Prefetch;

/* Rows [0, rows) of x (row stride k) times one panel, into out's columns [col, col + PANEL_COLUMNS). */
static void tile(const uint16_t *x, int64_t k, int rows, const uint16_t *panel, Prefetch ahead,
                 const uint16_t *bias, const uint16_t *scales, uint16_t *out, int64_t col, int64_t n) {
    __m512 acc[TILE_ROWS][PANEL_BLOCKS];
    const int32_t *pairs[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) {
        pairs[r] = (const int32_t *)(x + (r < rows ? r : rows - 1) * k);
        for (int j = 0; j < PANEL_BLOCKS; j++) acc[r][j] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < k / 2; i++) {
        __m512bh w[PANEL_BLOCKS];
        for (int j = 0; j < PANEL_BLOCKS; j++)
            w[j] = (__m512bh)_mm512_loadu_si512(panel + (i * PANEL_BLOCKS + j) * BLOCK_COLUMNS * 2);
        for (int64_t line = i * ahead.per_pair; line < (i + 1) * ahead.per_pair && line < ahead.lines; line++)
            _mm_prefetch(ahead.start + line * LINE_BYTES, _MM_HINT_T0);
        for (int r = 0; r < TILE_ROWS; r++) {
            __m512bh pair = (__m512bh)_mm512_set1_epi32(pairs[r][i]);
            for (int j = 0; j < PANEL_BLOCKS; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], pair, w[j]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < PANEL_BLOCKS && col + j * BLOCK_COLUMNS < n; j++)
            store_block(out + r * n, acc[r][j], bias, scales, col + j * BLOCK_COLUMNS, n);
}

/* Panels [first, last) of the product: every row tile of each, asking for the next panel. */
static void panel_range(const uint16_t *x, int64_t m, int64_t k, const uint16_t *weight, const Int8Panels *int8,
                        const uint16_t *bias, int64_t n, uint16_t *out, int64_t first, int64_t last) {
    int64_t panel_elements = k / 2 * PANEL_COLUMNS * 2;
    int64_t panel_lines = panel_elements * (int8 != 0 ? 1 : 2) / LINE_BYTES;
    int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    int64_t lines_per_tile = tiles <= MAX_PREFETCH_TILES ? (panel_lines + tiles - 1) / tiles : 0;
    int64_t per_pair = (lines_per_tile + k / 2 - 1) / (k / 2);
    const uint16_t *scales = int8 != 0 ? int8->scales : 0;
    for (int64_t p = first; p < last; p++) {
        const char *next;
        int64_t next_bytes;
        const uint16_t *panel = panel_at(weight, int8, p, panel_elements, &next, &next_bytes);
        int64_t next_lines = p + 1 < last ? panel_lines : 0;
        for (int64_t t = 0; t < tiles; t++) {
            int64_t row = t * TILE_ROWS, asked = t * lines_per_tile;
            int64_t lines = next_lines - asked < lines_per_tile ? next_lines - asked : lines_per_tile;
            Prefetch ahead = {next + asked * LINE_BYTES, lines > 0 ? lines : 0, per_pair};
            int rows = (int)(m - row < TILE_ROWS ? m - row : TILE_ROWS);
            tile(x + row * k, k, rows, panel, ahead, bias, scales, out + row * n, p * PANEL_COLUMNS, n);
        }
    }
}

int bg_bf16_gemm_available(void) { return 1; }

#endif

int bg_bf16_gemm_input_multiple(void) { return INPUT_MULTIPLE; }

int64_t bg_bf16_gemm_max_rows(void) { return MAX_ROWS; }

/* The threads of a product of `panels` panels: `num_threads`, at most one a panel, at least one. */
static int team_for(int64_t panels, int num_threads) {
    return num_threads > panels ? (int)panels : num_threads < 1 ? 1 : num_threads;
}

int bg_bf16_gemm_panel_columns(void) { return PANEL_COLUMNS; }

/* x [m, k] and out [m, n] row-major bf16, k a multiple of INPUT_MULTIPLE; weight packed as
 * above; bias [n] or NULL. m may be 0 (a step that keeps no logits): nothing is computed. */
void bg_bf16_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *weight, const uint16_t *bias,
                    int64_t n, uint16_t *out, int num_threads) {
    if (m < 1) return; /* panel_range divides by the row tile count */
    int64_t panels = (n + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
#pragma omp parallel num_threads(team_for(panels, num_threads))
    {
        int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
        panel_range(x, m, k, weight, 0, bias, n, out, panels * thread / team, panels * (thread + 1) / team);
    }
}

/* x [m, k] and out [m, n] row-major bf16, k a multiple of INPUT_MULTIPLE; values an int8 weight
 * packed as a bf16 one is (a byte a value), scales [n] bf16; widened: scratch of num_threads x k
 * x PANEL_COLUMNS bf16 (a panel's values for each thread). m may be 0: nothing is computed. */
void bg_bf16_linear_int8_weight(const uint16_t *x, int64_t m, int64_t k, const int8_t *values, const uint16_t *scales,
                                int64_t n, uint16_t *widened, uint16_t *out, int num_threads) {
    if (m < 1) return;
    int64_t panels = (n + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
#pragma omp parallel num_threads(team_for(panels, num_threads))
    {
        int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
        Int8Panels int8 = {values, scales, widened + thread * k * PANEL_COLUMNS};
        panel_range(x, m, k, 0, &int8, 0, n, out, panels * thread / team, panels * (thread + 1) / team);
    }
}

/* Consecutive row groups of x [m, k]: group g, counts[g] rows (0 or more) after the groups before
 * it, through weights[g] (packed as above, n columns) and biases[g] (or biases NULL) into the same
 * rows of out [m, n]: each group's rows as bg_bf16_linear computes them, every thread owning the
 * same panel range of each group's weight. */
void bg_bf16_linear_groups(const uint16_t *x, const int64_t *counts, int num_groups, int64_t k,
                           const uint16_t *const *weights, const uint16_t *const *biases, int64_t n, uint16_t *out,
                           int num_threads) {
    int64_t panels = (n + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
#pragma omp parallel num_threads(team_for(panels, num_threads))
    {
        int64_t thread = omp_get_thread_num(), team = omp_get_num_threads(), row = 0;
        for (int g = 0; g < num_groups; row += counts[g], g++)
            if (counts[g] > 0)
                panel_range(x + row * k, counts[g], k, weights[g], 0, biases ? biases[g] : 0, n, out + row * n,
                            panels * thread / team, panels * (thread + 1) / team);
    }
}

#else

int bg_bf16_gemm_available(void) { return 0; }

int bg_bf16_gemm_input_multiple(void) { return 2; }

int64_t bg_bf16_gemm_max_rows(void) { return 0; }

int bg_bf16_gemm_panel_columns(void) { return 0; }

#endif
