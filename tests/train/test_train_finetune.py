"""Fine-tune the embedded SmolLM2-135M-Instruct on tinyshakespeare (first 90% train, last 10% held out)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import DATA_DIR

SEQ_LEN, EVAL_BATCHES, BATCH = 64, 4, 2


def _hf_loss(model, windows: torch.Tensor) -> float:
    """Mean next-token loss of a transformers model on (n, T + 1) windows."""
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits  # (n, T, vocab)
    return F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten()).item()


# ~25k training tokens through a 135M model: too slow for the default suite, hence slow-marked.
@pytest.mark.slow
def test_finetune_smollm2_on_tinyshakespeare(tmp_path, embedded_dir, hf_embedded):
    from typer.testing import CliRunner

    from baige.cli.app import app
    from baige.runtime.model.tokenizer import Tokenizer
    from baige.runtime.train.config import load_train_config
    from baige.runtime.train.trainer import run_training
    from baige.runtime.weights.loader import load_model

    text = (DATA_DIR / "tinyshakespeare.txt").read_text()
    cut = int(len(text) * 0.9)
    (tmp_path / "train.txt").write_text(text[:cut])
    (tmp_path / "heldout.txt").write_text(text[cut:])
    out = tmp_path / "run"
    cfg = load_train_config(
        None,
        {
            "data.train": [str(tmp_path / "train.txt")],
            "data.eval": [str(tmp_path / "heldout.txt")],
            "output": str(out),
            "training.steps": 24,
            "training.seq_len": SEQ_LEN,
            "training.batch_size": BATCH,
            "training.eval_batches": EVAL_BATCHES,
            "optimizer.lr": 2e-4,
            "lr_scheduler.warmup_steps": 3,
            "metrics.log_every": 1,
            "checkpoint.interval": 0,
            "metrics.tensorboard": False,
        },
    )
    result = run_training(cfg)  # model.name unset: the embedded default

    # The step-0 held-out loss equals transformers' loss on the same windows (an independent oracle).
    hf_model, _ = hf_embedded
    tokenizer = Tokenizer.from_dir(embedded_dir)
    ids = tokenizer.encode(text[cut:])
    n = EVAL_BATCHES * BATCH
    windows = torch.tensor([ids[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1] for i in range(n)])  # (n, T + 1)
    assert abs(result.eval_losses[0] - _hf_loss(hf_model, windows)) < 1e-3, result.eval_losses

    # Held-out loss falls.
    assert result.eval_losses[24] < result.eval_losses[0] - 0.1, result.eval_losses

    # Training loss falls: transformers scores the windows of the first 4 steps with the original
    # and with the exported weights (the per-step losses of 128 tokens are too noisy to compare).
    from transformers import AutoModelForCausalLM

    from baige.runtime.train.data import DataLoader, load_windows
    from baige.runtime.weights.hub import cache_dir

    train_windows = load_windows(
        [str(tmp_path / "train.txt")], tokenizer, embedded_dir, cache_dir() / "tokens", SEQ_LEN
    )
    loader = DataLoader(train_windows, BATCH, 1, 1, 0, seed=0, shuffle=True)  # the run's order (seed 0)
    seen = []
    for _ in range(4):
        ((x, y),) = loader.next_step()
        seen.append(torch.cat([x, y[:, -1:]], dim=1))  # back to (B, T + 1) windows
    seen = torch.cat(seen)
    export = out / "hf"
    theirs = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    before, after = _hf_loss(hf_model, seen), _hf_loss(theirs, seen)
    assert after < before - 0.2, (before, after)

    # The HF export loads in transformers and in baige with the same logits.
    assert json.loads((export / "config.json").read_text())["tie_word_embeddings"] is True
    ours = load_model(export, dtype="float32")
    probe = windows[:2, :32]
    with torch.no_grad():
        ref = theirs(input_ids=probe).logits
        got = ours.compute_logits(ours(probe, torch.arange(32).expand(2, 32)))
        original = hf_model(input_ids=probe).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert (ref - original).abs().max() > 1e-2  # the export holds the fine-tuned weights, not the originals

    # ... and `baige generate` runs on it.
    run = CliRunner().invoke(
        app, ["generate", "-m", str(export), "-p", "ROMEO:", "--max-tokens", "4", "--temperature", "0", "--no-chat"]
    )
    assert run.exit_code == 0, run.output
    assert run.stdout.strip()
