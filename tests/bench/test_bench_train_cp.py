"""``baige bench train --cp 2``: one process and two context-parallel ranks per sequence length, each in fresh
processes; the two train on the same synthetic data, so their losses agree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))
from train_utils import tiny_model  # noqa: E402


def test_cli_train_cp_sweep_reports_per_rank_memory_and_equal_losses(tmp_path):
    from baige.cli import app

    model = tiny_model(tmp_path / "model", "llama-tied", vocab_size=97)
    args = ["bench", "train", "--model", str(model), "--cp", "2", "--seq-lens", "32", "--batch-size", "1"]
    args += ["--steps", "2", "--warmup-steps", "1", "--output-dir", str(tmp_path / "out")]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    (path,) = (tmp_path / "out").glob("train_cp-*.json")
    r = json.loads(path.read_text())
    rows = r["rows"]
    assert [(x["seq_len"], x["context_parallel_degree"]) for x in rows] == [(32, 1), (32, 2)]
    assert [len(x["peak_memory_bytes"]) for x in rows] == [1, 2]
    assert rows[1]["context_parallel_method"] == "ring" and rows[0]["context_parallel_method"] is None
    for one, cp in (rows[0:2],):
        assert cp["last_loss"] == pytest.approx(one["last_loss"], abs=1e-5)
        assert cp["tokens_per_s_per_device"] == pytest.approx(cp["seq_len"] / cp["step_time_s"] / 2)
    assert all(0 <= m <= p for x in rows for m, p in zip(x["step_memory_bytes"], x["peak_memory_bytes"]))
    assert "tokens/s/device" in res.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cp", "2", "--seq-lens", "30"], "30 is not a multiple of 2 x --cp = 4"),
        (["--cp", "2", "--seq-lens", "32,x"], "expected comma-separated integers"),
        (["--seq-lens", "32"], "pass --cp N"),
        (["--cp", "2", "--cp-method", "zigzag"], "choose ring or ulysses"),
    ],
)
def test_cli_train_cp_errors(cli_error, tmp_path, args, message):
    err = cli_error("bench", "train", "--model", "debug", *args, "--output-dir", tmp_path)
    assert message in err
