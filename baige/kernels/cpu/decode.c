/* One whole decode step of a Llama-family decoder in C: every layer's RMSNorm, q/k/v projections,
 * optional per-head q/k RMSNorm, RoPE, KV store, paged attention, o projection, residual add +
 * RMSNorm, gate/up projections, SiLU * up, down projection and residual add (or a Mixture-of-Experts MLP:
 * baige_moe below), for M decoding tokens.
 * It calls the same kernels the per-op path calls (qlinear.c or qdot.c, ops.c), in the model's order, so the
 * results match the module path up to SiLU's exp; what it removes is Python: the module path dispatches
 * ~40 small ops per layer, each with its interpreter and dispatcher overhead; this is one call per step
 * (measured: docs/benchmarks/archive.md, "AVX-512 paged attention, native prefill attention, one-call
 * decode step").
 *
 * Layout: baige/runtime/infer/cpu_decode.py fills the structs below from the loaded model (pointers into
 * the model's own tensors) and calls baige_decode_layers once per decode step. Activations and the
 * residual stream are fp32 whatever the model's dtype. Projections: fp32, int8 per channel, int4
 * group-wise, fp16 weights (fp32 math) or bf16 weights (bf16.c), each optionally with a stack of
 * LoRA adapters (multi-LoRA serving): y[m] += scale[i] * B_i (A_i x[m]) for token m's adapter slot i
 * (lora_ids[m], -1 = none), rows grouped by adapter so each adapter's A and B are read once per step
 * (the SGMV grouping of Punica, Chen et al. 2023, arXiv:2310.18547) through the same fp32 kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_convert.h"

void baige_qlinear_int8(const float *x, int64_t M, int64_t K, int64_t ldx, const int8_t *w, int64_t N, int64_t ldw,
                        const float *scale, const float *bias, float *y, int64_t ldy, int nthreads);
void baige_linear_f32(const float *x, int64_t M, int64_t K, int64_t ldx, const float *w, int64_t N, int64_t ldw,
                      const float *scale, const float *bias, float *y, int64_t ldy, int nthreads);
void baige_linear_f16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N, int64_t ldw,
                      const float *scale, const float *bias, float *y, int64_t ldy, int nthreads);
void baige_linear_bf16(const float *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N, int64_t ldw,
                       const float *scale, const float *bias, float *y, int64_t ldy, int nthreads);
void baige_qlinear_int4(const float *x, int64_t M, int64_t K, int64_t ldx, const int32_t *wp, int64_t N, int64_t ldw,
                        const float *scale, const int32_t *zp, int64_t G, int64_t gs, const float *bias, float *y,
                        int64_t ldy, int nthreads);
int baige_qdot_int8(const float *x, int64_t M, int64_t K, int64_t ldx, const void *wr, int64_t N,
                    const float *scale, const float *bias, float *y, int64_t ldy, int passes, int nthreads);
int baige_qdot_int4(const float *x, int64_t M, int64_t K, int64_t ldx, const void *wr, int64_t N,
                    const void *sr, int scale_bf16, const float *zr, int64_t G, int64_t gs, const float *bias,
                    float *y, int64_t ldy, int passes, int nthreads);
void baige_rms_norm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *out);
void baige_add_rms_norm(const float *x, const float *res, int64_t rows, int64_t n, const float *w, float eps,
                        float *out, float *sum);
void baige_rope(const float *q, const float *k, int64_t tokens, int64_t hq, int64_t hk, int64_t d,
                const float *cos_, const float *sin_, float *q_out, float *k_out);
void baige_store_kv(const float *k, const float *v, int64_t tokens, int64_t hk, int64_t d, void *k_cache,
                    void *v_cache, int64_t slots, const int64_t *slot_mapping, int kv_dtype);
int baige_paged_decode_attention(const float *q, const void *k_cache, const void *v_cache, int64_t S,
                                 int64_t hq, int64_t hk, int64_t d, int64_t num_blocks, int64_t bs,
                                 const int64_t *block_tables, int64_t W, const int64_t *table_of_row,
                                 const int64_t *context_lens, float scale, float *out, int kv_dtype, int nthreads);
void baige_silu_mul(const float *g, const float *u, int64_t n, float *out);

/* *_DOT: the same weights through the integer-dot kernels of qdot.c (int8-quantized activations) */
enum { BAIGE_F32 = 0, BAIGE_INT8 = 1, BAIGE_INT4 = 2, BAIGE_F16 = 3, BAIGE_INT8_DOT = 4, BAIGE_INT4_DOT = 5,
       BAIGE_BF16 = 6 };

typedef struct {
    int64_t kind;               /* BAIGE_F32 | BAIGE_INT8 | BAIGE_INT4 | BAIGE_F16 | BAIGE_INT8_DOT | BAIGE_INT4_DOT | BAIGE_BF16 */
    int64_t n, k;               /* out_features, in_features (int4: k % 8 == 0) */
    const void *w;              /* fp32 / int8 / fp16 / bf16 (n, ldw), or int32 (n, ldw) words of 8 nibbles;
                                   *_DOT: the repacked tiles of qdot.c */
    int64_t ldw;                /* row stride in elements */
    const float *scale;         /* int8 (n); int4 (n, groups), INT4_DOT: repacked (tiles, groups, 16), fp32 or bf16
                                   (scale_bf16); fp32: NULL */
    const int32_t *zero_point;  /* int4 asymmetric (n, groups), else NULL */
    int64_t groups, group_size; /* int4 */
    const float *bias;          /* (n) or NULL */
    const float *lora_a;        /* LoRA stack: fp32 (lora_slots, lora_r, k), or NULL without adapters */
    const float *lora_b;        /* fp32 (lora_slots, n, lora_r) */
    const float *lora_scale;    /* fp32 (lora_slots): alpha / r per adapter */
    int64_t lora_slots, lora_r;
    const float *scaled_zero;   /* INT4_DOT asymmetric: repacked scale * zero point (tiles, groups, 16), else NULL */
    int64_t act_passes;         /* *_DOT: activation passes of qdot.c (1: int8 blocks, 2: + their residual) */
    int64_t scale_bf16;         /* INT4_DOT: the repacked scales are bf16 (else fp32) */
} baige_linear;

/* Scratch of the LoRA terms for M tokens of widths up to `width` and ranks up to `rank`. */
typedef struct {
    const int64_t *ids;  /* (M) adapter slot per token, -1 = none; NULL = no adapter this step */
    int64_t *rows;       /* (M) */
    float *x, *t, *y;    /* (M, width), (M, rank), (M, width) */
} lora_scratch;

/* A Mixture-of-Experts MLP (baige/runtime/model/moe.py's SparseMoeBlock; 1 <= top_k <= num_experts, no LoRA:
 * cpu_decode._describe_moe checks): router logits (fp32 weight),
 * softmax, the top_k experts by probability (+ correction_bias for selection only, ERNIE-4.5), their
 * probabilities as weights (renormalized to sum 1, the sum floored at norm_min, when renormalize), the
 * routed experts' SwiGLU MLPs grouped by expert (each expert's weights read once per step for all its
 * tokens, tokens in order; kernels/reference.py fused_moe's grouping and combine order), then the
 * shared expert(s): out += [sigmoid(shared_gate x) *] down(silu(gate x) * up x). */
typedef struct {
    int64_t num_experts, top_k, renormalize, inter, shared_inter;  /* shared_inter 0: no shared expert */
    float norm_min;
    const float *correction_bias;          /* (num_experts) fp32, or NULL */
    baige_linear router;                   /* (num_experts, hidden), fp32 */
    baige_linear gate_up, down;            /* expert 0's (2 inter, hidden) and (hidden, inter), fp32 or bf16;
                                              expert e's follow at e * n * k elements */
    baige_linear shared_gate_proj, shared_up, shared_down;  /* the shared SwiGLU */
    baige_linear shared_gate;              /* (1, hidden): sigmoid scale of the shared output, or n == 0 */
    const baige_linear *experts;           /* NULL, or 3 per expert (gate, up, down: e.g. quantized experts),
                                              read instead of the stacked gate_up / down */
} baige_moe;

typedef struct {
    baige_linear q, k, v, o, gate, up, down;
    const float *input_norm, *post_norm;  /* (hidden) */
    const float *q_norm, *k_norm;         /* (head_dim), or NULL without per-head q/k norm */
    void *k_cache, *v_cache;              /* (hk, num_blocks, block_size, head_dim), fp32, fp16 or bf16 */
    baige_linear qkv, gate_up;            /* q|k|v and gate|up read as one weight each (output columns in that
                                             order), or n == 0: the members one by one (decode.py's _joined) */
    const baige_moe *moe;                 /* a Mixture-of-Experts MLP instead of gate/up/down, or NULL */
} baige_layer;

/* y += the LoRA term of every token that has an adapter (module docstring): per adapter present,
 * gather its rows of x, shrink (rows, k) -> (rows, r), expand -> (rows, n), add scaled. */
static void lora_add(const baige_linear *l, const float *x, int64_t M, float *y, const lora_scratch *s,
                     int nthreads) {
    const int64_t k = l->k, n = l->n, r = l->lora_r;
    for (int64_t slot = 0; slot < l->lora_slots; slot++) {
        int64_t cnt = 0;
        for (int64_t m = 0; m < M; m++)
            if (s->ids[m] == slot) s->rows[cnt++] = m;
        if (!cnt) continue;
        for (int64_t i = 0; i < cnt; i++)
            for (int64_t j = 0; j < k; j++) s->x[i * k + j] = x[s->rows[i] * k + j];
        baige_linear_f32(s->x, cnt, k, k, l->lora_a + slot * r * k, r, k, NULL, NULL, s->t, r, 1);
        baige_linear_f32(s->t, cnt, r, r, l->lora_b + slot * n * r, n, r, NULL, NULL, s->y, n, nthreads);
        const float sc = l->lora_scale[slot];
        for (int64_t i = 0; i < cnt; i++) {
            float *yr = y + s->rows[i] * n;
            const float *d = s->y + i * n;
            for (int64_t j = 0; j < n; j++) yr[j] += d[j] * sc;
        }
    }
}

/* y = the projection of x (+ its LoRA term). Returns 0, or -1 when an integer-dot kernel could not
 * allocate its scratch (y is then NaN). */
static int linear(const baige_linear *l, const float *x, int64_t M, float *y, const lora_scratch *s,
                  int nthreads) {
    const int64_t kind = l->kind;
    int rc = 0;
    if (kind == BAIGE_INT8)
        baige_qlinear_int8(x, M, l->k, l->k, l->w, l->n, l->ldw, l->scale, l->bias, y, l->n, nthreads);
    else if (kind == BAIGE_INT8_DOT)
        rc = baige_qdot_int8(x, M, l->k, l->k, l->w, l->n, l->scale, l->bias, y, l->n, (int)l->act_passes, nthreads);
    else if (kind == BAIGE_INT4_DOT)  /* group size a multiple of 32 (decode.py) */
        rc = baige_qdot_int4(x, M, l->k, l->k, l->w, l->n, l->scale, (int)l->scale_bf16, l->scaled_zero, l->groups,
                             l->group_size,
                             l->bias, y, l->n, (int)l->act_passes, nthreads);
    else if (kind == BAIGE_INT4)
        baige_qlinear_int4(x, M, l->k, l->k, l->w, l->n, l->ldw, l->scale, l->zero_point, l->groups,
                           l->group_size, l->bias, y, l->n, nthreads);
    else if (kind == BAIGE_BF16)
        baige_linear_bf16(x, M, l->k, l->k, l->w, l->n, l->ldw, NULL, l->bias, y, l->n, nthreads);
    else if (kind == BAIGE_F16)
        baige_linear_f16(x, M, l->k, l->k, l->w, l->n, l->ldw, NULL, l->bias, y, l->n, nthreads);
    else
        baige_linear_f32(x, M, l->k, l->k, l->w, l->n, l->ldw, NULL, l->bias, y, l->n, nthreads);
    if (l->lora_a && s->ids) lora_add(l, x, M, y, s, nthreads);
    return rc;
}

/* out (M, down.n) = down(silu(gate x) * up x) for x (M, gate.k), the three projections one by one; g, u:
 * (M, gate.n) scratch (g ends holding the activation). Returns linear()'s code. */
static int swiglu(const baige_linear *gate, const baige_linear *up, const baige_linear *down, const float *x,
                  int64_t M, float *g, float *u, float *out, const lora_scratch *sp, int nthreads) {
    int rc = linear(gate, x, M, g, sp, nthreads) | linear(up, x, M, u, sp, nthreads);
    if (rc) return rc;
    baige_silu_mul(g, u, M * gate->n, g);
    return linear(down, g, M, out, sp, nthreads);
}

/* out (M, hidden) = the MoE MLP (baige_moe) of x (M, hidden). Returns 0, or -1 when scratch memory cannot
 * be allocated or a projection fails (out is then unspecified). */
static int moe_mlp(const baige_moe *e, const float *x, int64_t M, int64_t hidden, float *out, const lora_scratch *sp,
                   int nthreads) {
    const int64_t E = e->num_experts, K = e->top_k, I = e->inter, S = e->shared_inter;
    const int64_t wide = 2 * I > 2 * S ? 2 * I : 2 * S;
    float *logits = malloc(sizeof(float) * (size_t)(M * E + M * K + M * hidden + M * wide + M * I + M * hidden + M));
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(M * K + M));
    if (!logits || !ids) {
        free(logits);
        free(ids);
        return -1;
    }
    float *wts = logits + M * E, *xs = wts + M * K, *gu = xs + M * hidden, *act = gu + M * wide;
    float *y = act + M * I, *sg = y + M * hidden;
    int64_t *rows = ids + M * K;
    int rc = linear(&e->router, x, M, logits, sp, nthreads);
    /* softmax, top-k, weights. Exact ties in the scores go to the lower expert index here; torch.topk
     * does not promise an order for ties (the per-op path may pick another of the tied experts). */
    for (int64_t m = 0; m < M && rc == 0; m++) {
        float *p = logits + m * E, mx = p[0], sum = 0.0f;
        for (int64_t j = 1; j < E; j++) mx = p[j] > mx ? p[j] : mx;
        for (int64_t j = 0; j < E; j++) sum += (p[j] = expf(p[j] - mx));
        for (int64_t j = 0; j < E; j++) p[j] /= sum;
        float wsum = 0.0f;
        for (int64_t t = 0; t < K; t++) {
            int64_t best = -1;
            float bs = 0.0f;
            for (int64_t j = 0; j < E; j++) {
                int taken = 0;
                for (int64_t u = 0; u < t; u++) taken |= ids[m * K + u] == j;
                const float sc = p[j] + (e->correction_bias ? e->correction_bias[j] : 0.0f);
                if (!taken && (best < 0 || sc > bs)) { best = j; bs = sc; }
            }
            ids[m * K + t] = best;
            wsum += (wts[m * K + t] = p[best]);
        }
        if (e->renormalize) {
            const float den = wsum > e->norm_min ? wsum : e->norm_min;
            for (int64_t t = 0; t < K; t++) wts[m * K + t] /= den;
        }
    }
    for (int64_t j = 0; j < M * hidden; j++) out[j] = 0.0f;
    const size_t es13 = e->gate_up.kind == BAIGE_BF16 ? 2 : 4, es2 = e->down.kind == BAIGE_BF16 ? 2 : 4;
    for (int64_t ex = 0; ex < E && rc == 0; ex++) {  /* each expert once, its tokens in order */
        int64_t c = 0;
        for (int64_t m = 0; m < M; m++)
            for (int64_t t = 0; t < K; t++)
                if (ids[m * K + t] == ex) {
                    rows[c] = m;
                    sg[c++] = wts[m * K + t];
                    memcpy(xs + (c - 1) * hidden, x + m * hidden, sizeof(float) * (size_t)hidden);
                }
        if (!c) continue;
        if (e->experts) {  /* gate, up, down one by one */
            const baige_linear *l3 = e->experts + 3 * ex;
            if ((rc = swiglu(&l3[0], &l3[1], &l3[2], xs, c, gu, gu + c * I, y, sp, nthreads))) break;
        } else {  /* stacked: row i holds gate | up */
            baige_linear w13 = e->gate_up, w2 = e->down;
            w13.w = (const char *)w13.w + (size_t)ex * (size_t)(w13.n * w13.k) * es13;
            w2.w = (const char *)w2.w + (size_t)ex * (size_t)(w2.n * w2.k) * es2;
            if ((rc = linear(&w13, xs, c, gu, sp, nthreads))) break;
            for (int64_t i = 0; i < c; i++) baige_silu_mul(gu + i * 2 * I, gu + i * 2 * I + I, I, act + i * I);
            if ((rc = linear(&w2, act, c, y, sp, nthreads))) break;
        }
        for (int64_t i = 0; i < c; i++) {
            float *o = out + rows[i] * hidden;
            const float *yi = y + i * hidden;
            for (int64_t j = 0; j < hidden; j++) o[j] += yi[j] * sg[i];
        }
    }
    if (S && rc == 0) {
        rc = swiglu(&e->shared_gate_proj, &e->shared_up, &e->shared_down, x, M, gu, gu + M * S, y, sp, nthreads);
        if (rc == 0 && e->shared_gate.n) rc = linear(&e->shared_gate, x, M, sg, sp, nthreads);
        for (int64_t m = 0; m < M && rc == 0; m++) {
            const float g = e->shared_gate.n ? 1.0f / (1.0f + expf(-sg[m])) : 1.0f;
            for (int64_t j = 0; j < hidden; j++) out[m * hidden + j] += g * y[m * hidden + j];
        }
    }
    free(logits);
    free(ids);
    return rc;
}

/* h: (M, hidden) fp32, in: the token embeddings, out: the last layer's output (before the final
 * norm). cos/sin: (M, head_dim). slots: (M,) cache slot of each token. tables: (M, W) block ids,
 * lens: (M,) context lengths including the new token. kv_dtype: the caches' element type (ops.c's
 * KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2). lora_ids: (M,)
 * adapter slot per token (-1 = none) for the projections that carry a LoRA stack, or NULL (no
 * adapter this step). Returns 0, or -1 when scratch memory cannot be allocated (h is then unspecified). */
int baige_decode_layers(const baige_layer *layers, int64_t n_layers, int64_t M, int64_t hidden, int64_t hq,
                        int64_t hk, int64_t d, int64_t inter, float eps, float scale, int64_t num_blocks,
                        int64_t bs, float *h, const float *cos_, const float *sin_, const int64_t *slots,
                        const int64_t *tables, int64_t W, const int64_t *lens, int kv_dtype,
                        const int64_t *lora_ids, int nthreads)
{
    const int64_t nq = M * hq * d, nk = M * hk * d;
    int64_t rank = 0, width = 0;
    for (int64_t i = 0; lora_ids && i < n_layers; i++) {
        const baige_layer *L = layers + i;
        const baige_linear *projections[7] = {&L->q, &L->k, &L->v, &L->o, &L->gate, &L->up, &L->down};
        for (int j = 0; j < 7; j++) {
            const baige_linear *l = projections[j];
            if (l->lora_a) {
                rank = l->lora_r > rank ? l->lora_r : rank;
                width = l->k > width ? l->k : width;
                width = l->n > width ? l->n : width;
            }
        }
    }
    const int64_t lora_floats = rank ? M * (2 * width + rank) : 0;
    int64_t njoin = 0;  /* scratch for the joined projections' outputs, only where a layer has them */
    for (int64_t i = 0; i < n_layers; i++) {
        if (layers[i].qkv.n && nq + 2 * nk > njoin) njoin = nq + 2 * nk;
        if (layers[i].gate_up.n && 2 * M * inter > njoin) njoin = 2 * M * inter;
    }
    float *buf = malloc(sizeof(float) * (size_t)(2 * M * hidden + 3 * nq + 3 * nk + 2 * M * inter + lora_floats + njoin));
    int64_t *rows = rank ? malloc(sizeof(int64_t) * (size_t)M) : NULL;
    if (!buf || (rank && !rows)) {
        free(buf);
        free(rows);
        return -1;
    }
    float *lbuf = buf + 2 * M * hidden + 3 * nq + 3 * nk + 2 * M * inter;
    const lora_scratch ls = {rank ? lora_ids : NULL, rows, lbuf, lbuf + M * width, lbuf + M * (width + rank)};
    const lora_scratch *sp = &ls;
    float *normed = buf, *o = normed + M * hidden, *q = o + M * hidden, *qr = q + nq, *attn = qr + nq;
    float *k = attn + nq, *kr = k + nk, *v = kr + nk, *g = v + nk, *u = g + M * inter, *joined = lbuf + lora_floats;
    const int64_t qw = hq * d, kw = hk * d;  /* a token's q and k (= v) widths */
    int rc = 0;
    for (int64_t i = 0; i < n_layers && rc == 0; i++) {  /* a failure stops before anything reaches the cache */
        const baige_layer *L = layers + i;
        baige_rms_norm(h, M, hidden, L->input_norm, eps, normed);
        if (L->qkv.n) {  /* one read of the three weights, then each token's columns to q, k, v */
            if ((rc = linear(&L->qkv, normed, M, joined, sp, nthreads))) break;
            for (int64_t m = 0; m < M; m++) {
                const float *row = joined + m * (qw + 2 * kw);
                memcpy(q + m * qw, row, sizeof(float) * (size_t)qw);
                memcpy(k + m * kw, row + qw, sizeof(float) * (size_t)kw);
                memcpy(v + m * kw, row + qw + kw, sizeof(float) * (size_t)kw);
            }
        } else {
            rc = linear(&L->q, normed, M, q, sp, nthreads) | linear(&L->k, normed, M, k, sp, nthreads)
                 | linear(&L->v, normed, M, v, sp, nthreads);
            if (rc) break;
        }
        if (L->q_norm) {  /* per-head RMSNorm (Qwen3), in place: each row is read before it is written */
            baige_rms_norm(q, M * hq, d, L->q_norm, eps, q);
            baige_rms_norm(k, M * hk, d, L->k_norm, eps, k);
        }
        baige_rope(q, k, M, hq, hk, d, cos_, sin_, qr, kr);
        baige_store_kv(kr, v, M, hk, d, L->k_cache, L->v_cache, num_blocks * bs, slots, kv_dtype);
        rc = baige_paged_decode_attention(qr, L->k_cache, L->v_cache, M, hq, hk, d, num_blocks, bs, tables, W, NULL,
                                          lens, scale, attn, kv_dtype, nthreads);
        if (rc || (rc = linear(&L->o, attn, M, o, sp, nthreads))) break;
        baige_add_rms_norm(o, h, M, hidden, L->post_norm, eps, normed, h);  /* h = o + h; normed = norm(h) */
        if (L->moe) {
            rc = moe_mlp(L->moe, normed, M, hidden, o, sp, nthreads);
        } else if (L->gate_up.n) {  /* one read of both weights; token m's gate and up are row m's two halves */
            if ((rc = linear(&L->gate_up, normed, M, joined, sp, nthreads))) break;
            for (int64_t m = 0; m < M; m++)
                baige_silu_mul(joined + 2 * m * inter, joined + (2 * m + 1) * inter, inter, g + m * inter);
            rc = linear(&L->down, g, M, o, sp, nthreads);
        } else {
            rc = swiglu(&L->gate, &L->up, &L->down, normed, M, g, u, o, sp, nthreads);
        }
        if (rc) break;
        for (int64_t j = 0; j < M * hidden; j++) h[j] = h[j] + o[j];
    }
    free(buf);
    free(rows);
    return rc;
}

/* The whole decode step around baige_decode_layers: token m's embedding row (ids[m] of `embed`, fp32,
 * or bf16 with embed_bf16, `vocab` rows of `hidden`) widened into h, its rotary row (positions[m] of
 * the (max_pos, d) fp32 cos/sin tables) copied, every layer, then the final RMSNorm (fp32 weight) of
 * h into out. h, out: (M, hidden) fp32 caller scratch. Returns 0; -1 when scratch memory cannot be
 * allocated; -2 when a token id is outside [0, vocab) or a position outside [0, max_pos) (nothing
 * is then written to the KV cache). */
int baige_decode_step(const baige_layer *layers, int64_t n_layers, int64_t M, int64_t hidden, int64_t hq,
                      int64_t hk, int64_t d, int64_t inter, float eps, float scale, int64_t num_blocks,
                      int64_t bs, const void *embed, int embed_bf16, int64_t vocab, const int64_t *ids,
                      const int64_t *positions, const float *cos_table, const float *sin_table, int64_t max_pos,
                      const float *final_norm, float *h, float *out, const int64_t *slots, const int64_t *tables,
                      int64_t W, const int64_t *lens, int kv_dtype, const int64_t *lora_ids, int nthreads)
{
    for (int64_t m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= vocab || positions[m] < 0 || positions[m] >= max_pos) return -2;
    float *rope = malloc(sizeof(float) * (size_t)(2 * M * d));
    if (!rope) return -1;
    for (int64_t m = 0; m < M; m++) {
        float *hm = h + m * hidden;
        if (embed_bf16) {
            const uint16_t *e = (const uint16_t *)embed + ids[m] * hidden;
            for (int64_t j = 0; j < hidden; j++) hm[j] = bf16_to_f32(e[j]);
        } else {
            memcpy(hm, (const float *)embed + ids[m] * hidden, sizeof(float) * (size_t)hidden);
        }
        memcpy(rope + m * d, cos_table + positions[m] * d, sizeof(float) * (size_t)d);
        memcpy(rope + (M + m) * d, sin_table + positions[m] * d, sizeof(float) * (size_t)d);
    }
    const int rc = baige_decode_layers(layers, n_layers, M, hidden, hq, hk, d, inter, eps, scale, num_blocks, bs, h,
                                       rope, rope + M * d, slots, tables, W, lens, kv_dtype, lora_ids, nthreads);
    free(rope);
    if (rc == 0) baige_rms_norm(h, M, hidden, final_norm, eps, out);
    return rc;
}
