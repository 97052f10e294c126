"""Strict loading, its user-facing failures, spec resolution and the convert round trip."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import make_checkpoint

from baige.errors import BaigeError
from baige.runtime.config import parse_size
from baige.runtime.weights.hub import resolve_model
from baige.runtime.weights.loader import load_model


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "baige", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama") / "ckpt", "llama")


def shard(src: Path, dst: Path) -> Path:
    """Split src/model.safetensors into two shards + an index, as HF writes them."""
    dst.mkdir()
    state = load_file(src / "model.safetensors")
    names = sorted(state)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in parts.items():
        save_file({k: state[k] for k in keys}, dst / fname, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_sharded_checkpoint_loads_same_weights(ckpt, tmp_path):
    a, b = load_model(ckpt), load_model(shard(ckpt, tmp_path / "sharded"))
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), name


def test_missing_shard_is_one_line_naming_it(ckpt, tmp_path):
    d = shard(ckpt, tmp_path / "sharded")
    (d / "model-00002-of-00002.safetensors").unlink()
    proc = run_cli("convert", str(d), str(tmp_path / "out"))
    assert_one_line_error(proc, "model-00002-of-00002.safetensors", "missing")
    assert not (tmp_path / "out").exists()


def test_index_entry_with_absent_tensor_names_it(ckpt, tmp_path):
    d = shard(ckpt, tmp_path / "sharded")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    proc = run_cli("convert", str(d), str(tmp_path / "out"))
    assert_one_line_error(proc, "model.layers.9.mlp.up_proj.weight", "absent")


def test_untied_without_lm_head_names_it(ckpt, tmp_path):
    d = tmp_path / "nohead"
    d.mkdir()
    state = load_file(ckpt / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, d / "model.safetensors")
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    proc = run_cli("convert", str(d), str(tmp_path / "out"))
    assert_one_line_error(proc, "lm_head.weight")


def test_missing_and_unexpected_tensors(ckpt, tmp_path):
    state = load_file(ckpt / "model.safetensors")
    for mutate, needle in [
        (lambda s: s.pop("model.layers.1.self_attn.k_proj.weight"), "model.layers.1.self_attn.k_proj.weight"),
        (lambda s: s.__setitem__("model.extra.weight", torch.zeros(2)), "model.extra.weight"),
        (lambda s: s.__setitem__("model.norm.weight", torch.zeros(3)), "model.norm.weight"),
    ]:
        d = tmp_path / needle.replace(".", "_")
        d.mkdir()
        s = dict(state)
        mutate(s)
        save_file(s, d / "model.safetensors")
        (d / "config.json").write_text((ckpt / "config.json").read_text())
        with pytest.raises(BaigeError, match=needle.replace(".", r"\.")):
            load_model(d)


def test_pickle_only_and_unknown_config_are_refused(ckpt, tmp_path):
    d = tmp_path / "pickle"
    d.mkdir()
    torch.save({}, d / "pytorch_model.bin")
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    with pytest.raises(BaigeError, match="safetensors only"):
        load_model(d)
    cfg = json.loads((ckpt / "config.json").read_text())
    for key, value, needle in [
        ("model_type", "gpt2", "'gpt2'"),
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "'longrope'"),
    ]:
        bad = tmp_path / f"bad-{key}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        (bad / "model.safetensors").symlink_to(ckpt / "model.safetensors")
        proc = run_cli("convert", str(bad), str(tmp_path / f"out-{key}"))
        assert_one_line_error(proc, needle)


def test_legacy_rope_scaling_type_key(ckpt, tmp_path):
    from baige.runtime.model.config import ModelConfig

    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 10000.0
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    mc = ModelConfig.from_dict(cfg)
    assert mc.rope_scaling == {"rope_type": "linear", "factor": 2.0} and mc.rope_theta == 10000.0


def test_bf16_checkpoint_stays_bf16(ckpt, tmp_path):
    proc = run_cli("convert", str(ckpt), str(tmp_path / "bf16"), "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    from baige.runtime.model.config import ModelConfig
    from baige.runtime.model.device import resolve_dtype

    # auto without a device (convert, quantize) keeps the checkpoint's dtype; on the CPU it is the CPU's
    # choice (tests/model/test_dtype_auto.py), which the suite pins to fp32
    assert resolve_dtype("auto", ModelConfig.from_file(tmp_path / "bf16" / "config.json")) == torch.bfloat16
    assert load_model(tmp_path / "bf16").lm_head.weight.dtype == torch.float32
    model = load_model(tmp_path / "bf16", "bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert load_model(tmp_path / "bf16", "float32").lm_head.weight.dtype == torch.float32


def test_convert_round_trip_sharded_loads_in_transformers(ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "converted"
    proc = run_cli("convert", str(ckpt), str(out), "--max-shard-size", "40KB")
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*.safetensors"))) > 1
    ids = torch.randint(0, 160, (1, 23))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(ckpt).eval()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    assert torch.equal(ref, got)
    # refuses to overwrite
    proc = run_cli("convert", str(ckpt), str(out))
    assert_one_line_error(proc, str(out), "not empty")


def test_written_checkpoint_has_the_umask_modes(ckpt, tmp_path):
    """A directory written through atomic_dir (convert, quantize, train checkpoints) ends up with the modes a
    plain mkdir / open give under the umask (0755 / 0644 under 022; not mkdtemp's owner-only 0700), also
    under a stricter umask (027)."""
    from baige.runtime.weights.safetensors_io import load_state_dict, save_hf_checkpoint

    state = load_state_dict(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    for mask in (0o022, 0o027):
        old = os.umask(mask)
        try:
            out = save_hf_checkpoint(state, config, tmp_path / f"out{mask:o}", tokenizer_dir=ckpt)
        finally:
            os.umask(old)
        assert (out.stat().st_mode & 0o777) == 0o777 & ~mask
        files = [p for p in out.rglob("*") if p.is_file()]
        assert any(p.name == "model.safetensors" for p in files) and len(files) >= 3
        assert {p.stat().st_mode & 0o777 for p in files} == {0o666 & ~mask}, [
            (p.name, oct(p.stat().st_mode)) for p in files
        ]


def test_spec_errors(tmp_path):
    with pytest.raises(BaigeError, match="no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(BaigeError, match="GGUF file not found"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(BaigeError, match="no such model"):
        resolve_model("./does/not/exist")


def test_offline_uncached_repo_is_one_line(tmp_path):
    proc = run_cli(
        "convert",
        "some-org/not-a-cached-model",
        str(tmp_path / "out"),
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )
    assert_one_line_error(proc, "some-org/not-a-cached-model")


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("1GiB") == 2**30
    assert parse_size("500 MB") == 500 * 10**6
    with pytest.raises(BaigeError):
        parse_size("lots")
