/*
 * The bfloat16 linear layers of a step on a CPU with AVX512-BF16 and no AMX.
 *
 *   bg_bf16_gemm_available  1 where this build holds the kernel (AVX512-BF16, no AMX-BF16:
 *                           oneDNN's AMX kernels are the faster ones there), else 0
 *   bg_bf16_linear          out[m, n] = bf16(x[m, k] @ w.T + bias): float32 sums of exact
 *                           bf16 products, rounded to nearest even once, as torch's GEMM does
 *
 * oneDNN runs a decode step's products (tens of rows against each weight) well below this
 * CPU's bf16 rate. Here (2-core AMD EPYC, AVX-512 on 256-bit units, bf16 dot peak ~460
 * GFLOP/s; the default model's product shapes, weights cold as in a step): 32 rows 340-415
 * against oneDNN's 240-305 GFLOP/s, 256 rows 400-415 against 375-410, 2,048 rows 390-415
 * against 335-425.
 *
 * Weight layout (`bf16_gemm.pack`): panel p holds output columns [96p, 96p + 96), zero past
 * n; within it, for each input pair (2i, 2i + 1), the 96 columns' two bf16 values side by
 * side. A panel is one contiguous stream of k / 2 runs of 6 vectors, the operand layout of
 * vdpbf16ps, which adds two products per lane.
 *
 * Compute: a tile of 4 rows x 96 columns is 24 float32 accumulators; for each input pair it
 * loads the panel's 6 vectors once and broadcasts each row's pair (4 x 96 measured faster
 * than 8 x 48, 6 x 64 and 12 x 32 tiles at 256 and 2,048 rows, even at 32). Rows past m read row
 * m - 1 (kept in registers, never stored). Each thread owns a contiguous range of panels.
 * With few row tiles (a decode step), a panel is used by few tiles after it comes from
 * memory, so the tiles ask for the thread's next panel as they go, a line or so per input
 * pair, and its reads overlap their compute.
 */
#include <stdint.h>

#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#include <immintrin.h>
#include <omp.h>

#define BLOCK_COLUMNS 16                  /* one vector of float32 accumulators */
#define PANEL_BLOCKS 6
#define PANEL_COLUMNS (BLOCK_COLUMNS * PANEL_BLOCKS)
#define TILE_ROWS 4
#define MAX_PREFETCH_TILES 16             /* more tiles per panel: its later tiles hit cache */
#define LINE_BYTES 64

typedef struct {
    const char *start;                    /* first line this tile asks for */
    int64_t lines;                        /* how many */
    int64_t per_pair;                     /* lines asked for per input pair */
} Prefetch;

/* float32 accumulators of one row block rounded to bf16 and stored, bias added, columns
 * past n left alone. */
static inline void store_block(uint16_t *out, __m512 sum, const uint16_t *bias, int64_t col, int64_t n) {
    int64_t left = n - col;
    __mmask16 mask = left >= BLOCK_COLUMNS ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    if (bias != 0) {
        __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + col);
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
    }
    _mm256_mask_storeu_epi16(out + col, mask, (__m256i)_mm512_cvtneps_pbh(sum));
}

/* Rows [0, rows) of x (row stride k) times one panel, into out's columns [col, col + PANEL_COLUMNS). */
static void tile(const uint16_t *x, int64_t k, int rows, const uint16_t *panel, Prefetch ahead,
                 const uint16_t *bias, uint16_t *out, int64_t col, int64_t n) {
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
            store_block(out + r * n, acc[r][j], bias, col + j * BLOCK_COLUMNS, n);
}

/* Panels [first, last) of the product: every row tile of each, asking for the next panel. */
static void panel_range(const uint16_t *x, int64_t m, int64_t k, const uint16_t *weight, const uint16_t *bias,
                        int64_t n, uint16_t *out, int64_t first, int64_t last) {
    int64_t panel_elements = k / 2 * PANEL_COLUMNS * 2;
    int64_t panel_lines = panel_elements * 2 / LINE_BYTES;
    int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    int64_t lines_per_tile = tiles <= MAX_PREFETCH_TILES ? (panel_lines + tiles - 1) / tiles : 0;
    int64_t per_pair = (lines_per_tile + k / 2 - 1) / (k / 2);
    for (int64_t p = first; p < last; p++) {
        const uint16_t *panel = weight + p * panel_elements;
        int64_t next_lines = p + 1 < last ? panel_lines : 0;
        for (int64_t t = 0; t < tiles; t++) {
            int64_t row = t * TILE_ROWS, asked = t * lines_per_tile;
            int64_t lines = next_lines - asked < lines_per_tile ? next_lines - asked : lines_per_tile;
            Prefetch ahead = {(const char *)(panel + panel_elements) + asked * LINE_BYTES, lines > 0 ? lines : 0,
                              per_pair};
            int rows = (int)(m - row < TILE_ROWS ? m - row : TILE_ROWS);
            tile(x + row * k, k, rows, panel, ahead, bias, out + row * n, p * PANEL_COLUMNS, n);
        }
    }
}

int bg_bf16_gemm_available(void) { return 1; }

/* x [m, k] and out [m, n] row-major bf16, k even; weight packed as above; bias [n] or NULL.
 * m may be 0 (a step that keeps no logits): nothing is computed. */
void bg_bf16_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *weight, const uint16_t *bias,
                    int64_t n, uint16_t *out, int num_threads) {
    if (m < 1) return; /* panel_range divides by the row tile count */
    int64_t panels = (n + PANEL_COLUMNS - 1) / PANEL_COLUMNS;
    if (num_threads > panels) num_threads = (int)panels;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
        panel_range(x, m, k, weight, bias, n, out, panels * thread / team, panels * (thread + 1) / team);
    }
}

#else

int bg_bf16_gemm_available(void) { return 0; }

#endif
