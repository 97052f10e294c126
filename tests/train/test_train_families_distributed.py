"""2-rank gloo `baige train` runs of the tiny Gemmas against one process on the same global batch: tensor
parallel Gemma 3 (its (1 + w) head norms on the local heads; tied, so the one process runs the tied
embedding's own lookup, which keeps Gemma's embedding scale) and a two-stage pipeline of Gemma 2 (the
soft-capped loss on the last stage)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from train_utils import free_port, job_train, read_metrics, shakespeare, spawn_worker, tiny_model

FLAGS = {"training.steps": 3, "training.batch_size": 4}
RUNS = {
    "gemma3_tp": ("gemma3", {"parallelism.tensor_parallel_degree": 2}),
    "gemma2_pp": (
        "gemma2",
        {"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_microbatches": 2},
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    data = root / "train.txt"
    data.write_text(shakespeare(20_000))
    models = {v: tiny_model(root / v, v) for v in ("gemma2", "gemma3")}
    jobs = [
        (job_train, dict(model=str(models[v]), data=str(data), output=str(root / name), **FLAGS, **extra))
        for name, (v, extra) in RUNS.items()
    ]
    mp.spawn(spawn_worker, args=(2, free_port(), jobs), nprocs=2, join=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for v, model in models.items():
            job_train(model=str(model), data=str(data), output=str(root / f"{v}_single"), **FLAGS)
    finally:
        torch.set_num_threads(threads)
    return root


@pytest.mark.parametrize("run", sorted(RUNS))
def test_two_ranks_match_one_process(runs, run):
    got, want = read_metrics(runs / run), read_metrics(runs / f"{RUNS[run][0]}_single")
    assert sorted(got) == [1, 2, 3]
    for step in (1, 2, 3):
        assert abs(got[step] - want[step]) < 1e-5, (step, got[step], want[step])
