"""The kernels issue's GPU targets, measured directly (run by scripts/gpu_check.sh on a CUDA machine).

1. rms_norm forward at hidden 4096 (bf16, 16384 rows): Triton vs eager PyTorch (the reference),
   target >= 3x.
2. fused linear + cross-entropy forward + backward at vocab 128256, hidden 4096, 8192 tokens (bf16):
   peak memory beyond the inputs vs the unfused path (logits materialised + F.cross_entropy),
   target <= 1/3.
3. flash attention forward, causal, seq 4096, head_dim 128, 32 heads, batch 4 (bf16): Triton vs
   torch SDPA restricted to its flash backend, target >= 0.9x.

Timing: triton.testing.do_bench median (ms). Prints a Markdown table and writes it to argv[1] when given.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from baige import kernels
from baige.kernels import reference


def _peak(fn) -> int:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def rms_norm_target() -> dict:
    x = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        t_triton = do_bench(lambda: kernels.rms_norm(x, w, 1e-6), return_mode="median")
        t_eager = do_bench(lambda: reference.rms_norm(x, w, 1e-6), return_mode="median")
    return {
        "target": "rms_norm fwd, hidden 4096, 16384 rows, bf16: eager / Triton time",
        "value": t_eager / t_triton,
        "goal": ">= 3",
        "met": t_eager / t_triton >= 3,
        "triton_ms": t_triton,
        "eager_ms": t_eager,
    }


def cross_entropy_target() -> dict:
    n, hidden, vocab = 8192, 4096, 128256
    h = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    t = torch.randint(0, vocab, (n,), device="cuda")

    def fused():
        h.grad = w.grad = None
        kernels.fused_linear_cross_entropy(h, w, t).backward()

    def unfused():
        h.grad = w.grad = None
        F.cross_entropy((h @ w.t()).float(), t).backward()

    fused(), unfused()  # warm-up (compilation, allocator)
    p_fused, p_unfused = _peak(fused), _peak(unfused)
    h.grad = w.grad = None
    t_fused, t_unfused = do_bench(fused, return_mode="median"), do_bench(unfused, return_mode="median")
    ratio = p_fused / p_unfused
    return {
        "target": "fused linear CE fwd+bwd, vocab 128256, hidden 4096, 8192 tokens, bf16: peak memory fused / unfused",
        "value": ratio,
        "goal": "<= 0.333",
        "met": ratio <= 1 / 3,
        "fused_peak_mib": p_fused / 2**20,
        "unfused_peak_mib": p_unfused / 2**20,
        "fused_ms": t_fused,
        "unfused_ms": t_unfused,
    }


def flash_attention_target() -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, T, D = 4, 32, 4096, 128
    q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    qh, kh, vh = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # SDPA's (B, H, T, D), not timed
    with torch.inference_mode():
        t_triton = do_bench(lambda: kernels.attention(q, k, v, D**-0.5), return_mode="median")
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            t_sdpa = do_bench(
                lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=D**-0.5), return_mode="median"
            )
    flops = 4 * B * H * D * T * (T + 1) / 2
    return {
        "target": (
            "flash attention fwd, causal, seq 4096, head_dim 128, 32 heads, batch 4, bf16: SDPA-flash / Triton time"
        ),
        "value": t_sdpa / t_triton,
        "goal": ">= 0.9",
        "met": t_sdpa / t_triton >= 0.9,
        "triton_ms": t_triton,
        "sdpa_flash_ms": t_sdpa,
        "triton_tflop_s": flops / t_triton / 1e9,
        "sdpa_tflop_s": flops / t_sdpa / 1e9,
    }


def main() -> None:
    assert torch.cuda.is_available(), "gpu_targets.py needs a CUDA device"
    rows = []
    for fn in (rms_norm_target, cross_entropy_target, flash_attention_target):
        try:
            rows.append(fn())
        except Exception as e:  # report and go on: one failure must not hide the other numbers
            rows.append(
                {"target": fn.__name__, "value": float("nan"), "goal": "", "met": False, "error": repr(e)[:300]}
            )
        torch.cuda.empty_cache()
    lines = [
        f"GPU: {torch.cuda.get_device_name()} · torch {torch.__version__}",
        "",
        "| target | measured | goal | met | details |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        details = ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
            for k, v in r.items()
            if k not in ("target", "value", "goal", "met")
        )
        lines.append(f"| {r['target']} | {r['value']:.3f} | {r['goal']} | {'yes' if r['met'] else 'NO'} | {details} |")
    text = "\n".join(lines)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text + "\n")
        with open(sys.argv[1] + ".json", "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
