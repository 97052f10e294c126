"""GRPO end to end on a tiny random model: the reward rises, the engine holds the trainer's weights
after every step (full and LoRA), resume is exact, 2 data-parallel ranks match 1, and the CLI."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.multiprocessing as mp
from rl_utils import grpo_config, job_grpo, read_records, write_prompts
from train_utils import free_port, spawn_worker, tiny_model

KEYS = ("reward", "reward_std", "kl", "logprob_mismatch", "engine_trainer_kl", "clip_fraction", "entropy")
KEYS += ("response_length", "loss", "grad_norm", "lr", "rollout_tokens_per_s", "train_tokens_per_s", "weight_sync_s")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    return tiny_model(root / "model"), write_prompts(root / "prompts.jsonl", 8)


def _engine_params(trainer) -> dict[str, torch.Tensor]:
    return dict(trainer.llm.engine.model.named_parameters())


def test_reward_rises_and_the_engine_follows_the_trainer(tiny, tmp_path, one_thread):
    from baige.runtime.train.rl.grpo import GRPOTrainer

    model, data = tiny
    trainer = GRPOTrainer(grpo_config(model, data, tmp_path / "run"))
    result = trainer.train()
    records = read_records(tmp_path / "run")
    full = [__import__("json").loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(records) == list(range(1, 13)) and all(k in full[0] for k in KEYS)
    rewards = [records[s]["reward"] for s in range(1, 13)]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.3, rewards  # a random model emits "e" ~1% of the time; GRPO makes it a habit
    r = records[12]
    assert r["kl"] is None  # no reference model without rl.kl_coef
    assert r["clip_fraction"] == 0.0  # one epoch: the ratio is exactly 1
    assert 0 < r["response_length"] <= 8 and r["entropy"] > 0
    assert 0 <= r["logprob_mismatch"] < 1e-5  # fp32 engine vs trainer forward: summation order only
    assert (
        r["reward/rl_utils:target_token_reward"] == pytest.approx(r["reward"])
        and "accuracy/rl_utils:target_token_reward" not in r
    )
    assert result.checkpoint is not None and result.checkpoint.name == "step_00000012"
    engine = _engine_params(trainer)
    for name, p in trainer.model.named_parameters():  # the last step's weights reached the engine, exactly
        assert torch.equal(engine[name], p.detach()), name


def test_lora_syncs_only_the_adapter(tiny, tmp_path, one_thread):
    """The engine serves the run's adapter; after training it holds the trainer's A and B exactly and
    the base weights it loaded, untouched."""
    from baige.runtime.model.lora import lora_modules
    from baige.runtime.train.rl.grpo import GRPOTrainer
    from baige.runtime.train.rl.rollout import ADAPTER

    model, data = tiny
    trainer = GRPOTrainer(grpo_config(model, data, tmp_path / "lora", **{"training.steps": 3, "lora.rank": 4}))
    base = {n: p.detach().clone() for n, p in _engine_params(trainer).items()}
    result = trainer.train()
    served = trainer.llm.engine.lora.get(ADAPTER).adapter.modules
    assert sorted(served) == sorted(name for name, _ in lora_modules(trainer.model))
    for name, module in lora_modules(trainer.model):
        a, b, scaling = served[name]
        assert module.lora_B.weight.abs().max() > 0, name  # the adapter trained
        assert torch.equal(a, module.lora_A.weight.detach()) and torch.equal(b, module.lora_B.weight.detach()), name
        assert scaling == module.lora_scaling
    assert all(torch.equal(p, base[n]) for n, p in _engine_params(trainer).items())
    records = read_records(tmp_path / "lora")
    assert result.losses and set(records) == {1, 2, 3}
    # the rollouts ran through the adapter: engine and trainer agree after it moved
    assert records[3]["logprob_mismatch"] < 1e-5


def test_resume_is_exact(tiny, tmp_path, one_thread):
    """KL to the reference, 2 epochs per step (off-policy ratios, clipping), TIS, per-sequence loss and
    Dr. GRPO advantages; 4 steps straight against 2 + resume + 2."""
    from baige.runtime.train.trainer import run_training

    model, data = tiny
    flags = {
        "training.steps": 4,
        "rl.kl_coef": 0.05,
        "rl.epochs_per_step": 2,
        "rl.tis_cap": 2.0,
        "rl.clip_high": 0.28,
        "rl.loss_agg_mode": "seq-mean-token-mean",
        "rl.norm_adv_by_std_in_grpo": False,
        "optimizer.lr": 3e-2,
        "checkpoint.interval": 2,
    }
    run_training(grpo_config(model, data, tmp_path / "straight", **flags))
    shutil.copytree(
        tmp_path / "straight" / "checkpoints" / "step_00000002", tmp_path / "resumed" / "checkpoints" / "step_00000002"
    )
    run_training(grpo_config(model, data, tmp_path / "resumed", **flags))
    straight, resumed = read_records(tmp_path / "straight"), read_records(tmp_path / "resumed")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert resumed[step] == straight[step], step
    assert straight[4]["kl"] > 0 and straight[4]["clip_fraction"] > 0


def test_two_ranks_match_one(tiny, tmp_path, one_thread):
    """Batch-invariant mode, fixed seeds: every per-step metric of 2 gloo ranks (2 prompts each) equals
    the 1-process run's (4 prompts) within 1e-5."""
    from baige.runtime.train.trainer import run_training

    model, data = tiny
    flags = {"training.steps": 6, "rl.batch_invariant": True, "rl.kl_coef": 0.05, "training.batch_size": 5}
    job = dict(model=str(model), data=str(data), output=str(tmp_path / "two"), **flags)
    mp.spawn(spawn_worker, args=(2, free_port(), [(job_grpo, job)]), nprocs=2, join=True)
    run_training(grpo_config(model, data, tmp_path / "one", **flags))
    one, two = read_records(tmp_path / "one"), read_records(tmp_path / "two")
    assert sorted(one) == sorted(two) == list(range(1, 7))
    for step in one:
        for key, value in one[step].items():
            if isinstance(value, float):
                assert abs(two[step][key] - value) < 1e-5, (step, key, two[step][key], value)
            else:
                assert two[step][key] == value, (step, key)
    assert max(one[s]["reward"] for s in one) > one[1]["reward"]  # the run learned something to compare
    assert all(two[s]["logprob_mismatch"] == 0.0 for s in two)  # batch-invariant engines under FSDP2 too


def test_batch_invariant_engine_and_trainer_logprobs_are_equal(tiny, tmp_path, one_thread):
    """--batch-invariant: the trainer's recomputation of every sampled token's logprob equals the
    engine's bitwise, at every step (the weights change between them)."""
    from baige.runtime.train.trainer import run_training

    model, data = tiny
    run_training(grpo_config(model, data, tmp_path / "bi", **{"training.steps": 3, "rl.batch_invariant": True}))
    for step, r in read_records(tmp_path / "bi").items():
        assert r["logprob_mismatch"] == 0.0 and r["engine_trainer_kl"] == 0.0, (step, r)


# ---- the CLI ---------------------------------------------------------------------------------------


def _cli_args(model, data, output, *extra):
    return [
        "train", "--method", "grpo", "--model", model, "--data", data, "--output", output, "--steps", "1",
        "--lr", "1e-3", "--set", "rl.group_size=2", "--set", "rl.prompts_per_step=2", "--set", "rl.max_tokens=4",
        "--set", "metrics.tensorboard=false", "--set", "checkpoint.export_hf=false", *extra,
    ]  # fmt: skip


def test_cli_runs_grpo(tiny, tmp_path, one_thread, capsys):
    from baige.cli import main

    model, data = tiny
    args = _cli_args(
        model, data, tmp_path / "cli", "--reward", "rl_utils:target_token_reward=2", "--reward", "length_penalty=0.5"
    )
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args + ["--batch-invariant"]])
    assert e.value.code in (0, None)
    (record,) = read_records(tmp_path / "cli").values()
    assert record["reward"] == pytest.approx(
        2 * record["reward/rl_utils:target_token_reward"] + 0.5 * record["reward/length_penalty"]
    )
    assert "step      1  reward" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,needle",
    [
        (
            ["--reward", "exact"],
            "--reward 'exact': unknown reward (built-ins: exact_answer, regex, json_schema, length_penalty",
        ),
        (
            ["--reward", "exact_answer=heavy"],
            "--reward 'exact_answer=heavy': the weight 'heavy' is not a finite number",
        ),
        (
            ["--reward", "exact_answer"],
            'prompts.jsonl:1: the record has no "answer" field, which the exact_answer reward needs',
        ),
        (
            ["--reward", "nosuchmodule_q:f"],
            "--reward nosuchmodule_q:f: cannot import 'nosuchmodule_q' (ModuleNotFoundError",
        ),
        (["--reward", "regex"], "the regex reward needs a pattern: --set rl.reward_regex='...'"),
        ([], "--method grpo needs a reward"),
        (["--reward", "exact_answer", "--set", "rl.group_size=1"], "rl.group_size must be an integer >= 2 (got 1)"),
        (["--reward", "exact_answer", "--set", "rl.loss_agg_mode=mean"], "rl.loss_agg_mode must be one of token-mean"),
        (["--reward", "exact_answer", "--batch-invariant", "--lora-rank", "4"], "--batch-invariant does not compose"),
        (
            ["--reward", "length_penalty", "--batch-invariant", "--set", "parallelism.mixed_precision_param=bfloat16"],
            "--batch-invariant needs the trainer to compute in the engine's dtype; autocast to bfloat16 over fp32",
        ),
    ],
)
def test_cli_errors(tiny, tmp_path, cli_error, one_thread, extra, needle):
    model, data = tiny
    assert needle in cli_error(*_cli_args(model, data, tmp_path / "err", *extra))


@pytest.mark.parametrize(
    "reward,message",
    [
        ("rl_utils:raising_reward", "error: reward rl_utils:raising_reward failed: ValueError: the grader is down"),
        (
            "rl_utils:short_reward",
            "error: reward rl_utils:short_reward returned 3 values; expected a list of 4 numbers",
        ),
        (
            "rl_utils:huge_reward",
            "error: a sample's weighted reward is 1e+39, beyond float32's range (3.4e+38): scale the rewards or "
            "their weights down",
        ),
    ],
)
def test_cli_a_failing_reward_stops_the_run_with_one_line(tiny, tmp_path, one_thread, capsys, reward, message):
    """The run has started (its log is on stderr): the failure is the last line, no traceback, no checkpoint."""
    from baige.cli import main

    model, data = tiny
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in _cli_args(model, data, tmp_path / "bad", "--reward", reward)])
    err = capsys.readouterr().err
    assert e.value.code not in (0, None) and "Traceback" not in err
    assert err.strip().splitlines()[-1] == message
    assert not (tmp_path / "bad" / "checkpoints").exists() or not any((tmp_path / "bad" / "checkpoints").iterdir())


def test_cli_rl_options_need_grpo(cli_error, tmp_path):
    (tmp_path / "t.txt").write_text("hello")
    err = cli_error("train", "--data", tmp_path / "t.txt", "--reward", "exact_answer", "--output", tmp_path / "o")
    assert "rl options (--reward, --batch-invariant, rl.*) need --method grpo" in err
    assert "--method must be one of sft, pretrain, grpo" in cli_error(
        "train", "--data", tmp_path / "t.txt", "--method", "ppo"
    )


def test_cli_a_prompt_too_long_for_the_context_names_its_line(tiny, tmp_path, cli_error, one_thread):
    model, _ = tiny
    data = tmp_path / "long.jsonl"
    data.write_text('{"prompt": "hi"}\n' + '{"prompt": "%s"}\n' % ("e" * 300))
    err = cli_error(*_cli_args(model, data, tmp_path / "err", "--reward", "length_penalty"))
    assert (
        err
        == f"error: {data}:2: the prompt (300 tokens) plus rl.max_tokens (4) exceeds the model's context of 256 tokens"
    )


def test_cli_a_rollout_kv_cache_beyond_free_memory_names_the_rl_options(
    tiny, tmp_path, one_thread, capsys, monkeypatch
):
    """Said in rl.* terms (the engine's own check speaks of --kv-cache-memory, a flag this command has not)."""
    from baige.cli import main
    from baige.runtime.train.rl import rollout

    monkeypatch.setattr(rollout, "available_memory", lambda device: 100)
    model, data = tiny
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in _cli_args(model, data, tmp_path / "err", "--reward", "length_penalty")])
    err = capsys.readouterr().err
    assert e.value.code not in (0, None) and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: the rollout's KV cache (4 sequences of up to ") and last.endswith(
        "more than the 0.0 GiB free on cpu; lower rl.max_tokens, rl.group_size or rl.prompts_per_step"
    ), last
