"""`baige train` on ERNIE-4.5 dense, Gemma 2 and Gemma 3 (tiny random checkpoints, tests/tiny.py): the loss
falls over a few steps, the exported checkpoint reloads in transformers with baige's logits, and the
soft-capped loss (Gemma 2's final_logit_softcapping, which the fused cross-entropy does not have) equals
transformers' own loss."""

from __future__ import annotations

import pytest
import torch
from train_utils import read_metrics, shakespeare, tiny_config, tiny_model

from baige.runtime.model.gemma import lm_head_cross_entropy
from baige.runtime.train.trainer import run_training
from baige.runtime.weights.loader import load_model


def test_soft_capped_loss_equals_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = tiny_model(tmp_path / "m", "gemma2")
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(input_ids=ids, labels=ids).loss
        model = load_model(path, dtype="float32")
        hidden = model(ids, torch.arange(30).expand(2, 30))
        labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # next token; none after the last
        got = lm_head_cross_entropy(model.config, hidden, model.lm_head.weight, labels)
        uncapped = torch.nn.functional.cross_entropy(
            (hidden @ model.lm_head.weight.T)[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1)
        )
    assert model.config.gemma.final_logit_softcapping == 3.0
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert (uncapped - ref).abs() > 1e-2  # the cap matters at these logits


@pytest.mark.parametrize("variant", ["ernie4.5", "gemma2", "gemma3"])
def test_training_lowers_the_loss_and_exports_for_transformers(tmp_path, variant, one_thread):
    from transformers import AutoModelForCausalLM

    model = tiny_model(tmp_path / "model", variant)
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(8_000))
    cfg = tiny_config(model, data, tmp_path / "out", **{"training.steps": 8, "training.batch_size": 4})
    run_training(cfg)
    losses = read_metrics(tmp_path / "out")
    assert losses[8] < losses[1] - 0.3, losses
    export = tmp_path / "out" / "hf"
    theirs = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ours = load_model(export, dtype="float32")
    ids = torch.randint(0, 60, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits
        got = ours.compute_logits(ours(ids, torch.arange(40).expand(2, 40)))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", ["ernie4.5", "gemma2", "gemma3"])
def test_trainer_loss_equals_transformers_on_its_first_batch(tmp_path, variant, one_thread):
    """The trainer's own forward and loss (grad on: the tied embedding's lookup, the fused or soft-capped
    cross-entropy) on its first micro-batch equal transformers' cross-entropy of the same windows."""
    from transformers import AutoModelForCausalLM

    from baige.runtime.train.trainer import Trainer

    model = tiny_model(tmp_path / "model", variant)
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(8_000))
    trainer = Trainer(tiny_config(model, data, tmp_path / "out", **{"training.steps": 1, "training.batch_size": 2}))
    ids, labels, positions, md = trainer._shard(trainer.loader.next_step()[0])
    loss, _, _ = trainer._loss_sum(ids, labels, positions, md, float((labels != -100).sum()))
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(input_ids=ids).logits
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    assert torch.is_grad_enabled() and loss.requires_grad
    torch.testing.assert_close(loss.detach(), ref, rtol=1e-5, atol=1e-5)
