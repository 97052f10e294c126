"""DeepSeek-V3's multi-token prediction (MTP) trained as an extra loss (``--set model.mtp_depth=D``): the
loss against a hand-written reference built from the same weights (transformers computes the main
model's hidden states), a short run that lowers it and logs it, the export under DeepSeek-V3's tensor
names (transformers ignores them, baige reloads them), and the config errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from train_utils import shakespeare, tiny_config, tiny_model

from baige.errors import BaigeError
from baige.runtime.train.mtp import num_valid
from baige.runtime.train.trainer import Trainer

SCALE = 0.5  # model.mtp_loss_scaling_factor in these tests


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reference_mtp_losses(hf, mtp_state: dict, ids: torch.Tensor, labels: torch.Tensor, depth: int) -> list[float]:
    """Per depth k the mean cross-entropy of predicting ``t_{i+k+1}`` (arXiv:2412.19437 §2.2), from the
    weights alone: h^0 from transformers, then enorm / hnorm / eh_proj over [emb(t_{i+k}); h^{k-1}_i],
    the block (transformers' LlamaDecoderLayer holding the MTP block's weights), shared_head.norm and
    the main model's head."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    c = hf.config
    eps = c.rms_norm_eps
    emb = hf.model.embed_tokens(ids)
    h = hf.model(input_ids=ids).last_hidden_state  # after the final norm
    T = ids.shape[1]
    losses = []
    for k in range(1, depth + 1):
        w = {n.removeprefix(f"mtp.{k - 1}."): t for n, t in mtp_state.items() if n.startswith(f"mtp.{k - 1}.")}
        x = torch.cat([_rms(emb[:, k:], w["enorm.weight"], eps), _rms(h[:, :-1], w["hnorm.weight"], eps)], -1)
        x = x @ w["eh_proj.weight"].T
        block = LlamaDecoderLayer(c, layer_idx=0).eval()
        block.load_state_dict({n.removeprefix("block."): t for n, t in w.items() if n.startswith("block.")})
        pos = torch.arange(T - k)[None]
        out = block(x, position_embeddings=hf.model.rotary_emb(x, pos), attention_mask=None, position_ids=pos)
        h = out[0] if isinstance(out, tuple) else out
        logits = _rms(h, w["shared_head.norm.weight"], eps) @ hf.lm_head.weight.T
        losses.append(F.cross_entropy(logits.flatten(0, 1), labels[:, k:].flatten(), ignore_index=-100).item())
    return losses


@pytest.fixture
def mtp_trainer(tmp_path, one_thread):
    model = tiny_model(tmp_path / "m", "llama")  # untied: the MTP head is lm_head, not the embedding
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(20_000))
    flags = {
        "model.mtp_depth": 2,
        "model.mtp_loss_scaling_factor": SCALE,
        "parallelism.mixed_precision_param": "float32",
        "training.batch_size": 2,
        "training.steps": 8,
        "optimizer.lr": 3e-3,
        "checkpoint.export_dtype": "float32",
    }
    return Trainer(tiny_config(model, data, tmp_path / "run", **flags)), model


def test_mtp_loss_equals_a_hand_written_reference(mtp_trainer):
    from transformers import AutoModelForCausalLM

    trainer, model_dir = mtp_trainer
    model = trainer.model
    with torch.no_grad():  # non-unit norms: an enorm / hnorm mix-up would show
        for name, p in model.mtp.named_parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    ids, labels, positions, md = trainer._shard(trainer.loader.next_step()[0])
    labels = labels.clone()
    labels[0, 5:9] = -100  # masked targets are skipped at every depth
    counts = [float(n) for n in num_valid(labels, 2)]
    assert counts == [float((labels[:, k:] != -100).sum()) for k in (1, 2)]
    _, _, sums = trainer._loss_sum(ids, labels, positions, md, 1.0, counts)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mtp_state = {n: t.detach() for n, t in model.state_dict().items() if n.startswith("mtp.")}
    with torch.no_grad():
        ref = _reference_mtp_losses(hf, mtp_state, ids, labels, 2)
    got = [s.item() for s in sums]
    assert got == pytest.approx(ref, abs=1e-6)
    assert all(3.0 < r < 7.0 for r in ref)  # about log(vocab): a real loss, not a degenerate one


def test_mtp_trains_logs_and_exports(mtp_trainer, tmp_path):
    from transformers import AutoModelForCausalLM

    from baige.runtime.weights.loader import load_model

    trainer, _ = mtp_trainer
    result = trainer.train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    mtp = [r["mtp_loss"] for r in records if r["split"] == "train"]
    assert len(mtp) == 8 and mtp[-1] < mtp[0] - 0.3, mtp
    assert len(result.losses) == 8
    export = result.export
    names = (
        set(json.loads((export / "model.safetensors.index.json").read_text())["weight_map"])
        if (export / "model.safetensors.index.json").exists()
        else set(_safetensors_names(export))
    )
    for k in (2, 3):  # DeepSeek-V3's layout: layer num_hidden_layers + k - 1
        for n in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "embed_tokens", "shared_head.head"):
            assert f"model.layers.{k}.{n}.weight" in names
        assert f"model.layers.{k}.self_attn.q_proj.weight" in names
    assert not any(n.startswith("mtp.") for n in names)
    assert json.loads((export / "config.json").read_text())["num_nextn_predict_layers"] == 2
    ours = load_model(export, dtype="float32")
    assert len(ours.mtp) == 2
    for (n, a), (m, b) in zip(trainer.model.mtp.state_dict().items(), ours.mtp.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    theirs = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ids = torch.randint(3, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            ours.compute_logits(ours(ids, torch.arange(20)[None])), theirs(input_ids=ids).logits, rtol=1e-4, atol=1e-4
        )


def _safetensors_names(export):
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), "pt") as f:
        return list(f.keys())


@pytest.mark.parametrize(
    "flags, needle",
    [
        ({"model.mtp_depth": -1}, "model.mtp_depth must be an integer >= 0"),
        ({"model.mtp_depth": 1, "model.mtp_loss_scaling_factor": -0.1}, "model.mtp_loss_scaling_factor must be >= 0"),
        ({"model.mtp_depth": 1, "parallelism.pipeline_parallel_degree": 2}, "does not support --pp"),
        ({"model.mtp_depth": 1, "training.attn_mask_type": "block_causal"}, "does not support training.attn_mask"),
    ],
)
def test_mtp_config_errors(tmp_path, flags, needle):
    data = tmp_path / "d.txt"
    data.write_text("hello")
    with pytest.raises(BaigeError, match=needle.replace(".", r"\.")):
        tiny_config(tmp_path, data, tmp_path / "out", **flags)
