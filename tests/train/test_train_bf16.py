"""bf16 compute on CPUs with native bf16: ``--dtype auto`` (the default) trains in bf16 there (fp32 master
weights, autocast in one process), and its loss curve follows the fp32 run's.

The suite pins ``BAIGE_CPU_AUTO_DTYPE=float32`` (tests/conftest.py); these tests lift the pin to see the
machine's own default."""

from __future__ import annotations

import pytest
import torch
from train_utils import read_metrics, shakespeare, tiny_config, tiny_model

from baige import kernels
from baige.runtime.settings import reload_settings


@pytest.fixture
def machine_default_dtype(monkeypatch):
    """``--dtype auto`` as on this machine (the suite's float32 pin lifted)."""
    monkeypatch.delenv("BAIGE_CPU_AUTO_DTYPE", raising=False)
    reload_settings()
    yield
    monkeypatch.undo()
    reload_settings()


STEPS = 50


def test_default_run_is_bf16_on_a_bf16_cpu_and_follows_fp32(tmp_path, one_thread, machine_default_dtype):
    if not kernels.cpu_has_native_bf16():
        pytest.skip("this CPU has no native bf16 (avx512_bf16 or amx_bf16): --dtype auto trains in fp32 here")
    from baige.runtime.train.trainer import Trainer

    model = tiny_model(tmp_path / "m")
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(40_000))
    runs = {}
    for name, flags in (("auto", {}), ("fp32", {"parallelism.mixed_precision_param": "float32"})):
        cfg = tiny_config(model, data, tmp_path / name, **{"training.steps": STEPS, **flags})
        trainer = Trainer(cfg)
        runs[name] = trainer.param_dtype
        trainer.train()
        master = {p.dtype for p in trainer.model.parameters()}
        assert master == {torch.float32}, master  # fp32 master weights either way
    assert runs == {"auto": torch.bfloat16, "fp32": torch.float32}
    bf16, fp32 = read_metrics(tmp_path / "auto"), read_metrics(tmp_path / "fp32")
    assert sorted(bf16) == sorted(fp32) == list(range(1, STEPS + 1))
    drift = max(abs(bf16[s] - fp32[s]) / fp32[s] for s in bf16)
    assert drift < 0.02, drift
    assert bf16 != fp32  # bf16 did compute something else
    assert fp32[STEPS] < fp32[1] - 1.0  # and both trained


def test_auto_dtype_is_fp32_without_native_bf16(tmp_path, monkeypatch, machine_default_dtype):
    """On a CPU without avx512_bf16 / amx_bf16 (flags replaced), ``auto`` resolves to fp32; a named dtype wins."""
    from baige.kernels.cpu import isa
    from baige.runtime.train.trainer import Trainer

    model = tiny_model(tmp_path / "m")
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(5_000))
    monkeypatch.setattr(isa, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma", "f16c"}))
    reload_settings()
    assert Trainer(tiny_config(model, data, tmp_path / "a", **{"training.steps": 1})).param_dtype == torch.float32
    forced = {"parallelism.mixed_precision_param": "bfloat16", "training.steps": 1}
    assert Trainer(tiny_config(model, data, tmp_path / "b", **forced)).param_dtype == torch.bfloat16
