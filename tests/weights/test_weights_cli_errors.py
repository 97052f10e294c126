"""Model paths and `baige convert` outputs a user gets wrong: one `error:` line, non-zero exit, no traceback.

In-process through the entry point; every case fails before any weights are converted."""

import shutil

import pytest
from tiny import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama") / "ckpt", "llama")


@pytest.mark.parametrize(
    "content, problem",
    [
        (b"garbage", "7 bytes, shorter than the 8-byte header length"),
        (b'\x08\x00\x00\x00\x00\x00\x00\x00{"a":', "header length 8 bytes is past the end of the 13-byte file"),
    ],
)
def test_corrupt_safetensors(cli_error, ckpt, tmp_path, content, problem):
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "model.safetensors").write_bytes(content)
    err = cli_error("convert", bad, tmp_path / "out")
    assert err == f"error: {bad / 'model.safetensors'}: not a valid safetensors file: {problem}"
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_a_model(cli_error, ckpt, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    assert "notes.txt: a file that is not a model: give an HF directory with config.json or a .gguf file" in cli_error(
        "convert", tmp_path / "notes.txt", tmp_path / "out"
    )
    assert f"(its directory {ckpt} is one)" in cli_error("convert", ckpt / "config.json", tmp_path / "out")


def test_convert_outputs(cli_error, ckpt, tmp_path):
    (tmp_path / "afile").write_text("x")
    assert f"OUT {tmp_path / 'afile'}: a file, not a directory" in cli_error("convert", ckpt, tmp_path / "afile")
    assert f"{tmp_path / 'afile'} is a file, not a directory" in cli_error("convert", ckpt, tmp_path / "afile" / "o")
    assert "--max-shard-size '0' must be at least 1 byte" in cli_error(
        "convert", ckpt, tmp_path / "o", "--max-shard-size", "0"
    )
    assert "--max-shard-size: bad size 'lots'" in cli_error("convert", ckpt, tmp_path / "o", "--max-shard-size", "lots")
    assert not (tmp_path / "o").exists()


def test_unwritable_cache(cli_error, tmp_path, monkeypatch):
    """The embedded model is imported into $BAIGE_CACHE on first use; a cache that cannot hold it is one line."""
    from baige.runtime.settings import reload_settings

    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("BAIGE_CACHE", str(tmp_path / "afile"))
    reload_settings()
    err = cli_error("convert", "smollm2-135m-instruct", tmp_path / "out")
    assert f"cannot create {tmp_path / 'afile' / 'models'} for the imported model" in err and "BAIGE_CACHE" in err
