"""`baige quantize` user mistakes: one `error:` line, non-zero exit, no traceback, nothing written.

QuantizeConfig checks them before the model is loaded (in-process through the entry point)."""

import pytest


@pytest.fixture
def paths(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    (tmp_path / "calib").mkdir()
    return tmp_path


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--method", "int4", "--group-size", "0"], "--group-size 0: choose 32, 64 or 128"),
        (
            ["--method", "gptq", "--group-size", "-32", "--calib-data", "{t}/afile"],
            "--group-size -32: choose 32, 64 or 128",
        ),
        (["--method", "int8", "--act-order"], "--act-order applies to --method gptq only"),
        (["--method", "gptq", "--calib-data", "{t}/missing.txt"], "--calib-data {t}/missing.txt: no such file"),
        (["--method", "int4", "--calib-data", "{t}/calib"], "--calib-data {t}/calib: a directory, not a file"),
        (["--method", "int8", "--output", "{t}/afile"], "--output {t}/afile: a file, not a directory"),
        (["--method", "int8", "--output", "{t}/afile/q"], "--output {t}/afile/q: {t}/afile is a file, not a directory"),
        (["--method", "int8", "--output", "{t}/full"], "{t}/full: already exists and is not empty"),
    ],
)
def test_bad_options_fail_before_loading(cli_error, paths, args, needle):
    args = [a.format(t=paths) for a in args]
    if "--output" not in args:
        args += ["--output", str(paths / "q")]
    assert needle.format(t=paths) in cli_error("quantize", *args)
    assert not (paths / "q").exists() and [p.name for p in (paths / "full").iterdir()] == ["keep.txt"]
