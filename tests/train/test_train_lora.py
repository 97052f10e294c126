"""LoRA fine-tuning against PEFT on a tiny random checkpoint (SFT data with loss masks): the same
5 steps give the same losses and adapters; resume is exact (with dropout); the exported adapter
loads in PEFT with baige's logits; ``--merge`` equals PEFT's ``merge_and_unload``; a quantized
(int8) base trains QLoRA-style and merges. FSDP2 on 2 gloo ranks against one process:
test_train_distributed.py (it shares that file's process spawn)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from train_utils import read_metrics, shakespeare, tiny_config, tiny_model

from baige.runtime.model.lora import LORA_TARGETS, lora_modules

STEPS, LR, RANK = 5, 1e-3, 8
FLAGS = {
    "training.steps": STEPS,
    "training.batch_size": 1,
    "training.grad_accum": 2,
    "optimizer.lr": LR,
    "lr_scheduler.name": "constant",
    "lr_scheduler.warmup_steps": 0,
    "lora.rank": RANK,
    "lora.alpha": 16.0,
    "checkpoint.interval": 2,
    "metrics.peak_tflops": 1.0,
}


def _sft_data(path: Path) -> Path:
    """Conversations (user line -> assistant line) from tinyshakespeare: only assistant tokens carry loss."""
    lines = [ln for ln in shakespeare(12_000).splitlines() if ln.strip()]
    with path.open("w") as f:
        for q, a in zip(lines[::2], lines[1::2]):
            f.write(
                json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
            )
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = tiny_model(root / "m", "llama-tied", vocab_size=98, seed=3)  # tied: lm_head is the frozen embedding
    data = _sft_data(root / "sft.jsonl")
    return root, model, data


@pytest.fixture(scope="module")
def single(setup):
    """One process: baige's run (merge on), its initial A matrices, its data loader's batches."""
    from baige.runtime.train.data import DataLoader
    from baige.runtime.train.trainer import Trainer

    root, model, data = setup
    trainer = Trainer(tiny_config(model, data, root / "single", **FLAGS, **{"lora.merge": True}))
    init_a = {n: m.lora_A.weight.detach().clone() for n, m in lora_modules(trainer.model)}
    loader = DataLoader(trainer.train_windows, 1, 2, 1, 0, 0, True)  # the run's batches, replayed
    batches = [loader.next_step() for _ in range(STEPS)]
    result = trainer.train()
    return trainer, result, init_a, batches


def _peft_model(model_dir: Path, init_a: dict | None = None, adapter: Path | None = None):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        return PeftModel.from_pretrained(hf, adapter).eval()
    pm = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=16, lora_dropout=0.0, target_modules=list(LORA_TARGETS)))
    with torch.no_grad():
        for name, a in init_a.items():
            pm.get_submodule(f"base_model.model.{name}").lora_A["default"].weight.copy_(a)
    return pm


def test_lora_matches_peft(setup, single):
    """Same init, data, AdamW and clipping: losses and adapters within 1e-5 after 5 steps."""
    _, model_dir, _ = setup
    trainer, result, init_a, batches = single
    pm = _peft_model(model_dir, init_a)
    params = [p for p in pm.parameters() if p.requires_grad]
    assert sum(p.numel() for p in params) == trainer.lora_params
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    peft_losses = []
    for micro in batches:
        n_valid = sum(int((labels != -100).sum()) for _, labels in micro)
        total = 0.0
        for input_ids, labels in micro:
            logits = pm(input_ids=input_ids).logits
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum") / n_valid
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
        peft_losses.append(total)
    assert any((labels == -100).any() for micro in batches for _, labels in micro)  # loss masks in play
    ours = [result.losses[s] for s in range(1, STEPS + 1)]
    assert max(abs(a - b) for a, b in zip(ours, peft_losses)) < 1e-5, (ours, peft_losses)
    for name, m in lora_modules(trainer.model):
        peft_mod = pm.get_submodule(f"base_model.model.{name}")
        for ours_w, theirs in (
            (m.lora_A.weight, peft_mod.lora_A["default"].weight),
            (m.lora_B.weight, peft_mod.lora_B["default"].weight),
        ):
            assert (ours_w - theirs).abs().max() < 1e-5, name
        assert m.lora_B.weight.abs().max() > 1e-4  # B moved off its zero init


def test_adapter_loads_in_peft_and_merge_equals_merge_and_unload(setup, single):
    from transformers import AutoModelForCausalLM

    root, model_dir, _ = setup
    trainer, _, _, batches = single
    out = root / "single"
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == RANK and cfg["lora_alpha"] == 16.0 and sorted(cfg["target_modules"]) == sorted(LORA_TARGETS)
    keys = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert len(keys) == 2 * len(LORA_TARGETS) * 2  # A and B, 7 targets, 2 layers
    ids = batches[0][0][0]  # (1, 32)
    pm = _peft_model(model_dir, adapter=out / "adapter")
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.model.compute_logits(trainer.model(ids, torch.arange(ids.shape[1])[None]))
        theirs = pm(input_ids=ids).logits
        assert (ours - theirs).abs().max() < 1e-4
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(input_ids=ids).logits
        assert (theirs - base).abs().max() > 1e-3  # the adapter changes the logits
        merged_ref = pm.merge_and_unload()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)(input_ids=ids).logits
    assert (merged - merged_ref).abs().max() < 1e-4
    # the DCP checkpoint holds the adapters and their optimizer state, not the frozen base
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(out / "checkpoints" / "step_00000002")).read_metadata()
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:3]
    assert sum(1 for k in meta.state_dict_metadata if k.startswith("optimizer.state.")) > 0


def test_lora_resume_is_exact_with_dropout(setup, tmp_path):
    """4 steps with dropout 0.1 against 2 steps, a stop, and a resume from the step-2 checkpoint."""
    from baige.runtime.train.trainer import run_training

    _, model_dir, data = setup
    flags = {**FLAGS, "training.steps": 4, "lora.dropout": 0.1}
    run_training(tiny_config(model_dir, data, tmp_path / "a", **flags))
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_00000002", tmp_path / "b" / "checkpoints" / "step_00000002")
    resumed = run_training(tiny_config(model_dir, data, tmp_path / "b", **flags))
    assert resumed.start_step == 2
    full = read_metrics(tmp_path / "a")
    assert [full[s] for s in (3, 4)] == [resumed.losses[s] for s in (3, 4)]
    a = load_file(str(tmp_path / "a" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "b" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_another_lora_config_is_one_line(setup, tmp_path, single):
    """The single run's step-2 checkpoint (rank 8, all seven targets) resumed with rank 4, with fewer
    targets, and as full fine-tuning: one line naming the tensor, before anything is loaded."""
    from baige.errors import BaigeError
    from baige.runtime.train.trainer import run_training

    root, model_dir, data = setup
    step2 = root / "single" / "checkpoints" / "step_00000002"
    full = {k: v for k, v in FLAGS.items() if not k.startswith("lora.")}
    cases = [
        (
            {**FLAGS, "lora.rank": 4},
            r"holds model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight of shape \(8, 64\), "
            r"this run's is \(4, 64\)",
        ),
        (
            {**FLAGS, "lora.targets": ["q_proj"]},
            r"holds model\.layers\.0\.mlp\.down_proj\.lora_A\.weight "
            r"\(and \d+ more\) that this run does not train",
        ),
        (full, r"does not hold model\.embed_tokens\.weight, which this run trains"),
    ]
    for i, (flags, match) in enumerate(cases):
        out = tmp_path / f"r{i}" / "checkpoints"
        shutil.copytree(step2, out / step2.name)
        with pytest.raises(BaigeError, match=match) as e:
            run_training(tiny_config(model_dir, data, out.parent, **flags))
        assert "\n" not in str(e.value) and "config.toml" in str(e.value)


@pytest.mark.usefixtures("exact_quant_kernels")
def test_qlora_int8_base_trains_and_merges(setup, tmp_path):
    """A baige int8 checkpoint as the frozen base: the adapters train through the quantized matmuls,
    and the merged export (dequantized base + adapter) gives the adapted model's logits."""
    from baige.runtime.config import QuantizeConfig
    from baige.runtime.quantize import quantize_checkpoint
    from baige.runtime.train.trainer import Trainer
    from baige.runtime.weights.loader import load_model

    _, model_dir, data = setup
    qdir = tmp_path / "int8"
    quantize_checkpoint(QuantizeConfig(model=str(model_dir), method="int8", output=str(qdir)))
    trainer = Trainer(
        tiny_config(
            qdir, data, tmp_path / "run", **{**FLAGS, "training.steps": 3, "lora.merge": True, "checkpoint.interval": 0}
        )
    )
    result = trainer.train()
    assert type(trainer.model.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    assert all(m.lora_B.weight.abs().max() > 0 for _, m in lora_modules(trainer.model))  # gradients reached layer 0
    assert result.losses[3] < result.losses[1]
    merged = load_model(tmp_path / "run" / "hf", dtype=torch.float32).eval()
    ids = torch.arange(5, 37)[None]
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model.compute_logits(trainer.model(ids, torch.arange(32)[None]))
        got = merged.compute_logits(merged(ids, torch.arange(32)[None]))
    assert (want - got).abs().max() < 1e-4


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--lora-rank", "0"], "lora.rank must be an integer >= 1 (got 0)"),
        (["--lora-rank", "-3"], "lora.rank must be an integer >= 1 (got -3)"),
        (["--lora-rank", "4", "--lora-targets", "q_proj,qkv_proj"], "lora.targets: unknown module 'qkv_proj'"),
        (["--lora-rank", "4", "--lora-dropout", "1"], "lora.dropout must be < 1"),
        (["--lora-rank", "4", "--lora-alpha", "0"], "lora.alpha must be a finite number > 0"),
        (["--lora-alpha", "16"], "lora options need lora.rank"),
        (["--merge"], "lora options need lora.rank"),
        (["--model-config", "debug", "--lora-rank", "4"], "lora.rank needs pretrained weights (--model)"),
    ],
)
def test_lora_bad_flags(cli_error, tmp_path, args, needle):
    (tmp_path / "t.txt").write_text("To be, or not to be.\n")
    base = ["train", "--data", tmp_path / "t.txt", "-o", tmp_path / "run", "--steps", "1", "--no-compile"]
    assert needle in cli_error(*base, *args)


def test_lora_target_absent_from_the_model(cli_error, tmp_path):
    # a Qwen3-MoE with every layer sparse: its experts are stacked, so it has no gate_proj Linear
    model = tiny_model(tmp_path / "moe", "qwen3-moe", vocab_size=98, mlp_only_layers=[])
    (tmp_path / "t.txt").write_text(shakespeare(2000))
    err = cli_error(
        "train",
        "--model",
        model,
        "--data",
        tmp_path / "t.txt",
        "-o",
        tmp_path / "run",
        "--steps",
        "1",
        "--seq-len",
        "8",
        "--batch-size",
        "1",
        "--no-compile",
        "--lora-rank",
        "4",
        "--lora-targets",
        "q_proj,gate_proj",
    )
    assert "lora target 'gate_proj' is not a linear module of this model (qwen3_moe: " in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_lora_flags_reach_the_config(monkeypatch, tmp_path):
    from baige.cli import main
    from baige.runtime.train import trainer

    seen = []
    monkeypatch.setattr(trainer, "run_training", seen.append)
    (tmp_path / "t.txt").write_text("To be, or not to be.\n")
    with pytest.raises(SystemExit) as e:
        main(
            [
                "train",
                "--data",
                str(tmp_path / "t.txt"),
                "-o",
                str(tmp_path / "run"),
                "--lora-rank",
                "8",
                "--lora-alpha",
                "32",
                "--lora-dropout",
                "0.05",
                "--lora-targets",
                "q_proj, v_proj",
                "--lora-use-rslora",
                "--merge",
            ]
        )
    assert e.value.code in (0, None)
    lo = seen[0].lora
    assert (lo.rank, lo.alpha, lo.dropout, lo.targets, lo.use_rslora, lo.merge) == (
        8,
        32.0,
        0.05,
        ["q_proj", "v_proj"],
        True,
        True,
    )
    assert "[lora]\nrank = 8\nalpha = 32.0" in seen[0].to_toml()


@pytest.mark.parametrize("bits,group,symmetric", [(8, None, True), (4, 32, False)])
def test_frozen_quantized_linear_input_gradient(bits, group, symmetric):
    """The QLoRA base's backward (weight dequantized again) equals autograd through F.linear of the
    dequantized weight; the integer weight gets no gradient."""
    from baige.runtime.quant.linear import QuantizedLinear
    from baige.runtime.quant.scheme import QuantScheme, quantize_weight

    torch.manual_seed(0)
    lin = torch.nn.Linear(72, 40)
    scheme = QuantScheme(num_bits=bits, group_size=group, symmetric=symmetric)
    q = QuantizedLinear.from_quantized(lin, scheme, *quantize_weight(lin.weight.detach(), scheme))
    q.requires_grad_(False)
    x = torch.randn(3, 5, 72, requires_grad=True)
    y = q(x)
    assert y.requires_grad
    (g,) = torch.autograd.grad((y * torch.linspace(-1, 1, 40)).sum(), x)
    x2 = x.detach().requires_grad_()
    ref = F.linear(x2, q.dequantized_weight(), lin.bias)
    (g_ref,) = torch.autograd.grad((ref * torch.linspace(-1, 1, 40)).sum(), x2)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(g, g_ref)
