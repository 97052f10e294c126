"""User mistakes on generate / serve / eval: one `error:` line, a non-zero exit, no traceback.

The other commands have theirs beside their tests (tests/train, tests/quant, tests/weights, tests/bench)."""

import subprocess
import sys

import pytest

from baige.errors import BaigeError


def test_serve_options_fail_before_the_model_loads(cli_error):
    assert f"--seed must be an integer in [-9223372036854775808, 18446744073709551615] (got {2**64})" in cli_error(
        "serve", "--seed", 2**64
    )
    assert "--kv-cache-memory: bad size 'lots'" in cli_error("serve", "--kv-cache-memory", "lots")
    assert "unknown kv_connector 'rdma'" in cli_error(
        "serve", "--kv-transfer-config", '{"kv_connector": "rdma", "kv_role": "kv_producer"}'
    )
    assert "kv_role 'decode'" in cli_error(
        "serve", "--kv-transfer-config", '{"kv_connector": "auto", "kv_role": "decode"}'
    )
    assert "--kv-offload-size: bad size 'lots'" in cli_error("serve", "--kv-offload-size", "lots")
    assert "--kv-offload-dir needs --kv-offload-size" in cli_error("serve", "--kv-offload-dir", "/tmp")
    for bad in ("-1", "nan"):
        assert "Invalid value for '--shutdown-timeout'" in cli_error("serve", "--shutdown-timeout", bad)


def test_eval_paths(cli_error, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    (tmp_path / "afile").write_text("x")
    assert f"--data {tmp_path / 'missing.txt'}: no such file" in cli_error(
        "eval", "ppl", "--data", tmp_path / "missing.txt"
    )
    assert f"--data {tmp_path}: a directory, not a file" in cli_error("eval", "ppl", "--data", tmp_path)
    assert f"--output {tmp_path}: a directory; give a file name" in cli_error(
        "eval", "ppl", "--data", text, "--output", tmp_path
    )
    assert f"{tmp_path / 'afile'} is a file, not a directory" in cli_error(
        "eval", "compare", "a", "b", "--data", text, "--output", tmp_path / "afile" / "r.json"
    )


def test_a_failed_load_leaves_no_progress_bar(cli_error, tmp_path):
    """The error comes from inside the progress bar (the model load); the bar is erased, not left above it."""
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.")
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file")
    assert "fake.gguf: not a valid GGUF file: not a GGUF file (no GGUF magic)" in cli_error(
        "eval", "ppl", "--data", text, "-m", tmp_path / "fake.gguf"
    )


def test_real_processes(tmp_path):
    """As a user runs them: the console entry point in a fresh interpreter, stderr one line, exit 1 or 2."""
    (tmp_path / "t.txt").write_text("hello")
    for args, code, needle in [
        (["train", "--data", tmp_path / "t.txt", "--lr", "nan", "-o", tmp_path / "run"], 1, "optimizer.lr"),
        (["generate", "-p", "hi", "--temperature", "nan"], 2, "--temperature"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "baige", *map(str, args)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == code and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert needle in proc.stderr


def test_serve_on_a_busy_port_or_bad_host_is_one_line_before_the_model_loads():
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        for args, needle in (
            (["--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
            (["--host", "999.1.1.1"], "cannot listen on 999.1.1.1"),
        ):
            proc = subprocess.run(
                [sys.executable, "-m", "baige", "serve", "--model", "/nonexistent", *args],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
            assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and needle in proc.stderr


def test_bad_config_json_values_are_named(tmp_path):
    import json

    from baige.runtime.model.config import ModelConfig

    base = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 160,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
    }
    for change, needle in (
        ({"hidden_size": "big"}, "hidden_size"),
        ({"num_hidden_layers": -1}, "num_hidden_layers"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps"),
        ({"head_dim": 0}, "head_dim"),
    ):
        with pytest.raises(BaigeError, match=needle):
            ModelConfig.from_dict({**base, **change})
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(BaigeError, match="JSON object"):
        ModelConfig.from_file(tmp_path / "config.json")


def test_kv_cache_larger_than_memory_is_one_line():
    import torch

    from baige.runtime.infer.kv_cache import num_blocks_for
    from baige.runtime.model.config import ModelConfig

    cfg = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "vocab_size": 160,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
        }
    )
    with pytest.raises(BaigeError, match="--kv-cache-memory"):
        num_blocks_for(cfg, 16, torch.float32, torch.device("cpu"), 100 * 10**12, 64)


def test_serve_reasoning_parser_the_model_cannot_use(cli_error):
    """SmolLM2 has no <think> token: one line after the model loads, the engine thread stopped."""
    import threading

    err = cli_error(
        "serve", "--port", 0, "--reasoning-parser", "qwen3", "--max-model-len", 64, "--kv-cache-memory", "8MB"
    )
    assert "--reasoning-parser qwen3: '<think>' is not one token of this model's vocabulary" in err
    assert not [t for t in threading.enumerate() if "engine" in t.name.lower() and t.is_alive()]
