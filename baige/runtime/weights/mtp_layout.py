"""DeepSeek-V3's checkpoint names for the multi-token-prediction modules (:mod:`baige.runtime.model.mtp`).

The published layout (DeepSeek-V3's ``model.safetensors.index.json``; vLLM's ``deepseek_mtp.py``) keeps
MTP module k (k = 0 .. D-1) as one more layer past the main stack, ``model.layers.{L + k}.`` with
``L = num_hidden_layers``:

- ``enorm.weight``, ``hnorm.weight``, ``eh_proj.weight``, ``shared_head.norm.weight``: the module's own;
- ``embed_tokens.weight``, ``shared_head.head.weight``: copies of the shared embedding and output head;
- everything else (``input_layernorm``, ``self_attn.*``, ``mlp.*``, ...): the decoder block.

baige holds module k as ``mtp.{k}.`` (the block under ``mtp.{k}.block.``) and shares the embedding and
head, so loading drops the copies after checking they equal the main model's, and export writes them.
transformers' causal LMs ignore these tensors on load (layers past ``num_hidden_layers`` are unexpected
keys it skips).
"""

from __future__ import annotations

import torch

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig

OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def hf_prefix(cfg: ModelConfig, k: int) -> str:
    """The published name prefix of MTP module ``k`` (0-based)."""
    return f"model.layers.{cfg.num_hidden_layers + k}."


def has_mtp(names, cfg: ModelConfig) -> bool:
    """Whether any tensor name in ``names`` (published layout) belongs to an MTP module of ``cfg``."""
    prefixes = tuple(hf_prefix(cfg, k) for k in range(cfg.mtp_depth))
    return bool(prefixes) and any(n.startswith(prefixes) for n in names)


def to_internal(state: dict, cfg: ModelConfig, where: str = "checkpoint") -> dict:
    """Rename the MTP modules' tensors to baige's ``mtp.{k}.`` and drop the copies of the shared
    embedding and head; returns a new dict (values untouched: tensors or header records).

    Raises:
        BaigeError: a copy of the embedding or head (a real tensor) differs from the main model's:
        baige shares them, as the paper does.
    """
    if not cfg.mtp_depth:
        return state
    out = {}
    for name, value in state.items():
        k = _depth_of(name, cfg)
        if k is None:
            out[name] = value
            continue
        rest = name[len(hf_prefix(cfg, k)) :]
        if rest in SHARED:
            _check_shared(state, name, SHARED[rest], cfg, where)
        elif rest.startswith(OWN):
            out[f"mtp.{k}.{rest}"] = value
        else:
            out[f"mtp.{k}.block.{rest}"] = value
    return out


def to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_internal`: ``mtp.{k}.`` tensors under the published names, with the
    embedding and head copies DeepSeek-V3's layout has; returns a new dict."""
    out = {}
    depths = set()
    for name, value in state.items():
        if not name.startswith("mtp."):
            out[name] = value
            continue
        _, k, rest = name.split(".", 2)
        depths.add(int(k))
        out[hf_prefix(cfg, int(k)) + rest.removeprefix("block.")] = value
    head = state.get("lm_head.weight", state.get("model.embed_tokens.weight"))
    for k in sorted(depths):  # copies: safetensors refuses tensors that share memory
        out[hf_prefix(cfg, k) + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        out[hf_prefix(cfg, k) + "shared_head.head.weight"] = head.clone()
    return out


def _depth_of(name: str, cfg: ModelConfig) -> int | None:
    for k in range(cfg.mtp_depth):
        if name.startswith(hf_prefix(cfg, k)):
            return k
    return None


def _check_shared(state: dict, copy: str, main: str, cfg: ModelConfig, where: str) -> None:
    if main == "lm_head.weight" and cfg.tie_word_embeddings:
        main = "model.embed_tokens.weight"
    a, b = state[copy], state.get(main)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.is_meta or b.is_meta:
        return
    if a.shape != b.shape or not torch.equal(a, b):
        raise BaigeError(f"{where}: {copy} differs from {main}; baige shares the MTP embedding and head")
