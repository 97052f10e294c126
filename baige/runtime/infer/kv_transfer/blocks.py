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


def write_blocks(kv: KVCache, block_ids: list[int], payloads: list[memoryview]) -> None:
    """Fill blocks ``block_ids[i]`` of every layer from ``payloads[i]`` (the layout of
    :func:`read_block`): one ``index_copy_`` per layer and K/V for all the blocks, not one copy per
    block and layer (a pull's writes hold the interpreter lock that long on the consumer, whose
    engine thread decodes meanwhile).

    Raises:
        ValueError: a payload is not :func:`block_bytes` long, or the two lists differ in length.
    """
    if len(block_ids) != len(payloads):
        raise ValueError(f"{len(block_ids)} block ids for {len(payloads)} payloads")
    if not block_ids:
        return
    size = block_bytes(kv)
    for p in payloads:
        if len(p) != size:
            raise ValueError(f"a KV block is {size} bytes, got {len(p)}")
    n, layers = len(block_ids), len(kv.k)
    shape = kv.k[0][:, 0].shape  # (n_kv_heads, block_size, head_dim)
    flat = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(kv.dtype)
    data = flat.view(n, 2, layers, *shape)  # block, K/V, layer, head, token, dim
    dst = torch.tensor(block_ids, dtype=torch.long, device=kv.k[0].device)
    for kind, caches in enumerate((kv.k, kv.v)):
        for layer, t in enumerate(caches):
            t.index_copy_(1, dst, data[:, kind, layer].transpose(0, 1).to(t.device))


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
