"""``baige bench grpo`` on a tiny random model: a sample per step with the reward and the phase times,
the summary, the table rows and the reward-curve chart; bad arguments are one line."""

from __future__ import annotations

import pytest
from train_utils import tiny_model

from baige.errors import BaigeError
from baige.runtime.bench.grpo import GRPOBenchConfig, run_grpo
from baige.runtime.bench.report import grpo_rows, write_plots


def test_bench_grpo(tmp_path, one_thread):
    model = tiny_model(tmp_path / "m")
    seen = []
    cfg = GRPOBenchConfig(str(model), steps=4, prompts_per_step=2, group_size=3, max_tokens=6, lr=1e-3)
    r = run_grpo(cfg, lambda done, total, what: seen.append((done, total)))
    assert r["benchmark"] == "grpo" and not r["interrupted"] and seen[-1] == (4, 4)
    assert [s["step"] for s in r["samples"]] == [1, 2, 3, 4]
    for s in r["samples"]:
        assert 0.0 <= s["reward"] <= 1.0 and 0 < s["response_length"] <= 6
        assert s["step_s"] >= s["rollout_s"] + s["train_s"] + s["weight_sync_s"] > 0
    summary = r["summary"]
    assert summary["reward_first"] == r["samples"][0]["reward"] and summary["reward_last"] == r["samples"][-1]["reward"]
    assert summary["logprob_mismatch_max"] < 1e-5 and summary["peak_memory_bytes"] > 0
    assert [row[0] for row in grpo_rows(r)][:2] == ["step time (median)", "  rollout"]
    (png,) = write_plots(r, tmp_path / "plots", "grpo")
    assert png.name == "grpo-reward.png" and png.stat().st_size > 1000


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"group_size": 1}, "--group-size must be an integer >= 2 (got 1)"),
        ({"difficulty": 6}, "--difficulty must be an integer in [1, 5] (got 6)"),
        ({"lr": float("nan")}, "--lr must be a finite number >= 0"),
    ],
)
def test_bench_grpo_bad_arguments(kwargs, needle):
    with pytest.raises(
        BaigeError, match=needle.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")
    ):
        GRPOBenchConfig(**kwargs)
