// Reference quantization of the kivi block formats (see ggml-kvq.h). tests/kvq_oracle.py is the
// independent numpy model of this file; the two must agree bit for bit.
//
// Defined outcome for hostile input, so that a broken activation can never crash the cache or make a
// block undecodable: values are saturated to the fp16 range, NaN is left out of the min/max and gets
// code 0, and a block without any non-NaN value is all zero. d and m are always finite.
//
// Compiled with -ffp-contract=off (ggml-kvq.cmake): a product fused into a sum (an FMA) would round differently
// from the oracle and the CUDA kernels.

#include "ggml-kvq.h"
#include "ggml-impl.h"

#include <math.h>
#include <string.h>

#define KIVI_FP16_MAX 65504.0f

static float kivi_saturate(float v) {
    return v > KIVI_FP16_MAX ? KIVI_FP16_MAX : (v < -KIVI_FP16_MAX ? -KIVI_FP16_MAX : v);
}

// the codes' grid of the range [lo, hi]: fp16 step and minimum as stored (dequantization uses them), and the values
// the codes are computed from
typedef struct {
    uint16_t dm[2];
    float    d;
    float    m;
    float    id;
} kivi_grid;

static kivi_grid kivi_range_grid(float lo, float hi, int qmax) {
    const float d_wanted = (hi - lo)/qmax;
    kivi_grid g;
    g.dm[0] = GGML_FP32_TO_FP16(d_wanted > KIVI_FP16_MAX ? KIVI_FP16_MAX : d_wanted);
    g.dm[1] = GGML_FP32_TO_FP16(lo);
    g.d     = GGML_FP16_TO_FP32(g.dm[0]);
    g.m     = GGML_FP16_TO_FP32(g.dm[1]);
    g.id    = g.d > 0.0f ? 1.0f/g.d : 0.0f;
    return g;
}

// nearest code of a value, t = (x - m)/d clamped before converting: with a subnormal d, t can exceed the range of int
static float kivi_clamped_step(float x, float m, float id, int qmax) {
    const float t = (kivi_saturate(x) - m)*id;
    return t < 0.0f ? 0.0f : (t > qmax ? (float) qmax : t);
}

// GGML_KVQ_CLIP_MSE's candidate ranges: each end of [lo, hi] moved in by 0..GGML_KVQ_MSE_STEPS steps, candidate
// a*KIVI_MSE_ENDS + b with the low end moved a steps and the high end b; laid out field by field, so that the error
// loop below runs across candidates in vector lanes while each candidate's sum keeps the value order the oracle has
#define KIVI_MSE_ENDS       (GGML_KVQ_MSE_STEPS + 1)
#define KIVI_MSE_CANDIDATES (KIVI_MSE_ENDS*KIVI_MSE_ENDS)

typedef struct {
    float lo[KIVI_MSE_CANDIDATES];
    float hi[KIVI_MSE_CANDIDATES];
    float d [KIVI_MSE_CANDIDATES];
    float m [KIVI_MSE_CANDIDATES];
    float id[KIVI_MSE_CANDIDATES];
} kivi_candidates;

static void kivi_candidate_grids(float lo, float hi, int qmax, kivi_candidates * GGML_RESTRICT c) {
    const float w = hi - lo;
    for (int a = 0; a < KIVI_MSE_ENDS; ++a) {
        const float l = lo + w*(a*GGML_KVQ_MSE_STEP);
        for (int b = 0; b < KIVI_MSE_ENDS; ++b) {
            const float     h = hi - w*(b*GGML_KVQ_MSE_STEP);
            const kivi_grid g = kivi_range_grid(l, h, qmax);
            const int       k = a*KIVI_MSE_ENDS + b;
            c->lo[k] = l;
            c->hi[k] = h;
            c->d[k]  = g.d;
            c->m[k]  = g.m;
            c->id[k] = g.id;
        }
    }
}

// adds a saturated value's squared error under each candidate's grid to its sum. The clamp is written in the
// operand order of SSE's max/min, and the code rounds to nearest even by adding and taking away 2^23 (exact for
// 0 <= t < 2^23, the value nearbyintf gives): both vectorize on baseline x86-64 and ARM. A -0 clamped to +0 changes
// no error's square.
static void kivi_add_squared_errors(float v, int qmax, const kivi_candidates * GGML_RESTRICT c,
                                    float * GGML_RESTRICT sse) {
    const float top = (float) qmax;
    for (int k = 0; k < KIVI_MSE_CANDIDATES; ++k) {
        float t = (v - c->m[k])*c->id[k];
        t = t > 0.0f ? t : 0.0f;
        t = t < top ? t : top;
        const float q = (t + 8388608.0f) - 8388608.0f;
        const float e = (c->m[k] + c->d[k]*q) - v;
        sse[k] += e*e;
    }
}

// GGML_KVQ_CLIP_MSE: [lo, hi] narrowed to the candidate range of least squared error, the first least (ggml-kvq.h)
static void kivi_search_range(const float * GGML_RESTRICT x, int qmax, float * lo, float * hi) {
    if (!(*hi - *lo > 0.0f)) {
        return;
    }
    kivi_candidates c;
    kivi_candidate_grids(*lo, *hi, qmax, &c);
    float sse[KIVI_MSE_CANDIDATES] = { 0.0f };
    for (int i = 0; i < QK_KIVI; ++i) {
        if (!isnan(x[i])) {
            kivi_add_squared_errors(kivi_saturate(x[i]), qmax, &c, sse);
        }
    }
    int best = 0;
    for (int k = 1; k < KIVI_MSE_CANDIDATES; ++k) {
        best = sse[k] < sse[best] ? k : best;
    }
    *lo = c.lo[best];
    *hi = c.hi[best];
}

// One block. The codes are computed from the fp16-rounded d and m that dequantization will use, with
// a subtraction, a multiplication and a round-to-nearest-even (or the dither's integer threshold): no operation a
// compiler could fuse, so SIMD paths and the numpy oracle reproduce it exactly.
void ggml_kvq_quantize_block_dithered(const float * GGML_RESTRICT x, void * GGML_RESTRICT out, int bits, float clip,
                                      int32_t spread16, uint64_t key) {
    GGML_ASSERT(spread16 >= 0 && spread16 <= 65536);
    GGML_ASSERT(clip >= GGML_KVQ_CLIP_MSE && clip <= 1.0f);
    uint8_t   * block  = (uint8_t *) out;
    const int   nbytes = QK_KIVI*bits/8;
    const int   qmax   = (1 << bits) - 1;
    float lo =  INFINITY;
    float hi = -INFINITY;
    for (int i = 0; i < QK_KIVI; ++i) {
        if (isnan(x[i])) {
            continue;
        }
        const float v = kivi_saturate(x[i]);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    uint16_t * dm = (uint16_t *) block;
    uint8_t  * qs = block + 2*sizeof(uint16_t);
    memset(qs, 0, nbytes);
    if (lo > hi) {
        dm[0] = GGML_FP32_TO_FP16(0.0f);
        dm[1] = GGML_FP32_TO_FP16(0.0f);
        return;
    }
    // SKVQ's clipping: the range narrowed about zero, or searched per block; values beyond it take the end codes
    if (clip == GGML_KVQ_CLIP_MSE) {
        kivi_search_range(x, qmax, &lo, &hi);
    } else {
        lo *= clip;
        hi *= clip;
    }
    const kivi_grid g = kivi_range_grid(lo, hi, qmax);
    dm[0] = g.dm[0];
    dm[1] = g.dm[1];
    for (int i = 0; i < QK_KIVI; ++i) {
        if (isnan(x[i])) {
            continue;
        }
        const float tc = kivi_clamped_step(x[i], g.m, g.id, qmax);
        const int   q  = spread16 == 0 ? (int) nearbyintf(tc) : ggml_kvq_dithered_code(tc, qmax, spread16, key + i);
        qs[i % nbytes] |= (uint8_t) (q << ((i / nbytes)*bits));
    }
}

void ggml_kvq_quantize_block(const float * GGML_RESTRICT x, void * GGML_RESTRICT out, int bits, float clip) {
    ggml_kvq_quantize_block_dithered(x, out, bits, clip, 0, 0);
}

static void kivi_dequantize_block(const uint8_t * GGML_RESTRICT block, float * GGML_RESTRICT y, int bits) {
    const int   nbytes = QK_KIVI*bits/8;
    const int   mask   = (1 << bits) - 1;
    const uint16_t * dm = (const uint16_t *) block;
    const uint8_t  * qs = block + 2*sizeof(uint16_t);
    const float d = GGML_FP16_TO_FP32(dm[0]);
    const float m = GGML_FP16_TO_FP32(dm[1]);
    for (int i = 0; i < QK_KIVI; ++i) {
        const int q = (qs[i % nbytes] >> ((i / nbytes)*bits)) & mask;
        y[i] = m + d*q;
    }
}

static void kivi_quantize_row(const float * GGML_RESTRICT x, void * GGML_RESTRICT y, int64_t k, int bits) {
    GGML_ASSERT(k % QK_KIVI == 0);
    uint8_t * out = (uint8_t *) y;
    for (int64_t ib = 0; ib < k/QK_KIVI; ++ib) {
        ggml_kvq_quantize_block(x + ib*QK_KIVI, out + ib*ggml_kvq_block_bytes(bits), bits, 1.0f);
    }
}

static void kivi_dequantize_row(const void * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k, int bits) {
    GGML_ASSERT(k % QK_KIVI == 0);
    const uint8_t * in = (const uint8_t *) x;
    for (int64_t ib = 0; ib < k/QK_KIVI; ++ib) {
        kivi_dequantize_block(in + ib*ggml_kvq_block_bytes(bits), y + ib*QK_KIVI, bits);
    }
}

static size_t kivi_quantize_rows(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, int bits) {
    const size_t row_size = (n_per_row/QK_KIVI)*ggml_kvq_block_bytes(bits);
    for (int64_t r = 0; r < nrows; ++r) {
        kivi_quantize_row(src + r*n_per_row, (uint8_t *) dst + r*row_size, n_per_row, bits);
    }
    return nrows*row_size;
}

static_assert(sizeof(block_kivi2) == 4 + QK_KIVI*2/8, "wrong kivi2 block size/padding");
static_assert(sizeof(block_kivi4) == 4 + QK_KIVI*4/8, "wrong kivi4 block size/padding");
static_assert(sizeof(block_kivi1) == 4 + QK_KIVI*1/8, "wrong kivi1 block size/padding");

void quantize_row_kivi2_ref(const float * GGML_RESTRICT x, block_kivi2 * GGML_RESTRICT y, int64_t k) { kivi_quantize_row(x, y, k, 2); }
void quantize_row_kivi4_ref(const float * GGML_RESTRICT x, block_kivi4 * GGML_RESTRICT y, int64_t k) { kivi_quantize_row(x, y, k, 4); }
void quantize_row_kivi1_ref(const float * GGML_RESTRICT x, block_kivi1 * GGML_RESTRICT y, int64_t k) { kivi_quantize_row(x, y, k, 1); }

void dequantize_row_kivi2(const block_kivi2 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) { kivi_dequantize_row(x, y, k, 2); }
void dequantize_row_kivi4(const block_kivi4 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) { kivi_dequantize_row(x, y, k, 4); }
void dequantize_row_kivi1(const block_kivi1 * GGML_RESTRICT x, float * GGML_RESTRICT y, int64_t k) { kivi_dequantize_row(x, y, k, 1); }

size_t quantize_kivi2(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix) {
    GGML_UNUSED(imatrix);
    return kivi_quantize_rows(src, dst, nrows, n_per_row, 2);
}

size_t quantize_kivi4(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix) {
    GGML_UNUSED(imatrix);
    return kivi_quantize_rows(src, dst, nrows, n_per_row, 4);
}

size_t quantize_kivi1(const float * GGML_RESTRICT src, void * GGML_RESTRICT dst, int64_t nrows, int64_t n_per_row, const float * imatrix) {
    GGML_UNUSED(imatrix);
    return kivi_quantize_rows(src, dst, nrows, n_per_row, 1);
}

bool ggml_kvq_validate_row_data(enum ggml_type type, const void * data, size_t nbytes) {
    const int bits = ggml_kvq_bits(type);
    GGML_ASSERT(bits != 0);
    const size_t bs = ggml_kvq_block_bytes(bits);
    if (nbytes % bs != 0) {
        fprintf(stderr, "%s: invalid size %zu for type %s\n", __func__, nbytes, ggml_type_name(type));
        return false;
    }
    const uint8_t * blocks = (const uint8_t *) data;
    for (size_t i = 0; i < nbytes/bs; ++i) {
        const uint16_t * dm = (const uint16_t *) (blocks + i*bs);
        if (!isfinite(GGML_FP16_TO_FP32(dm[0])) || !isfinite(GGML_FP16_TO_FP32(dm[1]))) {
            fprintf(stderr, "%s: ggml_type %s: non-finite d or m in block %zu\n", __func__, ggml_type_name(type), i);
            return false;
        }
    }
    return true;
}
