"""A decode step in one native call on CPU (``baige/kernels/cpu/decode.c``).

For decode-only steps of an fp32 model on CPU the engine's runner hands the whole layer stack to
``baige_decode_layers``: each layer's norms, projections (fp32 ``nn.Linear``, or int8 / int4
``QuantizedLinear`` through the native weight-only kernels), RoPE, KV store, paged attention and MLP
run in C, the tensors read in place through the pointers gathered here. Only the embedding lookup,
the rotary tables, the final norm and ``lm_head`` stay in PyTorch. The per-op path is unchanged and
remains the reference (``BAIGE_KERNELS=reference`` or ``BAIGE_CPU_DECODE=0`` select it); the
results agree up to accumulation order and SiLU's ``exp`` (tests/test_cpu_decode.py).

What makes a model eligible (:meth:`FusedDecoder.build` says which check failed): every parameter
fp32 on the CPU, each layer's seven projections fp32 ``nn.Linear``, ``Fp16WeightLinear``
(``--quantization fp16-weight``) or ``QuantizedLinear`` (int8 per channel, or int4 with
``in_features`` and ``group_size`` multiples of 8), contiguous fp32 or fp16 KV pools
(``kv_cache_dtype``), and the native library built.
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

from baige.runtime.kv_cache import KVCache
from baige.runtime.model import Transformer
from baige.runtime.quant import QuantizedLinear
from baige.runtime.quant_dynamic import Fp16WeightLinear

_F32, _INT8, _INT4, _F16 = 0, 1, 2, 3
_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _i64), ("n", _i64), ("k", _i64), ("w", _p), ("ldw", _i64), ("scale", _p),
                ("zero_point", _p), ("groups", _i64), ("group_size", _i64), ("bias", _p)]


_PROJ = ("q", "k", "v", "o", "gate", "up", "down")


class _Layer(ctypes.Structure):
    _fields_ = [(name, _Linear) for name in _PROJ] + [
        ("input_norm", _p), ("post_norm", _p), ("q_norm", _p), ("k_norm", _p), ("k_cache", _p), ("v_cache", _p)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecoder:
    """The native decode step for one model and KV cache (build with :meth:`build`).

    The structs point into the model's and the cache's own storage. Every tensor they point to
    (weights, norms, biases, pools, and the fp32 scale copies / unpacked int4 zero points made here)
    is referenced from ``self._keep``, so swapping a module afterwards leaves stale values, never a
    dangling pointer; build a new decoder after changing the model.
    """

    def __init__(self, model: Transformer, kv: KVCache, layers: ctypes.Array, keep: list):
        self.model, self.kv, self._layers, self._keep = model, kv, layers, keep
        c = model.config
        self._dims = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                      c.intermediate_size)
        self._eps = float(model.model.layers[0].input_layernorm.eps)
        self._scale = float(model.model.layers[0].self_attn.scale)

    @classmethod
    def build(cls, model: Transformer, kv: KVCache) -> tuple["FusedDecoder | None", str]:
        """``(decoder, "")`` when the model is eligible (module docstring), else ``(None, why)``."""
        from baige.kernels.cpu import library, native_allowed

        if os.environ.get("BAIGE_CPU_DECODE", "1") == "0" or not native_allowed():
            return None, "disabled (BAIGE_CPU_DECODE=0 or BAIGE_KERNELS set)"

        for name, t in model.named_parameters():
            if t.device.type != "cpu" or t.dtype != torch.float32:
                return None, f"{name} is {t.dtype} on {t.device.type}, not fp32 on the CPU"
        if kv.k[0].device.type != "cpu" or kv.k[0].dtype not in (torch.float32, torch.float16):
            return None, "the KV cache is not fp32 or fp16 on the CPU"
        if library() is None:
            return None, "the native CPU library is not available"
        keep: list = []
        layers = (_Layer * len(model.model.layers))()
        for i, layer in enumerate(model.model.layers):
            a, m = layer.self_attn, layer.mlp
            mods = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            for name, mod in zip(_PROJ, mods):
                lin, why = _describe(mod, keep)
                if lin is None:
                    return None, f"layer {i} {name}_proj: {why}"
                setattr(layers[i], name, lin)
            L = layers[i]
            L.input_norm, L.post_norm = _ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight)
            L.q_norm = _ptr(a.q_norm.weight) if a.q_norm is not None else None
            L.k_norm = _ptr(a.k_norm.weight) if a.k_norm is not None else None
            for t in (kv.k[i], kv.v[i]):
                if not t.is_contiguous():
                    return None, "a KV pool is not contiguous"
            L.k_cache, L.v_cache = _ptr(kv.k[i]), _ptr(kv.v[i])
            keep += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, kv.k[i], kv.v[i]]
            keep += [n.weight for n in (a.q_norm, a.k_norm) if n is not None]
        return cls(model, kv, layers, keep), ""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """One decode step.

        Args:
            input_ids, positions: (1, M) int64, the new token of each of M sequences and its position.
            slot_mapping: (M,) int64 cache slot of each new token.
            block_tables: (M, W) int64 block ids per sequence (padding beyond its context is not read).
            context_lens: (M,) int64 tokens in the cache per sequence, the new one included.
        Returns:
            (1, M, hidden) fp32 final hidden states (after the last norm), as ``Transformer.forward``.
        Raises:
            MemoryError: the kernel's scratch buffers could not be allocated.
        """
        from baige.kernels.cpu import library

        model = self.model
        h = model.model.embed_tokens(input_ids)[0].contiguous()  # (M, hidden), a fresh copy
        cos, sin = model.rotary_emb(positions, h.dtype)  # (1, M, head_dim)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        slots = slot_mapping.contiguous()
        tables, lens = block_tables.contiguous(), context_lens.contiguous()
        n_layers, hidden, hq, hk, d, inter = self._dims
        kv = self.kv
        rc = library().baige_decode_layers(
            ctypes.addressof(self._layers), n_layers, h.shape[0], hidden, hq, hk, d, inter, self._eps, self._scale,
            kv.k[0].shape[1], kv.block_size, h.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.shape[1], lens.data_ptr(), kv.k[0].dtype == torch.float16, torch.get_num_threads())
        if rc != 0:
            raise MemoryError("native decode step: could not allocate its scratch buffers")
        return model.model.norm(h)[None]


def _describe(mod: nn.Module, keep: list) -> tuple[_Linear | None, str]:
    """The C descriptor of one projection, or (None, why not)."""
    lin = _Linear()
    bias = getattr(mod, "bias", None)
    if type(mod) is nn.Linear:
        w = mod.weight
        if w.dtype != torch.float32 or w.stride(-1) != 1:
            return None, "an fp32 nn.Linear with a row-major weight is needed"
        lin.kind, lin.w, lin.ldw = _F32, w.data_ptr(), w.stride(0)
        keep.append(w)
    elif isinstance(mod, Fp16WeightLinear):
        lin.kind, lin.w, lin.ldw = _F16, mod.weight_fp16.data_ptr(), mod.weight_fp16.stride(0)
        keep.append(mod.weight_fp16)
        bias = mod.bias_fp32
    elif isinstance(mod, QuantizedLinear):
        scheme = mod.scheme
        scale = mod.weight_scale.float().contiguous()
        keep.append(scale)
        keep += [mod.weight if scheme.num_bits == 8 else mod.weight_packed]
        if scheme.num_bits == 8:
            lin.kind, lin.w, lin.ldw = _INT8, mod.weight.data_ptr(), mod.weight.stride(0)
        else:
            if mod.in_features % 8 or scheme.group_size % 8:
                return None, "int4 needs in_features and group_size multiples of 8"
            lin.kind, lin.w, lin.ldw = _INT4, mod.weight_packed.data_ptr(), mod.weight_packed.stride(0)
            lin.groups, lin.group_size = scale.shape[1], scheme.group_size
            zp = mod.zero_point()
            if zp is not None:
                zp = zp.to(torch.int32).contiguous()
                keep.append(zp)
                lin.zero_point = zp.data_ptr()
        lin.scale = scale.data_ptr()
    else:
        return None, f"{type(mod).__name__} has no native kernel"
    if bias is not None:
        b = bias.detach().float().contiguous()
        keep.append(b)
        lin.bias = b.data_ptr()
    lin.n, lin.k = mod.out_features, mod.in_features
    return lin, ""
