"""gpt-oss trains in one process: a few steps on tinyshakespeare lower the loss, move the attention
sinks (their gradient flows through the attention kernel) and the expert biases, and the HF export
loads in transformers with the trained model's logits."""

from __future__ import annotations

import torch
from train_utils import read_metrics, shakespeare, tiny_config, tiny_model

from baige.runtime.train.trainer import run_training
from baige.runtime.weights.loader import load_model

GPT_OSS = dict(
    model_type="gpt_oss",
    hidden_size=72,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=18,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=6,
)


def test_gpt_oss_trains_and_exports(tmp_path, one_thread):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model(tmp_path / "m", "llama", **GPT_OSS)  # seq_len 32: longer than the window
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(8_000))
    run_training(tiny_config(model_dir, data, tmp_path / "out", **{"training.steps": 4, "training.batch_size": 2}))
    losses = read_metrics(tmp_path / "out")
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]
    before, after = load_model(model_dir, dtype=torch.float32), load_model(tmp_path / "out" / "hf", dtype=torch.float32)
    for name in ("model.layers.0.self_attn.sinks", "model.layers.1.mlp.experts.down_proj_bias"):
        assert not torch.equal(before.state_dict()[name], after.state_dict()[name]), name
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf", dtype=torch.float32).eval()
        ref = hf(ids).logits
        out = after.compute_logits(after(ids, torch.arange(40)[None]))
    assert (out - ref).abs().max().item() < 1e-4
