"""The serving side of LoRA: adapters PEFT itself saved, read by baige's loader, stacked on the
model's projections, and chosen per token in one batch; logits against PEFT's model with each
adapter active (and the base for tokens without one). Loader mismatches are one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from tiny import make_checkpoint

from baige.errors import BaigeError
from baige.runtime.model.lora import LoRABatch, attach_adapters
from baige.runtime.weights.loader import load_model
from baige.runtime.weights.peft import load_peft_adapter

ADAPTERS = {  # name -> (rank, alpha, targets, use_rslora): different ranks and targets share one stack
    "a": (4, 8, ["q_proj", "v_proj"], False),
    "b": (7, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora_serving")
    base = make_checkpoint(root / "base", "llama", seed=2)
    out = {"base": base}
    for i, (name, (r, alpha, targets, rs)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        pm = get_peft_model(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
            LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rs, init_lora_weights=False),
        )  # random B: the adapter does something
        pm.save_pretrained(root / name)
        out[name] = root / name
    return out


def _peft_logits(dirs, ids: torch.Tensor) -> dict:
    """PEFT's logits of ``ids`` with each adapter active, and with none (key None)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(dirs["base"], dtype=torch.float32)
    pm = PeftModel.from_pretrained(hf, dirs["a"], adapter_name="a").eval()
    pm.load_adapter(dirs["b"], adapter_name="b")
    out = {}
    with torch.no_grad():
        for name in ADAPTERS:
            pm.set_adapter(name)
            out[name] = pm(input_ids=ids).logits
        with pm.disable_adapter():
            out[None] = pm(input_ids=ids).logits
    return out


def test_stacked_adapters_per_token_match_peft(dirs):
    model = load_model(dirs["base"], dtype=torch.float32).eval()
    adapters = [load_peft_adapter(dirs[n], model) for n in ADAPTERS]
    assert [a.rank for a in adapters] == [4, 7]
    batch = LoRABatch()
    attach_adapters(model, [a.modules for a in adapters], batch, torch.float32)
    ids = torch.randint(0, 160, (3, 13), generator=torch.Generator().manual_seed(0))
    # sequence 0 -> adapter "b" (slot 1), 1 -> none, 2 -> "a" (slot 0): one mixed batch
    batch.token_lora_ids = torch.tensor([1, -1, 0]).repeat_interleave(13)  # (B * T,)
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(13).expand(3, 13)))
    ref = _peft_logits(dirs, ids)
    for row, name in ((0, "b"), (1, None), (2, "a")):
        assert (ours[row] - ref[name][row]).abs().max() < 1e-4, name
    base = ref[None][2]
    assert (ours[2] - base).abs().max() > 1e-2  # the adapter changed that sequence
    batch.token_lora_ids = None  # no adapter this step: the base model
    with torch.no_grad():
        plain = model.compute_logits(model(ids[2:3], torch.arange(13)[None]))[0]
    assert (plain - base).abs().max() < 1e-4


def _edit(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def test_loader_mismatches_are_one_line(dirs, tmp_path):
    model = load_model(dirs["base"], dtype=torch.float32)
    cases = [
        (_edit(dirs["a"], tmp_path / "rank", r=5), "do not fit rank 5"),
        (_edit(dirs["a"], tmp_path / "target", target_modules=["q_proj", "qkv_proj"]), "target module 'qkv_proj'"),
        (_edit(dirs["a"], tmp_path / "dora", use_dora=True), "use_dora=true adapters are not supported"),
        (_edit(dirs["a"], tmp_path / "kind", peft_type="PROMPT_TUNING"), "is not LORA"),
        (_edit(dirs["a"], tmp_path / "bias", bias="lora_only"), "also train biases or whole modules"),
        (tmp_path, "not a PEFT adapter directory"),
    ]
    other = load_model(make_checkpoint(tmp_path / "wide", "llama", hidden_size=96), dtype=torch.float32)
    with pytest.raises(BaigeError) as e:
        load_peft_adapter(dirs["a"], other)  # trained on the 64-wide base
    assert "do not fit rank 4 on a 96 -> 96 linear" in str(e.value) and "\n" not in str(e.value)
    for path, needle in cases:
        with pytest.raises(BaigeError) as e:
            load_peft_adapter(path, model)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
