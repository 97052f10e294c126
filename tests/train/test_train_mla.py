"""Training a tiny DeepSeek-V3 (MLA + group-limited sigmoid routing) through the trainer with
auxiliary-loss-free balancing (``moe.load_balance=bias``): the loss falls, gradients reach every MLA
projection, the routers' ``e_score_correction_bias`` moves by whole update steps, the bias update
follows the observed load of the group-limited choice, and the exported HF directory loads in
transformers with logits equal to baige's."""

from __future__ import annotations

import json
import math

import pytest
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
        **{
            "training.steps": 12,
            "training.batch_size": 4,
            "optimizer.lr": 3e-3,
            "checkpoint.export_dtype": "float32",
            "moe.load_balance": "bias",
            "moe.bias_update_rate": 0.01,
        },
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
    for i in (1, 2):  # the selection biases: 12 steps of +-0.01 each (sign of mean load - load)
        moved = (
            trained.model.layers[i].mlp.gate.e_score_correction_bias
            - start.model.layers[i].mlp.gate.e_score_correction_bias
        ) / 0.01
        assert moved.abs().max() > 0.5 and torch.allclose(moved, moved.round(), atol=1e-3), moved
        assert moved.abs().max() <= 12 + 1e-3
    theirs = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ids = torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits
        got = trained.compute_logits(trained(ids, torch.arange(24).expand(2, 24)))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_bias_update_follows_the_group_limited_choice(tmp_path):
    """Every token's logits favour experts 0, 1, 2 (groups {0, 1} and {2, 3} kept): the load is
    [10, 10, 10, 0, ...], so those three biases go down by the rate and the others up."""
    from baige.runtime.train.config import MoESection
    from baige.runtime.train.moe import MoEBalancer, RouterLogits
    from baige.runtime.weights.loader import load_model

    model = load_model(make_mla_checkpoint(tmp_path / "m", "deepseek-v3"), dtype="float32")
    bal = MoEBalancer(model, MoESection(load_balance="bias", bias_update_rate=0.25), 1, lambda t: t)
    assert bal.layers == [1, 2]
    before = [b.gate.e_score_correction_bias.clone() for b in bal.blocks]
    logits = torch.full((10, 8), -5.0)
    logits[:, :3] = 5.0
    router = RouterLogits()
    router.append(logits)
    router.append(logits)
    bal.micro_batch_loss(router)
    bal.end_step()
    delta = 0.25 * torch.tensor([-1.0, -1, -1, 1, 1, 1, 1, 1])  # sign(mean load 30/8 - load)
    for block, b0 in zip(bal.blocks, before):
        torch.testing.assert_close(block.gate.e_score_correction_bias, b0 + delta)


def test_bias_balancing_is_refused_without_a_selection_bias(tmp_path):
    from baige.errors import BaigeError
    from baige.runtime.train.config import MoESection
    from baige.runtime.train.moe import MoEBalancer
    from baige.runtime.weights.loader import load_model

    model = load_model(make_mla_checkpoint(tmp_path / "m", "deepseek-v2"), dtype="float32")
    with pytest.raises(BaigeError, match="load_balance=bias"):
        MoEBalancer(model, MoESection(load_balance="bias"), 1, lambda t: t)
