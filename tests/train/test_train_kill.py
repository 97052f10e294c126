"""SIGKILL during a checkpoint write: the previous checkpoint survives and `--resume auto` continues."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from train_utils import read_metrics, shakespeare, tiny_model

# The child runs `baige train` with DCP's metadata step slowed down for one checkpoint: once the
# shard files of that step are on disk it touches a marker and waits, so the test can kill it
# mid-write (shards written, .metadata not yet, directory not yet renamed).
CHILD = r"""
import os, sys, time
from torch.distributed.checkpoint.filesystem import _FileSystemWriter
original = _FileSystemWriter.finish
def finish(self, metadata, results):
    if os.environ.get("HOLD_STEP") and os.environ["HOLD_STEP"] in str(self.path):
        open(os.environ["HOLD_MARKER"], "w").close()
        time.sleep(600)
    return original(self, metadata, results)
_FileSystemWriter.finish = finish
from baige.cli import main
sys.argv = ["baige", "train", *sys.argv[1:]]
main()
"""


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _train_steps(out: Path) -> set[int]:
    """The steps of the train records the child has written so far (a line being written is skipped)."""
    steps = set()
    if (out / "metrics.jsonl").exists():
        for line in (out / "metrics.jsonl").read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r["split"] == "train":
                steps.add(r["step"])
    return steps


def test_sigkill_during_checkpoint_write_then_resume_auto(tmp_path):
    model = tiny_model(tmp_path / "model")
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(20_000))
    out = tmp_path / "run"
    args = [
        "--model",
        str(model),
        "--data",
        str(data),
        "--output",
        str(out),
        "--steps",
        "10",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--lr",
        "1e-2",
        "--set",
        "checkpoint.interval=5",
        "--set",
        "metrics.log_every=1",
        "--set",
        "checkpoint.keep_latest=0",
        "--no-compile",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", HOLD_STEP="step_00000010", HOLD_MARKER=str(tmp_path / "held"))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "held").exists():
            assert child.poll() is None, child.stdout.read()
            assert time.monotonic() < deadline, "the child never reached the step-10 checkpoint"
            time.sleep(0.05)
        ckpts = out / "checkpoints"
        before = _digest(ckpts / "step_00000005")
        partial = ckpts / ".tmp-step_00000010"
        assert any(p.suffix == ".distcp" for p in partial.iterdir())  # killed while writing: shards are there
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    assert not (ckpts / "step_00000010").exists()
    assert _digest(ckpts / "step_00000005") == before
    killed_losses = read_metrics(out)
    assert sorted(killed_losses) == list(range(1, 11))

    env.pop("HOLD_STEP")
    resumed = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "step_00000005 at step 5" in resumed.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [*range(1, 11), *range(6, 11)]  # 6-10 again
    assert [r["step"] for r in records if r["split"] == "checkpoint"] == [5, 10]  # the complete saves
    after = read_metrics(out)
    for step in range(6, 11):
        assert after[step] == killed_losses[step], step  # same state, same data position: same losses
    assert (ckpts / "step_00000010" / ".metadata").is_file() and not partial.exists()
    assert (out / "hf" / "model.safetensors").is_file()


def test_sigkill_during_background_write_resumes_exactly(tmp_path, one_thread):
    """checkpoint.async_mode=async with the write of step 10 held in flight (BAIGE_TEST_CHECKPOINT_HOLD)
    while training goes on: SIGKILL leaves step 5 as the resume point, and the resumed run's losses and
    final weights equal an uninterrupted synchronous run's, bitwise."""
    from safetensors.torch import load_file

    from baige.cli import app

    model = tiny_model(tmp_path / "model")
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(20_000))
    common = [
        *("--model", str(model), "--data", str(data), "--steps", "12", "--seq-len", "32", "--batch-size", "4"),
        *("--lr", "1e-2", "--no-compile", "--set", "checkpoint.interval=5", "--set", "metrics.log_every=1"),
        *("--set", "checkpoint.keep_latest=0", "--set", "metrics.tensorboard=false"),
    ]
    out, ref = tmp_path / "run", tmp_path / "reference"
    args = [*common, "--output", str(out), "--set", "checkpoint.async_mode=async"]
    marker = tmp_path / "held"
    env = dict(os.environ, OMP_NUM_THREADS="1", BAIGE_TEST_CHECKPOINT_HOLD=f"10:{marker}")
    child = subprocess.Popen(
        [sys.executable, "-m", "baige", "train", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 180
        # the write of step 10 is held and the training went past it: a background write in flight
        while not (marker.exists() and 12 in _train_steps(out)):
            assert child.poll() is None, child.stdout.read().decode()
            assert time.monotonic() < deadline, "the child never trained past its held step-10 save"
            time.sleep(0.05)
        ckpts = out / "checkpoints"
        before = _digest(ckpts / "step_00000005")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    assert (ckpts / ".tmp-step_00000010").is_dir() and not (ckpts / "step_00000010").exists()
    assert _digest(ckpts / "step_00000005") == before
    killed = read_metrics(out)
    assert sorted(killed) == list(range(1, 13))

    env.pop("BAIGE_TEST_CHECKPOINT_HOLD")
    resumed = subprocess.run(
        [sys.executable, "-m", "baige", "train", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000005 at step 5" in resumed.stderr
    app(["train", *common, "--output", str(ref)], standalone_mode=False)  # uninterrupted, synchronous, here
    reference, after = read_metrics(ref), read_metrics(out)
    assert after == reference and killed == reference  # steps 6-12 again, the same losses
    a, b = load_file(str(out / "hf" / "model.safetensors")), load_file(str(ref / "hf" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (ckpts / "step_00000010" / ".metadata").is_file() and not (ckpts / ".tmp-step_00000010").exists()
