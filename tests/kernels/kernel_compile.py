"""Compile every Triton kernel for a Hopper GPU (sm_90) with the launch parameters its launcher
picks on CUDA, on a machine without a GPU: Triton's ahead-of-time compiler (source -> TTIR -> TTGIR
-> LLVM -> PTX -> cubin) needs no driver. Run as a script in a fresh process
(``python tests/kernel_compile.py bfloat16``): a process that imported Triton under
``TRITON_INTERPRET=1`` cannot compile. Used by tests/test_kernels_compile.py.

Each launcher runs on small CPU tensors with its kernels replaced by recorders; the recorded
arguments give the compile signature.
"""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from baige import kernels
from baige.kernels import dispatch
from baige.kernels.triton_ops import (
    cross_entropy,
    flash_attention_bwd,
    flash_attention_fwd,
    norm,
    paged_attention,
    paged_decode_split,
    quant_matmul,
    rope,
    swiglu,
)

MODULES = (
    norm,
    rope,
    swiglu,
    flash_attention_fwd,
    flash_attention_bwd,  # with the dK/dV kernel it imports from flash_attention_bwd_dkdv
    paged_attention,
    paged_decode_split,
    cross_entropy,
    quant_matmul,
)
TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int8: "i8",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "i1",
}
CUDA = torch.device("cuda")


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kw)`` records instead of running."""

    def __init__(self, name, kernel, calls):
        self.name, self.fn, self.calls = name, getattr(kernel, "fn", kernel), calls

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((self.name, self.fn, args, kw))


def _record() -> list:
    """Swap every ``_*_kernel`` for a recorder and every device-dependent launch choice for its CUDA
    value (this process only); route the public ops to Triton on CPU tensors."""
    calls: list = []
    for mod in MODULES:
        for name in dir(mod):
            obj = getattr(mod, name)
            if name.startswith("_") and name.endswith("_kernel") and hasattr(obj, "fn"):
                setattr(mod, name, _Recorder(f"{mod.__name__.rsplit('.', 1)[1]}.{name}", obj, calls))
    blocks, tiles, ce_opts = flash_attention_fwd.tile_sizes, paged_attention._tiles, cross_entropy._launch_options
    for mod in (flash_attention_fwd, flash_attention_bwd):  # the backward imported the name
        mod.tile_sizes = lambda d, dev, backward: blocks(d, CUDA, backward)
    paged_attention._tiles = lambda g, d, dev, decode: tiles(g, d, CUDA, decode)
    cross_entropy._launch_options = lambda vocab, dev: ce_opts(vocab, CUDA)
    norm._dw_programs = lambda x, n_rows: min(n_rows, 132)  # H100/H200: 132 SMs
    kernels.backend = dispatch.backend = lambda x: "triton"
    dispatch.native_cpu = lambda *tensors, **kw: None  # CPU tensors, but the Triton launchers are what is recorded
    return calls


def _compile(fn, args, kw, capability: int):
    jit = JITFunction(fn)
    signature, constexprs = {}, {}
    options = {k: kw.pop(k) for k in ("num_warps", "num_stages") if k in kw}
    names = [p.name for p in jit.params]
    values = dict(zip(names, args)) | kw
    for p in jit.params:
        v = values[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + TYPES[v.dtype]
        elif isinstance(v, bool):
            signature[p.name] = "i1"
        elif isinstance(v, int):
            signature[p.name] = "i64" if abs(v) >= 2**31 else "i32"
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        elif v is None:
            signature[p.name], constexprs[p.name] = "constexpr", None
        else:
            raise TypeError(f"{p.name}: cannot type {v!r}")
    return triton.compile(
        ASTSource(fn=jit, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", capability, 32),
        options=options,
    )


def _launch_everything(dtype):
    """Call every public op (forward and backward where there is one) on small tensors."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

    x, w = r(5, 256, grad=True), r(256, grad=True)
    kernels.rms_norm(x, w, 1e-6).sum().backward()
    kernels.add_rms_norm(r(5, 256), r(5, 256), r(256), 1e-6)
    q, k = r(2, 5, 8, 128, grad=True), r(2, 5, 2, 128, grad=True)
    qo, ko = kernels.apply_rope(q, k, r(2, 5, 128), r(2, 5, 128))
    (qo.sum() + ko.sum()).backward()
    a, b = r(5, 512, grad=True), r(5, 512, grad=True)
    kernels.silu_mul(a, b).sum().backward()
    q, k, v = r(1, 20, 8, 128, grad=True), r(1, 20, 2, 128, grad=True), r(1, 20, 2, 128, grad=True)
    kernels.attention(q, k, v, 0.1).sum().backward()
    kc, vc = r(2, 4, 16, 128), r(2, 4, 16, 128)
    kernels.store_kv(r(3, 2, 128), r(3, 2, 128), kc, vc, torch.tensor([0, 5, 17]))
    tables = torch.tensor([[0, 1], [2, 3]])
    kernels.paged_decode_attention(r(2, 8, 128), kc, vc, tables, torch.tensor([3, 20]), 0.1)
    kernels.paged_prefill_attention(r(5, 8, 128), kc, vc, tables, torch.tensor([0, 2, 5]), torch.tensor([3, 20]), 0.1)
    long_kc, long_vc = r(2, 64, 16, 128), r(2, 64, 16, 128)  # one sequence, 1000 keys: split decode
    kernels.paged_decode_attention(r(1, 8, 128), long_kc, long_vc, torch.arange(64)[None], torch.tensor([1000]), 0.1)
    # sliding window, attention sinks and soft-cap (their own specialisations), forward and backward
    sinks = torch.randn(8, generator=g).requires_grad_()
    variants = {"window": 7, "sinks": sinks, "softcap": 30.0}
    q, k, v = r(1, 20, 8, 128, grad=True), r(1, 20, 2, 128, grad=True), r(1, 20, 2, 128, grad=True)
    kernels.attention(q, k, v, 0.1, **variants).sum().backward()
    kernels.paged_decode_attention(r(2, 8, 128), kc, vc, tables, torch.tensor([3, 20]), 0.1, **variants)
    kernels.paged_prefill_attention(
        r(5, 8, 128), kc, vc, tables, torch.tensor([0, 2, 5]), torch.tensor([3, 20]), 0.1, **variants
    )
    long_q = r(1, 8, 128)  # split decode over a 300-key window, the sinks joining in the reduce
    kernels.paged_decode_attention(
        long_q, long_kc, long_vc, torch.arange(64)[None], torch.tensor([1000]), 0.1, window=300, sinks=sinks
    )
    h, wv = r(7, 64, grad=True), r(1000, 64, grad=True)
    kernels.fused_linear_cross_entropy(h, wv, torch.randint(0, 1000, (7,), generator=g)).backward()
    kernels.quantized_linear(r(3, 256), torch.randint(-100, 100, (64, 256), dtype=torch.int8), r(64, 1), None, None)
    packed = torch.randint(-(2**31), 2**31 - 1, (64, 32), dtype=torch.int32, generator=g)
    zp = torch.randint(-8, 8, (64, 2), dtype=torch.int8, generator=g)
    kernels.quantized_linear(r(3, 256), packed, r(64, 2), zp, 128, r(64))


def main(dtype_name: str, capability: int = 90) -> None:
    """Launch every op in ``dtype_name`` (recorded), compile each distinct kernel specialisation, print a summary.

    Raises:
        SystemExit(1): a kernel was never launched by any public op.
    """
    calls = _record()
    _launch_everything(getattr(torch, dtype_name))
    launched = {name for name, *_ in calls}
    expected = {
        f"{mod.__name__.rsplit('.', 1)[1]}.{n}"
        for mod in MODULES
        for n in dir(mod)
        if n.startswith("_") and n.endswith("_kernel")
    }
    if launched != expected:
        sys.exit(f"kernels never launched: {sorted(expected - launched)}")
    seen, compiled = set(), 0
    for name, fn, args, kw in calls:
        key = (name, tuple(sorted(kw.items())))
        if key in seen:  # same kernel, same constexprs: one compile is enough
            continue
        seen.add(key)
        kernel = _compile(fn, args, dict(kw), capability)
        assert kernel.asm.get("cubin"), name
        compiled += 1
        print(f"ok {name} {dict(kw)}")
    print(f"compiled {compiled} specialisations of {len(expected)} kernels for sm_{capability} ({dtype_name})")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 90)
