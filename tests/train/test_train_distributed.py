"""2-rank gloo runs of `baige train` against 1-process runs on the same global batch (tiny model).

One torch.multiprocessing spawn runs every 2-rank scenario in order (the process start-up is the
expensive part); the tests then compare what each run wrote to its metrics.jsonl and HF export.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import tomllib
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from train_utils import free_port, job_train, read_metrics, shakespeare, spawn_worker, tiny_model, torchrun_train

STEPS = 20
LORA = {"training.steps": 3, "lora.rank": 4, "lora.merge": True, "optimizer.lr": 1e-3, "checkpoint.interval": 0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    tied = tiny_model(root / "tied97", "llama-tied", vocab_size=97)  # 97 rows: not divisible by 2 ranks
    untied = tiny_model(root / "untied", "llama", vocab_size=98, seed=1)
    data = root / "train.txt"
    data.write_text(shakespeare(20_000))
    common = dict(model=str(tied), data=str(data))
    step10 = root / "fsdp" / "checkpoints" / "step_00000010"
    jobs = [
        # 20 steps with a save at 10 (FSDP2, 2 ranks x batch 2).
        (
            job_train,
            dict(
                common,
                output=str(root / "fsdp"),
                **{"training.steps": STEPS, "training.batch_size": 2, "checkpoint.interval": 10},
            ),
        ),
        # Resume the step-10 checkpoint on 2 ranks and train to 20.
        (
            job_train,
            dict(
                common,
                output=str(root / "fsdp_resumed"),
                copy_checkpoint=str(step10),
                **{"training.steps": STEPS, "training.batch_size": 2},
            ),
        ),
        # HSDP (2 replicas x 1 shard) with activation checkpointing on every block.
        (
            job_train,
            dict(
                common,
                output=str(root / "hsdp_ac"),
                **{
                    "training.steps": 3,
                    "training.batch_size": 2,
                    "parallelism.data_parallel_replicate_degree": 2,
                    "training.activation_checkpointing": "full",
                    "checkpoint.export_hf": False,
                    "data.eval": [str(data)],
                    "training.eval_batches": 2,
                },
            ),
        ),
        # LoRA under FSDP2 (frozen base sharded, adapters trained), with the merged export gathered.
        (job_train, dict(common, output=str(root / "lora_fsdp"), **LORA, **{"training.batch_size": 2})),
        # LoRA under HSDP (2 replicas x 1 shard) with activation checkpointing on every block.
        (
            job_train,
            dict(
                common,
                output=str(root / "lora_hsdp_ac"),
                **{
                    **LORA,
                    "training.batch_size": 2,
                    "parallelism.data_parallel_replicate_degree": 2,
                    "training.activation_checkpointing": "full",
                    "lora.merge": False,
                },
            ),
        ),
        # LoRA under tensor parallelism (TP 2, each rank the whole batch of 4): adapters follow the projections.
        (
            job_train,
            dict(
                common,
                output=str(root / "lora_tp"),
                **LORA,
                **{"training.batch_size": 4, "parallelism.tensor_parallel_degree": 2},
            ),
        ),
    ]
    mp.spawn(spawn_worker, args=(2, free_port(), jobs), nprocs=2, join=True)
    # Tensor parallel through the documented launch form: torchrun --no-python baige train (TP=2,
    # each rank sees the whole batch of 4).
    cmd = [
        *torchrun_train(2),
        "--model",
        str(untied),
        "--data",
        str(data),
        "--output",
        str(root / "tp"),
        "--steps",
        "3",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--lr",
        "1e-2",
        "--tp",
        "2",
        "--set",
        "lr_scheduler.warmup_steps=2",
        "--set",
        "metrics.log_every=1",
    ]
    tp = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert tp.returncode == 0, tp.stderr[-3000:]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        job_train(
            **common,
            output=str(root / "single"),
            **{"training.steps": STEPS, "training.batch_size": 4, "data.eval": [str(data)], "training.eval_batches": 2},
        )
        job_train(
            **common,
            output=str(root / "single_from_2ranks"),
            copy_checkpoint=str(step10),
            **{"training.steps": STEPS, "training.batch_size": 4},
        )
        job_train(
            model=str(untied),
            data=str(data),
            output=str(root / "single_tp"),
            **{"training.steps": 3, "training.batch_size": 4},
        )
        job_train(**common, output=str(root / "lora_single"), **LORA, **{"training.batch_size": 4})
    finally:
        torch.set_num_threads(threads)
    return root


def _params(run_dir):
    return load_file(str(run_dir / "hf" / "model.safetensors"))


def _assert_params_close(a, b):
    # Adam turns rounding noise in near-zero gradients into steps of up to +-lr (1e-2) on a few
    # elements, so compare the mean difference (one noisy element of 4096 moves it by ~5e-6).
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().mean() < 2e-5, name


def test_fsdp_two_ranks_match_one_process(runs):
    fsdp, single = read_metrics(runs / "fsdp"), read_metrics(runs / "single")
    assert sorted(fsdp) == list(range(1, STEPS + 1))
    for step in range(1, 6):
        assert abs(fsdp[step] - single[step]) < 1e-5, (step, fsdp[step], single[step])
    assert fsdp[5] < fsdp[1] - 0.5  # it trains: the character model learns the letter frequencies


def test_resume_is_bitwise_on_two_ranks_with_odd_vocab(runs):
    full, resumed = read_metrics(runs / "fsdp"), read_metrics(runs / "fsdp_resumed")
    assert sorted(resumed) == list(range(11, STEPS + 1))  # it started after the checkpoint
    for step in range(11, STEPS + 1):
        assert resumed[step] == full[step], step
    a, b = _params(runs / "fsdp"), _params(runs / "fsdp_resumed")
    assert a["model.embed_tokens.weight"].shape[0] == 97
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    saved = tomllib.loads((runs / "fsdp" / "checkpoints" / "step_00000010" / "config.toml").read_text())
    assert saved["training"]["steps"] == STEPS and saved["training"]["batch_size"] == 2  # the resolved config
    initial = load_file(str(runs / "tied97" / "model.safetensors"))
    assert not torch.equal(initial["model.norm.weight"], a["model.norm.weight"])  # parameters did change


def test_checkpoint_saved_on_two_ranks_resumes_on_one(runs):
    full, resumed = read_metrics(runs / "fsdp"), read_metrics(runs / "single_from_2ranks")
    assert sorted(resumed) == list(range(11, STEPS + 1))
    for step in range(11, STEPS + 1):
        assert abs(resumed[step] - full[step]) < 1e-4, (step, resumed[step], full[step])
    _assert_params_close(_params(runs / "fsdp"), _params(runs / "single_from_2ranks"))


def test_tensor_parallel_matches_one_process(runs):
    tp, single = read_metrics(runs / "tp"), read_metrics(runs / "single_tp")
    assert sorted(tp) == [1, 2, 3]
    for step in (1, 2, 3):
        assert abs(tp[step] - single[step]) < 1e-5, (step, tp[step], single[step])
    a, b = _params(runs / "tp"), _params(runs / "single_tp")
    assert "lm_head.weight" in a  # untied
    _assert_params_close(a, b)


def test_hsdp_with_activation_checkpointing_matches_one_process(runs):
    hsdp, single = read_metrics(runs / "hsdp_ac"), read_metrics(runs / "single")
    assert sorted(hsdp) == [1, 2, 3]
    for step in (1, 2, 3):
        assert abs(hsdp[step] - single[step]) < 1e-5, (step, hsdp[step], single[step])
    # Evaluation under FSDP (no-grad forward, ranks split the eval windows) matches too.
    eval_hsdp, eval_single = read_metrics(runs / "hsdp_ac", "eval"), read_metrics(runs / "single", "eval")
    assert sorted(eval_hsdp) == [0, 3] and sorted(eval_single) == [0, STEPS]
    assert abs(eval_hsdp[0] - eval_single[0]) < 1e-6


def test_metrics_records(runs):
    import json

    records = [json.loads(line) for line in (runs / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["split"] == "train"]  # not the checkpoint records
    assert {"loss", "grad_norm", "lr", "tokens_per_second_per_device", "mfu", "peak_memory_gib"} <= set(records[0])
    assert records[0]["lr"] == pytest.approx(0.5e-2)  # warmup step 1 of 2
    assert all(r["tokens_per_second_per_device"] > 0 and 0 < r["mfu"] for r in records)


@pytest.mark.parametrize("run", ["lora_fsdp", "lora_hsdp_ac", "lora_tp"])
def test_lora_two_ranks_match_one_process(runs, run):
    two, single = read_metrics(runs / run), read_metrics(runs / "lora_single")
    assert sorted(two) == [1, 2, 3]
    for step in (1, 2, 3):
        assert abs(two[step] - single[step]) < 1e-5, (step, two[step], single[step])
    # Adam hides a gradient scaled by a constant; the global gradient norm does not
    norms = [
        [
            r["grad_norm"]
            for r in map(json.loads, (runs / d / "metrics.jsonl").read_text().splitlines())
            if "grad_norm" in r
        ]
        for d in (run, "lora_single")
    ]
    assert max(abs(x - y) for x, y in zip(*norms)) < 1e-5 * max(norms[1]), norms
    a = load_file(str(runs / run / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(runs / "lora_single" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert max(b[k].abs().max().item() for k in b if "lora_B" in k) > 1e-4  # B moved off zero
    if run == "lora_hsdp_ac":
        return  # no merged export in that run
    merged_fsdp, merged_single = _params(runs / run), _params(runs / "lora_single")
    assert merged_fsdp.keys() == merged_single.keys() == load_file(str(runs / "tied97" / "model.safetensors")).keys()
    assert max((merged_fsdp[k] - merged_single[k]).abs().max().item() for k in merged_fsdp) < 1e-5
