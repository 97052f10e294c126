"""Crafted files through the real commands, as a user runs them (a fresh interpreter each): every one
exits non-zero with one `error:` line naming the file and the problem, no traceback, no marker file from a
pickle payload, and no output written. The processes run side by side to keep the test short."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_crafted_files import CORPUS, _Payload
from test_fuzz_files import write_tiny_gguf
from tiny import make_checkpoint, make_lora_adapter, write_tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> tuple[dict[str, tuple[list, str, Path | None]], Path]:
    """(case name -> (baige arguments, text its error line must hold, a path that must not exist after),
    the marker file the pickle payloads would create)."""
    root = tmp_path_factory.mktemp("crafted")
    ckpt = write_tiny_tokenizer(make_checkpoint(root / "ckpt", "llama"))
    marker = root / "marker"

    def variant(name: str) -> Path:
        out = root / name
        shutil.copytree(ckpt, out)
        return out

    big = variant("big")  # the reported failure: an absurd size ran for minutes
    cfg = json.loads((big / "config.json").read_text())
    cfg.update(hidden_size=2**16, intermediate_size=2**20, num_attention_heads=512, num_key_value_heads=512)
    (big / "config.json").write_text(json.dumps(cfg))

    lying = variant("lying")  # safetensors whose header promises more bytes than the file holds
    data = (lying / "model.safetensors").read_bytes()
    (lying / "model.safetensors").write_bytes(data[: len(data) // 2])

    pickled = variant("pickled")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))

    looping = variant("looping")  # the reported failure: jinja2's sandbox error as a traceback
    tok_cfg = json.loads((looping / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = (CORPUS / "template_nested_loops.jinja").read_text()
    (looping / "tokenizer_config.json").write_text(json.dumps(tok_cfg))

    gguf = write_tiny_gguf(root / "tiny.gguf")  # the reported failure: gguf's IndexError on a corrupt header
    cut = root / "cut.gguf"
    cut.write_bytes(gguf.read_bytes()[:3000])

    pickle_adapter = root / "pickle_adapter"
    pickle_adapter.mkdir()
    (pickle_adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]})
    )
    (pickle_adapter / "adapter_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    allowed = root / "allowed"
    allowed.mkdir()
    outside = make_lora_adapter(ckpt, root / "outside", 4, ["q_proj"], 0)

    serve = ["serve", "--port", "0", "--model"]
    lora = ["--enable-lora", "--lora-modules"]
    return {
        "absurd config": (
            ["generate", "-m", big, "-p", "t1", "--dtype", "float32"],
            f"{big}/config.json: a model of",
            None,
        ),
        "lying safetensors": (
            ["quantize", "-m", lying, "-o", root / "q", "--method", "int8"],
            f"{lying}/model.safetensors: not a valid safetensors file: tensor",
            root / "q",
        ),
        "pickle checkpoint": (["generate", "-m", pickled, "-p", "t1"], f"{pickled}: only pickle checkpoints", None),
        "corrupt gguf": (["convert", cut, root / "c"], f"{cut}: not a valid GGUF file: ", root / "c"),
        "looping template": (["chat", "-m", looping], f"chat template ({looping}/tokenizer_config.json) exceeds", None),
        "escaping template": (
            ["serve", "--port", "0", "--chat-template", CORPUS / "template_escape.jinja"],
            "template_escape.jinja) violates the sandbox",
            None,
        ),
        "pickle adapter": (
            [*serve, ckpt, *lora, f"a={pickle_adapter}"],
            f"{pickle_adapter}/adapter_model.bin: a pickle adapter is refused",
            None,
        ),
        "adapter outside --lora-root": (
            [*serve, ckpt, *lora, f"a={outside}", "--lora-root", allowed],
            f"is outside --lora-root ({allowed})",
            None,
        ),
    }, marker


def test_crafted_files_through_the_commands(cases, tmp_path):
    cases, marker = cases
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "baige", *map(str, args)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        for name, (args, _, _) in cases.items()
    }
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)  # a guard against a hang, not a timing assertion
        lines = [line for line in err.splitlines() if line.strip()]
        assert proc.returncode == 1, (name, err)
        assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), (name, err)
        assert cases[name][1] in lines[0], (name, lines[0])
        assert cases[name][2] is None or not cases[name][2].exists(), name
    assert not marker.exists()  # no pickle was ever opened
    assert not any(tmp_path.iterdir())  # nothing written where the commands ran
