"""Reference helpers of the quantization tests (tests/quant): round-to-nearest written independently
of baige's quantizer, and fresh parameter storage for bit-for-bit comparisons of two loads."""

import torch


def own_storage(model):
    """Fresh copies of the float parameters: a CPU GEMV's last bits depend on the weight's address
    alignment (measured on the (1, 72) shared_expert_gate), and loaded tensors sit wherever safetensors
    put them, so bit-for-bit comparisons of two loads need the same alignment on both sides."""
    for p in model.parameters():
        p.data = p.data.clone()
    return model


def fake_quant(w, scheme):
    """Symmetric RTN written independently: scale = max|w| / 127.5 per row (int8) or per 32 columns
    / 7.5 (int4, partial last group on its own columns), q = clamp(round(w / scale))."""
    g = w.shape[1] if scheme.group_size is None else scheme.group_size
    half, qmax = (127.5, 127) if scheme.num_bits == 8 else (7.5, 7)
    out = torch.empty_like(w)
    for b in range(0, w.shape[1], g):
        cols = w[:, b : b + g]
        scale = cols.abs().amax(dim=1, keepdim=True) / half
        out[:, b : b + g] = torch.clamp(torch.round(cols / scale), -qmax - 1, qmax) * scale
    return out
