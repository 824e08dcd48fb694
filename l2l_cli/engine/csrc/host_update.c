/* The EPS's host update in one pass over memory (issue 50; DESIGN.md "The host's update at its floor").
 *
 * l2l_adamw: read a layer's received gradient in the type it arrived in (FP32, BF16 or FP16), multiply it
 * by the unscale/clip factor (skipped at exactly 1), apply AdamW to the FP32 master and moments (read from
 * one state set, written to the same or another: L2L-p's undo is the set not written), and write the
 * device's half copy of the new master: per parameter 2-4 B of gradient, 12 B of state read, 12 written,
 * 2 of send copy, and nothing else. The arithmetic is ATen's fused CPU AdamW (aten/src/ATen/native/cpu/
 * FusedAdamKernel.cpp, ADAMW mode) operation for operation, including its FMAs, so the result is
 * bit-identical to torch.optim.AdamW(fused=True) after a separate widen and multiply (the caller checks
 * that once per process, and leaves the run's last few elements to torch). Build flags: -ffp-contract=off
 * (no FMA the source does not write), no fast-math.
 *
 * Each element is read, updated and written in registers, in one loop (update_loop). Beside (L2L-p), the
 * loop writes a block at a time into L1 buffers, and each block is streamed out (beside_run). The caller
 * splits a run over threads (each thread one contiguous range) and releases the GIL (ctypes).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { T_F32 = 0, T_BF16 = 1, T_F16 = 2, T_NONE = -1 };

#define BLOCK 1024

static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* bfloat16 <-> float: round to nearest even, NaN to a quiet NaN (as c10::BFloat16) */
static inline float bf16_to_f32(uint16_t h) { return from_bits((uint32_t)h << 16); }
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = to_bits(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return f != f ? (uint16_t)0x7FC0u : (uint16_t)r;
}

/* IEEE half <-> float, round to nearest even (the branch-free float tricks c10::Half also uses) */
static inline float f16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    float normalized = from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormalized = from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t r = sign | (two_w < (1u << 27) ? to_bits(denormalized) : to_bits(normalized));
    return from_bits(r);
}
static inline uint16_t f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t w = to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = from_bits((bias >> 1) + 0x07800000u) + base;
    uint32_t bits = to_bits(base);
    uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* What every element of one update shares (floats as ATen casts its doubles). */
typedef struct {
    float mult;       /* the unscale/clip factor */
    int32_t has_mult; /* 0: the factor is exactly 1, no multiply */
    float decay;      /* (float)(1 - lr * weight_decay) */
    int32_t has_decay;
    float lerp_w;     /* (float)(1 - beta1): the first moment's lerp weight */
    float beta2;      /* (float)beta2 */
    float c2;         /* (float)(1 - beta2) */
    float bc2_sqrt;   /* (float)sqrt(1 - beta2^step) */
    float eps;
    float step_size;  /* (float)(lr / (1 - beta1^step)) */
} adamw_args;

static void widen(const void *g, int g_type, int64_t at, int64_t n, float *out) {
    if (g_type == T_F32) {
        memcpy(out, (const float *)g + at, (size_t)n * 4);
    } else if (g_type == T_BF16) {
        const uint16_t *s = (const uint16_t *)g + at;
        for (int64_t k = 0; k < n; k++) out[k] = bf16_to_f32(s[k]);
    } else {
        const uint16_t *s = (const uint16_t *)g + at;
        for (int64_t k = 0; k < n; k++) out[k] = f16_to_f32(s[k]);
    }
}

static void narrow(const float *w, void *send, int send_type, int64_t at, int64_t n) {
    if (send_type == T_BF16) {
        uint16_t *d = (uint16_t *)send + at;
        for (int64_t k = 0; k < n; k++) d[k] = f32_to_bf16(w[k]);
    } else if (send_type == T_F16) {
        uint16_t *d = (uint16_t *)send + at;
        for (int64_t k = 0; k < n; k++) d[k] = f32_to_f16(w[k]);
    } else if (send_type == T_F32) {
        memcpy((float *)send + at, w, (size_t)n * 4);
    }
}

/* ATen's vector formula (Vectorized<float>): m by an FMA lerp, v = v*b2 + (c2*g)*g with the FMA torch's own
 * build makes of it, w + (-ss*m)/denom. (The last numel % vector-width elements of a run, which ATen's scalar
 * tail loop takes, the caller leaves to torch's kernel itself: how the compiler built that loop differs.) */
#define ADAMW_CONSTS(a)                                                                                    \
    const float lw = (a)->lerp_w, b2 = (a)->beta2, c2 = (a)->c2, bc = (a)->bc2_sqrt, eps = (a)->eps;    \
    const float neg_ss = -(a)->step_size, decay = (a)->has_decay ? (a)->decay : 1.0f;                   \
    const int small = fabsf(lw) < 0.5f, wd = (a)->has_decay;                                            \
    const float coeff = small ? lw : lw - 1.0f;
#define ADAMW_ELEMENT(gk, w0k, m0k, v0k, w1k, m1k, v1k)                                                     \
    do {                                                                                                   \
        float p_ = wd ? (w0k) * decay : (w0k);                                                             \
        float m_ = fmaf(coeff, (gk) - (m0k), small ? (m0k) : (gk));                                        \
        float v_ = fmaf(c2 * (gk), (gk), (v0k) * b2); /* as torch's build contracts it */                  \
        float denom_ = sqrtf(v_) / bc + eps;                                                               \
        (m1k) = m_;                                                                                        \
        (v1k) = v_;                                                                                        \
        (w1k) = p_ + (neg_ss * m_) / denom_;                                                               \
    } while (0)

/* The element at ``at`` of a buffer of ``type`` (FP32 4 bytes, a half type 2; no buffer: NULL). */
static inline void *elem(const void *p, int type, int64_t at) {
    return p ? (char *)p + at * (type == T_F32 ? 4 : 2) : NULL;
}

/* Element k of the gradient (type ``gt``), times the factor where ``mul``; and x narrowed into element k of
 * the send copy (type ``st``; T_NONE: none). Inlined where ``gt``, ``st`` and ``mul`` are constants. */
static inline __attribute__((always_inline)) float grad_at(const void *restrict g, const int gt, int64_t k,
                                                           const int mul, float f) {
    float x = gt == T_F32    ? ((const float *)g)[k]
              : gt == T_BF16 ? bf16_to_f32(((const uint16_t *)g)[k])
                             : f16_to_f32(((const uint16_t *)g)[k]);
    return mul ? x * f : x;
}
static inline __attribute__((always_inline)) void send_put(void *restrict s, const int st, int64_t k,
                                                           float x) {
    if (st == T_BF16) ((uint16_t *)s)[k] = f32_to_bf16(x);
    if (st == T_F16) ((uint16_t *)s)[k] = f32_to_f16(x);
    if (st == T_F32) ((float *)s)[k] = x;
}

/* The update in place of n elements (w, m, v read and written through one pointer each) in one loop: the
 * gradient read in its type and multiplied, AdamW, the new master narrowed into the send copy, each element
 * in registers. ``gt``, ``st`` and ``mul`` are constants at every call (L2L_SPECIALIZE), so each combination
 * is its own loop, vectorized: against widening into a buffer, then the multiply, the update and the
 * narrowing as four loops over it, this takes the pass from 0.62 to 0.41 ns per parameter in cache on one
 * core of a 2-core Zen 4 (BF16 gradient and send copy). */
static inline __attribute__((always_inline)) void update_loop(const void *restrict g, const int gt,
                                                              float *restrict w, float *restrict m,
                                                              float *restrict v, void *restrict send,
                                                              const int st, int64_t n, const adamw_args *a,
                                                              const int mul) {
    ADAMW_CONSTS(a)
    const float f = a->mult;
    for (int64_t k = 0; k < n; k++) {
        float gk = grad_at(g, gt, k, mul, f);
        ADAMW_ELEMENT(gk, w[k], m[k], v[k], w[k], m[k], v[k]);
        send_put(send, st, k, w[k]);
    }
}

/* The same update from one state set (w0, m0, v0) into another (w1, m1, v1) and the send copy. */
static inline __attribute__((always_inline)) void update_beside_loop(
    const void *restrict g, const int gt, const float *restrict w0, const float *restrict m0,
    const float *restrict v0, float *restrict w1, float *restrict m1, float *restrict v1, void *restrict send,
    const int st, int64_t n, const adamw_args *a, const int mul) {
    ADAMW_CONSTS(a)
    const float f = a->mult;
    for (int64_t k = 0; k < n; k++) {
        float gk = grad_at(g, gt, k, mul, f);
        ADAMW_ELEMENT(gk, w0[k], m0[k], v0[k], w1[k], m1[k], v1[k]);
        send_put(send, st, k, w1[k]);
    }
}

/* CALL(G, S, M) with the constants of this update's gradient type ``gt``, send type ``st`` and factor. */
#define L2L_BY_MULT(CALL, G, S)                                                                            \
    do {                                                                                                   \
        if (a->has_mult) CALL(G, S, 1);                                                                    \
        else CALL(G, S, 0);                                                                                \
    } while (0)
#define L2L_BY_SEND(CALL, G)                                                                               \
    do {                                                                                                   \
        if (st == T_NONE) L2L_BY_MULT(CALL, G, T_NONE);                                                    \
        else if (st == T_BF16) L2L_BY_MULT(CALL, G, T_BF16);                                               \
        else if (st == T_F16) L2L_BY_MULT(CALL, G, T_F16);                                                 \
        else L2L_BY_MULT(CALL, G, T_F32);                                                                  \
    } while (0)
#define L2L_SPECIALIZE(CALL)                                                                               \
    do {                                                                                                   \
        if (gt == T_F32) L2L_BY_SEND(CALL, T_F32);                                                         \
        else if (gt == T_BF16) L2L_BY_SEND(CALL, T_BF16);                                                  \
        else L2L_BY_SEND(CALL, T_F16);                                                                     \
    } while (0)

/* update_loop over n elements (the gradient and send copy at element 0 of the n) */
static void update_inplace(const void *g, int gt, float *w, float *m, float *v, void *send, int st, int64_t n,
                           const adamw_args *a) {
#define CALL(G, S, M) update_loop(g, G, w, m, v, send, S, n, a, M)
    L2L_SPECIALIZE(CALL);
#undef CALL
}

/* dst[0:nbytes] = src[0:nbytes] with non-temporal stores: memory that is written, not read, by this pass
 * (a state set beside the one read, the send copy) is not in cache, and plain stores would first read
 * each of its lines in (an out-of-place AdamW then moves 40 B/param, not 28). The values are unchanged. */
static void stream_out(void *restrict dst, const void *restrict src, int64_t nbytes) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
    int64_t k = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
    enum { V = 64 };
#else
    enum { V = 32 };
#endif
    k = (int64_t)((V - ((uintptr_t)d & (V - 1))) & (V - 1));
    if (k > nbytes) k = nbytes;
    memcpy(d, s, (size_t)k);
    for (; k + V <= nbytes; k += V) {
#if defined(__AVX512F__)
        _mm512_stream_si512((void *)(d + k), _mm512_loadu_si512((const void *)(s + k)));
#else
        _mm256_stream_si256((__m256i *)(d + k), _mm256_loadu_si256((const __m256i *)(s + k)));
#endif
    }
#endif
    memcpy(d + k, s + k, (size_t)(nbytes - k));
}

static void stream_fence(void) {
#if defined(__AVX512F__) || defined(__AVX2__)
    _mm_sfence(); /* the streamed lines reach memory before the caller says the pass is done */
#endif
}

/* Elements [lo, hi) updated beside (update_beside_loop), a block of BLOCK at a time into L1 buffers, each
 * block streamed out (the set written is not in cache, and plain stores would first read its lines in). */
static inline __attribute__((always_inline)) void beside_run(const void *g, const int gt, const float *w0,
                                                             const float *m0, const float *v0, float *w1,
                                                             float *m1, float *v1, void *send, const int st,
                                                             int64_t lo, int64_t hi, const adamw_args *a,
                                                             const int mul) {
    float wbuf[BLOCK], mbuf[BLOCK], vbuf[BLOCK], sbuf[BLOCK];
    const int64_t es = st == T_F32 ? 4 : 2;
    for (int64_t at = lo; at < hi; at += BLOCK) {
        int64_t n = hi - at < BLOCK ? hi - at : BLOCK;
        const void *ga = elem(g, gt, at);
        update_beside_loop(ga, gt, w0 + at, m0 + at, v0 + at, wbuf, mbuf, vbuf, sbuf, st, n, a, mul);
        stream_out(w1 + at, wbuf, n * 4);
        stream_out(m1 + at, mbuf, n * 4);
        stream_out(v1 + at, vbuf, n * 4);
        if (st != T_NONE) stream_out((char *)send + at * es, sbuf, n * es);
    }
    stream_fence();
}

static void update_beside(const void *g, int gt, const float *w0, const float *m0, const float *v0,
                          float *w1, float *m1, float *v1, void *send, int st, int64_t lo, int64_t hi,
                          const adamw_args *a) {
#define CALL(G, S, M) beside_run(g, G, w0, m0, v0, w1, m1, v1, send, S, lo, hi, a, M)
    L2L_SPECIALIZE(CALL);
#undef CALL
}

/* One pass over elements [lo, hi) of a run. State read from (w0, m0, v0), written to (w1, m1, v1): the same
 * buffers for an in-place update, else another set (L2L-p's undo), which is streamed out with the send copy.
 * ``send``: the device's copy of the new master (T_NONE: none). In place, plain stores: the lines were just
 * read, and with the send copy streamed too the update fell from 1.30x to 1.15x its triad on a 16-core Xeon
 * host (two machines of one kind; docs/gpu.md). */
void l2l_adamw(const void *g, int g_type, const float *w0, const float *m0, const float *v0, float *w1,
               float *m1, float *v1, void *send, int send_type, int64_t lo, int64_t hi, const adamw_args *a) {
    if (w1 == w0) {
        void *s = elem(send, send_type, lo);
        update_inplace(elem(g, g_type, lo), g_type, w1 + lo, m1 + lo, v1 + lo, s, send_type, hi - lo, a);
        return;
    }
    update_beside(g, g_type, w0, m0, v0, w1, m1, v1, send, send_type, lo, hi, a);
}

/* Rows idx[r0:r1) of a run of rows of ``width`` elements: what the update makes of each row
 * (update_beside_loop from the live state into scratch), its new master narrowed into the send copy's row;
 * the state itself is left alone. L2L-p's preview of the rows a batch reads of a table whose update trails
 * the step (engine/trailing.py): AdamW is elementwise, so each row equals the whole run's update of it bit
 * for bit. */
static inline __attribute__((always_inline)) void rows_run(const void *g, const int gt, const float *w,
                                                           const float *m, const float *v, void *send,
                                                           const int st, int64_t width, const int64_t *idx,
                                                           int64_t r0, int64_t r1, const adamw_args *a,
                                                           const int mul) {
    float wbuf[BLOCK], mbuf[BLOCK], vbuf[BLOCK];
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t at = idx[r] * width, end = at + width; at < end; at += BLOCK) {
            int64_t n = end - at < BLOCK ? end - at : BLOCK;
            const void *ga = elem(g, gt, at);
            void *sa = elem(send, st, at);
            update_beside_loop(ga, gt, w + at, m + at, v + at, wbuf, mbuf, vbuf, sa, st, n, a, mul);
        }
    }
}

void l2l_adamw_rows(const void *g, int gt, const float *w, const float *m, const float *v, void *send, int st,
                    int64_t width, const int64_t *idx, int64_t r0, int64_t r1, const adamw_args *a) {
#define CALL(G, S, M) rows_run(g, G, w, m, v, send, S, width, idx, r0, r1, a, M)
    L2L_SPECIALIZE(CALL);
#undef CALL
}

/* dst[lo:hi] = src[lo:hi] in dst's type (a send copy refreshed from the master; a widened gradient). */
void l2l_convert(const void *src, int src_type, void *dst, int dst_type, int64_t lo, int64_t hi) {
    float buf[BLOCK];
    for (int64_t at = lo; at < hi; at += BLOCK) {
        int64_t n = hi - at < BLOCK ? hi - at : BLOCK;
        widen(src, src_type, at, n, buf);
        narrow(buf, dst, dst_type, at, n);
    }
}

/* STREAM's triad, a[i] = b[i] + s * c[i] (no FMA: -ffp-contract=off), over [lo, hi): the machine's own
 * memory bandwidth under the same compiler, threads and buffer sizes as the update it is compared with. */
void l2l_triad(float *restrict a, const float *restrict b, const float *restrict c, float s, int64_t lo,
               int64_t hi) {
    for (int64_t k = lo; k < hi; k++) a[k] = b[k] + s * c[k];
}

/* ---- 8-bit AdamW (optim=adamw8bit; issue 52) ------------------------------------------------------------
 *
 * l2l_adamw8bit: one pass over blocks of QBLOCK (256) elements of one parameter tensor whose moments are
 * stored as uint8 codes and one FP32 absmax per block (engine/adamw8bit.py): per block, the gradient
 * widened (and multiplied), the moments dequantized (map value times the block's absmax), AdamW's update
 * exactly as l2l_adamw computes it (ATen's fused AdamW vector formula), the new master narrowed into the
 * send copy, and the new moments quantized back: the block's absmax, each element divided by it, its code
 * the number of the map's midpoints at or below the quotient (torch.bucketize(right=True): the nearest map
 * value, a value on a midpoint rounding up). All of it in the block's 3 KiB of L1 buffers: per parameter
 * the memory sees the gradient, the master read and written, a code of each moment read and written and
 * the absmaxes (1/64 B), and the send copy.
 *
 * The dequantizer is a lookup in registers where the CPU has AVX-512 VBMI (byte permutes): the map's 256
 * values as four byte planes, each looked up for 64 codes at once, then interleaved back into floats; on
 * a 2-core Zen 4 it takes the update from ~2.5 to ~2.1 ns per parameter on one thread against two
 * gathers per 16 elements (docs/optimizers.md). Elsewhere a gather.
 *
 * The quantizer is a table lookup, not a binary search: the top 16 bits of |y| (exponent and 7 mantissa
 * bits) name a slot; slots below 2^-23 (under every map's smallest midpoint) are one, and so are those at
 * or above 1. No slot of these maps holds more than one midpoint (l2l_qmap_init checks), so a slot's one
 * 32-bit entry finishes it with integer operations (one gather per 16 elements; the only comparison into
 * a mask is y's sign, which picks the table's half): the code is c - [low < f], c in bits 0-8 and f in
 * bits 15-31. For y >= 0, low is |y|'s low 16 bits, and a slot holding a midpoint has c = the midpoints
 * below it + 1 and f = the midpoint's low 16 bits (its top 16 are the slot's own); for y < 0, low is their
 * complement and f = 0xFFFF minus the midpoint's, so that |y| <= |mid| reads the same way. A slot with no
 * midpoint has f = 0 and c its count. The codes of 64 elements are packed to bytes at once (two packs
 * and a permute, not four narrowing moves). Gathers are slow on the CPUs measured (~0.25 ns per element
 * on a 2-core Emerald Rapids: half of the quantizer's time); the table in registers instead (as the
 * dequantizer's) would take more permutes than it saves. The result is the same integer as the binary
 * search's for every float, NaN included (code 255, as bucketize gives), on the vector path and the
 * scalar one alike. */

#include <float.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define L2L_AVX512 1
#endif

#define QBLOCK 256
#define KMIN 0x3400u /* |y| < 2^-23 */
#define KMAX 0x3F80u /* |y| = 1 */
#define NSLOT ((int)(KMAX - KMIN + 1))

typedef struct {
    const float *values;  /* the 256 map values, ascending */
    const float *mids;    /* 256: the 255 midpoints between neighbours, then a NaN (never <= y) */
    const uint32_t *base; /* l2l_qmap_table_bytes(): each slot's entry, y >= 0 then y < 0 */
} qmap_t;

/* After the slots' entries: the map's values as four byte planes (plane k: byte k of each value, 256 bytes),
 * the table the VBMI dequantizer looks up 64 codes at a time in registers, then the 64-byte order it
 * permutes the codes into (so that its interleave of the planes, within 128-bit lanes, lands each float in
 * order): made once here, not per block. */
#define PLANES_AT (2 * NSLOT)
#define ORDER_AT (4 * 256)
int64_t l2l_qmap_table_bytes(void) { return 2 * NSLOT * 4 + 4 * 256 + 64; }

/* Fill ``base`` for a map's ``values`` (256, ascending) and ``mids`` (255, then a NaN). Returns the most
 * midpoints any slot holds (2 where the first or last slot, which stand for every |y| below or above them,
 * holds one): the lookup is exact only where that is at most 1 (the caller falls back to torch otherwise). */
int l2l_qmap_init(const float *values, const float *mids, uint32_t *base) {
    int worst = 0;
    uint8_t *planes = (uint8_t *)(base + PLANES_AT);
    for (int i = 0; i < 256; i++)
        for (int k = 0; k < 4; k++) planes[k * 256 + i] = (uint8_t)(to_bits(values[i]) >> (8 * k));
    for (int l = 0; l < 4; l++) /* lane l, quarter j, byte r of the codes: float 16 j + 4 l + r */
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < 4; r++) planes[ORDER_AT + 16 * l + 4 * j + r] = (uint8_t)(16 * j + 4 * l + r);
    for (int s = 0; s < NSLOT; s++) {
        uint32_t k = KMIN + (uint32_t)s;
        float lo = s == 0 ? 0.0f : from_bits(k << 16), hi = from_bits((k + 1) << 16);
        int pos = 0, neg = 0, in_pos = 0, in_neg = 0;
        uint32_t at_pos = 0, at_neg = 0;
        for (int i = 0; i < 255; i++) {
            pos += mids[i] < lo;                        /* y in [lo, hi): below it */
            neg += mids[i] <= -hi;                      /* y in (-hi, -lo]: at or below -hi */
            if (mids[i] >= lo && mids[i] < hi) in_pos++, at_pos = to_bits(mids[i]);
            if (mids[i] > -hi && mids[i] <= -lo) in_neg++, at_neg = to_bits(mids[i]) & 0x7FFFFFFFu;
        }
        uint32_t lo_pos = at_pos & 0xFFFFu, lo_neg = at_neg & 0xFFFFu;
        base[s] = in_pos ? (uint32_t)(pos + 1) | (lo_pos << 15) : (uint32_t)pos;
        base[NSLOT + s] = in_neg ? (uint32_t)(neg + 1) | ((0xFFFFu - lo_neg) << 15) : (uint32_t)neg;
        int most = in_pos > in_neg ? in_pos : in_neg;
        most = (s == 0 || s == NSLOT - 1) && most ? 2 : most;
        worst = most > worst ? most : worst;
    }
    return worst;
}

/* |y|'s bits against the slot's midpoint: y >= mid is |y| >= |mid| for y >= 0, |y| <= |mid| for y < 0 */
static inline uint8_t quantize1(const qmap_t *q, float y) {
    uint32_t a = to_bits(y) & 0x7FFFFFFFu, key = a >> 16;
    key = key < KMIN ? KMIN : key > KMAX ? KMAX : key;
    int neg = y < 0.0f;
    uint32_t e = q->base[key - KMIN + (neg ? (uint32_t)NSLOT : 0u)];
    uint32_t lx = (neg ? ~a : a) & 0xFFFFu;
    return (uint8_t)((e & 0x1FFu) - (lx < (e >> 15)));
}

/* out[k] = values[codes[k]] * absmax */
static void dequantize_block(const uint8_t *codes, float absmax, const qmap_t *q, float *out, int64_t n) {
    int64_t k = 0;
#ifdef L2L_AVX512
    const __m512 s = _mm512_set1_ps(absmax);
#ifdef __AVX512VBMI__
    /* 64 codes at a time, no gather: each byte plane of the values looked up in registers (two 128-entry
     * vpermi2b, the code's top bit picking one), the four planes interleaved back into floats. The codes
     * are first permuted (the table's order) so that the interleave lands each float in order. */
    const uint8_t *pl = (const uint8_t *)(q->base + PLANES_AT);
    __m512i t[4][4];
    for (int p = 0; p < 4; p++)
        for (int j = 0; j < 4; j++) t[p][j] = _mm512_loadu_si512((const void *)(pl + p * 256 + j * 64));
    const __m512i perm = _mm512_loadu_si512((const void *)(pl + ORDER_AT));
    for (; k + 64 <= n; k += 64) {
        __m512i c = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512((const void *)(codes + k)));
        __mmask64 top = _mm512_movepi8_mask(c);
        __m512i b[4];
        for (int p = 0; p < 4; p++) {
            __m512i lo = _mm512_permutex2var_epi8(t[p][0], c, t[p][1]);
            __m512i hi = _mm512_permutex2var_epi8(t[p][2], c, t[p][3]);
            b[p] = _mm512_mask_blend_epi8(top, lo, hi);
        }
        __m512i w01l = _mm512_unpacklo_epi8(b[0], b[1]), w01h = _mm512_unpackhi_epi8(b[0], b[1]);
        __m512i w23l = _mm512_unpacklo_epi8(b[2], b[3]), w23h = _mm512_unpackhi_epi8(b[2], b[3]);
        __m512i f[4] = {_mm512_unpacklo_epi16(w01l, w23l), _mm512_unpackhi_epi16(w01l, w23l),
                        _mm512_unpacklo_epi16(w01h, w23h), _mm512_unpackhi_epi16(w01h, w23h)};
        for (int j = 0; j < 4; j++)
            _mm512_storeu_ps(out + k + 16 * j, _mm512_mul_ps(_mm512_castsi512_ps(f[j]), s));
    }
#endif
    for (; k + 16 <= n; k += 16) {
        __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + k)));
        _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_i32gather_ps(c, q->values, 4), s));
    }
#endif
    for (; k < n; k++) out[k] = q->values[codes[k]] * absmax;
}

/* max |x[k]|, NaN if any is NaN (torch.amax): the max of |x|'s bits as integers, which order as the floats do
 * and put a NaN above every number, with no comparison into a mask */
static float absmax_block(const float *x, int64_t n) {
    uint32_t mx = 0;
    int64_t k = 0;
#ifdef L2L_AVX512
    const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);
    __m512i vmx = _mm512_setzero_si512();
    for (; k + 16 <= n; k += 16)
        vmx = _mm512_max_epu32(vmx, _mm512_and_si512(_mm512_loadu_si512((const void *)(x + k)), absmask));
    mx = _mm512_reduce_max_epu32(vmx);
#endif
    for (; k < n; k++) {
        uint32_t ax = to_bits(x[k]) & 0x7FFFFFFFu;
        mx = ax > mx ? ax : mx;
    }
    return mx > 0x7F800000u ? NAN : from_bits(mx);
}

/* The codes of x[0:16] / s, one per int32 lane. The slot: |y|'s top 16 bits less KMIN, saturating at 0
 * (16-bit lanes: the top half of each is 0 - KMIN, also 0), at most the last slot; y < 0 reads the table's
 * second half. */
static inline __attribute__((always_inline)) __m512i quantize16(const float *x, const __m512 s,
                                                                const uint32_t *base) {
    const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF), kmin = _mm512_set1_epi16((short)KMIN);
    const __m512i last = _mm512_set1_epi32(NSLOT - 1), nslot = _mm512_set1_epi32(NSLOT);
    const __m512i low = _mm512_set1_epi32(0xFFFF), count = _mm512_set1_epi32(0x1FF);
    __m512 y = _mm512_div_ps(_mm512_loadu_ps(x), s);
    __m512i a = _mm512_and_si512(_mm512_castps_si512(y), absmask);
    __mmask16 neg = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512i key = _mm512_min_epu32(_mm512_subs_epu16(_mm512_srli_epi32(a, 16), kmin), last);
    key = _mm512_mask_add_epi32(key, neg, key, nslot);
    __m512i e = _mm512_i32gather_epi32(key, (const void *)base, 4);
    __m512i lx = _mm512_and_si512(_mm512_mask_xor_epi32(a, neg, a, low), low);
    __m512i t = _mm512_sub_epi32(lx, _mm512_srli_epi32(e, 15));
    return _mm512_sub_epi32(_mm512_and_si512(e, count), _mm512_srli_epi32(t, 31));
}

/* codes[k] = the code of x[k] / scale */
static void quantize_block(const float *x, float scale, const qmap_t *q, uint8_t *codes, int64_t n) {
    int64_t k = 0;
#ifdef L2L_AVX512
    const __m512 s = _mm512_set1_ps(scale);
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (; k + 64 <= n; k += 64) {
        __m512i c0 = quantize16(x + k, s, q->base), c1 = quantize16(x + k + 16, s, q->base);
        __m512i c2 = quantize16(x + k + 32, s, q->base), c3 = quantize16(x + k + 48, s, q->base);
        __m512i b = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
        _mm512_storeu_si512((void *)(codes + k), _mm512_permutexvar_epi32(order, b));
    }
    for (; k + 16 <= n; k += 16)
        _mm_storeu_si128((__m128i *)(codes + k), _mm512_cvtepi32_epi8(quantize16(x + k, s, q->base)));
#endif
    for (; k < n; k++) codes[k] = quantize1(q, x[k] / scale);
}

/* Blocks [blo, bhi) of a tensor of ``n`` elements (the last block may be partial): its gradient ``g`` (type
 * g_type), master ``w``, codes ``cm``/``cv`` (an element each), absmaxes ``am``/``av`` (a block each), and
 * the send copy (T_NONE: none), all updated in place. ``qm``/``qv``: the first (signed) and second
 * (unsigned) moment's maps. */
void l2l_adamw8bit(const void *g, int g_type, float *w, uint8_t *cm, uint8_t *cv, float *am, float *av,
                   void *send, int send_type, int64_t n, int64_t blo, int64_t bhi, const adamw_args *a,
                   const qmap_t *qm, const qmap_t *qv) {
    float mbuf[QBLOCK], vbuf[QBLOCK];
    for (int64_t b = blo; b < bhi; b++) {
        int64_t at = b * QBLOCK, len = n - at < QBLOCK ? n - at : QBLOCK;
        dequantize_block(cm + at, am[b], qm, mbuf, len);
        dequantize_block(cv + at, av[b], qv, vbuf, len);
        void *s = elem(send, send_type, at);
        update_inplace(elem(g, g_type, at), g_type, w + at, mbuf, vbuf, s, send_type, len, a);
        float xm = absmax_block(mbuf, len), xv = absmax_block(vbuf, len);
        am[b] = xm; /* (an all-zero block divides by the smallest normal float instead: codes of 0) */
        av[b] = xv;
        quantize_block(mbuf, xm < FLT_MIN ? FLT_MIN : xm, qm, cm + at, len);
        quantize_block(vbuf, xv < FLT_MIN ? FLT_MIN : xv, qv, cv + at, len);
    }
}

/* The dequantizer alone (values[codes[k]] * absmax, n elements): what the tests hold against the map. */
void l2l_dequantize(const uint8_t *codes, float absmax, const qmap_t *q, float *out, int64_t n) {
    dequantize_block(codes, absmax, q, out, n);
}

/* The quantizer alone (codes of x / scale, n elements): what the tests hold against torch.bucketize. */
void l2l_quantize(const float *x, float scale, const qmap_t *q, uint8_t *codes, int64_t n) {
    quantize_block(x, scale, q, codes, n);
}
