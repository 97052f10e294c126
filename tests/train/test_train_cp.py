"""Context parallelism against one process (tiny model, windows of 1024 tokens, fp32, 5 steps): CP=2 over
gloo with ring attention, with and without document masking (training.attn_mask_type=block_causal), and
with Ulysses all-to-all; ring and Ulysses attention alone in fp64 on two gloo ranks. The 4-rank
compositions (CP x FSDP, CP x TP) are in test_train_cp_4ranks.py."""

from __future__ import annotations

import json

import pytest
import torch.multiprocessing as mp
from cp_utils import docs_data, job_ring_gloo
from train_utils import free_port, job_train, read_metrics, spawn_worker, tiny_config, tiny_model

from baige.errors import BaigeError

COMMON = {"training.steps": 5, "training.seq_len": 1024, "training.batch_size": 1, "checkpoint.export_hf": False}
RUNS = {
    "ring": {"parallelism.context_parallel_degree": 2},
    "ring_docs": {"parallelism.context_parallel_degree": 2, "training.attn_mask_type": "block_causal", "eval": True},
    "ulysses_docs": {
        "parallelism.context_parallel_degree": 2,
        "parallelism.context_parallel_method": "ulysses",
        "training.attn_mask_type": "block_causal",
    },
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    model = tiny_model(root / "model", "llama-tied", vocab_size=97)
    data = docs_data(root / "docs.jsonl")
    common = dict(model=str(model), data=str(data), **COMMON)
    jobs = [(job_ring_gloo, dict(output=str(root / "attn")))]
    evaluate = {"data.eval": [str(data)], "training.eval_batches": 2}  # at steps 0 and 5
    for name, flags in RUNS.items():
        flags = {k: v for k, v in flags.items() if k != "eval"} | (evaluate if flags.get("eval") else {})
        jobs.append((job_train, dict(common, output=str(root / name), **flags)))
    mp.spawn(spawn_worker, args=(2, free_port(), jobs), nprocs=2, join=True)
    for mask in ("causal", "block_causal"):  # the one-process references
        flags = {"training.attn_mask_type": mask} | (evaluate if mask == "block_causal" else {})
        job_train(**dict(common, output=str(root / f"one_{mask}"), **flags))
    return root


def test_ring_and_ulysses_attention_on_two_gloo_ranks_equal_full_attention_fp64(runs):
    for rank in range(2):
        errors = json.loads((runs / "attn" / f"attn_rank{rank}.json").read_text())
        for method in ("ring", "ulysses"):
            assert max(errors[method]) < 1e-10, (rank, method, errors[method])  # out, dq, dk, dv


@pytest.mark.parametrize(
    ("name", "reference"), [("ring", "causal"), ("ring_docs", "block_causal"), ("ulysses_docs", "block_causal")]
)
def test_cp2_losses_equal_one_process(runs, name, reference):
    one, cp = read_metrics(runs / f"one_{reference}"), read_metrics(runs / name)
    assert sorted(cp) == [1, 2, 3, 4, 5]
    for step in one:
        assert abs(cp[step] - one[step]) < 1e-5, (step, cp[step], one[step])


def test_cp2_evaluation_equals_one_process(runs):
    one, cp = read_metrics(runs / "one_block_causal", "eval"), read_metrics(runs / "ring_docs", "eval")
    assert sorted(cp) == [0, 5]
    for step in one:
        assert abs(cp[step] - one[step]) < 1e-5, (step, cp[step], one[step])


def test_cli_cp_flag_reaches_the_config(cli_error, tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("hello")
    err = cli_error(
        "train", "--model", "x", "--data", data, "--cp", "4", "--seq-len", "100", "--output", tmp_path / "o"
    )
    assert "training.seq_len 100 must be a multiple of 2 x context_parallel_degree = 8" in err


def test_document_masking_changes_the_losses(runs):
    """block_causal is not causal under another name: the windows hold several documents."""
    causal, docs = read_metrics(runs / "one_causal"), read_metrics(runs / "one_block_causal")
    assert abs(causal[1] - docs[1]) > 1e-3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            {"parallelism.context_parallel_degree": 2, "training.seq_len": 30},
            "multiple of 2 x context_parallel_degree = 4",
        ),
        ({"parallelism.context_parallel_method": "zigzag"}, "context_parallel_method must be one of ring, ulysses"),
        ({"training.attn_mask_type": "document"}, "attn_mask_type must be one of causal, block_causal"),
        ({"parallelism.context_parallel_degree": 2, "parallelism.pipeline_parallel_degree": 2}, "pipeline parallel"),
        ({"parallelism.context_parallel_degree": 2, "parallelism.expert_parallel_degree": 2}, "expert parallel"),
        ({"parallelism.context_parallel_degree": 0}, "context_parallel_degree"),
    ],
)
def test_context_parallel_config_errors(tmp_path, flags, message):
    data = tmp_path / "d.txt"
    data.write_text("hello")
    with pytest.raises(BaigeError, match=message):
        tiny_config(tmp_path / "m", data, tmp_path / "out", **flags)
