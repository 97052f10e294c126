"""Pipeline parallel (``--pp``) against one process on the same global batch (tiny 4-layer models).

Default suite: one 2-rank spawn runs 1F1B on SFT data (loss masks: the valid-token count differs per
pipeline micro-batch) with tied embeddings (the first and last stage sum the tied gradient), a
checkpoint at step 3 and an HF export, and resumes a 1-process checkpoint on 2 pipeline ranks (GPipe);
one process runs the same steps and resumes the PP=2 checkpoint.
Slow: the other schedules (tied and untied), PP=2 x FSDP=2 and PP=2 x TP=2 (4 ranks), and more
stages than layers under torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from train_utils import chat_data, free_port, job_train, read_metrics, spawn_worker, tiny_model, torchrun_train

STEPS = 5


def _flags(**extra) -> dict:
    return {"training.steps": STEPS, "training.batch_size": 4, "optimizer.lr": 3e-3, "training.max_norm": 0.5, **extra}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    # 97 rows: FSDP shards the tied table unevenly over 2 ranks
    tied = tiny_model(root / "tied4", "llama-tied", vocab_size=97, seed=2, num_hidden_layers=4)
    data = chat_data(root / "chat.jsonl")
    return root, dict(model=str(tied), data=str(data))


def _untied(common: dict, root: Path) -> dict:
    """The tied setup's data with an untied 4-layer model (written on first use: slow tests only)."""
    if not (root / "untied4" / "config.json").is_file():
        tiny_model(root / "untied4", "llama", vocab_size=98, seed=3, num_hidden_layers=4)
    return dict(common, model=str(root / "untied4"))


def _single(common: dict, output: Path, **flags) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        job_train(**common, output=str(output), **flags)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(setup):
    root, common = setup
    evaluate = {"data.eval": [common["data"]], "training.eval_batches": 2}
    _single(common, root / "single", **_flags(**{"checkpoint.interval": 3}, **evaluate))
    step3_single = root / "single" / "checkpoints" / "step_00000003"
    step3_pp = root / "pp_1f1b" / "checkpoints" / "step_00000003"
    jobs = [
        (
            job_train,
            dict(
                common,
                output=str(root / "pp_1f1b"),
                **_flags(
                    **{
                        "parallelism.pipeline_parallel_degree": 2,
                        "checkpoint.interval": 3,
                        "parallelism.pipeline_parallel_microbatches": 2,
                        **evaluate,
                    }
                ),
            ),
        ),
        # a 1-process checkpoint resumes on two pipeline ranks (GPipe, one window per micro-batch)
        (
            job_train,
            dict(
                common,
                output=str(root / "pp_from_single"),
                copy_checkpoint=str(step3_single),
                **_flags(
                    **{"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_schedule": "gpipe"}
                ),
            ),
        ),
    ]
    mp.spawn(spawn_worker, args=(2, free_port(), jobs), nprocs=2, join=True)
    _single(common, root / "single_from_pp", copy_checkpoint=str(step3_pp), **_flags())
    return root


def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "hf" / "model.safetensors"))


def _assert_params_close(a: dict, b: dict) -> None:
    # Adam turns rounding noise in near-zero gradients into steps of up to +-lr on a few elements:
    # compare the mean difference (as test_train_distributed does)
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().mean() < 2e-5, name


def _assert_losses_equal(got: dict, want: dict, steps) -> None:
    assert sorted(got) == list(steps)
    for step in steps:
        assert abs(got[step] - want[step]) < 1e-5, (step, got[step], want[step])


def test_1f1b_two_stages_match_one_process_on_sft_data(runs):
    single = read_metrics(runs / "single")
    _assert_losses_equal(read_metrics(runs / "pp_1f1b"), single, range(1, STEPS + 1))
    assert single[STEPS] < single[1] - 0.3  # it trains
    # the HF export of the pipelined run is the one-process export (measured: max |diff| 1.3e-6)
    a, b = _params(runs / "pp_1f1b"), _params(runs / "single")
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() < 1e-5 for k in a)
    exported = _params(runs / "pp_1f1b")
    assert "lm_head.weight" not in exported and "model.layers.3.mlp.down_proj.weight" in exported  # tied: dropped
    assert exported.keys() == load_file(str(runs / "tied4" / "model.safetensors")).keys()


def test_pipeline_eval_matches_one_process(runs):
    pp, single = read_metrics(runs / "pp_1f1b", "eval"), read_metrics(runs / "single", "eval")
    assert sorted(pp) == sorted(single) == [0, STEPS]
    assert abs(pp[0] - single[0]) < 1e-6 and abs(pp[STEPS] - single[STEPS]) < 1e-5


def test_checkpoints_reshard_between_pp_degrees(runs):
    single = read_metrics(runs / "single")
    # PP=2 -> 1 process, and 1 process -> PP=2: the remaining steps as if uninterrupted
    _assert_losses_equal(read_metrics(runs / "single_from_pp"), single, range(4, STEPS + 1))
    _assert_losses_equal(read_metrics(runs / "pp_from_single"), single, range(4, STEPS + 1))
    _assert_params_close(_params(runs / "single_from_pp"), _params(runs / "single"))
    _assert_params_close(_params(runs / "pp_from_single"), _params(runs / "single"))


def test_metrics_have_stage_times_and_bubble(runs):
    records = [json.loads(line) for line in (runs / "pp_1f1b" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert len(train) == STEPS
    for r in train:
        assert len(r["pp_stage_compute_seconds"]) == 2 and all(s > 0 for s in r["pp_stage_compute_seconds"])
        assert r["pp_step_seconds"] >= max(r["pp_stage_compute_seconds"])
        assert 0 <= r["pp_bubble_fraction"] < 1
        assert r["pp_bubble_fraction_schedule"] == pytest.approx(1 / 3)  # (p - 1) / (m + p - 1), p = m = 2


# ---- slow: every schedule, and PP composed with FSDP and TP ----------------------------------------


def _single_untied(setup) -> Path:
    root, common = setup
    out = root / "single_untied"
    if not (out / "hf").is_dir():
        _single(_untied(common, root), out, **_flags())
    return out


EVAL = {"training.eval_batches": 2}  # + data.eval: the reference "single" run evaluates at 0 and STEPS


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,microbatches,tied,extra",
    [
        ("GPipe", 4, False, {"training.activation_checkpointing": "full"}),
        ("1F1B", 2, False, {"training.batch_size": 2, "training.grad_accum": 2}),  # the same 4 windows per step
        ("Interleaved1F1B", 2, True, EVAL),
        ("ZBVZeroBubble", 4, True, {}),
        ("ZBVZeroBubble", 2, False, {}),
    ],
)
def test_schedule_matches_one_process(setup, runs, tmp_path, schedule, microbatches, tied, extra):
    root, common = setup
    out, ref = tmp_path / schedule, runs / "single" if tied else _single_untied(setup)
    if extra is EVAL:
        extra = dict(EVAL, **{"data.eval": [common["data"]]})
    jobs = [
        (
            job_train,
            dict(
                common if tied else _untied(common, root),
                output=str(out),
                **_flags(
                    **{
                        "parallelism.pipeline_parallel_degree": 2,
                        "parallelism.pipeline_parallel_schedule": schedule,
                        "parallelism.pipeline_parallel_microbatches": microbatches,
                        **extra,
                    }
                ),
            ),
        )
    ]
    mp.spawn(spawn_worker, args=(2, free_port(), jobs), nprocs=2, join=True)
    _assert_losses_equal(read_metrics(out), read_metrics(ref), range(1, STEPS + 1))
    _assert_params_close(_params(out), _params(ref))
    if "data.eval" in extra:  # forward-only pipeline passes of the multi-stage schedules
        got, want = read_metrics(out, "eval"), read_metrics(ref, "eval")
        assert sorted(got) == [0, STEPS] and all(abs(got[k] - want[k]) < 1e-5 for k in got), (got, want)
    record = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in x][-1]
    print(schedule, microbatches, {k: v for k, v in record.items() if k.startswith("pp_")})


@pytest.mark.slow
def test_pp_with_fsdp_and_tp_on_four_ranks(setup, runs, tmp_path):
    """PP=2 x FSDP=2 (Interleaved1F1B, tied, vocab 97 sharded unevenly), PP=2 x HSDP (2 replicas,
    GPipe, tied) and PP=2 x TP=2 (1F1B, untied), each on 4 ranks, against one process."""
    root, common = setup
    jobs = [
        (
            job_train,
            dict(
                common,
                output=str(tmp_path / "pp_fsdp"),
                **_flags(
                    **{
                        "parallelism.pipeline_parallel_degree": 2,
                        "parallelism.pipeline_parallel_schedule": "Interleaved1F1B",
                        "training.batch_size": 2,
                        "parallelism.pipeline_parallel_microbatches": 2,
                    }
                ),
            ),
        ),
        (
            job_train,
            dict(
                common,
                output=str(tmp_path / "pp_hsdp"),
                **_flags(
                    **{
                        "parallelism.pipeline_parallel_degree": 2,
                        "parallelism.pipeline_parallel_schedule": "GPipe",
                        "parallelism.data_parallel_replicate_degree": 2,
                        "training.batch_size": 2,
                    }
                ),
            ),
        ),
        (
            job_train,
            dict(
                _untied(common, root),
                output=str(tmp_path / "pp_tp"),
                **_flags(**{"parallelism.pipeline_parallel_degree": 2, "parallelism.tensor_parallel_degree": 2}),
            ),
        ),
    ]
    mp.spawn(spawn_worker, args=(4, free_port(), jobs), nprocs=4, join=True)
    for name, ref in (("pp_fsdp", runs / "single"), ("pp_hsdp", runs / "single"), ("pp_tp", _single_untied(setup))):
        _assert_losses_equal(read_metrics(tmp_path / name), read_metrics(ref), range(1, STEPS + 1))
        _assert_params_close(_params(tmp_path / name), _params(ref))


@pytest.mark.slow
def test_more_stages_than_layers_under_torchrun_is_one_line(setup, tmp_path):
    """Interleaved1F1B on 2 ranks wants 4 stages; a 2-layer model has 2 layers: each rank prints one
    error line and exits 1 (torchrun then reports the failed workers)."""
    root, common = setup
    two = tiny_model(tmp_path / "two", "llama", vocab_size=98)
    cmd = [
        *torchrun_train(2),
        "--model",
        str(two),
        "--data",
        common["data"],
        "--output",
        str(tmp_path / "run"),
        "--steps",
        "1",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--no-compile",
        "--pp",
        "2",
        "--pp-schedule",
        "Interleaved1F1B",
    ]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert (
        errors
        == [
            "error: 4 pipeline stages for 2 layers: more stages than layers (lower --pp, or use "
            "GPipe/1F1B: one stage per rank)"
        ]
        * 2
    ), proc.stderr[-3000:]
    assert "baige/runtime" not in proc.stderr  # no traceback through baige's code
    # 1F1B needs at least as many micro-batches as stages: the schedule's check, as one line
    cmd[cmd.index("Interleaved1F1B")], cmd[cmd.index("--pp-schedule")] = "1", "--pp-microbatches"
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 2, proc.stderr[-3000:]
    assert errors[0].startswith("error: 1 pipeline micro-batches do not fit 1F1B with 2 stages on 2 ranks"), errors
    assert "baige/runtime" not in proc.stderr


def test_split_layers_puts_fewer_layers_beside_embedding_and_head():
    from baige.errors import BaigeError
    from baige.runtime.train.pipeline import split_layers, stage_ids

    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(6, 4) == [range(0, 1), range(1, 3), range(3, 5), range(5, 6)]
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]  # ties: the earlier stage
    assert split_layers(30, 4) == [range(0, 7), range(7, 15), range(15, 23), range(23, 30)]
    with pytest.raises(BaigeError, match="3 pipeline stages for 2 layers: more stages than layers"):
        split_layers(2, 3)
    assert stage_ids(0, 2, 4, v_shape=False) == (0, 2) and stage_ids(1, 2, 4, v_shape=False) == (1, 3)
    assert stage_ids(0, 2, 4, v_shape=True) == (0, 3) and stage_ids(1, 2, 4, v_shape=True) == (1, 2)


def test_checkpoint_from_before_the_flattened_optimizer_state_resumes(setup, tmp_path, one_thread):
    """Checkpoints written before PP hold the optimizer state nested (param groups by index): one
    process still resumes them, exactly as an uninterrupted run."""
    from train_utils import tiny_config

    from baige.runtime.train.checkpoint import optimizer_state_is_flat
    from baige.runtime.train.trainer import Trainer, run_training

    root, common = setup
    model, data = Path(common["model"]), Path(common["data"])
    flags = {"training.steps": 3, "training.batch_size": 2, "checkpoint.export_hf": False}
    full = run_training(tiny_config(model, data, tmp_path / "full", **flags))
    old = Trainer(tiny_config(model, data, tmp_path / "old", **dict(flags, **{"training.steps": 2})))
    for _ in range(2):
        old.train_step()
    path = old.ckpt.save(old.step, old._state(flat_optimizer=False), old.cfg.to_toml())  # the old layout
    assert not optimizer_state_is_flat(path) and optimizer_state_is_flat(
        tmp_path / "full" / "checkpoints" / "step_00000003"
    )
    resumed = run_training(tiny_config(model, data, tmp_path / "old", **flags))
    assert resumed.start_step == 2 and resumed.losses[3] == full.losses[3]
