"""Weight-only int8/int4 linear on the native CPU kernels: integer dot products over int8 block-quantized
activations and, by default, their int8-quantized residual (``qdot.c``, the default;
``BAIGE_CPU_INT_DOT=0`` turns it off, ``BAIGE_CPU_INT_DOT_PASSES=1`` drops the residual pass, and int4
with a group size that is not a multiple of 32 never takes it) or the exact dequantize-in-registers
kernels (``qlinear.c``).

The integer-dot kernels read the weights repacked into 16-row interleaved tiles (:func:`repacked`,
built on first use and kept beside the compressed-tensors weights, in first-use order in the
huge-page arena of :mod:`baige.kernels.cpu.arena`: one more copy of the packed bytes and scales per
quantized weight; the checkpoint layout is unchanged).

On CPU, PyTorch has no fast int8/int4 weight-only matmul for fp32 activations
(``torch._weight_int8pack_mm`` measured slower than fp32 ``F.linear``), so without this a quantized
checkpoint dequantizes every weight on every call. The integer-dot kernels take any number of rows (in
chunks of :data:`DOT_CHUNK_ROWS`, so a chunk's activation blocks stay in cache): with the residual pass
they round nothing a perplexity sees, and they ran faster than dequantize + sgemm at 512-2048 rows too
(measured: docs/benchmarks/archive.md, "The residual activation pass"). The exact kernels take at
most :data:`MAX_ROWS` rows; above that, dequantize + PyTorch's sgemm is as fast (compute-bound).
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F

from baige.kernels.cpu import arena
from baige.kernels.cpu.build import current_isa, library, native_allowed
from baige.kernels.settings import int_dot_passes, settings

# Above this many input rows, dequantize + PyTorch's sgemm is as fast (measured on an AVX2 core: the
# native kernels' lead, each weight read once for all rows, shrinks as the rows make the call
# compute-bound).
MAX_ROWS = 512
DOT_CHUNK_ROWS = 512  # rows per integer-dot kernel call: 2 x 512 x 1536 activation bytes stay in L2/L3
TILE_ROWS = 16  # weight rows per repacked tile (qdot.c's RT)
ACT_BLOCK = 32  # columns per activation block (qdot.c's QB)
_EMPTY_WORD = -0x77777778  # 0x88888888 as int32: eight nibbles of stored value 8 (weight 0)


def repack_int8(qweight: torch.Tensor) -> torch.Tensor:
    """int8 (N, K) -> uint8 (T, nb, 8, 16, 4) tiles of ``qdot.c``: byte [t][b][j][r][i] = w[16t + r][32b + 4j + i]
    + 128, T = ceil(N / 16), nb = ceil(K / 32), padding 128 (weight 0)."""
    n, k = qweight.shape
    t, nb = -(-n // TILE_ROWS), -(-k // ACT_BLOCK)
    u = torch.full((t * TILE_ROWS, nb * ACT_BLOCK), 128, dtype=torch.uint8)
    u[:n, :k] = (qweight.to(torch.int16) + 128).to(torch.uint8)
    return u.view(t, TILE_ROWS, nb * 8, 4).transpose(1, 2).contiguous().view(t, nb, 8, TILE_ROWS, 4)


def repack_int4(
    qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """compressed-tensors int4 -> ``qdot.c``'s tiles.

    Args:
        qweight: int32 (N, W) words of 8 nibbles; scale: fp32 or bf16 (N, G); zero_point: int (N, G) or None.
    Returns:
        words int32 (T, nb * 4, 16) (word [t][4b + j][r] = qweight[16t + r][4b + j], padding 0x88888888),
        scales (T, G, 16) (padding 0) in bf16 when ``scale`` is bf16 (a bf16 model's: the same values in half
        the bytes the kernel streams), else fp32, and fp32 ``scale * zero_point`` in that layout or None.
    """
    n, words = qweight.shape
    t, nw = -(-n // TILE_ROWS), -(-words // 4) * 4
    w = torch.full((t * TILE_ROWS, nw), _EMPTY_WORD, dtype=torch.int32)
    w[:n, :words] = qweight

    def tiles(v: torch.Tensor) -> torch.Tensor:  # (N, G) -> (T, G, 16)
        p = torch.zeros(t * TILE_ROWS, v.shape[1], dtype=v.dtype)
        p[:n] = v
        return p.view(t, TILE_ROWS, -1).transpose(1, 2).contiguous()

    s = scale.float()
    return (
        w.view(t, TILE_ROWS, nw).transpose(1, 2).contiguous(),
        tiles(scale if scale.dtype == torch.bfloat16 else s),
        None if zero_point is None else tiles(s * zero_point.float()),
    )


_repacks: dict[int, tuple] = {}  # id(qweight) -> (versions, repacked tensors)
_repack_lock = threading.Lock()


def repacked(qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> tuple:
    """The repacked tensors of a quantized weight (:func:`repack_int8`: ``(tiles,)``; :func:`repack_int4`:
    ``(words, scales, scaled_zeros)``), built once per weight tensor and rebuilt when that tensor is
    written in place (its version: loading a checkpoint writes weight and scales together); dropped
    with the weight. The scales are read only when building, so callers may pass converted copies."""
    key = id(qweight)
    versions = (qweight.data_ptr(), qweight._version)
    hit = _repacks.get(key)
    if hit is not None and hit[0] == versions:
        return hit[1]
    value = (repack_int8(qweight),) if qweight.dtype == torch.int8 else repack_int4(qweight, scale, zero_point)
    value = tuple(None if v is None else arena.weights.place(v) for v in value)  # back to back, huge pages
    with _repack_lock:
        _remember(qweight, value)
    return value


def _remember(qweight: torch.Tensor, value: tuple) -> None:
    """Cache ``value`` as ``qweight``'s repacked tensors at its current version (hold ``_repack_lock``)."""
    if id(qweight) not in _repacks:
        weakref.finalize(qweight, _repacks.pop, id(qweight), None)
    _repacks[id(qweight)] = ((qweight.data_ptr(), qweight._version), value)


_groups: dict[tuple[int, ...], tuple] = {}  # member ids -> (member versions, joined tiles)


def repacked_together(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]) -> tuple | None:
    """The repacked tiles of weights that read the same input (a layer's q/k/v, or its gate/up), joined
    so one kernel call reads them as one weight of ``sum(N)`` rows: one call quantizes the activations
    once and streams one run of tiles instead of restarting per matrix (measured faster at one row:
    docs/benchmarks/archive.md, "Joined projections, native prefill chunks, bf16 int4 scales").

    Args:
        parts: ``(qweight, scale, zero_point)`` per member in output order, as :func:`repacked` takes them;
            int4 members must share one group size (the caller's check: at some in_features two group
            sizes give the same number of groups).
    Returns:
        The joined tensors in :func:`repacked`'s form (int8: ``(tiles,)``; int4: ``(words, scales,
        scaled_zeros)``), tile rows in member order; each member's :func:`repacked` entry becomes a view
        into them (no second copy). None when they cannot be joined: fewer than two members, mixed bits or
        ``in_features``, int4 group counts, scale dtypes (bf16 or not) or zero points that differ, or a member other
        than the last
        whose rows are not a multiple of 16 (its padding rows would land inside the joined output).
    """
    q0, s0, z0 = parts[0] if parts else (None, None, None)
    if len(parts) < 2 or any(q.dtype != q0.dtype or q.shape[1] != q0.shape[1] for q, _, _ in parts):
        return None
    if any(q.shape[0] % TILE_ROWS for q, _, _ in parts[:-1]):
        return None
    int8 = q0.dtype == torch.int8
    if not int8 and any(
        s.shape[1] != s0.shape[1]
        or (s.dtype == torch.bfloat16) != (s0.dtype == torch.bfloat16)
        or (z is None) != (z0 is None)
        for _, s, z in parts
    ):
        return None
    key = tuple(id(q) for q, _, _ in parts)
    versions = tuple((q.data_ptr(), q._version) for q, _, _ in parts)
    hit = _groups.get(key)
    if hit is not None and hit[0] == versions:
        return hit[1]
    raw = [(repack_int8(q),) if int8 else repack_int4(q, s, z) for q, s, z in parts]
    joined = tuple(
        None if raw[0][i] is None else arena.weights.place(torch.cat([r[i] for r in raw])) for i in range(len(raw[0]))
    )
    with _repack_lock:
        row = 0
        for (q, _, _), r in zip(parts, raw):
            tiles = r[0].shape[0]
            _remember(q, tuple(None if j is None else j[row : row + tiles] for j in joined))
            row += tiles
        if key not in _groups:
            for q, _, _ in parts:
                weakref.finalize(q, _groups.pop, key, None)
        _groups[key] = (versions, joined)
    return joined


# Under these variants a bf16 model's int8 / int4 linears of at least AMX_DEQUANT_MIN_ROWS rows (prefill
# chunks) dequantize the weight to bf16 and run F.linear, i.e. oneDNN's AMX bf16 matmul -- the reference's
# own math -- instead of the integer dots, whose AVX-512 VNNI products cannot keep up with the tiles at
# many rows: from about AMX_DEQUANT_MIN_ROWS rows on the dequantize + AMX call is the faster, int8 and
# int4 (unpacked by dequantized_bf16's native pass) alike, and the quantized prefill gains several times
# over (measured: docs/benchmarks/archive.md, "bf16 prefill on AMX: attention, RoPE, K/V stores,
# quantized prefill").
AMX_DEQUANT_ISAS = ("avx512_amx",)
AMX_DEQUANT_MIN_ROWS = {torch.int8: 128, torch.int32: 128}  # by qweight dtype: int8, int4 (packed in int32)


def takes_amx_dequant(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether ``baige.kernels.quantized_linear`` runs bf16 ``x`` (..., in) against this int8 / int4 weight
    as dequantize-to-bf16 + ``F.linear`` (see :data:`AMX_DEQUANT_ISAS`): a variant of it in force and at
    least :data:`AMX_DEQUANT_MIN_ROWS` rows."""
    rows = x.numel() // max(x.shape[-1], 1)
    return (
        x.dtype == torch.bfloat16
        and rows >= AMX_DEQUANT_MIN_ROWS.get(qweight.dtype, 1 << 62)
        and current_isa() in AMX_DEQUANT_ISAS
    )


def dequantized_bf16(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, group_size: int | None
) -> torch.Tensor:
    """The weight of ``baige.kernels.quantized_linear`` as bf16 (out, in): ``reference.dequantize_weight``
    (q - zp) * scale in the scale's dtype, rounded to bf16, bit for bit; int4 (int32 ``qweight`` (out,
    ceil(in / 8)), a group size that is a multiple of 8) unpacked natively (``qlinear.c``, one pass, where
    torch's nibble unpacking was the slow part of the call), int8 by torch's ops. ``x`` (..., in) gives ``in``."""
    k = x.shape[-1]
    if qweight.dtype != torch.int32 or group_size is None or group_size % 8 or library() is None:
        from baige.kernels import reference

        q = qweight if qweight.dtype == torch.int8 else reference.unpack_int4(qweight, k)
        return reference.dequantize_weight(q, scale, zero_point, group_size).to(torch.bfloat16)
    wp = qweight if qweight.stride(-1) == 1 and qweight.stride(0) >= qweight.shape[1] else qweight.contiguous()
    s = (
        scale
        if scale.dtype in (torch.bfloat16, torch.float32) and scale.is_contiguous()
        else scale.float().contiguous()
    )
    z = None if zero_point is None else zero_point.to(torch.int32).contiguous()
    out = torch.empty(wp.shape[0], k, dtype=torch.bfloat16)
    library().baige_dequant_int4_bf16(
        wp.data_ptr(),
        wp.shape[0],
        k,
        wp.stride(0),
        s.data_ptr(),
        int(s.dtype == torch.bfloat16),
        None if z is None else z.data_ptr(),
        s.shape[1],
        group_size,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    return out


def takes_int_dot(qweight: torch.Tensor, group_size: int | None, int_dot: bool | None = None) -> bool:
    """Whether :func:`quantized_linear` runs this weight through the integer-dot kernels: ``int_dot`` (None:
    ``BAIGE_CPU_INT_DOT``) and int8, or int4 with a group size that is a multiple of 32."""
    on = settings().cpu_int_dot if int_dot is None else int_dot
    return bool(on) and (qweight.dtype == torch.int8 or (group_size or 0) % 32 == 0)


def supports(
    x: torch.Tensor,
    qweight: torch.Tensor,
    group_size: int | None,
    bias: torch.Tensor | None,
    int_dot: bool | None = None,
) -> bool:
    """Whether :func:`quantized_linear` takes these arguments: CPU fp32 ``x`` with no gradient needed
    (and at most :data:`MAX_ROWS` rows unless the integer-dot kernels run it: :func:`takes_int_dot`),
    an int8 per-channel or int4 weight whose group size is a multiple of 8, and a buildable kernel."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return False
    if x.numel() // max(x.shape[-1], 1) > MAX_ROWS and not takes_int_dot(qweight, group_size, int_dot):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    if qweight.dtype == torch.int8:
        if group_size is not None:
            return False
    elif qweight.dtype != torch.int32 or group_size is None or group_size % 8:
        return False
    return library() is not None


def quantized_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    group_size: int | None,
    bias: torch.Tensor | None = None,
    *,
    int_dot: bool | None = None,
    passes: int | None = None,
) -> torch.Tensor:
    """:func:`baige.kernels.quantized_linear` on the native kernel (same arguments and layouts; call
    only where :func:`supports` is true). ``int_dot``: None follows ``BAIGE_CPU_INT_DOT``; False
    forces the exact kernels. ``passes``: the integer-dot kernels' activation passes (1: int8 blocks;
    2: + their residual; None: ``BAIGE_CPU_INT_DOT_PASSES``, default 2). Returns (..., out) fp32; no autograd.

    Raises:
        MemoryError: an integer-dot kernel could not allocate its scratch (activation blocks).
        ValueError: on the integer-dot path, ``passes`` (or ``BAIGE_CPU_INT_DOT_PASSES``) is not 1 or 2.
    """
    lib = library()
    shape = x.shape
    k = shape[-1]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y.view(*shape[:-1], n)
    # per-call work is a handful of pointer reads: decode calls this ~200 times per token
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    b_ptr = None if bias is None else bias.data_ptr()
    nthreads = torch.get_num_threads()
    dot = takes_int_dot(qweight, group_size, int_dot)
    passes = (int_dot_passes() if passes is None else passes) if dot else 1  # read only where it matters
    if passes not in (1, 2):
        raise ValueError(f"integer-dot activation passes must be 1 or 2, got {passes!r}")
    # the int4 integer-dot kernel reads the repacked scales (fp32, or a bf16 model's bf16), the others these;
    # repacked() is keyed by the weight tensor itself, so only the exact kernels get a contiguous copy
    fp32_scale = scale.dtype == torch.float32 and scale.is_contiguous()
    s = scale if fp32_scale or (dot and qweight.dtype == torch.int32) else scale.float().contiguous()
    if qweight.dtype == torch.int32 and k % 8:
        x2 = F.pad(x2, (0, 8 - k % 8))  # zero columns: the padded int4 nibbles multiply 0
    if not dot:
        _run_exact(lib, x2, y, qweight, s, zero_point, group_size, b_ptr, nthreads)
    elif _run_int_dot(lib, x2, y, qweight, scale, s, zero_point, group_size, b_ptr, passes, nthreads) != 0:
        raise MemoryError("native integer-dot linear: could not allocate its scratch buffers")
    return y if len(shape) == 2 else y.view(*shape[:-1], n)


def _run_int_dot(lib, x2, y, qweight, scale, s, zero_point, group_size, b_ptr, passes, nthreads) -> int:
    """The integer-dot kernels (``qdot.c``) of :func:`quantized_linear`: ``x2`` (m, k) fp32 rows (k padded
    to whole int4 words), :data:`DOT_CHUNK_ROWS` rows per call, into ``y`` (m, n) fp32. They read the
    weight repacked (:func:`repacked`): int8 with the scales ``s``, int4 with its repacked scales and
    zero points. Returns the calls' return codes OR-ed: non-zero when a kernel could not allocate its
    scratch."""
    m, n = y.shape
    k = x2.shape[1]
    rc = 0
    # (x pointer, y pointer, rows) per call
    chunks = [
        (x2.data_ptr() + 4 * i * x2.stride(0), y.data_ptr() + 4 * i * n, min(DOT_CHUNK_ROWS, m - i))
        for i in range(0, m, DOT_CHUNK_ROWS)
    ]
    if qweight.dtype == torch.int8:
        (wr,) = repacked(qweight, scale, None)
        for xp, yp, rows in chunks:
            rc |= lib.baige_qdot_int8(
                xp, rows, k, x2.stride(0), wr.data_ptr(), n, s.data_ptr(), b_ptr, yp, n, passes, nthreads
            )
    else:
        wr, sr, zr = repacked(qweight, scale, zero_point)
        for xp, yp, rows in chunks:
            rc |= lib.baige_qdot_int4(
                xp,
                rows,
                k,
                x2.stride(0),
                wr.data_ptr(),
                n,
                sr.data_ptr(),
                int(sr.dtype == torch.bfloat16),
                None if zr is None else zr.data_ptr(),
                sr.shape[1],
                group_size,
                b_ptr,
                yp,
                n,
                passes,
                nthreads,
            )
    return rc


def _run_exact(lib, x2, y, qweight, s, zero_point, group_size, b_ptr, nthreads) -> None:
    """The exact dequantizing kernels (``qlinear.c``) of :func:`quantized_linear`: ``x2`` (m, k) fp32
    rows (k padded to whole int4 words) into ``y`` (m, n) fp32, with ``s`` the fp32 contiguous scales."""
    m, n = y.shape
    qc = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    if qweight.dtype == torch.int8:
        lib.baige_qlinear_int8(
            x2.data_ptr(),
            m,
            x2.shape[1],
            x2.stride(0),
            qc.data_ptr(),
            n,
            qc.stride(0),
            s.data_ptr(),
            b_ptr,
            y.data_ptr(),
            n,
            nthreads,
        )
    else:
        z = None if zero_point is None else zero_point.to(torch.int32).contiguous()
        lib.baige_qlinear_int4(
            x2.data_ptr(),
            m,
            x2.shape[1],
            x2.stride(0),
            qc.data_ptr(),
            n,
            qc.stride(0),
            s.data_ptr(),
            None if z is None else z.data_ptr(),
            s.shape[1],
            group_size,
            b_ptr,
            y.data_ptr(),
            n,
            nthreads,
        )


def supports_f16(x: torch.Tensor) -> bool:
    """Whether :func:`linear_f16` takes ``x``: (rows, in) CPU fp32, at most :data:`MAX_ROWS` rows, no
    gradient needed, ``BAIGE_KERNELS`` unset or ``auto``, outside a ``torch.compile`` trace, library built."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.shape[0] <= MAX_ROWS
        and not (torch.is_grad_enabled() and x.requires_grad)
        and native_allowed()
        and library() is not None
    )


def linear_f16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.float().T + bias`` without materialising the fp32 weight.

    Args:
        x: (rows, in) fp32, rows unit-strided.
        weight: (out, in) fp16, bf16 or fp32, rows unit-strided (fp32 runs the fp32 kernel: a weight row is
            read from memory once for all rows, where a BLAS sgemm at a few rows reads it per row;
            bf16 runs bf16.c: vdpbf16ps over x rounded to bf16 on AVX-512 BF16, else exact widening).
        bias: (out,) fp32 contiguous, or None.
    Returns:
        (rows, out) fp32 (accumulated in fp32).
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib = library()
        fn = {torch.float32: lib.baige_linear_f32, torch.bfloat16: lib.baige_linear_bf16}.get(
            weight.dtype, lib.baige_linear_f16
        )
        fn(
            x.data_ptr(),
            m,
            k,
            x.stride(0),
            weight.data_ptr(),
            n,
            weight.stride(0),
            None,
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            n,
            torch.get_num_threads(),
        )
    return y
