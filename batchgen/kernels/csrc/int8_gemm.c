/*
 * The int8 linear layers of a step (`quantization: int8`, W8A8) on a CPU with AVX512-VNNI,
 * through AMX tiles where the CPU has AMX-INT8.
 *
 *   bg_int8_gemm_available       1 where this build holds a kernel and may run it, else 0
 *   bg_int8_gemm_panel_columns   output columns per panel of the weight layout (96; 32 on the
 *                                AMX path)
 *   bg_int8_linear               out[m, n] = bf16(float(q[m] . w[n]) * (x_scale[m] * w_scale[n])
 *                                + bias[n]), where, with y[r] = x[r] * smoothing (float32, per
 *                                input; none where no smoothing is given), q[r] = round(y[r] *
 *                                (127 / max|y[r]|)) (to nearest even) and x_scale[r] = max|y[r]|
 *                                / 127: each row quantized symmetric, per token; the int32 sum is exact, the
 *                                scaling two float32 products (no fused multiply-add: the build
 *                                has -ffp-contract=off), the bias one float32 addition, rounded
 *                                to nearest even once; with `gated` (GATED_SILU or
 *                                GATED_GELU_TANH), the weight's rows are [gate; up] halves
 *                                interleaved per 16 (`int8_gemm.gated_order`) and out[m, n / 2] =
 *                                bf16(act(gate) * up) of those bf16 values, as decoder_ops'
 *                                bg_silu_mul / bg_gelu_tanh_mul compute it (`lanes16.h`);
 *                                with `split`, each row is quantized in two parts, y[r] as above
 *                                (q, x_scale), then what that rounding left, e[r] = y[r] - q[r] *
 *                                x_scale[r] (one rounding: a fused multiply-add), quantized alike
 *                                (q', x_scale'), and out[m, n] = bf16(float(q[m] . w[n]) * (x_scale[m]
 *                                * w_scale[n]) + float(q'[m] . w[n]) * (x_scale'[m] * w_scale[n]) +
 *                                bias[n]): the inputs' rounding error about 1/127 of int8's, for twice
 *                                the products (no `gated` with it)
 *
 * A split product runs as a product of 2m quantized rows, each row's two parts side by side (rows
 * 2r and 2r + 1), and its epilogue adds the two parts' scaled sums into out's row r.
 *
 * Inputs come in multiples of INPUT_MULTIPLE (64, one AMX tile row of int8): the weight and the
 * quantized rows are padded with zeros to it, so any number of inputs is taken.
 *
 * Weight layout (`int8_gemm.pack`): panel p holds output columns [Pp, Pp + P) (P =
 * PANEL_COLUMNS), zero past n; within it, for each input quad (4i .. 4i + 3), the P columns'
 * four int8 values side by side. A panel is one contiguous stream of k / 4 runs of P / 16
 * vectors: the operand layout of vpdpbusd, which adds four products per lane, and of an AMX B
 * tile (16 input quads of 16 columns, a row stride of one quad's P columns). Each thread owns a
 * contiguous range of panels, or of rows where they are many (`bg_int8_linear`).
 *
 * AVX512-VNNI path: vpdpbusd multiplies unsigned by signed bytes, so each row's quad is taken
 * as q + 128 (its sign bit flipped) and 128 * sum(w[n]) (`compensation`, computed at packing)
 * is subtracted from every column's sum. A tile of 4 rows x 96 columns is 24 int32
 * accumulators; for each input quad it loads the panel's 6 vectors once and broadcasts each
 * row's quad, and asks for the thread's next panel as it goes (the bf16 kernel's tiling).
 *
 * AMX path: a block of 32 rows x 32 columns is four 16 x 16 int32 accumulator tiles fed per 64
 * inputs by two tiles of rows and two of the panel (tdpbssd: signed by signed). The quantized
 * rows are written in tile order (`quantized_row`), so a tile of rows is one contiguous run of
 * bytes and a block's row tiles one stream. A panel is one block's 32 columns, read as one
 * contiguous stream; the row blocks of a panel ask for the next panel's weight into L2, and rows
 * go SUPER_ROWS at a time so their int8 rows stay in L2 while the thread's panels pass (the bf16
 * kernel's AMX tiling). A block's epilogue scales, rounds and stores its sums, a row's 32 columns
 * one 64-byte store; a gated product's (its activation: many vector operations a column) runs in
 * slices between the next block's tile products, its sums in the other of two buffers, where the
 * core overlaps some of it with them (a plain epilogue interleaved so slowed the tiles' loads).
 */
#include <stdint.h>

#define INPUT_MULTIPLE 64

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#include <omp.h>

#include "lanes16.h"

enum { GATED_NONE = 0, GATED_SILU = 1, GATED_GELU_TANH = 2 }; /* bg_int8_linear's `gated` */

#define BLOCK_COLUMNS 16                  /* one vector of int32 accumulators */
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define HAS_TILES 1                       /* the AMX path (its epilogue rounds with AVX512-BF16) */
#else
#define HAS_TILES 0
#endif
#if HAS_TILES
#define PANEL_BLOCKS 2
#else
#define PANEL_BLOCKS 6
#endif
#define PANEL_COLUMNS (BLOCK_COLUMNS * PANEL_BLOCKS)
#define LINE_BYTES 64

static inline __mmask16 column_mask(int64_t col, int64_t n) {
    int64_t left = n - col;
    return left >= BLOCK_COLUMNS ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* 16 output columns' weight scales and bias (where the product has one) as float32, read once
 * for all rows. */
typedef struct {
    __mmask16 mask;                       /* the columns before n */
    int has_bias;
    __m512 w_scales, bias;
} Columns;

static inline Columns columns_at(const float *w_scales, const uint16_t *bias, int64_t col, int64_t n) {
    __mmask16 mask = column_mask(col, n);
    Columns columns = {mask, bias != 0, _mm512_maskz_loadu_ps(mask, w_scales + col),
                       bias != 0 ? load_bf16x16(bias + col, mask) : _mm512_setzero_ps()};
    return columns;
}

/* One row's 16 columns from their exact int32 sums, times their row's and columns' scales. */
static inline __m512 unbiased(__m512i sums, float x_scale, Columns columns) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(_mm512_set1_ps(x_scale), columns.w_scales));
}

/* `value` plus the columns' bias, where they have one. */
static inline __m512 plus_bias(__m512 value, Columns columns) {
    return columns.has_bias ? _mm512_add_ps(value, columns.bias) : value;
}

/* One row's 16 columns from their exact int32 sums: scaled, bias added, before their rounding to
 * bf16. */
static inline __m512 scaled(__m512i sums, float x_scale, Columns columns) {
    return plus_bias(unbiased(sums, x_scale, columns), columns);
}

/* One row's 16 columns, `scaled`, rounded to bf16 and stored; columns past n left alone. */
static inline void store_block(uint16_t *out, __m512i sums, float x_scale, Columns columns, int64_t col) {
    _mm256_mask_storeu_epi16(out + col, columns.mask, to_bf16x16(scaled(sums, x_scale, columns)));
}

/* One split row's 16 columns from its two parts' sums (`bg_int8_linear`'s `split`): each scaled,
 * added, then the bias, before their rounding to bf16. */
static inline __m512 split_scaled(__m512i sums, __m512i rest_sums, const float *x_scales, Columns columns) {
    return plus_bias(_mm512_add_ps(unbiased(sums, x_scales[0], columns), unbiased(rest_sums, x_scales[1], columns)),
                     columns);
}

/* `split_scaled`, rounded to bf16 and stored; columns past n left alone. */
static inline void store_split_block(uint16_t *out, __m512i sums, __m512i rest_sums, const float *x_scales,
                                     Columns columns, int64_t col) {
    _mm256_mask_storeu_epi16(out + col, columns.mask, to_bf16x16(split_scaled(sums, rest_sums, x_scales, columns)));
}

/* One row's 16 outputs of a `gated` product from its 16 gate columns' and their 16 up columns'
 * sums: each `scaled` and rounded to bf16 (the unfused product's output), then act(gate) * up
 * rounded to bf16 (the activation pass's), stored at out. */
static inline void store_gated_block(uint16_t *out, __m512i gate_sums, __m512i up_sums, float x_scale, Columns gate,
                                     Columns up, int gated) {
    __m512 gate_value = round16(scaled(gate_sums, x_scale, gate), 1);
    __m512 up_value = round16(scaled(up_sums, x_scale, up), 1);
    __m512 value = gated == GATED_SILU ? silu_mul16(gate_value, up_value, 1) : gelu_tanh_mul16(gate_value, up_value, 1);
    _mm256_storeu_si256((__m256i *)out, to_bf16x16(value));
}

/* x[i, i + 16) as float32, each times smoothing[i] where it is given. */
static inline __m512 input_at(const uint16_t *x, const float *smoothing, int64_t i, __mmask16 mask) {
    __m512 value = load_bf16x16(x + i, mask);
    return smoothing != 0 ? _mm512_mul_ps(value, _mm512_maskz_loadu_ps(mask, smoothing + i)) : value;
}

/* A row's quantization: its scale and 127 / max|value| (0 for a row of zeros). */
typedef struct {
    float scale, inverse;
} Quantization;

/* What is left to quantize of x[i, i + 16) (`input_at`): the inputs themselves where `taken` is
 * NULL, else what `taken`'s rounding left of them (value - round(value * inverse) * scale, one
 * rounding). */
static inline __m512 left_at(const uint16_t *x, const float *smoothing, int64_t i, __mmask16 mask,
                             const Quantization *taken) {
    __m512 value = input_at(x, smoothing, i, mask);
    if (taken == 0) return value;
    __m512 rounded = _mm512_roundscale_ps(_mm512_mul_ps(value, _mm512_set1_ps(taken->inverse)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_fnmadd_ps(rounded, _mm512_set1_ps(taken->scale), value);
}

/* Row x (what `taken` left of it, where given: `left_at`) quantized into q: its input i at
 * q[(i / 64) * chunk_stride + i % 64] (chunk_stride 64: one contiguous row), zeros for inputs [k,
 * q_length) (q_length a multiple of 64); returns the quantization. The largest magnitude is kept in
 * four running maxima (the same maximum in any order); a chunk's 64 inputs are rounded as four
 * vectors, narrowed with saturation (as vpmovsdb narrows one) and stored as one 64-byte run. */
static Quantization quantize_row(const uint16_t *x, const float *smoothing, const Quantization *taken, int64_t k,
                                 int8_t *q, int64_t q_length, int64_t chunk_stride) {
    __m512 peaks[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t i = 0; i < k; i += 16)
        peaks[i / 16 % 4] = _mm512_max_ps(peaks[i / 16 % 4], _mm512_abs_ps(left_at(x, smoothing, i, column_mask(i, k), taken)));
    const float absmax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(peaks[0], peaks[1]), _mm512_max_ps(peaks[2], peaks[3])));
    const Quantization quantization = {absmax / 127.0f, absmax > 0.0f ? 127.0f / absmax : 0.0f};
    const __m512 inverse = _mm512_set1_ps(quantization.inverse);
    /* the packs narrow within 128-bit lanes: lane L holds dwords 4L .. 4L + 3 of each vector in turn */
    const __m512i in_order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    for (int64_t c = 0; c < q_length; c += INPUT_MULTIPLE) {
        __m512i rounded[4];
        for (int j = 0; j < 4; j++) {
            const int64_t i = c + 16 * j;
            rounded[j] = _mm512_cvtps_epi32(_mm512_mul_ps(left_at(x, smoothing, i, column_mask(i, k), taken), inverse));
        }
        const __m512i bytes = _mm512_packs_epi16(_mm512_packs_epi32(rounded[0], rounded[1]),
                                                 _mm512_packs_epi32(rounded[2], rounded[3]));
        _mm512_storeu_si512(q + c / INPUT_MULTIPLE * chunk_stride, _mm512_permutexvar_epi32(in_order, bytes));
    }
    return quantization;
}

#if HAS_TILES
#include "amx.h"

#define CHUNK_INPUTS 64                   /* inputs per tile product: 16 quads */
#define BLOCK_ROWS 32                     /* two tiles of 16 rows */
#define SUPER_ROWS 512                    /* rows that stay in L2 while the thread's panels pass */
/* What a product's epilogue writes with: each row's scale, each column's scale and bias (or NULL),
 * the columns n, the `gated` and `split` forms, the output. */
typedef struct {
    const float *x_scales, *w_scales;
    const uint16_t *bias;
    int64_t n;
    int gated, split;
    uint16_t *out;
} Outputs;

/* A block whose sums (`block`'s four tiles) are stored and wait for their epilogue: its `rows`
 * rows from `row`, panel p. */
typedef struct {
    const int32_t *sums;
    int rows;
    int64_t row, p;
} Stored;

/* Row r's 16 sums of a block's left (half 0) or right (half 1) columns in `block`'s tiles. */
static inline __m512i block_sums(const int32_t *sums, int r, int half) {
    return _mm512_load_si512(sums + (r < 16 ? r * 16 : 512 + (r - 16) * 16) + half * 256);
}

/* The rows a block's epilogue goes by: a split product's two parts of a row are one. */
static inline int epilogue_units(const Outputs *o, int rows) { return o->split ? rows / 2 : rows; }

/* Units [first, last) of a stored block's sums scaled into out: its rows and panel p's columns;
 * `gated`: the panel's 16 gate and 16 up columns into outputs [16p, 16p + 16) of rows n / 2 wide;
 * `split`: rows 2i and 2i + 1 (two parts of one row) into out's row row / 2 + i. A row's 32
 * columns are one 64-byte store where they are all before n. */
static void store_units(const Outputs *o, const Stored *b, int first, int last) {
    const int64_t col = b->p * PANEL_COLUMNS, n = o->n;
    if (o->gated) {
        const Columns gate = columns_at(o->w_scales, 0, col, n), up = columns_at(o->w_scales, 0, col + BLOCK_COLUMNS, n);
        for (int r = first; r < last; r++)
            store_gated_block(o->out + (b->row + r) * (n / 2) + b->p * BLOCK_COLUMNS, block_sums(b->sums, r, 0),
                              block_sums(b->sums, r, 1), o->x_scales[b->row + r], gate, up, o->gated);
        return;
    }
    const Columns left = columns_at(o->w_scales, o->bias, col, n), right = columns_at(o->w_scales, o->bias, col + BLOCK_COLUMNS, n);
    for (int unit = first; unit < last; unit++) {
        const int r = o->split ? 2 * unit : unit;
        const float *x_scales = o->x_scales + b->row + r;
        uint16_t *out = o->out + (b->row + r) / (o->split ? 2 : 1) * n + col;
        __m512 values[2];
        for (int half = 0; half < 2; half++) {
            const Columns columns = half ? right : left;
            values[half] = o->split ? split_scaled(block_sums(b->sums, r, half), block_sums(b->sums, r + 1, half), x_scales, columns)
                                    : scaled(block_sums(b->sums, r, half), x_scales[0], columns);
        }
        if (right.mask == 0xffff) {
            _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(values[1], values[0])); /* values[0]'s 16, then values[1]'s */
            continue;
        }
        _mm256_mask_storeu_epi16(out, left.mask, to_bf16x16(values[0]));
        _mm256_mask_storeu_epi16(out + BLOCK_COLUMNS, right.mask, to_bf16x16(values[1]));
    }
}

/* One block: `top` rows of q in tile order (`quantized_row`: a 64-input tile every top * 64
 * bytes), and `bottom` rows (the next group's, 16 k bytes on), times the 32 panel columns at `w`,
 * into `sums` as four 16 x 16 int32 tiles (top left, top right, bottom left, bottom right); its
 * chunks ask for `ahead_lines` lines from `ahead` into L2, evenly, and each stores a share of the
 * `pending` block's epilogue (where given) behind its tile products. */
static void block(const int8_t *q, int64_t k, int top, int bottom, const int8_t *w, const char *ahead,
                  int64_t ahead_lines, int32_t *sums, const Outputs *outputs, const Stored *pending) {
    const int64_t w_stride = PANEL_COLUMNS * 4, w_chunk = CHUNK_INPUTS * PANEL_COLUMNS;
    _tile_zero(C_TOP_LEFT);
    _tile_zero(C_TOP_RIGHT);
    if (bottom) {
        _tile_zero(C_BOTTOM_LEFT);
        _tile_zero(C_BOTTOM_RIGHT);
    }
    const int64_t chunks = k / CHUNK_INPUTS, per_chunk = (ahead_lines + chunks - 1) / chunks;
    const int units = pending ? epilogue_units(outputs, pending->rows) : 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int8_t *chunk = w + c * w_chunk;
        for (int64_t line = c * per_chunk; line < (c + 1) * per_chunk && line < ahead_lines; line++)
            _mm_prefetch(ahead + line * LINE_BYTES, _MM_HINT_T2);
        _tile_loadd(X_TOP, q + c * top * CHUNK_INPUTS, CHUNK_INPUTS);
        _tile_loadd(W_LEFT, chunk, w_stride);
        _tile_dpbssd(C_TOP_LEFT, X_TOP, W_LEFT);
        _tile_loadd(W_RIGHT, chunk + BLOCK_COLUMNS * 4, w_stride);
        _tile_dpbssd(C_TOP_RIGHT, X_TOP, W_RIGHT);
        if (bottom) {
            _tile_loadd(X_BOTTOM, q + 16 * k + c * bottom * CHUNK_INPUTS, CHUNK_INPUTS);
            _tile_dpbssd(C_BOTTOM_LEFT, X_BOTTOM, W_LEFT);
            _tile_dpbssd(C_BOTTOM_RIGHT, X_BOTTOM, W_RIGHT);
        }
        if (pending) store_units(outputs, pending, (int)(units * c / chunks), (int)(units * (c + 1) / chunks));
    }
    _tile_stored(C_TOP_LEFT, sums, 64);
    _tile_stored(C_TOP_RIGHT, sums + 256, 64);
    if (bottom) {
        _tile_stored(C_BOTTOM_LEFT, sums + 512, 64);
        _tile_stored(C_BOTTOM_RIGHT, sums + 768, 64);
    }
}

/* Rows [first_row, last_row) over panels [first, last), in blocks of `rows` (the tiles are
 * configured for it). The blocks of a panel ask for the next panel's weight into L2. A gated
 * block's epilogue runs during the next block's tile products (its sums in the other of two
 * buffers), the last one's after them; a plain block's right after its own. */
static void row_pass(const int8_t *q, int64_t k, const int8_t *weight, const Outputs *outputs, int64_t first,
                     int64_t last, int64_t first_row, int64_t last_row, int rows) {
    int32_t sums[2][4 * 256] __attribute__((aligned(64)));
    int top = rows < 16 ? rows : 16, bottom = rows - top;
    const int64_t panel_bytes = k * PANEL_COLUMNS, next_lines = panel_bytes / LINE_BYTES;
    const int64_t blocks = (last_row - first_row + rows - 1) / rows;
    Stored pending = {0};
    int buffer = 0;
    for (int64_t p = first; p < last; p++) {
        const int8_t *panel = weight + p * panel_bytes;
        const int64_t lines = p + 1 < last ? next_lines : 0;
        for (int64_t row = first_row, b = 0; row < last_row; row += rows, b++, buffer ^= outputs->gated != 0) {
            int64_t from = lines * b / blocks, to = lines * (b + 1) / blocks;
            block(q + row * k, k, top, bottom, panel, (const char *)(panel + panel_bytes) + from * LINE_BYTES,
                  to - from, sums[buffer], outputs, pending.sums ? &pending : 0);
            pending = (Stored){sums[buffer], rows, row, p};
            if (!outputs->gated) {
                store_units(outputs, &pending, 0, epilogue_units(outputs, rows));
                pending.sums = 0;
            }
        }
    }
    if (pending.sums) store_units(outputs, &pending, 0, epilogue_units(outputs, pending.rows));
}

static void panel_range(const int8_t *q, const float *x_scales, int64_t m, int64_t k, const int8_t *weight,
                        const float *w_scales, const int32_t *compensation, const uint16_t *bias, int64_t n,
                        int gated, int split, uint16_t *out, int64_t first, int64_t last) {
    (void)compensation; /* tdpbssd multiplies signed by signed */
    const Outputs outputs = {x_scales, w_scales, bias, n, gated, split, out};
    int64_t full_rows = m / BLOCK_ROWS * BLOCK_ROWS;
    if (full_rows > 0) {
        configure_block_tiles(16, 16);
        for (int64_t start = 0; start < full_rows; start += SUPER_ROWS)
            row_pass(q, k, weight, &outputs, first, last, start, start + SUPER_ROWS < full_rows ? start + SUPER_ROWS : full_rows,
                     BLOCK_ROWS);
    }
    if (m > full_rows) {
        int rows = (int)(m - full_rows);
        configure_block_tiles(rows < 16 ? rows : 16, rows < 16 ? 0 : rows - 16);
        row_pass(q, k, weight, &outputs, first, last, full_rows, m, rows);
    }
    _tile_release();
}

int bg_int8_gemm_available(void) { return amx_tiles_granted(); }

/* Where row r of the m quantized rows goes, and the stride between its 64-input chunks: in tile
 * order, the rows in groups of 16 (the last group may hold fewer, g), each group k / 64 tiles of g
 * rows x 64 inputs, so that a tile is one contiguous run of bytes. */
static int8_t *quantized_row(int8_t *q, int64_t m, int64_t k, int64_t r, int64_t *chunk_stride) {
    int64_t group = r / 16 * 16, rows = m - group < 16 ? m - group : 16;
    *chunk_stride = rows * CHUNK_INPUTS;
    return q + group * k + (r - group) * CHUNK_INPUTS;
}

#else

#define TILE_ROWS 4
#define MAX_PREFETCH_TILES 16             /* more tiles per panel: its later tiles hit cache */

/* Rows [0, rows) of q (row stride k) times one panel, into out's columns [col, col + PANEL_COLUMNS)
 * (`gated`: each pair of 16 gate and 16 up columns into 16 outputs, from col / 2, of rows n / 2
 * wide; `split`: rows 2i and 2i + 1, two parts of one row, into out's row i); rows past `rows`
 * read row rows - 1 and are not stored. */
static void tile(const int8_t *q, const float *x_scales, int64_t k, int rows, const int8_t *panel,
                 const char *ahead, int64_t ahead_lines, int64_t per_quad, const float *w_scales,
                 const int32_t *compensation, const uint16_t *bias, int gated, int split, uint16_t *out, int64_t col,
                 int64_t n) {
    __m512i acc[TILE_ROWS][PANEL_BLOCKS];
    const int32_t *quads[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) {
        quads[r] = (const int32_t *)(q + (r < rows ? r : rows - 1) * k);
        for (int j = 0; j < PANEL_BLOCKS; j++) acc[r][j] = _mm512_setzero_si512();
    }
    const __m512i sign_bits = _mm512_set1_epi32((int32_t)0x80808080u);
    for (int64_t i = 0; i < k / 4; i++) {
        __m512i w[PANEL_BLOCKS];
        for (int j = 0; j < PANEL_BLOCKS; j++)
            w[j] = _mm512_loadu_si512(panel + (i * PANEL_BLOCKS + j) * BLOCK_COLUMNS * 4);
        for (int64_t line = i * per_quad; line < (i + 1) * per_quad && line < ahead_lines; line++)
            _mm_prefetch(ahead + line * LINE_BYTES, _MM_HINT_T0);
        for (int r = 0; r < TILE_ROWS; r++) {
            __m512i quad = _mm512_xor_si512(_mm512_set1_epi32(quads[r][i]), sign_bits);
            for (int j = 0; j < PANEL_BLOCKS; j++) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], quad, w[j]);
        }
    }
    for (int j = 0; j < PANEL_BLOCKS && col + j * BLOCK_COLUMNS < n; j++) {
        const __m512i offset = _mm512_loadu_si512(compensation + col + j * BLOCK_COLUMNS);
        for (int r = 0; r < rows; r++) acc[r][j] = _mm512_sub_epi32(acc[r][j], offset);
    }
    for (int j = 0; j < PANEL_BLOCKS && col + j * BLOCK_COLUMNS < n; j += gated ? 2 : 1) {
        const Columns columns = columns_at(w_scales, bias, col + j * BLOCK_COLUMNS, n);
        if (gated) {
            const Columns up = columns_at(w_scales, 0, col + (j + 1) * BLOCK_COLUMNS, n);
            for (int r = 0; r < rows; r++)
                store_gated_block(out + r * (n / 2) + (col + j * BLOCK_COLUMNS) / 2, acc[r][j], acc[r][j + 1],
                                  x_scales[r], columns, up, gated);
            continue;
        }
        for (int r = 0; r < rows; r += split ? 2 : 1) {
            if (split)
                store_split_block(out + r / 2 * n, acc[r][j], acc[r + 1][j], x_scales + r, columns, col + j * BLOCK_COLUMNS);
            else
                store_block(out + r * n, acc[r][j], x_scales[r], columns, col + j * BLOCK_COLUMNS);
        }
    }
}

static void panel_range(const int8_t *q, const float *x_scales, int64_t m, int64_t k, const int8_t *weight,
                        const float *w_scales, const int32_t *compensation, const uint16_t *bias, int64_t n,
                        int gated, int split, uint16_t *out, int64_t first, int64_t last) {
    const int64_t panel_bytes = k * PANEL_COLUMNS, panel_lines = panel_bytes / LINE_BYTES;
    const int64_t tiles = (m + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t lines_per_tile = tiles <= MAX_PREFETCH_TILES ? (panel_lines + tiles - 1) / tiles : 0;
    const int64_t per_quad = (lines_per_tile + k / 4 - 1) / (k / 4);
    for (int64_t p = first; p < last; p++) {
        const int8_t *panel = weight + p * panel_bytes;
        const int64_t next_lines = p + 1 < last ? panel_lines : 0;
        for (int64_t t = 0; t < tiles; t++) {
            int64_t row = t * TILE_ROWS, asked = t * lines_per_tile;
            int64_t lines = next_lines - asked < lines_per_tile ? next_lines - asked : lines_per_tile;
            int rows = (int)(m - row < TILE_ROWS ? m - row : TILE_ROWS);
            tile(q + row * k, x_scales + row, k, rows, panel, (const char *)(panel + panel_bytes) + asked * LINE_BYTES,
                 lines > 0 ? lines : 0, per_quad, w_scales, compensation, bias, gated, split,
                 out + (split ? row / 2 : row) * (gated ? n / 2 : n), p * PANEL_COLUMNS, n);
        }
    }
}

int bg_int8_gemm_available(void) { return 1; }

/* Where row r of the quantized rows goes, and the stride between its 64-input chunks: rows one
 * after another. */
static int8_t *quantized_row(int8_t *q, int64_t m, int64_t k, int64_t r, int64_t *chunk_stride) {
    (void)m;
    *chunk_stride = INPUT_MULTIPLE;
    return q + r * k;
}

#endif

int bg_int8_gemm_panel_columns(void) { return PANEL_COLUMNS; }

/* Quantized rows [first, last) of a product of `rows` quantized rows (a split product's row r is
 * quantized rows 2r and 2r + 1, `parts` 2), each where `quantized_row` puts it, with its scale. */
static void quantize_rows(const uint16_t *x, int64_t x_stride, int64_t k, const float *smoothing, int8_t *q,
                          float *x_scales, int64_t k_padded, int64_t rows, int64_t parts, int64_t first, int64_t last) {
    for (int64_t at = first; at < last; at += parts) {
        const uint16_t *row = x + at / parts * x_stride;
        int64_t chunk_stride;
        int8_t *values = quantized_row(q, rows, k_padded, at, &chunk_stride);
        const Quantization head = quantize_row(row, smoothing, 0, k, values, k_padded, chunk_stride);
        x_scales[at] = head.scale;
        if (parts == 2) {
            values = quantized_row(q, rows, k_padded, at + 1, &chunk_stride);
            x_scales[at + 1] = quantize_row(row, smoothing, &head, k, values, k_padded, chunk_stride).scale;
        }
    }
}

/* x [m, k] bf16 rows of row stride x_stride, each input i times smoothing[i] (float32 [k], or NULL
 * for none), quantized into q (m x k_padded bytes, each row where `quantized_row` puts it) and
 * x_scales [m]
 * (scratch the caller allocates; k_padded a multiple of INPUT_MULTIPLE, >= k); weight packed as
 * above for k_padded inputs, with w_scales [n] and compensation [n] (128 times each column's
 * sum); bias [n] bf16 or NULL; out [m, n] bf16, or with `gated` other than GATED_NONE (n a
 * multiple of 32, no bias) [m, n / 2]; with `split` (no `gated`), q and x_scales hold 2m rows,
 * each row's two parts. m may be 0: nothing is computed.
 *
 * Where the quantized rows give each thread at least ROW_SPLIT_ROWS, each thread takes a range of
 * rows (in runs of 32, an AMX block's) and quantizes and computes them against every panel: a row
 * is read, quantized and stored by one core, and the threads wait for none of each other's
 * (measured in docs/performance.md). Fewer rows (a decode step's) go by panels: each thread
 * quantizes a share of the rows, then all compute their own panels over every row, so that each
 * weight byte is read by one core. */
#define ROW_SPLIT_ROWS 128
void bg_int8_linear(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const float *smoothing, int8_t *q,
                    float *x_scales,
                    int64_t k_padded, const int8_t *weight, const float *w_scales, const int32_t *compensation,
                    const uint16_t *bias, int64_t n, int gated, int split, uint16_t *out, int num_threads) {
    if (m < 1) return;
    const int64_t panels = (n + PANEL_COLUMNS - 1) / PANEL_COLUMNS, parts = split ? 2 : 1, rows = m * parts;
    const int64_t out_width = gated ? n / 2 : n, runs = (rows + 31) / 32;
    if (num_threads < 1) num_threads = 1;
    if (rows >= (int64_t)ROW_SPLIT_ROWS * num_threads) {
#pragma omp parallel num_threads(num_threads)
        {
            const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
            const int64_t first = runs * thread / team * 32, end = runs * (thread + 1) / team * 32;
            const int64_t last = end < rows ? end : rows;
            quantize_rows(x, x_stride, k, smoothing, q, x_scales, k_padded, rows, parts, first, last);
            if (last > first)
                panel_range(q + first * k_padded, x_scales + first, last - first, k_padded, weight, w_scales,
                            compensation, bias, n, gated, split, out + first / parts * out_width, 0, panels);
        }
        return;
    }
    if (num_threads > panels) num_threads = (int)panels;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t thread = omp_get_thread_num(), team = omp_get_num_threads();
        quantize_rows(x, x_stride, k, smoothing, q, x_scales, k_padded, rows, parts, m * thread / team * parts,
                      m * (thread + 1) / team * parts);
#pragma omp barrier
        panel_range(q, x_scales, rows, k_padded, weight, w_scales, compensation, bias, n, gated, split, out,
                    panels * thread / team, panels * (thread + 1) / team);
    }
}

#else

int bg_int8_gemm_available(void) { return 0; }

int bg_int8_gemm_panel_columns(void) { return 0; }

#endif

int bg_int8_gemm_input_multiple(void) { return INPUT_MULTIPLE; }
