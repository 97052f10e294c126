"""A tiny DeepSeek-V3 (MLA, q LoRA on, dense-then-MoE layers, group-limited sigmoid routing with
``e_score_correction_bias``, a shared expert) trained with auxiliary-loss-free balancing
(``moe.load_balance=bias``) on 2 gloo ranks against one process on the same global batch, fp32,
5 steps: expert parallel (EP=2 over the data-parallel shard dimension, FSDP2 on the rest: 2 ranks x
batch 2) and pipeline parallel (PP=2, Interleaved1F1B over 2 micro-batches with activation
checkpointing: one layer per stage, stages 0 (the dense layer) and 2 on rank 0, 1 and 3 on rank 1;
each rank the whole batch of 4). The bias update reads the load summed
over every rank (EP: the data-parallel ranks; PP: the stages' disjoint layers), so every run ends
with the one-process biases. PP with a router loss is refused (one error line).

One torch.multiprocessing spawn runs the three 2-rank jobs in order; one process runs the reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from mla_tiny import make_mla_checkpoint
from safetensors.torch import load_file
from train_utils import free_port, job_train, shakespeare, spawn_worker, write_char_tokenizer

STEPS = 5
RATE = 0.01
FLAGS = {
    "training.steps": STEPS,
    "training.batch_size": 4,
    "moe.load_balance": "bias",
    "moe.bias_update_rate": RATE,
    "checkpoint.export_dtype": "float32",
}


def job_expect_error(model: str, data: str, output: str, **flags) -> None:
    """:func:`job_train` that must fail with a BaigeError; rank 0 writes its message to ``output/error.txt``."""
    import os

    from baige.errors import BaigeError

    try:
        job_train(model, data, output, **flags)
    except BaigeError as e:
        if os.environ["RANK"] == "0":
            (Path(output) / "error.txt").write_text(str(e))
    else:
        raise AssertionError("the run did not fail")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_parallel")
    model = make_mla_checkpoint(root / "v3", "deepseek-v3", vocab_size=97, num_hidden_layers=4)
    write_char_tokenizer(model, shakespeare(200_000))
    data = root / "train.txt"
    data.write_text(shakespeare(20_000))
    common = dict(model=str(model), data=str(data), **FLAGS)
    pp = {
        "parallelism.pipeline_parallel_degree": 2,
        "parallelism.pipeline_parallel_schedule": "Interleaved1F1B",
        "parallelism.pipeline_parallel_microbatches": 2,
        "training.activation_checkpointing": "full",
    }
    jobs = [
        (
            job_train,
            dict(
                common,
                output=str(root / "ep"),
                **{"parallelism.expert_parallel_degree": 2, "training.batch_size": 2},
            ),
        ),
        (job_train, dict(common, output=str(root / "pp"), **pp)),
        (
            job_expect_error,
            dict(
                common,
                output=str(root / "pp_aux"),
                **pp,
                **{"moe.load_balance": "aux_loss", "moe.router_aux_loss_coef": 0.01, "training.steps": 1},
            ),
        ),
    ]
    mp.spawn(spawn_worker, args=(2, free_port(), jobs), nprocs=2, join=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        job_train(**common, output=str(root / "single"))
    finally:
        torch.set_num_threads(threads)
    return root


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == "train"]


def _assert_matches_one_process(runs: Path, name: str) -> None:
    got, want = _records(runs / name), _records(runs / "single")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for a, b in zip(got, want):
        for key in ("loss", "grad_norm", "aux_loss"):  # aux_loss: measured only (coefficient 0 in bias mode)
            assert abs(a[key] - b[key]) < 1e-5 * max(1.0, abs(b[key])), (name, a["step"], key, a[key], b[key])
        # the same experts took the same tokens in every sparse layer
        assert a["expert_load_cv"] == pytest.approx(b["expert_load_cv"], abs=1e-9)
    assert want[-1]["loss"] < want[0]["loss"] - 0.5  # it trains

    start = load_file(str(runs / "v3" / "model.safetensors"))
    mine, single = (load_file(str(runs / d / "hf" / "model.safetensors")) for d in (name, "single"))
    assert mine.keys() == single.keys() == start.keys()
    for key in single:
        diff = (mine[key] - single[key]).abs()
        # Adam turns rounding noise in near-zero gradients into steps of up to +-lr on a few elements:
        # the mean is tight, the maximum looser (measured: mean <= 5.4e-8, max 8.1e-6; 1F1B PP: max 4.3e-5)
        assert diff.mean() < 2e-6 and diff.max() < 2e-4, (name, key, diff.mean(), diff.max())
    for layer in (1, 2, 3):  # the sparse layers' selection biases: whole update steps, equal to one process
        key = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        assert torch.equal(mine[key], single[key]), (name, key)
        moved = (single[key] - start[key]) / RATE
        assert torch.allclose(moved, moved.round(), atol=1e-3) and moved.abs().max() > 0.5, moved


def test_expert_parallel_deepseek_v3_matches_one_process(runs):
    _assert_matches_one_process(runs, "ep")


def test_pipeline_parallel_deepseek_v3_matches_one_process(runs):
    _assert_matches_one_process(runs, "pp")
    assert all(len(r["pp_stage_compute_seconds"]) == 2 for r in _records(runs / "pp"))
    error = (runs / "pp_aux" / "error.txt").read_text()
    assert "moe.router_aux_loss_coef=0 (here 0.01)" in error and "pipeline parallel" in error
