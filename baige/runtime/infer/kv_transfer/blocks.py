"""A KV block as bytes, and the fingerprint that says two engines' blocks are interchangeable.

A block's bytes are, for each layer in order, its K slice then (after all layers' K) each layer's V
slice, each ``(n_kv_heads, block_size, head_dim)`` in the cache dtype, C order: ``2 * layers *
n_kv_heads * block_size * head_dim * element size`` bytes (``KVCache.bytes_per_block``).
"""

from __future__ import annotations

import hashlib
import json

import torch

from baige.runtime.infer.kv_cache import KVCache

SAMPLE_ELEMENTS = 4096  # per tensor, the first and last this many elements go into the fingerprint


def block_bytes(kv: KVCache) -> int:
    """Bytes of one block's K and V over all layers."""
    return 2 * len(kv.k) * kv.k[0][:, 0].numel() * kv.k[0].element_size()


def read_block(kv: KVCache, block_id: int) -> memoryview:
    """Block ``block_id``'s bytes (a copy, on the CPU; the layout of the module docstring)."""
    parts = [t[:, block_id].reshape(-1) for t in kv.k] + [t[:, block_id].reshape(-1) for t in kv.v]
    flat = torch.cat(parts)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_block(kv: KVCache, block_id: int, payload: memoryview) -> None:
    """Fill block ``block_id`` of every layer from ``payload`` (the layout of :func:`read_block`).

    Raises:
        ValueError: ``payload`` is not :func:`block_bytes` long.
    """
    if len(payload) != block_bytes(kv):
        raise ValueError(f"a KV block is {block_bytes(kv)} bytes, got {len(payload)}")
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(kv.dtype)
    per = kv.k[0][:, 0].numel()
    shape = kv.k[0][:, 0].shape  # (n_kv_heads, block_size, head_dim)
    for i, t in enumerate([*kv.k, *kv.v]):
        t[:, block_id].copy_(flat[i * per : (i + 1) * per].view(shape), non_blocking=False)


def model_fingerprint(model: torch.nn.Module, kv: KVCache, block_size: int) -> str:
    """sha256 (hex) over what makes two engines' KV blocks interchangeable: the cache's dtype and
    per-layer block shape, the block size, and every weight's name, shape, dtype and first and last
    :data:`SAMPLE_ELEMENTS` values (two different checkpoints of one architecture differ there; the
    whole weights are not hashed, which would take seconds for a large model)."""
    h = hashlib.sha256()
    h.update(json.dumps([str(kv.dtype), list(kv.k[0][:, 0].shape), len(kv.k), block_size]).encode())
    for name, t in model.state_dict().items():
        t = t.detach()
        h.update(json.dumps([name, list(t.shape), str(t.dtype)]).encode())
        flat = t.reshape(-1)
        for part in (flat[:SAMPLE_ELEMENTS], flat[-SAMPLE_ELEMENTS:]):
            h.update(part.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
