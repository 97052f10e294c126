"""The small per-layer ops of CPU inference on the native library (``ops.c``): same arguments and
results as their twins in :mod:`baige.kernels.reference` (see :mod:`baige.kernels` for shapes),
fp32 CPU tensors (the KV cache may also be fp16 or bf16; ``silu_mul``, ``rms_norm`` and
``add_rms_norm`` also take all-bf16 tensors: ``act_bf16.c``, on ``torch.get_num_threads()``
threads for large tensors), no autograd. Call them only where
:func:`usable` is true."""

from __future__ import annotations

import torch

from baige.kernels import reference
from baige.kernels.cpu.build import current_isa, library

# KV cache element types as ops.c numbers them (KV_F32, KV_F16, KV_BF16)
KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def kv_dtype_code(dtype: torch.dtype) -> int:
    """ops.c's code of a KV cache dtype (fp32 0, fp16 1, bf16 2). Raises KeyError for any other."""
    return KV_DTYPES[dtype]


def usable(*tensors: torch.Tensor, caches: tuple[torch.Tensor, ...] = (), bf16: bool = False) -> bool:
    """True when every tensor is fp32 on the CPU (or, with ``bf16``, every one bf16), none needs a
    gradient, the KV ``caches`` (if any) are fp32, fp16 or bf16 CPU tensors of one dtype, and the
    library builds."""
    grad = torch.is_grad_enabled()
    dtype = tensors[0].dtype if bf16 and tensors[0].dtype == torch.bfloat16 else torch.float32
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != dtype or (grad and t.requires_grad):
            return False
    for c in caches:
        if c.device.type != "cpu" or c.dtype not in KV_DTYPES or c.dtype != caches[0].dtype:
            return False
    return library() is not None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """(S, V) fp32, V >= 1 -> (S,) int64: torch.argmax(x, -1) (first index of the maximum; a NaN wins)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.long)
    library().baige_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """(R, V) fp32 non-negative, V >= 1, and (R,) float64 uniforms -> (R,) int64: per row the first
    position whose float64 running sum reaches ``(1 - u) * total`` (``ops.c``), or None when a row's
    total is not finite."""
    if probs.stride(-1) != 1:
        probs = probs.contiguous()
    u = u.to(torch.float64).contiguous()
    out = torch.empty(probs.shape[0], dtype=torch.long)
    bad = library().baige_inverse_cdf_rows(
        probs.data_ptr(), probs.shape[0], probs.shape[1], probs.stride(0), u.data_ptr(), out.data_ptr()
    )
    return None if bad else out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    lib = library()
    if gate.dtype == torch.bfloat16:
        lib.baige_silu_mul_bf16(gate.data_ptr(), up.data_ptr(), gate.numel(), out.data_ptr(), torch.get_num_threads())
    else:
        lib.baige_silu_mul(gate.data_ptr(), up.data_ptr(), gate.numel(), out.data_ptr())
    return out


def moe_experts(
    xs: torch.Tensor, offsets: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, skip_rows: int, ys: torch.Tensor
) -> bool:
    """The routed SwiGLU experts in fp32 on rows sorted by expert (``moe.c``): ``ys[i] = w2[e] @ (silu(w13[e, :I]
    @ xs[i]) * (w13[e, I:] @ xs[i]))`` for ``offsets[e] <= i < offsets[e + 1]``, for every expert with
    more than ``skip_rows`` rows (the rows of the others are left as they are), fp32 accumulation, on
    ``torch.get_num_threads()`` threads (results independent of the count).

    Args:
        xs: (n, H) fp32, unit stride along H. offsets: (E + 1,) int64 contiguous, non-decreasing, 0 .. n.
        w13: (E, 2I, H) and w2: (E, H, I) fp32 contiguous. ys: (n, H) fp32, unit stride along H.
    Returns:
        False, with nothing written, where the variant in force has no such kernel (below AVX-512 F).
    Raises:
        MemoryError: the kernel's scratch (a chunk of rows transposed: ~512 KiB) could not be allocated.
    """
    rc = library().baige_moe_experts_f32(
        xs.data_ptr(),
        xs.stride(0),
        offsets.data_ptr(),
        w13.shape[0],
        w13.data_ptr(),
        w2.data_ptr(),
        xs.shape[1],
        w2.shape[-1],
        skip_rows,
        ys.data_ptr(),
        ys.stride(0),
        torch.get_num_threads(),
    )
    if rc == -2:
        raise MemoryError("baige_moe_experts_f32: no memory for its scratch")
    return rc == 0


def moe_experts_combine(
    x: torch.Tensor,
    tok: torch.Tensor,
    wts: torch.Tensor,
    offsets: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    skip_rows: int,
    out: torch.Tensor,
) -> bool:
    """The routed SwiGLU experts in bf16 on AMX tiles, gather and weighted combine included (``moe_amx.c``):
    ``out[tok[i]] += wts[i] * w2[e] @ (silu(w13[e, :I] @ x[tok[i]]) * (w13[e, I:] @ x[tok[i]]))`` for
    ``offsets[e] <= i < offsets[e + 1]``, for every expert with more than ``skip_rows`` pairs (the others'
    are not added), fp32 accumulation, the activations rounded once to bf16, the expert outputs added in
    fp32 in ascending expert order; on ``torch.get_num_threads()`` threads (results independent of the count).

    Args:
        x: (T, H) bf16, unit stride along H. tok: (n,) int64 contiguous, the token of each pair sorted by
            expert, no token twice within one expert. wts: (n,) fp32 contiguous, each pair's routing weight.
        offsets: (E + 1,) int64 contiguous, non-decreasing, 0 .. n. w13: (E, 2I, H) and w2: (E, H, I) bf16
            contiguous. out: (T, H) fp32, unit stride along H, added into.
    Returns:
        False, with nothing written, where the variant in force has no such kernel (anything but
        ``avx512_amx``, or Linux refused the AMX tile state).
    Raises:
        MemoryError: the kernel's scratch (a chunk of rows packed: up to 1 MiB) could not be allocated.
    """
    rc = library().baige_moe_experts_bf16(
        x.data_ptr(),
        x.stride(0),
        tok.data_ptr(),
        wts.data_ptr(),
        offsets.data_ptr(),
        w13.shape[0],
        w13.data_ptr(),
        w2.data_ptr(),
        x.shape[1],
        w2.shape[-1],
        skip_rows,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
    )
    if rc == -2:
        raise MemoryError("baige_moe_experts_bf16: no memory for its scratch")
    return rc == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    x = x.contiguous()
    out = torch.empty_like(x)
    lib = library()
    args = (x.data_ptr(), x.numel() // n, n, weight.contiguous().data_ptr(), eps, out.data_ptr())
    if x.dtype == torch.bfloat16:
        lib.baige_rms_norm_bf16(*args, torch.get_num_threads())
    else:
        lib.baige_rms_norm(*args)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x, residual = x.contiguous(), residual.contiguous()
    out, summed = torch.empty_like(x), torch.empty_like(x)
    lib = library()
    args = (
        x.data_ptr(),
        residual.data_ptr(),
        x.numel() // n,
        n,
        weight.contiguous().data_ptr(),
        eps,
        out.data_ptr(),
        summed.data_ptr(),
    )
    if x.dtype == torch.bfloat16:
        lib.baige_add_rms_norm_bf16(*args, torch.get_num_threads())
    else:
        lib.baige_add_rms_norm(*args)
    return out, summed


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    d = q.shape[-1]
    tokens = q.numel() // (q.shape[-2] * d)
    cos = cos.expand(*q.shape[:-2], d).contiguous()  # (..., d): one row per token
    sin = sin.expand(*q.shape[:-2], d).contiguous()
    q, k = q.contiguous(), k.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    args = (
        q.data_ptr(),
        k.data_ptr(),
        tokens,
        q.shape[-2],
        k.shape[-2],
        d,
        cos.data_ptr(),
        sin.data_ptr(),
        q_out.data_ptr(),
        k_out.data_ptr(),
    )
    if q.dtype == torch.bfloat16:  # all four bf16 (kernels.apply_rope's dispatch): act_bf16.c
        library().baige_rope_bf16(*args, torch.get_num_threads())
    else:
        library().baige_rope(*args)
    return q_out, k_out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    hk, d = k_cache.shape[0], k_cache.shape[-1]
    k, v = k.contiguous(), v.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    if k.dtype == k_cache.dtype != torch.float32:  # bf16 K/V into a bf16 cache: row copies
        library().baige_store_kv_same(
            k.data_ptr(),
            v.data_ptr(),
            k.shape[0],
            hk,
            d,
            k.element_size(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            k_cache.numel() // (hk * d),
            slots.data_ptr(),
        )
        return
    library().baige_store_kv(
        k.data_ptr(),
        v.data_ptr(),
        k.shape[0],
        hk,
        d,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.numel() // (hk * d),
        slots.data_ptr(),
        kv_dtype_code(k_cache.dtype),
    )


# Where the avx512_amx variant is in force, the scores of bf16 K caches come from AMX tiles when the
# shapes fit them (attention_amx.c): per 16 keys x up to 16 query heads one tile product, no lane
# reductions, faster than the fp32 lanes whether the blocks are in order or shuffled (measured:
# docs/benchmarks/archive.md, "AMX attention scores, int8 prefetch on Intel").
AMX_SCORES_ISAS = ("avx512_amx",)


def amx_scores(kv_dtype: torch.dtype, head_dim: int, block_size: int, group: int) -> bool:
    """True when attention.c takes the scores of a cache from the AMX tiles (q rounded to bf16 for
    them): the avx512_amx variant in force, a bf16 cache, ``head_dim`` a multiple of 32 up to 256,
    ``block_size`` a multiple of 16 and at most 16 query heads per KV head (``group``); the OS may
    still refuse the tiles, and then the fp32 path runs."""
    return (
        current_isa() in AMX_SCORES_ISAS
        and kv_dtype == torch.bfloat16
        and head_dim % 32 == 0
        and head_dim <= 256
        and block_size % 16 == 0
        and 1 <= group <= 16
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    table_of_row: torch.Tensor | None = None,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Runs ``attention.c`` on ``torch.get_num_threads()`` OpenMP threads over (sequence, KV head)
    pairs, in fp32 (a bf16 ``q`` is widened, the result rounded back to bf16) -- except the scores of
    a bf16 cache where :func:`amx_scores` holds: there ``q`` is rounded to bf16 and q . K runs on the
    AMX tiles (``attention_amx.c``; fp32 sums of exact bf16 products). ``table_of_row`` (S,) int64,
    optional: row ``s`` reads ``block_tables[table_of_row[s]]`` (default: row ``s``). ``window``,
    ``sinks``, ``softcap`` (:func:`baige.kernels.attention`'s): ``baige_paged_attention_ext`` on the 8-lane
    kernels, reading only the blocks from the one holding the window's first key. Raises MemoryError when a
    thread's score buffer (n_heads / n_kv_heads x longest context floats) cannot be allocated."""
    S, H, D = q.shape
    hk, nb, bs, _ = k_cache.shape
    q32 = q.float().contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    rows = None if table_of_row is None else table_of_row.to(torch.int64).contiguous()
    out = torch.empty_like(q32)
    if window is not None or sinks is not None or softcap is not None:
        sinks32 = None if sinks is None else sinks.detach().float().contiguous()
        rc = library().baige_paged_attention_ext(
            q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), S, H, hk, D, nb, bs, tables.data_ptr(),
            tables.shape[1], None if rows is None else rows.data_ptr(), lens.data_ptr(), scale, window or 0,
            None if sinks32 is None else sinks32.data_ptr(), softcap or 0.0, out.data_ptr(),
            kv_dtype_code(k_cache.dtype), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("paged decode attention: could not allocate the score buffer")
        return out.to(q.dtype)
    rc = library().baige_paged_decode_attention(
        q32.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        S,
        H,
        hk,
        D,
        nb,
        bs,
        tables.data_ptr(),
        tables.shape[1],
        None if rows is None else rows.data_ptr(),
        lens.data_ptr(),
        scale,
        out.data_ptr(),
        kv_dtype_code(k_cache.dtype),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("paged decode attention: could not allocate the score buffer")
    return out.to(q.dtype)


# The longest context whose K and V (per KV head) the prefill rows read natively, in bytes. Each query
# row streams its sequence's whole K/V prefix, which pays while that stays in a core's L2; past it
# torch's flash SDPA (query blocks, one K/V pass per block) is as fast or faster (measured on an AMD
# EPYC, Zen 4: docs/benchmarks/archive.md, "AVX-512 paged attention, native prefill attention, one-call
# decode step").
PREFILL_NATIVE_MAX_BYTES = 512 << 10
# Where the AMX variant is in force, bf16 prefill chunks over a bf16 cache run prefill_amx.c (q . K and
# P . V on the tiles) at any length, where its shape rule (:func:`amx_prefill`) holds; other bf16 chunks
# there go to torch's flash SDPA, whose oneDNN AMX GEMMs beat the row-by-row kernel; fp32 stays native
# there, where it is the faster (measured on an Intel Xeon, Sapphire Rapids class:
# docs/benchmarks/archive.md, "Workload roofline, SDPA bf16 prefill on AMX").
SDPA_BF16_PREFILL_ISAS = ("avx512_amx",)


def amx_prefill(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """True when bf16 prefill chunks run prefill_amx.c: the avx512_amx variant in force, bf16 queries and
    cache, ``head_dim`` a multiple of 32 up to 256, ``block_size`` a multiple of 16 (the OS may still
    refuse the tiles, and then torch's SDPA runs)."""
    return (
        current_isa() in SDPA_BF16_PREFILL_ISAS
        and q_dtype == kv_dtype == torch.bfloat16
        and head_dim % 32 == 0
        and head_dim <= 256
        and block_size % 16 == 0
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Prefill chunks through the decode kernel, one query row per token: token ``j`` of sequence
    ``i``'s chunk of ``T_i`` reads sequence ``i``'s block table and a context of
    ``context_lens[i] - T_i + j + 1`` keys, which is the causal mask. Chunks of a sequence whose K + V
    per KV head exceed :data:`PREFILL_NATIVE_MAX_BYTES`, and bf16 chunks under a variant of
    :data:`SDPA_BF16_PREFILL_ISAS`, go to the reference (torch's SDPA) instead, the whole call at once --
    but where :func:`amx_prefill` holds (bf16 q and cache under avx512_amx), the whole call runs
    ``prefill_amx.c`` (the query heads a multiple of the KV heads). Same dtypes and errors as
    :func:`paged_decode_attention`. With ``window`` / ``sinks`` / ``softcap`` never the AMX kernel, and a
    window bounds the keys a row reads (to ``window + block_size``)."""
    D = k_cache.shape[-1]
    lens_all = context_lens.to(torch.int64)
    extra = {"window": window, "sinks": sinks, "softcap": softcap}
    variant = window is not None or sinks is not None or softcap is not None
    if not variant and amx_prefill(q.dtype, k_cache.dtype, D, k_cache.shape[2]):  # None where the kernel declines
        out = _prefill_amx(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens_all, scale)
        if out is not None:
            return out
    longest = int(lens_all.max()) if lens_all.numel() else 0
    longest = longest if window is None else min(longest, window + k_cache.shape[2])
    if longest * D * 2 * k_cache.element_size() > PREFILL_NATIVE_MAX_BYTES or (
        q.dtype == torch.bfloat16 and current_isa() in SDPA_BF16_PREFILL_ISAS
    ):
        return reference.paged_prefill_attention(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, **extra
        )
    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).to(torch.int64)
    seq = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)  # (N,) sequence of each token
    pos = torch.arange(q.shape[0]) - cu_seqlens_q.to(torch.int64)[seq]  # (N,) index within its chunk
    lens = lens_all[seq] - counts[seq] + pos + 1
    return paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale, table_of_row=seq, **extra)


def _prefill_amx(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale) -> torch.Tensor | None:
    """prefill_amx.c on bf16 q (N, H, D) and bf16 caches -> (N, H, D) bf16, or None where the kernel
    declines (tiles refused by the OS, query heads not a multiple of the KV heads). Raises MemoryError when
    its scratch cannot be allocated."""
    hk, nb, bs, D = k_cache.shape
    qc = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    cu = cu_seqlens_q.to(torch.int64).contiguous()
    lens = context_lens.contiguous()
    out = torch.empty_like(qc)
    rc = library().baige_prefill_attention_amx(
        qc.data_ptr(),
        q.shape[1],
        hk,
        D,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        nb * bs,
        bs,
        tables.data_ptr(),
        tables.shape[1],
        cu.data_ptr(),
        lens.data_ptr(),
        lens.shape[0],
        scale,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc == -2:
        raise MemoryError("prefill attention: no memory for the AMX kernel's scratch")
    return out if rc == 0 else None
