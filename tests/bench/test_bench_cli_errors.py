"""`baige bench` user mistakes: one `error:` line naming the option, a non-zero exit, no traceback.

The config dataclasses check them (and the output directory) before any model loads or server starts."""

import pytest


@pytest.mark.parametrize(
    "args,needle",
    [
        (["latency", "--seed", "-1"], "--seed must be an integer in [0, 9223372036854775807] (got -1)"),
        (["throughput", "--seed", "-1"], "--seed must be an integer in [0, 9223372036854775807] (got -1)"),
        (["compare", "--seed", str(2**64)], f"--seed must be an integer in [0, 9223372036854775807] (got {2**64})"),
        (["train", "--seed", "-1"], "--seed must be an integer in [0, 9223372036854775807] (got -1)"),
        (["serve", "--seed", "-1"], "--seed must be an integer in [0, 9223372036854775807] (got -1)"),
        (["serve", "--request-rate", "nan"], "--request-rate must be a number > 0 (got nan)"),
        (["serve", "--burstiness", "0"], "--burstiness must be a finite number > 0 (got 0.0)"),
        (["serve", "--burstiness", "nan"], "--burstiness must be a finite number > 0 (got nan)"),
        (["serve", "--slo", "ttft:nan"], "--slo: ttft must be a finite number of ms > 0 (got 'nan')"),
        (["serve", "--base-url", "localhost:8000"], "--base-url 'localhost:8000': expected http://HOST:PORT"),
    ],
)
def test_bad_values(cli_error, args, needle):
    assert needle in cli_error("bench", *args)


def test_output_dir_that_cannot_be_a_directory(cli_error, tmp_path):
    (tmp_path / "afile").write_text("x")
    assert f"--output-dir {tmp_path / 'afile'}: a file, not a directory" in cli_error(
        "bench", "latency", "--output-dir", tmp_path / "afile"
    )
    assert f"{tmp_path / 'afile'} is a file, not a directory" in cli_error(
        "bench", "kernels", "--op", "rms_norm", "--output-dir", tmp_path / "afile" / "results"
    )
    assert f"--output-dir {tmp_path / 'afile'}: a file, not a directory" in cli_error(  # the default suite
        "bench", "--output-dir", tmp_path / "afile"
    )


@pytest.mark.parametrize("load, threads, noted", [(2.04, 2, False), (2.8, 2, True), (2.1, 1, True), (1.5, 1, False)])
def test_load_note_discounts_the_runs_own_threads(tmp_path, capsys, load, threads, noted):
    """The "other work shared the machine" note on 2 CPUs: a --threads 2 run alone reads a load of ~2.0
    and gets none; half a CPU or more of load beyond the run's threads (and above the CPU count) gets it."""
    from baige.cli.bench.group import execute

    env = {"device": "cpu", "cpu_count": 2, "torch_num_threads": threads, "load_average": [load, 1.0, 1.0]}
    execute("throughput", lambda cfg, progress: {"environment": env, "limits": {}}, None, tmp_path, False, lambda r: "")
    assert ("other work shared the machine" in capsys.readouterr().err) == noted
