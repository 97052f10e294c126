"""`baige train` user mistakes: one `error:` line naming the bad field, a non-zero exit, no traceback.

Every case fails in TrainConfig's checks, before a model or a file is loaded (in-process, milliseconds)."""

import pytest


@pytest.fixture
def base(tmp_path):
    (tmp_path / "train.txt").write_text("To be, or not to be, that is the question.\n")
    (tmp_path / "afile").write_text("x")
    # one tiny step, so that a check that regressed fails in seconds rather than training for minutes
    return [
        "train",
        "--data",
        tmp_path / "train.txt",
        "--output",
        tmp_path / "run",
        "--steps",
        "1",
        "--seq-len",
        "8",
        "--batch-size",
        "1",
        "--no-compile",
    ]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--lr", "nan"], "optimizer.lr must be a finite number >= 0 (got nan)"),
        (["--optimizer", "lion"], "optimizer.name must be adamw or muon (got 'lion')"),
        (["--dtype", "float16"], "parallelism.mixed_precision_param must be auto, float32 or bfloat16"),
        (["--set", "optimizer.ns_steps=0"], "optimizer.ns_steps must be an integer in [1, 99] (got 0)"),
        (["--lr", "-1"], "optimizer.lr must be a finite number >= 0 (got -1.0)"),
        (["--lr", "inf"], "optimizer.lr must be a finite number >= 0 (got inf)"),
        (["--seed", "-1"], "training.seed must be an integer in [0, 9223372036854775807] (got -1)"),
        (["--seed", str(2**64)], f"training.seed must be an integer in [0, 9223372036854775807] (got {2**64})"),
        (["--eval-every", "-1"], "training.eval_every must be >= 0"),
        (["--set", "optimizer.betas=[0.9, 2]"], "optimizer.betas must be two numbers in [0, 1)"),
        (["--set", "optimizer.betas=[nan, 0.9]"], "optimizer.betas must be two numbers in [0, 1)"),
        (["--set", "optimizer.lr=nan"], "optimizer.lr must be a finite number"),
        (["--set", "optimizer.weight_decay=-0.1"], "optimizer.weight_decay"),
        (["--set", "lr_scheduler.min_lr_ratio=2"], "lr_scheduler.min_lr_ratio must be a finite number >= 0 and <= 1"),
        (["--set", "lr_scheduler.warmup_steps=-5"], "lr_scheduler.warmup_steps must be >= 0"),
        (["--set", "training=5"], "config 'training' is a section, not a field"),
        (["--set", "checkpoint.keep_latest=-1"], "checkpoint.keep_latest must be >= 0"),
    ],
)
def test_bad_values(cli_error, base, args, needle):
    assert needle in cli_error(*base, *args)


def test_bad_paths(cli_error, base, tmp_path):
    (tmp_path / "dir.toml").mkdir()
    (tmp_path / "binary.toml").write_bytes(b"\xff\xfe\x00")
    assert "dir.toml: cannot read the config file as UTF-8 text (IsADirectoryError)" in cli_error(
        "train", "--config", tmp_path / "dir.toml"
    )
    assert "binary.toml: cannot read the config file as UTF-8 text (UnicodeDecodeError)" in cli_error(
        "train", "--config", tmp_path / "binary.toml"
    )
    assert f"data.train '{tmp_path}' is a directory" in cli_error(*base, "--data", tmp_path)
    assert f"output {tmp_path / 'afile'}: a file, not a directory" in cli_error(*base, "-o", tmp_path / "afile")
    err = cli_error(*base, "-o", tmp_path / "afile" / "run")
    assert f"{tmp_path / 'afile'} is a file, not a directory" in err
    assert not (tmp_path / "run").exists()
    long = f"/tmp/{'x' * 5000}"  # a name the file system refuses (ENAMETOOLONG): was an OSError traceback
    assert cli_error(*base, "--data", long).endswith("x': File name too long")
    assert cli_error(*base, "-o", long).startswith(f"error: output '/tmp/{'x' * 110}")


def test_ep_flag_reaches_the_config(cli_error, tmp_path):
    from baige.runtime.train.config import load_train_config

    text = tmp_path / "t.txt"
    text.write_text("hello world " * 50)
    cfg = load_train_config(None, {"parallelism.expert_parallel_degree": 2, "data.train": [str(text)]}, None)
    assert cfg.parallelism.expert_parallel_degree == 2
    assert "parallelism.expert_parallel_degree" in cli_error(
        "train", "--data", text, "--model-config", "moe-tiny", "--ep", 0, "-o", tmp_path / "run"
    )


@pytest.mark.parametrize("name", ["latin1.txt", "latin1.jsonl"])
def test_data_that_is_not_utf8_is_one_line(cli_error, base, tmp_path, name, embedded_dir):
    data = tmp_path / name
    data.write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1") if name.endswith(".jsonl") else "café".encode("latin-1"))
    err = cli_error(
        *base, "--data", data, "--model-config", "moe-tiny", "--tokenizer", embedded_dir, "-o", tmp_path / "run-bad"
    )
    assert f"{data}: not UTF-8 text (it holds the byte 0xe9)" in err


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--pp", "2"], "pipeline_parallel_degree 2 does not divide world_size 1"),
        (["--pp", "0"], "parallelism.pipeline_parallel_degree must be an integer >= 1 (got 0)"),
        (
            ["--pp-schedule", "zigzag"],
            "parallelism.pipeline_parallel_schedule must be one of GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble (got "
            "'zigzag')",
        ),
        (
            ["--batch-size", "4", "--pp-microbatches", "3"],
            "parallelism.pipeline_parallel_microbatches 3 must divide training.batch_size 4",
        ),
        (["--pp", "2", "--ep", "2"], "pipeline parallel (--pp) does not compose with expert parallel (--ep) yet"),
        (["--pp", "2", "--lora-rank", "4", "--model", "MODEL"], "pipeline parallel (--pp) does not compose with LoRA"),
        (
            ["--pp", "2", "--pp-schedule", "zbvzerobubble", "--eval-data", "EVAL"],
            "evaluation (--eval-data) under ZBVZeroBubble is not supported",
        ),
    ],
)
def test_bad_pipeline_options(cli_error, base, args, needle):
    args = [base[2] if a in ("EVAL", "MODEL") else a for a in args]  # a file that exists (checked later)
    assert needle in cli_error(*base, *args)
