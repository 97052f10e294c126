"""``--dtype auto``: bf16 on a CPU with native bf16, fp32 elsewhere; the checkpoint's dtype on CUDA and
for convert/quantize; ``BAIGE_CPU_AUTO_DTYPE`` overrides (the suite pins float32: tests/conftest.py)."""

import subprocess
import sys

import pytest
import torch

from baige.errors import BaigeError
from baige.kernels.cpu import isa
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.device import checkpoint_dtype, resolve_dtype
from baige.runtime.settings import reload_settings
from tests.tiny import make_checkpoint, write_tiny_tokenizer

CPU = torch.device("cpu")


@pytest.fixture
def auto_env(monkeypatch):
    """``auto_env(value, flags)``: BAIGE_CPU_AUTO_DTYPE set (None: unset) and the CPU's flags replaced."""

    def use(value, flags):
        if value is None:
            monkeypatch.delenv("BAIGE_CPU_AUTO_DTYPE", raising=False)
        else:
            monkeypatch.setenv("BAIGE_CPU_AUTO_DTYPE", value)
        monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset(flags))
        reload_settings()

    yield use
    monkeypatch.undo()
    reload_settings()


def _cfg(tmp_path, torch_dtype):
    cfg = ModelConfig.from_file(make_checkpoint(tmp_path / "m", "llama") / "config.json")
    cfg.torch_dtype = torch_dtype
    return cfg


AVX2 = {"avx", "avx2", "fma", "f16c"}
ZEN4 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}
SPR_AMX = AVX2 | {"avx512f", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize("ckpt", ["float32", "bfloat16", "float16"])
def test_auto_on_cpu_follows_the_instruction_set(tmp_path, auto_env, ckpt):
    cfg = _cfg(tmp_path, ckpt)
    auto_env(None, ZEN4)
    assert resolve_dtype("auto", cfg, CPU) == torch.bfloat16
    auto_env(None, SPR_AMX)
    assert resolve_dtype(None, cfg, CPU) == torch.bfloat16
    auto_env(None, AVX2)
    assert resolve_dtype("auto", cfg, CPU) == torch.float32
    # no device (convert, quantize): the checkpoint's own dtype whatever the CPU
    auto_env(None, ZEN4)
    assert resolve_dtype("auto", cfg) == checkpoint_dtype(cfg) == getattr(torch, ckpt)
    assert resolve_dtype("float16", cfg, CPU) == torch.float16  # a named dtype is taken as is


def test_override_and_bad_value(tmp_path, auto_env):
    cfg = _cfg(tmp_path, "bfloat16")
    auto_env("float32", ZEN4)
    assert resolve_dtype("auto", cfg, CPU) == torch.float32
    auto_env("bfloat16", AVX2)
    assert resolve_dtype("auto", cfg, CPU) == torch.bfloat16
    auto_env("fp8", ZEN4)
    with pytest.raises(BaigeError, match="BAIGE_CPU_AUTO_DTYPE='fp8': choose auto, float32 or bfloat16"):
        resolve_dtype("auto", cfg, CPU)


def test_engine_and_cli_report_the_dtype_picked(tmp_path):
    """End to end on this machine, without the suite's pin: the engine's model is bf16 exactly when
    the CPU has native bf16; a bad override is one line from the CLI, exit 1, no traceback."""
    path = make_checkpoint(tmp_path / "m", "llama")
    write_tiny_tokenizer(path)
    code = (
        "from baige import LLM; import sys; llm = LLM(sys.argv[1], max_model_len=64, kv_cache_memory=1 << 20); "
        "print(llm.engine.model.model.embed_tokens.weight.dtype, llm.engine.kv_cache.k[0].dtype)"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "BAIGE_CPU_AUTO_DTYPE"}
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    native = bool({"avx512_bf16", "amx_bf16"} & isa.cpu_flags())
    want = "torch.bfloat16" if native else "torch.float32"
    assert r.stdout.split() == [want, want]
    env["BAIGE_CPU_AUTO_DTYPE"] = "half"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "baige",
            "generate",
            "--model",
            str(path),
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
            "--no-chat",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "BAIGE_CPU_AUTO_DTYPE='half': choose auto, float32 or bfloat16" in r.stderr.strip().splitlines()[-1]
