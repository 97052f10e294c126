"""A training run's life: SIGTERM stops it with a checkpoint at the next step boundary and exit 0 (one
process, and two ranks where only one received the signal), the same command resumes it exactly; under
torchrun's elastic agent a rank killed mid-run restarts the job from the newest complete checkpoint, with the
losses and weights of an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_utils import free_port, read_metrics, shakespeare, tiny_model

from baige.runtime.train.lifecycle import StopSignal


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lifecycle")
    model = tiny_model(tmp / "model")
    data = tmp / "train.txt"
    data.write_text(shakespeare(20_000))
    return model, data


def _args(setup, out: Path, steps: int, interval: int) -> list[str]:
    model, data = setup
    return [
        *("--model", str(model), "--data", str(data), "--output", str(out), "--steps", str(steps)),
        *("--seq-len", "32", "--batch-size", "2", "--lr", "1e-2", "--no-compile"),
        *("--set", f"checkpoint.interval={interval}", "--set", "checkpoint.keep_latest=0"),
        *("--set", "metrics.log_every=1", "--set", "metrics.tensorboard=false"),
    ]


def _wait_for(path: Path, procs: list[subprocess.Popen], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for p in procs:
            assert p.poll() is None, p.communicate()[1]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "hf" / "model.safetensors")), load_file(str(b / "hf" / "model.safetensors"))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_stop_signal_flag_and_second_signal():
    # the process's own handlers first: a pytest-xdist worker ignores SIGINT, and StopSignal hands the
    # second signal to whatever was installed before it
    saved = signal.signal(signal.SIGINT, signal.default_int_handler), signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with StopSignal() as stop:
            assert stop.received is None and not stop.agreed(torch.device("cpu"))
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the handler runs in the main thread between bytecodes
            assert stop.received == "SIGINT" and stop.agreed(torch.device("cpu"))
            with pytest.raises(KeyboardInterrupt):  # the second one: the default behaviour at once
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, saved[0])
        signal.signal(signal.SIGTERM, saved[1])


def test_sigterm_checkpoints_at_the_next_step_and_resumes_exactly(setup, tmp_path, one_thread):
    """SIGTERM while step 2's checkpoint is written (held): step 3 finishes, its checkpoint is written,
    exit 0, no HF export; the same command resumes at step 3 and ends with an uninterrupted run's losses
    and weights."""
    from baige.cli import app

    out, ref, marker = tmp_path / "run", tmp_path / "reference", tmp_path / "held"
    args = _args(setup, out, steps=6, interval=2)
    env = dict(os.environ, OMP_NUM_THREADS="1", BAIGE_TEST_CHECKPOINT_HOLD=f"2:{marker}")
    child = subprocess.Popen(
        [sys.executable, "-m", "baige", "train", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        _wait_for(marker, [child])
        child.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # delivered while the write is held (a Python sleep loop: the handler runs)
        marker.unlink()
        _, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    stderr = stderr.decode()
    assert child.returncode == 0, stderr
    assert "stopped by SIGTERM after step 3" in stderr
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_00000002", "step_00000003"] and not (out / "hf").exists()
    stopped = read_metrics(out)
    assert sorted(stopped) == [1, 2, 3]

    env.pop("BAIGE_TEST_CHECKPOINT_HOLD")
    resumed = subprocess.run(
        [sys.executable, "-m", "baige", "train", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "step_00000003 at step 3" in resumed.stderr
    app(["train", *_args(setup, ref, steps=6, interval=2)], standalone_mode=False)
    reference = read_metrics(ref)
    assert read_metrics(out) == reference and {s: reference[s] for s in (1, 2, 3)} == stopped
    assert _same_weights(out, ref)


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_sigterm_to_one_rank_stops_both_at_the_same_step(setup, tmp_path, mode):
    """Two ranks (gloo, the launcher's variables set as torchrun would); SIGTERM reaches rank 1 only, while
    step 2's checkpoint is held: both stop after the same step with a complete checkpoint of it and exit 0
    (ranks that disagreed would hang in their next collective). Synchronous saves block the training, so
    that step is 3; with async ones training goes on while the write is held, and the step depends on
    when the signal lands."""
    out, marker = tmp_path / "run", tmp_path / "held"
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            BAIGE_TEST_CHECKPOINT_HOLD=f"2:{marker}",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        args = [*_args(setup, out, steps=12, interval=2), "--set", f"checkpoint.async_mode={mode}"]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "baige", "train", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        )
    try:
        _wait_for(marker, procs)
        procs[1].send_signal(signal.SIGTERM)
        time.sleep(0.2)
        marker.unlink()
        errs = [p.communicate(timeout=120)[1].decode() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], errs
    m = re.search(r"stopped by a stop signal on another rank after step (\d+)", errs[0])  # rank 0 logs
    assert m is not None, errs[0]
    stop = int(m.group(1))
    assert stop == 3 if mode == "disabled" else 3 <= stop < 12
    saved = sorted(int(p.name[5:]) for p in (out / "checkpoints").iterdir())
    assert saved[-1] == stop and all(s % 2 == 0 for s in saved[:-1])  # the interval's, then the stop's
    assert (out / "checkpoints" / f"step_{stop:08d}" / ".metadata").is_file() and not (out / "hf").exists()
    assert sorted(read_metrics(out)) == list(range(1, stop + 1))


def _torchrun(args: list[str], env: dict, max_restarts: int) -> subprocess.CompletedProcess:
    # a fresh rendezvous store per restart: with the agent's store shared (torch's default), a restarted
    # worker can read a gloo address of the attempt before (pytorch/pytorch#135712)
    env = dict(env, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("--max-restarts", str(max_restarts), "--monitor-interval", "0.1", "-m", "baige", "train", *args),
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.slow  # two torchrun launches with a restart (about a minute): the suite's time budget
def test_elastic_restart_after_a_killed_rank_matches_an_uninterrupted_run(setup, tmp_path):
    """torchrun --max-restarts 1, 2 ranks (gloo): rank 1 is SIGKILLed as step 3 begins (BAIGE_TEST_FAIL_AT);
    the agent restarts both, they resume from step 2 by themselves, and the run ends with the uninterrupted
    run's losses and weights, bitwise."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out, ref = tmp_path / "run", tmp_path / "reference"
    failed = _torchrun(_args(setup, out, steps=4, interval=2), dict(env, BAIGE_TEST_FAIL_AT="3:1"), max_restarts=1)
    assert failed.returncode == 0, failed.stderr[-3000:]
    assert "exitcode: -9" in failed.stderr and "step_00000002 at step 2" in failed.stderr
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]  # step 3 never finished first
    straight = _torchrun(_args(setup, ref, steps=4, interval=2), env, max_restarts=0)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert read_metrics(out) == read_metrics(ref)
    assert _same_weights(out, ref)
