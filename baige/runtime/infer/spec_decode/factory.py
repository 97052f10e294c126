"""The engine's proposer from its ``speculative_config``."""

from __future__ import annotations

import torch

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.spec_decode.draft import DraftModelProposer, check_same_vocab
from baige.runtime.infer.spec_decode.mtp import MTPProposer
from baige.runtime.infer.spec_decode.ngram import NgramProposer
from baige.runtime.infer.spec_decode.proposer import Proposer
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.model.transformer import Transformer
from baige.runtime.weights.hub import resolve_model
from baige.runtime.weights.loader import load_model


def build_proposer(
    cfg: EngineConfig,
    max_model_len: int,
    tokenizer: Tokenizer,
    model: Transformer,
    num_blocks: int,
    kv_dtype: torch.dtype,
) -> Proposer | None:
    """None without ``cfg.speculative_config``; else its proposer.

    A draft model is loaded like the target (same dtype and device) and gets a KV pool of as many
    tokens as the target's plus k per sequence (its own memory, on top of ``kv_cache_memory``).

    Raises:
        BaigeError: method mtp on a model without MTP modules; the draft cannot be found or loaded,
        its vocabulary differs from the target's, or its context is shorter than ``max_model_len``.
    """
    sc = cfg.speculative_config
    if sc is None:
        return None
    k = sc.num_speculative_tokens
    if sc.method == "ngram":
        return NgramProposer(k, sc.prompt_lookup_max, sc.prompt_lookup_min)
    if sc.method == "mtp":
        return MTPProposer(model, k, model.config.vocab_size)
    try:
        draft_dir = resolve_model(sc.model)
    except BaigeError as e:
        raise BaigeError(f"--speculative-config: draft model: {e}", param="speculative_config") from None
    check_same_vocab(tokenizer, Tokenizer.from_dir(draft_dir))
    p = next(model.parameters())
    draft = load_model(draft_dir, p.dtype, p.device)
    blocks = num_blocks + cfg.max_num_seqs * -(-k // cfg.block_size) + 1
    return DraftModelProposer(
        draft,
        k,
        blocks,
        cfg.block_size,
        kv_dtype,
        cfg.max_num_seqs,
        max_model_len,
        model.config.vocab_size,
        cfg.enforce_eager,
    )
