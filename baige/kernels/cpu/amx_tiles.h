/* Intel AMX helpers shared by the native kernels that use tiles (moe_amx.c, amx_linear.c); only with
 * AMX-TILE + AMX-BF16 + AVX-512 BF16 (the ``avx512_amx`` variant).
 *
 * AMX in one paragraph (Intel 64 and IA-32 Architectures Software Developer's Manual, vol. 1 ch. 18, and
 * the Intel Intrinsics Guide): eight tile registers of up to 16 rows x 64 bytes; TDPBF16PS C, A, B adds
 * C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1] for a 16 x 16 fp32 C, a 16 x 32 bf16 A and a
 * B of 16 rows each holding 16 bf16 *pairs* (the "VNNI" layout: rows of B are pairs of K).
 *
 * Every kernel here configures all 8 tiles as 16 rows x 64 bytes; tiles 0-3 accumulate, 4-7 hold
 * operands. Linux gives a process the 8 KiB tile state only when asked (arch_prctl(ARCH_REQ_XCOMP_PERM),
 * kernels since 5.16); a kernel whose ask is refused reports itself unsupported.
 */
#ifndef BAIGE_AMX_TILES_H
#define BAIGE_AMX_TILES_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* arch/x86/include/uapi/asm/prctl.h */
#define XFEATURE_XTILEDATA 18

/* Linux hands out the 8 KiB tile state only to processes that ask (once per process, any thread) */
static inline int amx_permitted(void) {
    static int state; /* 0 not asked, 1 granted, -1 refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* every one of the 8 tiles 16 rows x 64 bytes (this thread's tile state; zeroes the tiles). The config
 * lives in .rodata: one built on the stack has been seen optimised away before LDTILECFG read it
 * (upstream llama.cpp PR #26954's report). */
static inline void configure_tiles(void) {
    static const tile_config cfg __attribute__((aligned(64))) = {
        .palette_id = 1,
        .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
        .rows = {16, 16, 16, 16, 16, 16, 16, 16},
    };
    _tile_loadconfig(&cfg);
}

/* r[0..15] := its 16 x 16 transpose (32-bit lanes): unpack 32- then 64-bit pairs, then 128-bit lanes twice */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* rows 4i..4i+3: r[4i + j] holds column j (mod 4) of those 4 rows */
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int j = 0; j < 4; j++) { /* columns j, j + 4, j + 8, j + 12 of rows 0-7 and of rows 8-15 */
        t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
        t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
        r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd);
    }
}

/* The B operand of a product against 16 bf16 vectors (rows 0..15 of qb, d values each, row stride d, d a
 * multiple of 32): bq[ch][r][n] = the r-th pair of columns 32 ch .. 32 ch + 32 of row n, i.e. TDPBF16PS's
 * pairs layout of each 32-wide chunk (a 16 x 16 transpose of 32-bit pairs per chunk) */
static inline void b_pairs(const uint16_t *qb, int64_t d, uint32_t bq[][16][16]) {
    for (int64_t ch = 0; ch < d / 32; ch++) {
        __m512 r[16];
        for (int n = 0; n < 16; n++) r[n] = _mm512_castsi512_ps(_mm512_loadu_si512(qb + n * d + 32 * ch));
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_store_ps((float *)bq[ch][i], r[i]);
    }
}

/* where to load the 16 x 32 bf16 A tile of rows r0.. and columns k0.. of w (nrows x K, row stride ld):
 * in place when whole, else a zero-padded copy in pad (16 x 32); *stride gets the byte stride */
static inline const uint16_t *a_tile(const uint16_t *w, int64_t ld, int64_t r0, int64_t nrows, int64_t k0,
                                     int64_t K, uint16_t *pad, int64_t *stride) {
    if (r0 + 16 <= nrows && k0 + 32 <= K) {
        *stride = ld * 2;
        return w + r0 * ld + k0;
    }
    memset(pad, 0, 16 * 32 * sizeof(uint16_t));
    const int64_t nr = nrows - r0 < 16 ? nrows - r0 : 16, nk = K - k0 < 32 ? K - k0 : 32;
    for (int64_t r = 0; r < nr; r++) memcpy(pad + r * 32, w + (r0 + r) * ld + k0, (size_t)nk * sizeof(uint16_t));
    *stride = 64;
    return pad;
}

/* bring columns k0 .. k0 + 32 (one cache line) of rows 0 .. nrows (at most 16) of w into L2: the
 * weight tiles the next call will read, fetched while this one computes (a tile load waits on its 16
 * rows' lines one after another; the weights of a MoE layer stream from memory) */
static inline void prefetch_rows(const uint16_t *w, int64_t ld, int64_t nrows, int64_t k0) {
    if (!w) return;
    for (int64_t r = 0; r < nrows && r < 16; r++) _mm_prefetch((const char *)(w + r * ld + k0), _MM_HINT_T1);
}

/* The one tile product of these kernels: accumulator tiles 0-3 := A x B over K, for up to two A blocks of
 * 16 weight rows -- rows r0.. of w0 and rows r1.. of w1 (both nrows x K, row stride ld; the second only when
 * na2 = 2) -- and up to two B blocks of 16 packed rows (b and b + bs, K / 2 rows of 16 pairs each; the second
 * only when nb2 = 2): tile 0 = (A0, B0), 1 = (A0, B1), 2 = (A1, B0), 3 = (A1, B1). Each A tile is loaded
 * once for both B blocks and each B tile once for both A blocks; rows past nrows and columns past K read
 * zero-padded copies (pad: 2 x 16 x 32). While it runs, p0 (np0 rows) and p1 (np1 rows) -- the next call's
 * weight rows, or NULL -- are brought into L2 a cache line per 32 columns. */
static inline __attribute__((always_inline)) void product_2x2(const uint16_t *w0, int64_t r0, const uint16_t *w1,
                                                              int64_t r1, const int na2, int64_t ld, int64_t nrows,
                                                              int64_t K, const uint16_t *b, int64_t bs, const int nb2,
                                                              uint16_t *pad, const uint16_t *p0, int64_t np0,
                                                              const uint16_t *p1, int64_t np1) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t kp = (K + 31) / 32 * 32;
    for (int64_t k0 = 0; k0 < kp; k0 += 32) {  /* k0 < K: kp is K rounded up to 32 */
        int64_t s0, s1;
        prefetch_rows(p0, ld, np0, k0);
        prefetch_rows(p1, ld, np1, k0);
        _tile_loadd(6, b + k0 * 16, 64);
        if (nb2 == 2) _tile_loadd(7, b + bs + k0 * 16, 64);
        _tile_loadd(4, a_tile(w0, ld, r0, nrows, k0, K, pad, &s0), s0);
        _tile_dpbf16ps(0, 4, 6);
        if (nb2 == 2) _tile_dpbf16ps(1, 4, 7);
        if (na2 == 2) {
            _tile_loadd(5, a_tile(w1, ld, r1, nrows, k0, K, pad + 512, &s1), s1);
            _tile_dpbf16ps(2, 5, 6);
            if (nb2 == 2) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* accumulator tile t (0-3) -> c (16 x 16 fp32); tile numbers must be immediates */
static inline void store_acc(int t, float c[16][16]) {
    switch (t) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64);
    }
}

/* accumulator tile t (0-3; its rows are 16 outputs, its columns 16 packed rows) turned back into rows:
 * r[j] = the 16 outputs of packed row j */
static inline void acc_rows(int t, __m512 r[16]) {
    float c[16][16] __attribute__((aligned(64)));
    store_acc(t, c);
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(c[i]);
    transpose16(r);
}

#endif
#endif
