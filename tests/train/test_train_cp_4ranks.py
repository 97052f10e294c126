"""Context parallelism composed with FSDP2 and with TP on 4 gloo ranks, against one process on the same
global batch (tiny model, windows of 1024 tokens holding several documents, fp32, 5 steps, with and without
block_causal document masking): dp_shard 2 x cp 2 (FSDP over ``dp_shard_cp``, each data-parallel rank one
window), and cp 2 x tp 2 (each rank's heads of its shard of both windows; FSDP over ``cp``)."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp
from cp_utils import docs_data
from train_utils import free_port, job_train, read_metrics, spawn_worker, tiny_model

COMMON = {"training.steps": 5, "training.seq_len": 1024, "checkpoint.export_hf": False}
LAYOUTS = {
    "cp_fsdp": {"parallelism.context_parallel_degree": 2, "training.batch_size": 1},
    "cp_tp": {
        "parallelism.context_parallel_degree": 2,
        "parallelism.tensor_parallel_degree": 2,
        "training.batch_size": 2,
    },
}
MASKS = ("causal", "block_causal")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp4")
    model = tiny_model(root / "model", "llama", vocab_size=98, seed=1)  # untied: the head is its own FSDP/TP case
    data = docs_data(root / "docs.jsonl", seed=1)
    common = dict(model=str(model), data=str(data), **COMMON)
    jobs = [
        (job_train, dict(common, output=str(root / f"{name}-{mask}"), **flags, **{"training.attn_mask_type": mask}))
        for name, flags in LAYOUTS.items()
        for mask in MASKS
    ]
    mp.spawn(spawn_worker, args=(4, free_port(), jobs), nprocs=4, join=True)
    for mask in MASKS:
        flags = {"training.batch_size": 2, "training.attn_mask_type": mask}
        job_train(**dict(common, output=str(root / f"one-{mask}"), **flags))
    return root


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_cp_compositions_equal_one_process(runs, name, mask):
    one, got = read_metrics(runs / f"one-{mask}"), read_metrics(runs / f"{name}-{mask}")
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in one:
        assert abs(got[step] - one[step]) < 1e-5, (step, got[step], one[step])
