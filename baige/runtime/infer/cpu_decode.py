"""A decode step in one native call on CPU (``baige/kernels/cpu/decode.c``).

For decode steps of an fp32 or bf16 model on CPU, and prefill chunks and mixed steps of up to
:data:`MAX_STEP_ROWS` token rows (:meth:`FusedDecoder.takes_rows`; each row a decode row of its own
context, so a chunk's causal mask is each row's context length), the engine's runner hands the whole layer stack to
``baige_decode_layers`` (:class:`baige.kernels.NativeDecodeLayers`): each layer's norms, projections (fp32
``nn.Linear``, or int8 / int4
``QuantizedLinear`` through the native weight-only kernels), RoPE, KV store, paged attention and MLP
run in C, the tensors read in place through the pointers gathered here; so do the embedding lookup,
the rotary rows (from tables by position) and the final norm where the model allows
(:class:`FusedDecoder`). ``lm_head`` is a second native call. The per-op path is unchanged and
remains the reference (``BAIGE_KERNELS=reference`` or ``BAIGE_CPU_DECODE=0`` select it); the
results agree up to accumulation order and SiLU's ``exp`` (tests/infer/test_cpu_decode.py).

What makes a model eligible (:meth:`FusedDecoder.build` says which check failed): every floating
parameter on the CPU in one dtype, fp32 or bf16 (ERNIE-4.5's fp32 routing bias aside); each layer's seven
projections an ``nn.Linear`` of that dtype, ``Fp16WeightLinear`` (``--quantization fp16-weight``) or
``QuantizedLinear`` (int8 per channel, or int4 with ``in_features`` and ``group_size`` multiples of 8) --
or, in a Mixture-of-Experts layer, the four attention projections (eligible as above) and a
``SparseMoeBlock`` whose experts (stacked fp32 / bf16 weights, or per-expert projections eligible as
above: quantized experts) and shared expert's projections are eligible, without LoRA stacks, top_k in
1..num_experts (:func:`_describe_moe`; the router runs in fp32); under interleaved RoPE (ERNIE-4.5)
plain fp32 / bf16 q and k projections (read as permuted copies, :func:`_head_dims_permuted`);
contiguous fp32, fp16 or bf16 KV pools (``kv_cache_dtype``); and the native library built.

Under a bf16 model the step keeps activations and the residual stream in fp32 (the kernel's only
activation dtype): bf16 weights are read as they are (vdpbf16ps over bf16-rounded activations on
AVX-512 BF16, exact widening elsewhere; ``bf16.c``), norm weights and biases are fp32 copies, the
K/V pools stay bf16 (rounded to nearest even on store, as torch rounds), and ``lm_head`` runs the
same bf16 kernel into fp32 logits. The per-op bf16 path rounds every activation to bf16, so the two
agree to bf16 precision, not bit for bit (tests/infer/test_cpu_decode.py).

Multi-LoRA serving: a projection carrying a serving stack (``module.lora_stack``, fp32, see
:func:`baige.runtime.model.lora.attach_lora_stack`) is described with it, and a step passes each
token's adapter slot (``lora_ids``): the kernel adds the adapters' terms itself, grouped by adapter.
The table points at the stacks present when it was built; the runner rebuilds it after the loaded
adapters change. A training adapter (``lora_A``) makes a projection ineligible.
"""

from __future__ import annotations

import torch
from torch import nn

from baige import kernels
from baige.runtime.infer.kv_cache import KVCache
from baige.runtime.model.moe import SparseMoeBlock
from baige.runtime.model.transformer import Transformer
from baige.runtime.quant.experts import QuantizedExperts
from baige.runtime.quant.fp16_weight import Fp16WeightLinear
from baige.runtime.quant.linear import QuantizedLinear
from baige.runtime.settings import settings

# Prefill chunks and mixed steps of at most this many token rows run through the native step too (each
# row a decode row of its own context; the runner's _run_mixed); larger ones keep the per-op path, whose
# GEMMs (oneDNN, MKL) block for many rows. The limits are where the native step stops beating the per-op
# path on a prefill: integer-dot and bf16 projections up to a few hundred rows, fp32 weights only up to a
# few dozen (MKL's sgemm wins past that); measured: docs/benchmarks/archive.md.
MAX_STEP_ROWS = 256  # integer-dot and bf16 projections
MAX_STEP_ROWS_FP32 = 32  # fp32 / fp16 weights, or the exact int8/int4 kernels


class FusedDecoder:
    """The native decode step for one model and KV cache (build with :meth:`build`).

    The kernel's layer table points into the model's and the cache's own storage; every tensor
    it points to (weights, norms, biases, pools, the unpacked int4 zero points made here and the fp32
    scale copies made by the kernel's table) stays referenced by it, so swapping a module afterwards leaves stale
    values,
    never a dangling pointer; build a new decoder after changing the model.
    """

    def __init__(self, model: Transformer, layers: kernels.NativeDecodeLayers, kv_k: torch.Tensor):
        self.model, self._layers, self._kv_k = model, layers, kv_k
        # The whole step in C (kernels.NativeDecodeLayers.step) when the embedding is a plain table and
        # the rotary rows do not depend on the sequence length (not "dynamic" NTK): the embedding rows,
        # the rotary rows (a table by position, computed here by the model's own rotary module so its
        # values are the per-op path's) and the final norm then cost no PyTorch ops per step.
        emb, norm = model.model.embed_tokens, model.model.norm
        self._whole = (
            type(emb) is nn.Embedding
            and emb.weight.is_contiguous()
            and not model.rotary_emb.dynamic
            and norm.eps == model.model.layers[0].input_layernorm.eps
        )
        self._final_norm = _f32(norm.weight) if self._whole else None
        if self._whole:
            self._grow_rope(torch.zeros(1, dtype=torch.int64))

    def _grow_rope(self, positions: torch.Tensor) -> None:
        """Rotary tables covering ``positions`` (next power of two, at least 1024 rows)."""
        n = max(1024, 1 << int(positions.max()).bit_length())
        cos, sin = self.model.rotary_emb(torch.arange(n), torch.float32)
        self._cos, self._sin = cos.contiguous(), sin.contiguous()

    @classmethod
    def build(cls, model: Transformer, kv: KVCache) -> tuple["FusedDecoder | None", str]:
        """``(decoder, "")`` when the model is eligible (module docstring), else ``(None, why)``."""
        if not settings().cpu_decode or not kernels.native_allowed():
            return None, "disabled (BAIGE_CPU_DECODE=0 or BAIGE_KERNELS set)"
        if model.config.mla is not None:
            return None, "Multi-head Latent Attention (deepseek) runs on the per-op path"
        if model.config.gemma is not None:
            return None, "Gemma's (1 + w) norms, GeGLU MLP and soft-caps are not in the native step"
        dtype = model.model.embed_tokens.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16):
            return None, f"the model is {dtype}, not fp32 or bf16"
        for name, t in model.named_parameters():
            if name.endswith("e_score_correction_bias"):  # ERNIE-4.5's routing bias is fp32 in every model dtype
                continue
            if t.device.type != "cpu" or t.dtype != dtype:
                return None, f"{name} is {t.dtype} on {t.device.type}, not {dtype} on the CPU"
        if kv.k[0].device.type != "cpu" or kv.k[0].dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return None, "the KV cache is not fp32, fp16 or bf16 on the CPU"
        if not kernels.native_cpu_available():
            return None, "the native CPU library is not available"
        descs = []
        for i, layer in enumerate(model.model.layers):
            desc, why = _describe_layer(i, layer, kv)
            if desc is None:
                return None, why
            descs.append(desc)
        head = model.lm_head
        if type(head) is nn.Linear and head.weight.dtype in (torch.float32, torch.bfloat16):
            _to_arena(head.weight)  # read right after the last layer (logits)
        c = model.config
        dims = (
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.intermediate_size,
        )
        layer0 = model.model.layers[0]
        table = kernels.NativeDecodeLayers(
            descs, dims, float(layer0.input_layernorm.eps), float(layer0.self_attn.scale)
        )
        return cls(model, table, kv.k[0]), ""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        lora_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step.

        Args:
            input_ids, positions: (1, M) int64, the new token of each of M sequences and its position.
            slot_mapping: (M,) int64 cache slot of each new token.
            block_tables: (M, W) int64 block ids per sequence (padding beyond its context is not read).
            context_lens: (M,) int64 tokens in the cache per sequence, the new one included.
            lora_ids: (M,) int64 adapter slot of each token (-1 = none) in the LoRA stacks this decoder
                was built with, or None (no adapter this step).
        Returns:
            (1, M, hidden) fp32 final hidden states (after the last norm), as ``Transformer.forward``
            (whose result is in the model's dtype).
        Raises:
            MemoryError: the kernel's scratch buffers could not be allocated.
        """
        model = self.model
        if self._whole:

            def step():
                return self._layers.step(
                    input_ids[0],
                    positions[0],
                    model.model.embed_tokens.weight,
                    self._cos,
                    self._sin,
                    self._final_norm,
                    slot_mapping,
                    block_tables,
                    context_lens,
                    lora_ids,
                )

            out = step()
            if out is None:  # a position past the rotary tables
                if int(positions.min()) < 0:
                    raise ValueError(f"native decode step: negative position {int(positions.min())}")
                self._grow_rope(positions)
                out = step()
            return out[None]
        h = model.model.embed_tokens(input_ids)[0].float().contiguous()  # (M, hidden) fp32, a fresh copy
        cos, sin = model.rotary_emb(positions, torch.float32)  # (1, M, head_dim)
        self._layers(h, cos[0].contiguous(), sin[0].contiguous(), slot_mapping, block_tables, context_lens, lora_ids)
        return model.model.norm(h)[None]

    def takes_rows(self, rows: int, longest_prefill: int) -> bool:
        """Whether a step of ``rows`` token rows (decodes and prefill chunks, each row with its own
        context) should run natively: at most :data:`MAX_STEP_ROWS` rows (:data:`MAX_STEP_ROWS_FP32` unless
        every projection is integer-dot or bf16), and no prefill chunk whose context (``longest_prefill``
        tokens, its last row's) has K + V per KV head beyond ``kernels.NATIVE_ATTENTION_MAX_BYTES``: each of
        its rows streams its whole context (decode rows have no such limit, as in decode-only steps).

        Under a bf16 model the native step keeps activations in fp32 where the per-op path rounds them to
        bf16, so a sequence's prefill logits (and prompt logprobs) depend, at bf16 precision, on whether
        its step ran natively, which depends on the step's other rows."""
        k = self._kv_k
        kv_bytes = longest_prefill * k.shape[-1] * 2 * k.element_size()
        return (
            rows <= (MAX_STEP_ROWS if self._layers.blocked else MAX_STEP_ROWS_FP32)
            and kv_bytes <= kernels.NATIVE_ATTENTION_MAX_BYTES
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(M, hidden) fp32 -> (M, vocab) logits; an fp32 or bf16 ``lm_head`` runs the native kernel (one
        read of its weight for all M rows: a speculating sequence's k + 1 rows cost about one row), into
        fp32 logits."""
        head = self.model.lm_head
        if type(head) is torch.nn.Linear and head.weight.dtype in (torch.float32, torch.bfloat16):
            bias = None if head.bias is None else head.bias.float()
            return kernels.dense_linear(hidden.contiguous(), head.weight, bias)
        return self.model.compute_logits(hidden)


def _describe(mod: nn.Module) -> tuple[kernels.DecodeLinearDesc | None, str]:
    """The kernel's description of one projection (with its LoRA serving stack), or (None, why not)."""
    if hasattr(mod, "lora_A"):
        return None, "it has a training LoRA adapter"
    bias = getattr(mod, "bias", None)
    if type(mod) is nn.Linear:
        w = mod.weight
        if w.dtype not in (torch.float32, torch.bfloat16) or w.stride(-1) != 1:
            return None, "an fp32 or bf16 nn.Linear with a row-major weight is needed"
        w = _to_arena(w)
        kind = kernels.LINEAR_F32 if w.dtype == torch.float32 else kernels.LINEAR_BF16
        desc = kernels.DecodeLinearDesc(kind, mod.out_features, mod.in_features, w)
    elif isinstance(mod, Fp16WeightLinear):
        desc = kernels.DecodeLinearDesc(kernels.LINEAR_F16, mod.out_features, mod.in_features, mod.weight_fp16)
        bias = mod.bias_fp32
    elif isinstance(mod, QuantizedLinear):
        scheme = mod.scheme
        scale = mod.weight_scale.contiguous()  # fp32 or bf16 (the model's), as the per-op path passes it
        if scheme.num_bits == 8:
            desc = kernels.DecodeLinearDesc(kernels.LINEAR_INT8, mod.out_features, mod.in_features, mod.weight, scale)
        else:
            if mod.in_features % 8 or scheme.group_size % 8:
                return None, "int4 needs in_features and group_size multiples of 8"
            zp = mod.zero_point()
            zp = None if zp is None else zp.to(torch.int32).contiguous()
            desc = kernels.DecodeLinearDesc(
                kernels.LINEAR_INT4, mod.out_features, mod.in_features, mod.weight_packed, scale, zp, scheme.group_size
            )
    else:
        return None, f"{type(mod).__name__} has no native kernel"
    if bias is not None:
        desc.bias = bias.detach().float().contiguous()
    stack = getattr(mod, "lora_stack", None)
    if stack is not None:
        a, b, scale = stack[:3]
        if a.dtype != torch.float32 or b.dtype != torch.float32:
            return None, f"its LoRA stack is {a.dtype}, not fp32"
        desc.lora_a, desc.lora_b, desc.lora_scale = a.contiguous(), b.contiguous(), scale.float().contiguous()
    return desc, ""


def _head_dims_permuted(d: kernels.DecodeLinearDesc, perm: torch.Tensor, heads: int) -> kernels.DecodeLinearDesc | None:
    """A copy of the fp32 / bf16 projection ``d`` whose output rows are each head's dims in ``perm`` order
    (row h * D + i of the copy = row h * D + perm[i]), or None for other kinds or with LoRA. Interleaved
    RoPE (ERNIE-4.5) is half-split RoPE on q and k permuted so (model/transformer.py's ``rope_perm``; q.k
    is unchanged and the cache holds the permuted keys, as on the per-op path), so the native step reads
    q and k projections permuted once at build (one more copy of those two weights)."""
    if d.kind not in (kernels.LINEAR_F32, kernels.LINEAR_BF16) or d.lora_a is not None:
        return None
    D = perm.numel()
    cached = getattr(d.w, "_baige_head_perm", None)  # one copy per weight version: rebuilds (LoRA) reuse it
    if cached is None or cached[0] != d.w._version:
        cached = (d.w._version, kernels.to_weight_arena(d.w.detach().view(heads, D, d.k)[:, perm].reshape(d.n, d.k)))
        d.w._baige_head_perm = cached
    out = kernels.DecodeLinearDesc(d.kind, d.n, d.k, cached[1])
    if d.bias is not None:
        out.bias = d.bias.view(heads, D)[:, perm].reshape(-1).contiguous()
    return out


def _describe_all(parent: nn.Module, names, label: str) -> tuple[tuple | None, str]:
    """:func:`_describe` of each named child: (their descriptions, "") or (None, "<label><name>: why")."""
    out = []
    for name in names:
        lin, why = _describe(getattr(parent, name))
        if lin is None:
            return None, f"{label}{name}: {why}"
        out.append(lin)
    return tuple(out), ""


def _describe_layer(i: int, layer: nn.Module, kv: KVCache) -> tuple["kernels.DecodeLayerDesc | None", str]:
    """Layer ``i``'s native description (its projections, norms and KV pools), or ``(None, why)`` when the
    native step cannot run it."""
    a, m = layer.self_attn, layer.mlp
    if any(getattr(a, name, None) is not None for name in ("sliding_window", "sinks", "softcap")):
        return None, f"layer {i}: a sliding window, sinks or soft-capping (the native step has none)"
    moe = None
    if isinstance(m, SparseMoeBlock):
        moe, why = _describe_moe(m)
        if moe is None:
            return None, f"layer {i} Mixture-of-Experts: {why}"
        mods = (a.q_proj, a.k_proj, a.v_proj, a.o_proj)
    else:
        mods = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
    linears = []
    for name, mod in zip(kernels.DECODE_PROJECTIONS, mods):
        lin, why = _describe(mod)
        if lin is None:
            return None, f"layer {i} {name}_proj: {why}"
        linears.append(lin)
    linears += [None] * (len(kernels.DECODE_PROJECTIONS) - len(linears))
    norms = [_f32(n.weight) if n is not None else None for n in (a.q_norm, a.k_norm)]
    if a.rope_perm is not None:  # interleaved RoPE: q and k computed in the permuted order, as below
        perm = torch.tensor(a.rope_perm)
        for j, heads in ((0, a.n_heads), (1, a.n_kv_heads)):
            linears[j] = _head_dims_permuted(linears[j], perm, heads)
            if linears[j] is None:
                return None, (
                    f"layer {i}: interleaved RoPE takes the native step with plain fp32 / bf16 q and k projections only"
                )
        norms = [None if w is None else w[perm].contiguous() for w in norms]
    if not (kv.k[i].is_contiguous() and kv.v[i].is_contiguous()):
        return None, "a KV pool is not contiguous"
    return (
        kernels.DecodeLayerDesc(
            linears,
            _f32(layer.input_layernorm.weight),
            _f32(layer.post_attention_layernorm.weight),
            *norms,
            kv.k[i],
            kv.v[i],
            moe,
        ),
        "",
    )


def _describe_moe(m: SparseMoeBlock) -> tuple[kernels.DecodeMoEDesc | None, str]:
    """The kernel's description of a sparse MoE block (router in fp32, the stacked experts' fp32 / bf16
    weights read in place, the shared expert's projections), or (None, why not)."""
    E = m.gate.weight.shape[0]
    per_expert = isinstance(m.experts, QuantizedExperts)
    biased = m.experts.has_bias if per_expert else m.experts.gate_up_proj_bias is not None
    if m.gate.bias is not None or biased or m.experts.swiglu_limit is not None:
        return None, "a biased router and biased, clamped-SwiGLU experts (gpt_oss) run on the per-op path"
    if not 1 <= m.top_k <= E:
        return None, f"top_k {m.top_k} is outside 1..{E} experts"
    if any(getattr(mod, "lora_stack", None) is not None for mod in m.modules()):
        return None, "LoRA adapters on its projections run on the per-op path"
    bias = m.moe_statics.e_score_correction_bias[0] if m.moe_statics is not None else None
    desc = kernels.DecodeMoEDesc(
        _f32(m.gate.weight), None, None, m.top_k, m.renormalize, float(m.norm_min), None if bias is None else _f32(bias)
    )
    if per_expert:  # per-expert projections (quantized, or float ones kept)
        desc.experts = []
        for j, expert in enumerate(m.experts):
            trio, why = _describe_all(expert, expert.names, f"expert {j} ")
            if trio is None:
                return None, why
            desc.experts.append(trio)
    else:
        gate_up, down = getattr(m.experts, "gate_up_proj", None), getattr(m.experts, "down_proj", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
            return None, f"its experts ({type(m.experts).__name__}) have no native kernel"
        if gate_up.dtype not in (torch.float32, torch.bfloat16) or not (
            gate_up.is_contiguous() and down.is_contiguous()
        ):
            return None, "the stacked experts are not contiguous fp32 / bf16"
        desc.gate_up, desc.down = _to_arena(gate_up).detach(), _to_arena(down).detach()
    shared = m.shared_expert if m.shared_expert is not None else m.shared_experts
    if shared is not None:
        desc.shared, why = _describe_all(shared, ("gate_proj", "up_proj", "down_proj"), "shared expert ")
        if desc.shared is None:
            return None, why
    if m.shared_expert_gate is not None:
        desc.shared_gate, why = _describe(m.shared_expert_gate)
        if desc.shared_gate is None:
            return None, f"shared_expert_gate: {why}"
    return desc, ""


def place_weights(model: Transformer) -> None:
    """Move the plain linear weights a decode step streams (each layer's projections, then ``lm_head``) into the
    huge-page arena in the order a step reads them, as :meth:`FusedDecoder.build` does for its kernel: for steps
    that run per op (batch-invariant mode). Values and parameters are unchanged."""
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for mod in (
            a.q_proj,
            a.k_proj,
            a.v_proj,
            a.o_proj,
            *(getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")),
        ):
            if type(mod) is nn.Linear:
                _to_arena(mod.weight)
    if type(model.lm_head) is nn.Linear:
        _to_arena(model.lm_head.weight)


def _to_arena(p: torch.Tensor) -> torch.Tensor:
    """Move a weight the step streams into the huge-page arena (``kernels.to_weight_arena``), in the
    order the step reads them: the parameter keeps its identity and values, its storage is replaced
    (the old one is freed), once per parameter."""
    if not getattr(p, "_baige_arena", False) and p.is_contiguous():
        with torch.no_grad():
            p.data = kernels.to_weight_arena(p.data)
        p._baige_arena = True
    return p


def _f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when fp32 and contiguous (the table then reads the parameter in place), else an fp32
    contiguous copy (the norm weights of a bf16 model)."""
    return t.detach().float().contiguous()
