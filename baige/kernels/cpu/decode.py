"""The C ABI of the one-call native decode step (``decode.c``): descriptors and the call.

The runtime (:mod:`baige.runtime.infer.cpu_decode`) walks the model and describes each layer's
tensors; this module packs them into the structs ``baige_decode_layers`` reads and calls it. The
structs hold raw pointers: every tensor described is kept referenced by :class:`DecodeLayers`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from baige.kernels.cpu.build import library
from baige.kernels.cpu.ops import kv_dtype_code
from baige.kernels.cpu.qlinear import repacked, repacked_together, takes_int_dot
from baige.kernels.settings import int_dot_passes

# projection kinds understood by decode.c
LINEAR_F32, LINEAR_INT8, LINEAR_INT4, LINEAR_F16, LINEAR_BF16 = 0, 1, 2, 3, 6
_INT8_DOT, _INT4_DOT = 4, 5  # the int8/int4 kinds through qdot.c's integer dot products (BAIGE_CPU_INT_DOT)
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
JOINED = {"qkv": (0, 1, 2), "gate_up": (4, 5)}  # projections of one input read as one weight when they can be
_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", _i64),
        ("n", _i64),
        ("k", _i64),
        ("w", _p),
        ("ldw", _i64),
        ("scale", _p),
        ("zero_point", _p),
        ("groups", _i64),
        ("group_size", _i64),
        ("bias", _p),
        ("lora_a", _p),
        ("lora_b", _p),
        ("lora_scale", _p),
        ("lora_slots", _i64),
        ("lora_r", _i64),
        ("scaled_zero", _p),
        ("act_passes", _i64),
        ("scale_bf16", _i64),
    ]


class _Moe(ctypes.Structure):
    _fields_ = (
        [
            ("num_experts", _i64),
            ("top_k", _i64),
            ("renormalize", _i64),
            ("inter", _i64),
            ("shared_inter", _i64),
            ("norm_min", ctypes.c_float),
            ("correction_bias", _p),
        ]
        + [
            (name, _Linear)
            for name in ("router", "gate_up", "down", "shared_gate_proj", "shared_up", "shared_down", "shared_gate")
        ]
        + [("experts", ctypes.POINTER(_Linear))]
    )


class _Layer(ctypes.Structure):
    _fields_ = (
        [(name, _Linear) for name in PROJECTIONS]
        + [("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p), ("k_cache", _p), ("v_cache", _p)]
        + [(name, _Linear) for name in JOINED]
        + [("moe", ctypes.POINTER(_Moe))]
    )


@dataclass
class LinearDesc:
    """One projection ``y = x W^T + b`` with ``W`` (n, k) in row-major storage of row stride ``ldw``.

    ``kind`` LINEAR_F32: fp32 ``w``; LINEAR_F16: fp16 ``w``; LINEAR_BF16: bf16 ``w`` (``bf16.c``:
    vdpbf16ps over bf16-rounded activations on AVX-512 BF16, exact widening elsewhere); LINEAR_INT8: int8 ``w`` with
    per-row ``scale`` (n,); LINEAR_INT4: int32 ``w`` of 8 packed nibbles, ``scale`` (n, groups) (scales fp32 or
    bf16: the module's own, so the repacked int4 tiles keep a bf16 model's bf16 scales),
    optional int32 ``zero_point`` (n, groups). ``bias``: fp32 (n,) or None. With ``BAIGE_CPU_INT_DOT``
    on (read when :class:`DecodeLayers` is built, with ``BAIGE_CPU_INT_DOT_PASSES``) int8 and int4 (group
    size a multiple of 32) run as integer dot products on the weights' repacked tiles
    (:func:`baige.kernels.cpu.qlinear.repacked`,
    shared with the per-op path), as the per-op path does.

    LoRA (multi-adapter serving, all three or none): ``lora_a`` fp32 (L, r, k), ``lora_b`` fp32 (L, n, r),
    ``lora_scale`` fp32 (L,), contiguous: ``y[m] += lora_scale[i] * lora_b[i] @ (lora_a[i] @ x[m])`` for
    the step's adapter slot ``i`` of token m (the ``lora_ids`` of :meth:`DecodeLayers.__call__`).
    """

    kind: int
    n: int
    k: int
    w: torch.Tensor
    scale: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None
    group_size: int = 0
    bias: torch.Tensor | None = None
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    lora_scale: torch.Tensor | None = None


@dataclass
class MoEDesc:
    """A Mixture-of-Experts MLP (decode.c's baige_moe; the model's SparseMoeBlock): ``router`` fp32 (E, hidden);
    ``gate_up`` (E, 2 inter, hidden) and ``down`` (E, hidden, inter), both fp32 or both bf16, contiguous;
    ``top_k`` experts by softmax probability (+ ``correction_bias`` fp32 (E,) for the choice only), weighted by
    their probabilities, renormalized (sum floored at ``norm_min``) when ``renormalize``; ``shared``: the
    shared SwiGLU's (gate, up, down) projections or None, ``shared_gate``: its (1, hidden) sigmoid gate or
    None. ``experts``: instead of the stacks (``gate_up`` and ``down`` None), per expert its (gate, up, down)
    projections (any kind, e.g. int8 / int4 quantized experts)."""

    router: torch.Tensor
    gate_up: torch.Tensor | None
    down: torch.Tensor | None
    top_k: int
    renormalize: bool
    norm_min: float = 0.0
    correction_bias: torch.Tensor | None = None
    shared: tuple[LinearDesc, LinearDesc, LinearDesc] | None = None
    shared_gate: LinearDesc | None = None
    experts: list[tuple[LinearDesc, LinearDesc, LinearDesc]] | None = None


@dataclass
class LayerDesc:
    """One decoder layer: seven projections (``PROJECTIONS`` order; with ``moe`` the last three are None),
    fp32 norm weights (hidden,) or (head_dim,) for q/k norms, this layer's K/V pools (n_kv_heads,
    num_blocks, block_size, head_dim), fp32, fp16 or bf16 (every layer's the same dtype), and a
    Mixture-of-Experts MLP in place of gate/up/down, or None."""

    linears: list[LinearDesc | None]
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    moe: MoEDesc | None = None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _takes_dot(d: LinearDesc) -> bool:
    """Whether an int8 / int4 projection runs as integer dot products (qlinear.takes_int_dot, the per-op
    path's rule)."""
    return d.kind in (LINEAR_INT8, LINEAR_INT4) and takes_int_dot(d.w, d.group_size if d.kind == LINEAR_INT4 else None)


class _CacheArgs:
    """The paged-cache, adapter and thread arguments that end both decode entry points (decode.c: slots,
    tables, W, lens, kv_dtype, lora_ids, nthreads), from (M,) int64 ``slot_mapping``, (M, W) int64
    ``block_tables``, (M,) int64 ``context_lens`` and (M,) ``lora_ids`` or None; holds the contiguous copies
    the pointers address until the call returns."""

    def __init__(self, slot_mapping, block_tables, context_lens, lora_ids):
        self.slots = slot_mapping.contiguous()
        self.tables = block_tables.contiguous()
        self.lens = context_lens.contiguous()
        self.lora_ids = None if lora_ids is None else lora_ids.to(torch.int64).contiguous()

    def args(self, kv_dtype: int) -> tuple:
        return (
            self.slots.data_ptr(),
            self.tables.data_ptr(),
            self.tables.shape[1],
            self.lens.data_ptr(),
            kv_dtype,
            _ptr(self.lora_ids),
            torch.get_num_threads(),
        )


class DecodeLayers:
    """The packed layer table of one model and KV cache; call it for each decode step.

    Args:
        layers: the layers' descriptions (tensors contiguous, on the CPU; see :class:`LayerDesc`).
        dims: (n_layers, hidden, n_heads, n_kv_heads, head_dim, intermediate).
        eps: the RMSNorm epsilon; scale: the attention softmax scale.
        join: read q/k/v, and gate/up, as one weight each where :meth:`_joined` can (the default; the
            results are the same bit for bit: members other than the last cover whole 16-row tiles, so
            each output row goes through the same tile code as alone).
    """

    def __init__(self, layers: list[LayerDesc], dims: tuple[int, ...], eps: float, scale: float, join: bool = True):
        self._keep: list[torch.Tensor] = []
        self._keep_structs: list = []  # the MoE structs (and per-expert tables) the table points to
        self._table = (_Layer * len(layers))()
        kinds: set[int] = set()
        for i, desc in enumerate(layers):
            row = self._table[i]
            for name, members in JOINED.items():  # before the members: their repacked tiles become views
                ds = [desc.linears[j] for j in members]
                joined = self._joined(ds) if join and None not in ds else None
                if joined is not None:
                    setattr(row, name, joined)
            for name, lin in zip(PROJECTIONS, desc.linears):
                if lin is not None:
                    setattr(row, name, self._linear(lin))
                    kinds.add(getattr(row, name).kind)
            if desc.moe is not None:
                row.moe = ctypes.pointer(self._moe(desc.moe, kinds))
            row.input_norm, row.post_norm = _ptr(desc.input_norm), _ptr(desc.post_norm)
            row.q_norm, row.k_norm = _ptr(desc.q_norm), _ptr(desc.k_norm)
            row.k_cache, row.v_cache = _ptr(desc.k_cache), _ptr(desc.v_cache)
            self._keep += [
                t
                for t in (desc.input_norm, desc.post_norm, desc.q_norm, desc.k_norm, desc.k_cache, desc.v_cache)
                if t is not None
            ]
        self._dims, self._eps, self._scale = dims, eps, scale
        # every projection bf16 or an integer dot: kernels that block many rows (see cpu_decode.MAX_STEP_ROWS)
        self.blocked = kinds <= {LINEAR_BF16, _INT8_DOT, _INT4_DOT}
        self._kv_dtype = kv_dtype_code(layers[0].k_cache.dtype)
        self._num_blocks, self._block_size = layers[0].k_cache.shape[1], layers[0].k_cache.shape[2]

    def _shape_args(self, M: int) -> tuple:
        """The model-shape arguments that begin both decode entry points (decode.c: layers, n_layers, M,
        hidden, hq, hk, d, inter, eps, scale, num_blocks, bs) for a step of ``M`` tokens."""
        n_layers, *dims = self._dims  # then hidden, hq, hk, d, inter
        table, blocks = ctypes.addressof(self._table), (self._num_blocks, self._block_size)
        return (table, n_layers, M, *dims, self._eps, self._scale, *blocks)

    def _moe(self, d: MoEDesc, kinds: set[int]) -> _Moe:
        """The C struct of one MoE MLP (kept referenced with its tensors); adds the experts' kinds to ``kinds``."""
        m = _Moe()
        E, hidden = d.router.shape
        m.num_experts, m.top_k, m.renormalize = E, d.top_k, int(d.renormalize)
        m.norm_min, m.correction_bias = d.norm_min, _ptr(d.correction_bias)
        m.router = self._linear(LinearDesc(LINEAR_F32, E, hidden, d.router))
        if d.experts is not None:
            m.inter = d.experts[0][0].n
            table = (_Linear * (3 * E))(*[self._linear(lin) for trio in d.experts for lin in trio])
            kinds.update(lin.kind for lin in table)
            m.experts = ctypes.cast(table, ctypes.POINTER(_Linear))
            self._keep_structs.append(table)
        else:
            m.inter = d.gate_up.shape[1] // 2
            kind = LINEAR_BF16 if d.gate_up.dtype == torch.bfloat16 else LINEAR_F32
            m.gate_up = self._linear(LinearDesc(kind, 2 * m.inter, hidden, d.gate_up[0]))
            m.down = self._linear(LinearDesc(kind, hidden, m.inter, d.down[0]))
            kinds.add(kind)
        if d.shared is not None:
            m.shared_inter = d.shared[0].n
            for name, lin in zip(("shared_gate_proj", "shared_up", "shared_down"), d.shared):
                setattr(m, name, self._linear(lin))
                kinds.add(getattr(m, name).kind)
        if d.shared_gate is not None:
            m.shared_gate = self._linear(d.shared_gate)
        self._keep += [t for t in (d.router, d.gate_up, d.down, d.correction_bias) if t is not None]
        self._keep_structs.append(m)
        return m

    def _joined(self, ds: list[LinearDesc]) -> _Linear | None:
        """One projection computing every member of ``ds`` (same input) into consecutive output columns,
        or None. Joined: integer-dot int8, or int4 of one group size and zero-point form, through
        :func:`repacked_together`; fp32 / bf16 / fp16 weights that already lie back to back in memory
        (the runtime places a layer's weights in read order) with row stride ``k``. Members other than the
        last must have a multiple of 16 rows (the kernels' tiles: a partial tile takes other code). Never
        with LoRA."""
        d0 = ds[0]
        if any(d.lora_a is not None or d.kind != d0.kind or d.k != d0.k for d in ds) or any(d.n % 16 for d in ds[:-1]):
            return None
        lin = _Linear()
        lin.kind, lin.n, lin.k = d0.kind, sum(d.n for d in ds), d0.k
        if d0.kind in (LINEAR_INT8, LINEAR_INT4):
            if not all(_takes_dot(d) and d.group_size == d0.group_size for d in ds):
                return None
            tiles = repacked_together([(d.w, d.scale, d.zero_point) for d in ds])
            if tiles is None:
                return None
            lin.groups, lin.group_size = (d0.scale.shape[1], d0.group_size) if d0.kind == LINEAR_INT4 else (0, 0)
            self._dot(lin, d0.kind, tiles, torch.cat([d.scale.float() for d in ds]) if d0.kind == LINEAR_INT8 else None)
        else:
            nxt = d0.w.data_ptr()
            for d in ds:  # back to back, rows of k elements
                if d.w.dtype != d0.w.dtype or not d.w.is_contiguous() or d.w.data_ptr() != nxt:
                    return None
                nxt += d.w.numel() * d.w.element_size()
            lin.w, lin.ldw = d0.w.data_ptr(), d0.k
            self._keep += [d.w for d in ds]
        if any(d.bias is not None for d in ds):
            bias = torch.cat([d.bias if d.bias is not None else torch.zeros(d.n) for d in ds])
            self._keep.append(bias)
            lin.bias = bias.data_ptr()
        return lin

    def _dot(self, lin: _Linear, kind: int, tiles: tuple, int8_scale: torch.Tensor | None) -> None:
        """Point ``lin`` (an int8 / int4 ``kind``) at integer-dot tiles (:func:`repacked` or
        :func:`repacked_together`); int8 reads ``int8_scale`` (fp32 per row) beside them."""
        self._keep += [t for t in (*tiles, int8_scale) if t is not None]
        lin.kind, lin.w, lin.ldw, lin.act_passes = (
            _INT8_DOT if kind == LINEAR_INT8 else _INT4_DOT,
            tiles[0].data_ptr(),
            0,
            int_dot_passes(),
        )
        if kind == LINEAR_INT8:
            lin.scale = int8_scale.data_ptr()
        else:
            lin.scale, lin.zero_point, lin.scaled_zero = tiles[1].data_ptr(), None, _ptr(tiles[2])
            lin.scale_bf16 = int(tiles[1].dtype == torch.bfloat16)

    def _linear(self, d: LinearDesc) -> _Linear:
        lin = _Linear()
        lin.kind, lin.n, lin.k, lin.w, lin.ldw = d.kind, d.n, d.k, d.w.data_ptr(), d.w.stride(0)
        dot = _takes_dot(d)  # the per-op path's choice too, on the same repacked tiles
        # the exact and int8 kernels read fp32 scales; int4 integer dots read the repacked tiles instead
        scale = None if d.scale is None or (dot and d.kind == LINEAR_INT4) else d.scale.float().contiguous()
        self._keep += [t for t in (scale,) if t is not None]
        lin.scale, lin.zero_point, lin.bias = _ptr(scale), _ptr(d.zero_point), _ptr(d.bias)
        if d.kind == LINEAR_INT4:
            lin.groups, lin.group_size = d.scale.shape[1], d.group_size
        if dot:
            self._dot(lin, d.kind, repacked(d.w, d.scale, d.zero_point), scale)
        if d.lora_a is not None:
            L, r, k = d.lora_a.shape
            ok = (
                k == d.k
                and d.lora_b.shape == (L, d.n, r)
                and d.lora_scale.shape == (L,)
                and all(t.dtype == torch.float32 and t.is_contiguous() for t in (d.lora_a, d.lora_b, d.lora_scale))
            )
            if not ok:
                raise ValueError(
                    f"LinearDesc: LoRA A {tuple(d.lora_a.shape)}, B {tuple(d.lora_b.shape)}, scale "
                    f"{tuple(d.lora_scale.shape)} do not fit a {d.k} -> {d.n} projection as contiguous fp32"
                )
            lin.lora_a, lin.lora_b, lin.lora_scale = _ptr(d.lora_a), _ptr(d.lora_b), _ptr(d.lora_scale)
            lin.lora_slots, lin.lora_r = L, r
        self._keep += [
            t for t in (d.w, d.scale, d.zero_point, d.bias, d.lora_a, d.lora_b, d.lora_scale) if t is not None
        ]
        return lin

    def __call__(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        lora_ids: torch.Tensor | None = None,
    ) -> None:
        """Run every layer on ``h`` in place.

        Args:
            h: (M, hidden) fp32 contiguous hidden states of M sequences' new tokens, updated in place.
            cos, sin: (M, head_dim) fp32 rotary tables of the tokens' positions.
            slot_mapping: (M,) int64 cache slot of each new token.
            block_tables: (M, W) int64 block ids per sequence.
            context_lens: (M,) int64 tokens in the cache per sequence, the new one included.
            lora_ids: (M,) int64 adapter slot per token (-1 = none; ids outside the stacks add nothing)
                for the projections described with a LoRA stack, or None: no adapter this step.
        Raises:
            MemoryError: the kernel's scratch buffers could not be allocated.
        """
        cache = _CacheArgs(slot_mapping, block_tables, context_lens, lora_ids)
        rc = library().baige_decode_layers(
            *self._shape_args(h.shape[0]), h.data_ptr(), cos.data_ptr(), sin.data_ptr(), *cache.args(self._kv_dtype)
        )
        if rc != 0:
            raise MemoryError("native decode step: could not allocate its scratch buffers")

    def step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        embed: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        final_norm: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        lora_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The whole step in one call (``baige_decode_step``): embedding rows, rotary rows, every layer,
        the final norm.

        Args:
            input_ids, positions: (M,) int64 the new tokens and their positions.
            embed: (vocab, hidden) fp32 or bf16 contiguous embedding table.
            cos_table, sin_table: (max_pos, head_dim) fp32 contiguous rotary rows by position.
            final_norm: (hidden,) fp32 weight of the last RMSNorm (the layers' epsilon).
            slot_mapping, block_tables, context_lens, lora_ids: as :meth:`__call__`.
        Returns:
            (M, hidden) fp32 normed final hidden states; None when a position is past the tables (grow
            them and call again: nothing was written). Raises ValueError for a token id outside the
            vocabulary, MemoryError when scratch memory cannot be allocated.
        """
        hidden = self._dims[1]
        M = input_ids.shape[0]
        ids, pos = input_ids.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        h, out = torch.empty(M, hidden), torch.empty(M, hidden)
        cache = _CacheArgs(slot_mapping, block_tables, context_lens, lora_ids)
        rc = library().baige_decode_step(
            *self._shape_args(M),
            embed.data_ptr(),
            int(embed.dtype == torch.bfloat16),
            embed.shape[0],
            ids.data_ptr(),
            pos.data_ptr(),
            cos_table.data_ptr(),
            sin_table.data_ptr(),
            cos_table.shape[0],
            final_norm.data_ptr(),
            h.data_ptr(),
            out.data_ptr(),
            *cache.args(self._kv_dtype),
        )
        if rc == -2:
            if bool(((ids < 0) | (ids >= embed.shape[0])).any()):
                raise ValueError(f"native decode step: a token id is outside the vocabulary of {embed.shape[0]}")
            return None
        if rc != 0:
            raise MemoryError("native decode step: could not allocate its scratch buffers")
        return out
