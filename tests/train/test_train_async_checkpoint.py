"""Asynchronous checkpoints (checkpoint.async_mode): the step after a save runs while the save is written
(the checkpoint manager's event order, with the write held in flight by BAIGE_TEST_CHECKPOINT_HOLD), the
checkpoint holds the state of its step, and the losses and resumes equal the synchronous ones."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest
import torch
from train_utils import read_metrics, shakespeare, tiny_config, tiny_model

from baige.errors import BaigeError
from baige.runtime.settings import reload_settings
from baige.runtime.train.config import load_train_config
from baige.runtime.train.trainer import Trainer

STEPS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("async_ckpt")
    model = tiny_model(tmp / "model")
    data = tmp / "train.txt"
    data.write_text(shakespeare(20_000))
    return model, data


def _config(setup, out, mode, **flags):
    model, data = setup
    return tiny_config(
        model,
        data,
        out,
        **{
            "training.steps": STEPS,
            "training.batch_size": 2,
            "checkpoint.interval": 2,
            "checkpoint.async_mode": mode,
            "checkpoint.export_hf": False,
            **flags,
        },
    )


def _release_after(events, marker, event, deadline_s=120.0):
    """A thread that removes ``marker`` (the held write goes on) once ``event`` is in ``events`` or
    ``deadline_s`` passed, so a failing run never hangs the test."""

    def run():
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline and not (marker.exists() and event in list(events)):
            time.sleep(0.01)
        marker.unlink(missing_ok=True)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _load_dcp(path, scratch):
    """A DCP checkpoint directory as one nested dict (DCP's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(scratch))
    return torch.load(scratch, weights_only=False)


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.fixture
def hold_step_2(tmp_path, monkeypatch):
    marker = tmp_path / "held"
    monkeypatch.setenv("BAIGE_TEST_CHECKPOINT_HOLD", f"2:{marker}")
    reload_settings()
    yield marker
    monkeypatch.delenv("BAIGE_TEST_CHECKPOINT_HOLD")
    reload_settings()


@pytest.fixture(scope="module")
def sync_run(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("sync") / "run"
    trainer = Trainer(_config(setup, out, "disabled"))
    return trainer.train(), list(trainer.ckpt.events), out


def test_sync_save_blocks_the_next_step(sync_run):
    _, events, _ = sync_run
    i = events.index
    assert i(("save", 2)) < i(("written", 2)) < i(("complete", 2)) < i(("optimizer_step", 3))


@pytest.mark.parametrize("mode", ["async", "async_with_pinned_mem"])
def test_next_step_runs_while_the_save_is_written(setup, tmp_path, mode, hold_step_2, sync_run, one_thread):
    """The write of step 2 is held until the trainer reaches optimizer step 3 (the parameters change under
    a save in flight): the checkpoint still holds step 2's state, and losses and records match sync."""
    trainer = Trainer(_config(setup, tmp_path / "run", mode))
    releaser = _release_after(trainer.ckpt.events, hold_step_2, ("optimizer_step", 3))
    result = trainer.train()
    releaser.join(timeout=5)
    events = list(trainer.ckpt.events)
    i = events.index
    assert i(("save", 2)) < i(("staged", 2)) < i(("optimizer_step", 3)) < i(("written", 2)) < i(("complete", 2))
    assert i(("complete", 2)) < i(("save", 4))  # one save in flight: step 4's waits for step 2's
    sync_result, _, sync_out = sync_run
    assert result.losses == sync_result.losses
    for step in (2, 4):  # the same state as the synchronous save of the same step, every entry
        name = f"checkpoints/step_{step:08d}"
        a, b = (
            _flat(_load_dcp(sync_out / name, tmp_path / "a.pt")),
            _flat(_load_dcp(tmp_path / "run" / name, tmp_path / "b.pt")),
        )
        assert a.keys() == b.keys() and len(a) > 10
        for key in a:
            assert torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key], key
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ckpt = [r for r in records if r["split"] == "checkpoint"]
    assert [(r["step"], r["async_mode"]) for r in ckpt] == [(2, mode), (4, mode)]
    assert all(r["critical_path_seconds"] >= 0 and r["write_seconds"] > 0 for r in ckpt)


def test_resume_from_an_async_checkpoint_is_exact(setup, tmp_path, sync_run, one_thread):
    """Steps 3-4 resumed from the async checkpoint of step 2 (its directory alone, copied into a new
    output) equal the uninterrupted run's, and so do the final weights."""
    first = Trainer(_config(setup, tmp_path / "first", "async"))
    first.train()
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "first/checkpoints/step_00000002", tmp_path / "run/checkpoints/step_00000002")
    resumed = Trainer(_config(setup, tmp_path / "run", "async"))
    result = resumed.train()
    assert result.start_step == 2 and sorted(result.losses) == [3, 4]
    sync_result, _, sync_out = sync_run
    assert result.losses == {s: sync_result.losses[s] for s in (3, 4)}
    assert read_metrics(tmp_path / "run") == {s: sync_result.losses[s] for s in (3, 4)}
    name = "checkpoints/step_00000004"
    a = _flat(_load_dcp(sync_out / name, tmp_path / "a.pt"))
    b = _flat(_load_dcp(tmp_path / "run" / name, tmp_path / "b.pt"))
    for key in (k for k in a if k.startswith("model.")):
        assert torch.equal(a[key], b[key]), key


def test_async_mode_is_checked(setup, tmp_path):
    model, data = setup
    with pytest.raises(BaigeError, match="checkpoint.async_mode must be disabled, async, async_with_pinned_mem"):
        load_train_config(None, {"model.name": str(model), "data.train": [str(data)]}, ["checkpoint.async_mode=on"])


@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_failed_write_is_one_line_and_leaves_no_checkpoint(tmp_path, mode):
    """A write that fails (here an entry that cannot be pickled, as a full disk would fail it): one
    BaigeError naming the checkpoint and the cause, raised by the save (sync) or the wait for it (async),
    and no step directory."""
    from baige.runtime.train.checkpoint import CheckpointManager

    class Unpicklable:  # a local class: copied by the staging, refused by pickle in the writer
        pass

    m = CheckpointManager(tmp_path / "checkpoints", True, 0, mode)
    with pytest.raises(BaigeError, match=r"^checkpoint step_00000001: the write failed.*(pickle|Unpicklable)"):
        m.save(1, {"model": {"w": torch.zeros(3)}, "bad": Unpicklable()}, "")
        m.finalize()
    assert m.complete_steps() == []
    m.save(2, {"model": {"w": torch.ones(3)}}, "")  # the next save works
    m.finalize()
    assert [s for s, _ in m.complete_steps()] == [2]
