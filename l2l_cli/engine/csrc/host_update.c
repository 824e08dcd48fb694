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
 * Work is cut into blocks that stay in L1/L2: the gradient block is widened into a small float buffer, the
 * update runs over it, the send copy is narrowed from the new master while it is in cache. The caller
 * splits a run over threads (each thread one contiguous range) and releases the GIL (ctypes).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

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
static void adamw_vec(const float *restrict g, const float *restrict w0, const float *restrict m0,
                      const float *restrict v0, float *restrict w1, float *restrict m1, float *restrict v1,
                      int64_t n, const adamw_args *a) {
    const float lw = a->lerp_w, b2 = a->beta2, c2 = a->c2, bc = a->bc2_sqrt, eps = a->eps;
    const float neg_ss = -a->step_size, decay = a->has_decay ? a->decay : 1.0f;
    const int small = fabsf(lw) < 0.5f, wd = a->has_decay;
    const float coeff = small ? lw : lw - 1.0f;
    for (int64_t k = 0; k < n; k++) {
        float gk = g[k], p = wd ? w0[k] * decay : w0[k];
        float base = small ? m0[k] : gk;
        float m = fmaf(coeff, gk - m0[k], base);
        float v = fmaf(c2 * gk, gk, v0[k] * b2); /* as torch's build contracts it */
        float denom = sqrtf(v) / bc + eps;
        m1[k] = m;
        v1[k] = v;
        w1[k] = p + (neg_ss * m) / denom;
    }
}

/* One pass over elements [lo, hi) of a run. State read from (w0, m0, v0), written to (w1, m1, v1): the same
 * buffers for an in-place update. ``send``: the device's copy of the new master (T_NONE: none). */
void l2l_adamw(const void *g, int g_type, const float *w0, const float *m0, const float *v0, float *w1,
               float *m1, float *v1, void *send, int send_type, int64_t lo, int64_t hi, const adamw_args *a) {
    float gbuf[BLOCK];
    for (int64_t at = lo; at < hi; at += BLOCK) {
        int64_t n = hi - at < BLOCK ? hi - at : BLOCK;
        widen(g, g_type, at, n, gbuf);
        if (a->has_mult) {
            const float f = a->mult;
            for (int64_t k = 0; k < n; k++) gbuf[k] = gbuf[k] * f;
        }
        adamw_vec(gbuf, w0 + at, m0 + at, v0 + at, w1 + at, m1 + at, v1 + at, n, a);
        narrow(w1 + at, send, send_type, at, n);
    }
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
