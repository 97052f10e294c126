"""``baige bench startup``: its plan of runs and summary by hand, bad values, a failing command, and one
real run on a tiny checkpoint (serve, generate and --help as child processes)."""

import json
from pathlib import Path

import pytest
from tiny import make_checkpoint, write_tiny_tokenizer

from baige.runtime.bench.startup import StartupConfig, cold_env, plan, summarize_runs

MEASURED = {"serve_ready_s", "generate_ttft_s", "generate_exit_s", "help_s"}


def test_plan_runs_warmups_then_warm_then_cold_and_no_cold_help():
    warm, warmup, cold = ("warm", True), ("warm", False), ("cold", True)
    runs = plan(StartupConfig(repeats=2, num_iters_warmup=1))
    assert runs == [
        ("help", *warmup),
        ("help", *warm),
        ("help", *warm),
        *[(c, *state) for c in ("generate", "serve") for state in (warmup, warm, warm, cold, cold)],
    ]
    assert plan(StartupConfig(repeats=1, num_iters_warmup=0, cold=False)) == [
        ("help", *warm),
        ("generate", *warm),
        ("serve", *warm),
    ]


def test_cold_runs_point_every_cache_under_their_empty_root(tmp_path):
    env = cold_env({"PATH": "/usr/bin", "BAIGE_CACHE": "/home/u/.cache/baige"}, tmp_path)
    assert env["PATH"] == "/usr/bin"
    assert {k: Path(env[k]).parent for k in ("BAIGE_CACHE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")} == {
        "BAIGE_CACHE": tmp_path,
        "TRITON_CACHE_DIR": tmp_path,
        "TORCHINDUCTOR_CACHE_DIR": tmp_path,
    }


def test_summary_by_hand():
    samples = [{"measurement": "serve_ready_s", "cache": "warm", "seconds": s} for s in (3.0, 1.0, 2.0)]
    samples += [{"measurement": "serve_ready_s", "cache": "cold", "seconds": 9.0}]
    samples += [{"measurement": "help_s", "cache": "warm", "seconds": s} for s in (0.4, 0.7)]
    assert summarize_runs(samples) == {
        "serve_ready_s": {
            "warm": {"runs": 3, "median": 2.0, "min": 1.0, "max": 3.0},
            "cold": {"runs": 1, "median": 9.0, "min": 9.0, "max": 9.0},
        },
        "help_s": {"warm": {"runs": 2, "median": 0.55, "min": 0.4, "max": 0.7}},
    }


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--timeout", "0"], "--timeout must be a finite number > 0 (got 0.0)"),
        (["--timeout", "nan"], "--timeout must be a finite number > 0 (got nan)"),
        (["--repeats", "0"], "Invalid value for '--repeats'"),
        (["--num-iters-warmup", "-1"], "Invalid value for '--num-iters-warmup'"),
    ],
)
def test_bad_values(cli_error, args, needle):
    assert needle in cli_error("bench", "startup", *args)


def test_a_command_that_fails_is_one_line_naming_it(cli_error, tmp_path):
    err = cli_error(
        *("bench", "startup", "-m", tmp_path / "missing", "--repeats", "1", "--num-iters-warmup", "0", "--no-cold"),
        *("--output-dir", tmp_path / "out"),
    )
    assert err.startswith("error: `baige generate` exited with code 1: error: ") and "missing" in err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())  # no result written


def test_one_real_run_on_a_tiny_checkpoint(tmp_path, monkeypatch):
    from baige.cli import main

    model = write_tiny_tokenizer(make_checkpoint(tmp_path / "tiny", "llama"))
    monkeypatch.setenv("BAIGE_KERNELS", "reference")  # the children compile no native library
    out = tmp_path / "out"
    args = ["--repeats", "1", "--num-iters-warmup", "0", "--no-cold", "--max-tokens", "4", "--output-dir", out]
    with pytest.raises(SystemExit) as e:
        main(["bench", "startup", "-m", str(model), *map(str, args)])
    assert e.value.code == 0
    (path,) = out.glob("startup-*.json")
    r = json.loads(path.read_text())
    assert r["benchmark"] == "startup" and r["interrupted"] is False and r["model_id"] == str(model)
    assert r["units"] == dict.fromkeys(MEASURED, "s") and r["args"]["max_tokens"] == 4
    assert set(r["summary"]) == MEASURED and {s["measurement"] for s in r["samples"]} == MEASURED
    for name, by_cache in r["summary"].items():
        assert list(by_cache) == ["warm"] and by_cache["warm"]["runs"] == 1 and by_cache["warm"]["min"] > 0, name
    s = {name: by_cache["warm"]["median"] for name, by_cache in r["summary"].items()}
    assert s["generate_ttft_s"] < s["generate_exit_s"]  # the first token is printed before the process ends
    assert r["commands"]["generate"][-2:] == ["--model", str(model)] and "--max-tokens" in r["commands"]["generate"]
    assert r["environment"]["cpu_count"] >= 1
