"""The crafted-file corpus (tests/weights/corpus, written by make_corpus.py): truncated files, lying lengths
and offsets, absurd sizes, wrong types, sandbox escapes and unbounded loops. Each is read the way baige reads
its kind and must fail with one BaigeError line naming the file and the problem, quickly, and no other
exception; plus pickle payloads that would create a marker file, and adapter paths outside --lora-root."""

from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
from pathlib import Path

import pytest
from tiny import make_checkpoint, make_lora_adapter, write_tiny_tokenizer

from baige.errors import BaigeError
from baige.runtime.model.chat_template import ChatTemplateError, probe_template
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.validate import read_safetensors_header
from baige.runtime.weights.validate_gguf import check_gguf

CORPUS = Path(__file__).parent / "corpus"
MANIFEST = json.loads((CORPUS / "manifest.json").read_text())


def _read_side_file(path: Path, tmp_path: Path) -> None:
    """Put a side file where a checkpoint keeps it and read it as baige does."""
    name = path.name
    if name.startswith("adapter_config"):
        from baige.runtime.weights.peft import _read_config

        shutil.copy(path, tmp_path / "adapter_config.json")
        _read_config(tmp_path)
        return
    write_tiny_tokenizer(tmp_path)
    target = {"tokenizer_config": "tokenizer_config.json", "generation": "generation_config.json"}
    dest = next((v for k, v in target.items() if name.startswith(k)), "tokenizer.json")
    shutil.copy(path, tmp_path / dest)
    Tokenizer.from_dir(tmp_path)


def _read(kind: str, path: Path, tmp_path: Path) -> None:
    if kind == "safetensors":
        read_safetensors_header(path)
    elif kind == "gguf":
        check_gguf(path)
    elif kind == "config":
        ModelConfig.from_file(path)
    elif kind == "chat_template":
        probe_template(path.read_text(), str(path))
    else:
        _read_side_file(path, tmp_path)


@pytest.mark.parametrize("name", sorted(MANIFEST))
def test_each_crafted_file_is_one_line_naming_it(name, tmp_path):
    kind, problem = MANIFEST[name]
    with pytest.raises(BaigeError) as e:
        _read(kind, CORPUS / name, tmp_path)
    message = str(e.value)
    assert problem in message and "\n" not in message, message
    named = name if kind in ("safetensors", "gguf", "config", "chat_template") else ""
    assert named in message, message
    if kind == "chat_template":
        assert isinstance(e.value, ChatTemplateError)


def test_the_corpus_is_what_make_corpus_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_corpus", CORPUS / "make_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path)
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == sorted(p.name for p in CORPUS.iterdir() if p.suffix != ".py" and p.name != "__pycache__")
    assert all((tmp_path / n).read_bytes() == (CORPUS / n).read_bytes() for n in made)
    assert sum((CORPUS / n).stat().st_size for n in made) < 100_000  # the corpus stays small


class _Payload:
    """A pickle that creates ``marker`` when unpickled (what a malicious .bin does, harmlessly)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("base") / "ckpt", "llama")
    return write_tiny_tokenizer(path)


def test_pickle_adapters_and_checkpoints_are_refused_unopened(ckpt, tmp_path):
    import torch

    from baige.runtime.weights.loader import load_model
    from baige.runtime.weights.peft import load_peft_adapter

    marker = tmp_path / "marker"
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]})
    )
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    model = load_model(ckpt, torch.float32)
    with pytest.raises(BaigeError, match="adapter_model.bin: a pickle adapter is refused"):
        load_peft_adapter(adapter, model)
    pickled = tmp_path / "pickled"
    shutil.copytree(ckpt, pickled)
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(BaigeError, match="only pickle checkpoints"):
        load_model(pickled)
    assert not marker.exists()


def test_adapter_checks_before_reading_tensors(ckpt, tmp_path):
    import torch

    from baige.runtime.infer.lora import LoRAManager, LoRARequest, resolve_lora_path
    from baige.runtime.weights.loader import load_model
    from baige.runtime.weights.peft import load_peft_adapter

    model = load_model(ckpt, torch.float32)
    good = make_lora_adapter(ckpt, tmp_path / "roots" / "a" / "good", 4, ["q_proj", "v_proj"], 0)
    assert load_peft_adapter(good, model, max_rank=4).rank == 4
    with pytest.raises(BaigeError, match=r"adapter_config.json: rank 4 exceeds --max-lora-rank 2"):
        load_peft_adapter(good, model, max_rank=2)
    lying = tmp_path / "lying"
    shutil.copytree(good, lying)
    data = bytearray((lying / "adapter_model.safetensors").read_bytes())
    data[8:16] = b'{"x":{  '  # the header no longer parses
    (lying / "adapter_model.safetensors").write_bytes(bytes(data))
    with pytest.raises(BaigeError, match=r"adapter_model.safetensors: not a valid safetensors file: header is not"):
        load_peft_adapter(lying, model)
    # --lora-root: the path is resolved (.., symlinks) before it is compared
    root = tmp_path / "roots" / "a"
    assert resolve_lora_path(str(good), (str(root),)) == good.resolve()
    outside = f"{root}/../../lying"
    with pytest.raises(BaigeError, match="is outside --lora-root") as e:
        resolve_lora_path(outside, (str(root),))
    assert e.value.param == "lora_path"
    (root / "link").symlink_to(lying)
    with pytest.raises(BaigeError, match="is outside --lora-root"):
        resolve_lora_path(str(root / "link"), (str(root),))
    manager = LoRAManager(model, 8, (str(root),))  # what /v1/load_lora_adapter calls
    assert manager.read(LoRARequest("good", 1, str(good))).rank == 4
    with pytest.raises(BaigeError, match=r"LoRA adapter 'x': lora_path .* is outside --lora-root") as e:
        manager.read(LoRARequest("x", 2, outside))
    assert e.value.param == "lora_path"


def test_a_config_far_larger_than_memory_is_refused_with_the_number(ckpt, tmp_path):
    from baige.runtime.weights.loader import load_model

    big = tmp_path / "big"
    shutil.copytree(ckpt, big)
    cfg = json.loads((big / "config.json").read_text())
    cfg.update(hidden_size=2**16, intermediate_size=2**20, num_attention_heads=512, num_key_value_heads=512)
    (big / "config.json").write_text(json.dumps(cfg))
    n = ModelConfig.from_file(big / "config.json").num_params()
    with pytest.raises(BaigeError) as e:
        load_model(big, "float32")
    assert f"{big / 'config.json'}: a model of {n} parameters in float32 needs" in str(e.value)
    assert f"({4 * n} bytes), more than the" in str(e.value) and "free on cpu" in str(e.value)


def test_a_config_declaring_more_layers_than_the_checkpoint_fails_before_building(ckpt, tmp_path):
    from baige.runtime.weights.loader import load_model

    deep = tmp_path / "deep"
    shutil.copytree(ckpt, deep)
    cfg = json.loads((deep / "config.json").read_text())
    (deep / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 60000}))
    with pytest.raises(
        BaigeError, match=r"declares num_hidden_layers=60000 but the checkpoint has tensors of 2 layers"
    ):
        load_model(deep, "float32")


def test_a_tensor_of_the_wrong_kind_is_refused_before_reading(ckpt, tmp_path):
    """An integer tensor where the model holds floats (its header says so): refused by the meta-device
    check, before the data is read (torch would otherwise fail deep inside load_state_dict)."""
    import torch
    from safetensors.torch import load_file, save_file

    from baige.runtime.weights.loader import load_model

    bad = tmp_path / "int"
    shutil.copytree(ckpt, bad)
    state = load_file(str(bad / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.int32)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(BaigeError, match=r"tensor 'model.norm.weight' is int32, the model expects a floating-point"):
        load_model(bad)
