"""Mixture-of-Experts compositions that need 4 gloo ranks, against one process on the same global
batch: EP=2 inside dp_shard=4 (the experts FSDP-sharded over the remaining ``efsdp`` = 2 and the
expert gradients averaged over all 4 ranks), HSDP 2 x 2 with EP=2 (experts replicated over
``dp_replicate``, one rank each in ``efsdp``), and dp_shard=2 x TP=2 x EP=2 on a model with dense
layers and a gated shared expert (TP splits the attention, the dense MLPs and the shared expert;
EP groups the ranks of one TP index)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from train_utils import free_port, job_train, shakespeare, spawn_worker, tiny_model

STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_4ranks")
    qwen3 = tiny_model(root / "qwen3_moe", "qwen3-moe", num_experts=8)
    shared = tiny_model(root / "qwen2_moe", "qwen2-moe-shared", seed=1, num_experts=4)  # layers 0, 2 dense
    data = root / "train.txt"
    data.write_text(shakespeare(20_000))
    common = {
        "data": str(data),
        "training.steps": STEPS,
        "checkpoint.export_hf": False,
        "moe.router_aux_loss_coef": 0.02,
        "moe.router_z_loss_coef": 1e-3,
    }
    jobs = [
        (
            job_train,
            dict(
                common,
                model=str(qwen3),
                output=str(root / "ep_efsdp"),
                **{"training.batch_size": 1, "parallelism.expert_parallel_degree": 2},
            ),
        ),
        (
            job_train,
            dict(
                common,
                model=str(qwen3),
                output=str(root / "ep_hsdp"),
                **{
                    "training.batch_size": 1,
                    "parallelism.expert_parallel_degree": 2,
                    "parallelism.data_parallel_replicate_degree": 2,
                },
            ),
        ),
        (
            job_train,
            dict(
                common,
                model=str(shared),
                output=str(root / "ep_tp"),
                **{
                    "training.batch_size": 2,
                    "parallelism.expert_parallel_degree": 2,
                    "parallelism.tensor_parallel_degree": 2,
                },
            ),
        ),
    ]
    mp.spawn(spawn_worker, args=(4, free_port(), jobs), nprocs=4, join=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, model in (("single_qwen3", qwen3), ("single_shared", shared)):
            job_train(**dict(common, model=str(model)), output=str(root / name), **{"training.batch_size": 4})
    finally:
        torch.set_num_threads(threads)
    return root


def _records(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["split"] == "train"]


# 4 ranks; the 2-rank EP tests (test_train_moe_distributed, test_train_mla_parallel) stay in the default set
@pytest.mark.slow
@pytest.mark.parametrize(
    "run, single", [("ep_efsdp", "single_qwen3"), ("ep_hsdp", "single_qwen3"), ("ep_tp", "single_shared")]
)
def test_four_rank_moe_matches_one_process(runs, run, single):
    a, b = _records(runs / run), _records(runs / single)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        for key in ("loss", "aux_loss", "z_loss", "grad_norm"):
            assert abs(ra[key] - rb[key]) < 1e-5, (run, ra["step"], key, ra[key], rb[key])
