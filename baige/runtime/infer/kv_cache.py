"""The paged KV-cache tensors: per layer, a pool of fixed-size blocks allocated once.

Which block holds which tokens is decided by :class:`baige.runtime.infer.block_manager.BlockManager`
(plain Python); this module only owns the memory and sizes it.
"""

from __future__ import annotations

import logging

import torch

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.model.config import ModelConfig, kv_cache_dims
from baige.runtime.model.device import available_memory

logger = logging.getLogger("baige.engine")

KV_CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_KV_FRACTION = 0.1  # default share of available RAM for the cache on CPU
GPU_KV_FRACTION = 0.9  # default share of free GPU memory after warm-up (vLLM's gpu_memory_utilization)


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


class KVCache:
    """K and V pools, each layer ``(n_kv_heads, num_blocks + 1, block_size, head_dim)`` (the layout of
    ``baige.kernels``' paged ops: heads outermost).

    Block ``num_blocks`` (the last) is a scratch block the block manager never hands out: padded
    rows of a fixed-shape decode batch write their K/V there. Pools are zero-filled so padded,
    masked reads never meet NaNs; on the CPU with fresh zero pages from the OS
    (:func:`baige.kernels.zeroed_pages`), allocated as blocks are first written, so start-up does not
    touch the whole pool.

    Args:
        cfg: the model's config.
        num_blocks: usable blocks.
        block_size: token slots per block.
        dtype: cache dtype (the model's, or ``--kv-cache-dtype``: :func:`resolve_kv_cache_dtype`).
        device: where the pool lives.
        num_sliding_blocks: None: every layer's pool has ``num_blocks`` blocks. Else the sliding-window
            layers (``cfg.layer_window(i)`` set: ``sliding_layers``) get pools of that many blocks (plus
            their scratch block ``sliding_scratch``), indexed by the sequences' ``sliding_table``
            (``sliding_blocks.py``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_sliding_blocks: int | None = None,
    ):
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.scratch_block = num_blocks
        self.device = torch.device(device)
        heads, head_dim = kv_cache_dims(cfg)
        self._shape = (heads, num_blocks + 1, block_size, head_dim)
        # MLA: one pool per layer, V is K's latent columns (kernels.mla); its expanded cache: K and V pools
        self._latent = cfg.mla is not None and not cfg.mla.expanded_cache
        self._layers = cfg.num_hidden_layers
        self.sliding_window = cfg.sliding_window if num_sliding_blocks is not None else None
        self.sliding_layers = frozenset(
            i for i in range(self._layers) if num_sliding_blocks is not None and cfg.layer_window(i) is not None
        )
        self.num_sliding_blocks = self.sliding_scratch = num_sliding_blocks or 0
        self._sliding_shape = (cfg.num_key_value_heads, self.num_sliding_blocks + 1, block_size, cfg.head_dim)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.allocate()

    def allocate(self) -> None:
        """(Re)create the pools, zero-filled (the engine's ``wake_up``): every block's K/V is gone."""
        on_cpu = self.device.type == "cpu"

        def pool(i: int) -> torch.Tensor:
            shape = self._sliding_shape if i in self.sliding_layers else self._shape
            if on_cpu:
                return kernels.zeroed_pages(shape, self.dtype)
            return torch.zeros(shape, dtype=self.dtype, device=self.device)

        self.k = [pool(i) for i in range(self._layers)]
        self.v = self.k if self._latent else [pool(i) for i in range(self._layers)]

    def release(self) -> None:
        """Drop the pools (the engine's ``sleep``): their memory goes back to the OS (CPU: the pools'
        own mappings) or to the CUDA caching allocator, which hands it back to the driver here, once
        nothing else references them (a native decode table does: drop it first)."""
        self.k, self.v = [], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy every layer's K and V of block ``src`` into block ``dst`` for each ``(src, dst)`` (the block
        manager's copy-on-write of a forked sequence's shared block); the ``dst`` are distinct and never a
        ``src``. Block ids index the full-attention pools.

        Raises:
            RuntimeError: the sliding-window layers have a pool of their own (their tables are not forked).
        """
        if not pairs:
            return
        if self.sliding_layers:
            raise RuntimeError("copy_blocks: the sliding-window layers' pools are not indexed by these blocks")
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long, device=self.device)
        for pools in (self.k,) if self.v is self.k else (self.k, self.v):
            for pool in pools:
                pool.index_copy_(1, dst, pool.index_select(1, src))

    @property
    def allocated(self) -> bool:
        """Whether the pools exist (False between :meth:`release` and :meth:`allocate`)."""
        return bool(self.k)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, K and V."""
        return block_size * cfg.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV-cache dtype for ``--kv-cache-dtype`` (vLLM's option): ``auto`` is the model's dtype.

    On CPU any of float32 / float16 / bfloat16 works under any model dtype (K/V are rounded when
    stored and read back converted; the native kernels read an fp16 cache under an fp32 model at half
    the memory traffic of fp32). The Triton kernels need the model's dtype.

    Raises:
        BaigeError: an unknown name, or a dtype other than the model's on CUDA.
    """
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise BaigeError(f"unknown --kv-cache-dtype {name!r} (choose auto, {', '.join(KV_CACHE_DTYPES)})")
    dtype = KV_CACHE_DTYPES[name]
    if device.type != "cpu" and dtype != model_dtype:
        model = str(model_dtype).removeprefix("torch.")
        raise BaigeError(
            f"--kv-cache-dtype {name} under a {model} model is supported on CPU only; "
            f"use auto or {model} on {device.type}"
        )
    return dtype


@torch.inference_mode()
def profile_activation_peak(model: torch.nn.Module, num_tokens: int, num_logits: int) -> int:
    """Warm-up (vLLM's profile run): one forward of ``num_tokens`` dummy tokens (the largest step the
    scheduler can build) plus logits of ``num_logits`` rows; returns the peak bytes it allocated on
    CUDA beyond what was allocated before (0 off CUDA, where no allocator statistics exist). The
    caching allocator's freed blocks are released afterwards so a free-memory reading sees them.
    """
    device = next(model.parameters()).device
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ids = torch.zeros((1, num_tokens), dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)[None]
    hidden = model(ids, positions, None)  # causal attention over the whole chunk
    model.compute_logits(hidden[0, -num_logits:])
    del hidden
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return int(peak)


def num_blocks_for(
    cfg: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_memory: int | None,
    max_model_len: int,
    activation_peak: int = 0,
) -> int:
    """Blocks that fit in ``kv_cache_memory`` bytes. Default budget: a fraction of the free memory
    measured now (after the warm-up, on CUDA), less ``activation_peak`` bytes kept free for the
    activations of the largest step (:func:`profile_activation_peak`).

    Raises:
        BaigeError: the budget does not hold one sequence of ``max_model_len`` tokens.
    """
    per_block = KVCache.bytes_per_block(cfg, block_size, dtype)
    if kv_cache_memory is not None and kv_cache_memory > (free := available_memory(device)):
        raise BaigeError(
            f"--kv-cache-memory {kv_cache_memory} bytes is more than the {free} bytes free on "
            f"{device.type}; lower it (or leave it out to use a fraction of what is free)"
        )
    if kv_cache_memory is None:
        frac = GPU_KV_FRACTION if device.type == "cuda" else CPU_KV_FRACTION
        kv_cache_memory = max(0, int(available_memory(device) * frac) - activation_peak)
    num_blocks = kv_cache_memory // per_block
    need = -(-max_model_len // block_size)
    if num_blocks < need:
        raise BaigeError(
            f"KV cache of {kv_cache_memory} bytes holds {_blocks(num_blocks)} of {block_size} tokens, "
            f"fewer than one sequence of max_model_len={max_model_len} tokens needs ({_blocks(need)}, "
            f"{need * per_block} bytes); raise --kv-cache-memory or lower --max-model-len"
        )
    return int(num_blocks)


def sliding_split(kv_cfg: ModelConfig, cfg: EngineConfig, num_blocks: int) -> tuple[int, int]:
    """``(full blocks, sliding blocks)`` of a budget of ``num_blocks`` blocks of every layer, for a model
    with sliding-window layers whose blocks get a pool of their own. The sliding pool holds what
    ``max_num_seqs`` sequences need at once: each the ``ceil(w / block_size) + 1`` blocks of its
    window plus two partial blocks, plus the blocks of one step's ``max_num_batched_tokens`` prefill
    tokens (at most ``num_blocks``); the full layers get the rest of the bytes. A model without full
    layers keeps ``num_blocks`` full blocks, which then hold nothing (the block manager's count of
    each sequence's tokens)."""
    bs, n_layers = cfg.block_size, kv_cfg.num_hidden_layers
    n_sliding = sum(kv_cfg.layer_window(i) is not None for i in range(n_layers))
    w = kv_cfg.sliding_window
    need = cfg.max_num_seqs * (-(-w // bs) + 3) + -(-cfg.max_num_batched_tokens // bs)
    sliding = min(num_blocks, need)
    n_full = n_layers - n_sliding
    full = (num_blocks * n_layers - sliding * n_sliding) // n_full if n_full else num_blocks
    return full, sliding


def allocate_kv_cache(
    model: torch.nn.Module,
    kv_cfg: ModelConfig,
    cfg: EngineConfig,
    max_model_len: int,
    profile: bool = True,
    separate_sliding: bool = False,
) -> KVCache:
    """The engine's KV cache: ``cfg.kv_cache_memory`` bytes (an int), or without it a fraction of the memory
    free after a warm-up step of the largest batch (:func:`profile_activation_peak`, skipped when not
    ``profile``: tensor-parallel ranks), in blocks of ``cfg.block_size`` tokens of ``kv_cfg``'s shape
    (this rank's KV heads) in the dtype :func:`resolve_kv_cache_dtype` picks. Logs its size. With
    ``separate_sliding`` and a model with sliding-window layers, those get a pool of their own
    (:func:`sliding_split`).

    Raises:
        BaigeError: as :func:`resolve_kv_cache_dtype` and :func:`num_blocks_for`.
    """
    p = next(model.parameters())
    peak = 0
    if cfg.kv_cache_memory is None and profile:
        peak = profile_activation_peak(
            model,
            min(cfg.max_num_batched_tokens, max_model_len),
            min(cfg.max_num_seqs, cfg.max_num_batched_tokens, max_model_len),
        )
    dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, p.dtype, p.device)
    num_blocks = num_blocks_for(
        kv_cfg, cfg.block_size, dtype, p.device, cfg.kv_cache_memory, max_model_len, activation_peak=peak
    )
    logger.info(
        "KV cache: %d blocks of %d tokens (%d tokens, %.1f MB, %s)",
        num_blocks,
        cfg.block_size,
        num_blocks * cfg.block_size,
        num_blocks * KVCache.bytes_per_block(kv_cfg, cfg.block_size, dtype) / 1e6,
        str(dtype).removeprefix("torch."),
    )
    sliding = separate_sliding and any(kv_cfg.layer_window(i) is not None for i in range(kv_cfg.num_hidden_layers))
    if not sliding:
        return KVCache(kv_cfg, num_blocks, cfg.block_size, dtype, p.device)
    num_blocks, num_sliding = sliding_split(kv_cfg, cfg, num_blocks)
    logger.info(
        "KV cache: the sliding-window layers' own pool of %d blocks, the full layers' %d", num_sliding, num_blocks
    )
    return KVCache(kv_cfg, num_blocks, cfg.block_size, dtype, p.device, num_sliding_blocks=num_sliding)
