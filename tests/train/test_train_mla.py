"""Training a tiny DeepSeek-V3 (MLA + group-limited sigmoid routing) through the trainer: the loss
falls, gradients reach every MLA projection, and the exported HF directory loads in transformers
with logits equal to baige's."""

from __future__ import annotations

import json
import math

import torch
from mla_tiny import make_mla_checkpoint
from train_utils import shakespeare, tiny_config, write_char_tokenizer

from baige.runtime.train.trainer import run_training


def test_deepseek_v3_trains_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    from baige.runtime.weights.loader import load_model

    model = make_mla_checkpoint(tmp_path / "m", "deepseek-v3", vocab_size=97)
    vocab = write_char_tokenizer(model, shakespeare(200_000))
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(20_000))
    cfg = tiny_config(
        model,
        data,
        tmp_path / "out",
        **{"training.steps": 12, "training.batch_size": 4, "optimizer.lr": 3e-3, "checkpoint.export_dtype": "float32"},
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_training(cfg)
    finally:
        torch.set_num_threads(threads)
    out = tmp_path / "out"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["split"] == "train"]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses  # it learns (character statistics at least)
    assert losses[0] < math.log(vocab) + 1.0

    export = out / "hf"
    trained = load_model(export, dtype="float32")
    start = load_model(model, dtype="float32")
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        a = getattr(trained.model.layers[1].self_attn, name).weight
        b = getattr(start.model.layers[1].self_attn, name).weight
        assert not torch.equal(a, b), name  # every MLA projection received gradient updates
    theirs = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ids = torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits
        got = trained.compute_logits(trained(ids, torch.arange(24).expand(2, 24)))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
