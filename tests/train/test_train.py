"""One-process `baige train` pieces: fused loss, schedule, config, data packing/sharding, SFT masks,
gradient accumulation, non-finite loss, resume errors, activation checkpointing."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from train_utils import chat_data, read_metrics, shakespeare, tiny_config, tiny_model

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.settings import reload_settings
from baige.runtime.train.checkpoint import CheckpointManager
from baige.runtime.train.config import load_train_config
from baige.runtime.train.lr_scheduler import lr_lambda
from baige.runtime.train.trainer import run_training

# ---- loss ----------------------------------------------------------------------------------------


def test_fused_linear_cross_entropy_matches_full_logits():
    g = torch.Generator().manual_seed(0)
    n, d, vocab = 601, 16, 70_000  # chunks of 2**24 // 70000 = 239 tokens: three chunks, the last partial
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = (0.1 * torch.randn(vocab, d, generator=g)).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[::7] = -100
    loss = kernels.fused_linear_cross_entropy(hidden, weight, targets)
    loss.backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = F.cross_entropy(h2 @ w2.t(), targets, ignore_index=-100)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-5, atol=1e-8)
    # An explicit normalizer divides the sum: here the sum itself.
    valid = int((targets != -100).sum())
    total = kernels.fused_linear_cross_entropy(hidden.detach(), weight.detach(), targets, normalizer=1.0)
    torch.testing.assert_close(total, ref.detach() * valid, rtol=1e-6, atol=1e-3)


# ---- schedule and config -------------------------------------------------------------------------


def test_lr_schedules():
    cos = dict(name="cosine", warmup=2, total=10, min_ratio=0.1, decay_ratio=0.2)
    assert lr_lambda(0, **cos) == 0.5 and lr_lambda(1, **cos) == 1.0
    # step 3 of 10: 1/8 of the way through the cosine: 0.1 + 0.9 * (1 + cos(pi/8)) / 2
    assert lr_lambda(2, **cos) == pytest.approx(0.1 + 0.9 * (1 + 0.9238795325) / 2)
    assert lr_lambda(9, **cos) == pytest.approx(0.1)
    wsd = dict(cos, name="wsd")
    assert [round(lr_lambda(s, **wsd), 6) for s in range(10)] == [0.5, 1, 1, 1, 1, 1, 1, 1, 0.55, 0.1]
    assert lr_lambda(7, **dict(cos, name="constant")) == 1.0


def test_config_file_flags_and_set_overrides(tmp_path):
    (tmp_path / "run.toml").write_text(
        'output = "o"\n[data]\ntrain = ["a.txt"]\n[training]\nsteps = 50\nseq_len = 128\n[optimizer]\nlr = 1e-3\n'
    )
    cfg = load_train_config(
        tmp_path / "run.toml",
        {"training.steps": 70, "training.batch_size": None},
        ["optimizer.betas=[0.9, 0.99]", "model.name=/models/x", "training.max_norm=2", "lr_scheduler.name=wsd"],
    )
    assert (cfg.training.steps, cfg.training.seq_len, cfg.training.batch_size) == (70, 128, 8)
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.betas == [0.9, 0.99] and cfg.model.name == "/models/x"
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    (tmp_path / "again.toml").write_text(cfg.to_toml())
    assert load_train_config(tmp_path / "again.toml") == cfg
    with pytest.raises(BaigeError, match="unknown config field 'training.stepz'"):
        load_train_config(tmp_path / "run.toml", overrides=["training.stepz=3"])
    with pytest.raises(BaigeError, match="training.steps"):
        load_train_config(tmp_path / "run.toml", overrides=["training.steps=many"])
    with pytest.raises(BaigeError, match="section.field=value"):
        load_train_config(tmp_path / "run.toml", overrides=["steps"])
    with pytest.raises(BaigeError, match="no training data"):
        load_train_config(None)


# ---- data ----------------------------------------------------------------------------------------


def test_windows_and_rank_sharding(tmp_path):
    from baige.runtime.train.data import DataLoader, PackedWindows, TokenFile

    files = [
        TokenFile(np.arange(0, 50, dtype=np.uint32), None, 49),
        TokenFile(np.arange(50, 103, dtype=np.uint32), None, 102),
    ]
    w = PackedWindows(files, seq_len=10)
    assert w.num_windows == 10  # (103 - 1) // 10
    x, y = w.window(4)  # crosses the file boundary at token 50
    assert x.tolist() == list(range(40, 50)) and y.tolist() == list(range(41, 51))
    one = DataLoader(w, batch_size=4, grad_accum=1, dp_size=1, dp_rank=0, seed=3, shuffle=True)
    two = [DataLoader(w, batch_size=1, grad_accum=2, dp_size=2, dp_rank=r, seed=3, shuffle=True) for r in (0, 1)]
    for _ in range(5):  # 2 steps per epoch of 10 windows (remainder 2 dropped), so this crosses epochs
        big = one.next_step()[0][0]
        parts = [two[r].next_step() for r in (0, 1)]
        # micro-batch a of rank r holds global rows a * 2 + r
        got = torch.cat([parts[r][a][0] for a in (0, 1) for r in (0, 1)])
        assert torch.equal(got, big)
    assert one.state_dict() == {"epoch": 2, "position": 4} == two[0].state_dict()
    # Restoring the state continues the same sequence.
    again = DataLoader(w, batch_size=4, grad_accum=1, dp_size=1, dp_rank=0, seed=3, shuffle=True)
    again.load_state_dict({"epoch": 1, "position": 4})
    ref = DataLoader(w, batch_size=4, grad_accum=1, dp_size=1, dp_rank=0, seed=3, shuffle=True)
    for _ in range(3):
        ref.next_step()
    assert torch.equal(again.next_step()[0][0], ref.next_step()[0][0])


def _chats():
    return [
        {
            "messages": [
                {"role": "system", "content": "You answer in verse."},
                {"role": "user", "content": "Who is the Duke?"},
                {"role": "assistant", "content": "The Duke of Venice, sir."},
                {"role": "user", "content": "And Antonio?"},
                {"role": "assistant", "content": "A merchant, sad of heart."},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "Say hello."},
                {"role": "assistant", "content": "Hello, good friend!"},
            ]
        },
    ]


def test_sft_loss_mask_covers_exactly_assistant_tokens(tmp_path, embedded_dir):
    from baige.runtime.model.tokenizer import Tokenizer
    from baige.runtime.train.data import PackedWindows, tokenize_file

    tok = Tokenizer.from_dir(embedded_dir)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in _chats()))
    tf = tokenize_file(path, tok, embedded_dir, tmp_path / "cache")
    im_end = tok.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1
    # The masked tokens, split into runs, are each assistant reply followed by <|im_end|>; nothing else.
    mask, ids = np.asarray(tf.mask), np.asarray(tf.tokens)
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            runs.append(ids[start:i].tolist())
            start = None
    replies = [m["content"] for c in _chats() for m in c["messages"] if m["role"] == "assistant"]
    assert runs == [tok.encode(r, add_special_tokens=False) + im_end for r in replies]
    assert tok.decode(runs[0], skip_special_tokens=False) == "The Duke of Venice, sir.<|im_end|>"
    # Targets: window labels are -100 exactly where the next token is not an assistant token.
    w = PackedWindows([tf], seq_len=len(ids) - 1)
    _, labels = w.window(0)
    assert ((labels != -100).numpy() == mask[1:].astype(bool)).all()
    assert (labels[labels != -100].numpy() == ids[1:][mask[1:] == 1]).all()


def test_sft_from_scratch_preset(tmp_path, embedded_dir, one_thread):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in _chats() * 8))
    cfg = load_train_config(
        None,
        {
            "model.config": "debug",
            "model.tokenizer": str(embedded_dir),
            "data.train": [str(path)],
            "output": str(tmp_path / "out"),
            "training.steps": 2,
            "training.seq_len": 64,
            "training.batch_size": 2,
            "metrics.log_every": 1,
            "metrics.tensorboard": False,
            "training.compile": False,
        },
    )  # compile: its own test
    result = run_training(cfg)
    assert sorted(result.losses) == [1, 2]
    # Seeded N(0, 0.02) init: the first loss is close to ln(vocab) = ln(49152) = 10.80.
    assert abs(result.losses[1] - math.log(49152)) < 0.1
    exported = json.loads((tmp_path / "out" / "hf" / "config.json").read_text())
    assert exported["num_hidden_layers"] == 2 and exported["vocab_size"] == 49152


# ---- training-step semantics ---------------------------------------------------------------------


def test_grad_accum_equals_one_big_batch_with_unequal_valid_tokens(tmp_path, one_thread):
    model = tiny_model(tmp_path / "model")
    data = tmp_path / "chat.jsonl"
    chat_data(data, 40)
    accum = tiny_config(
        model, data, tmp_path / "accum", **{"training.steps": 3, "training.batch_size": 2, "training.grad_accum": 2}
    )
    big = tiny_config(model, data, tmp_path / "big", **{"training.steps": 3, "training.batch_size": 4})
    from baige.runtime.train.trainer import Trainer

    trainer = Trainer(accum)
    micro = trainer.loader.next_step()
    counts = [int((labels != -100).sum()) for _, labels in micro]
    assert counts[0] != counts[1], counts  # the premise: micro-batches with different numbers of targets
    del trainer
    a, b = run_training(accum), run_training(big)
    for step in (1, 2, 3):
        assert abs(a.losses[step] - b.losses[step]) < 1e-6, (step, a.losses[step], b.losses[step])
    from safetensors.torch import load_file

    pa, pb = (
        load_file(str(tmp_path / "accum/hf/model.safetensors")),
        load_file(str(tmp_path / "big/hf/model.safetensors")),
    )
    for name in pa:
        assert (pa[name] - pb[name]).abs().mean() < 1e-6, name


def test_activation_checkpointing_gives_the_same_losses(tmp_path, one_thread):
    model = tiny_model(tmp_path / "model")
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(5_000))
    base = {"training.steps": 3, "training.batch_size": 2, "checkpoint.export_hf": False}
    plain = run_training(tiny_config(model, data, tmp_path / "plain", **base))
    ac = run_training(
        tiny_config(model, data, tmp_path / "ac", **base, **{"training.activation_checkpointing": "full"})
    )
    assert plain.losses == ac.losses


def test_nonfinite_loss_stops_without_a_checkpoint(tmp_path, one_thread):
    from safetensors.torch import load_file, save_file

    model = tiny_model(tmp_path / "model")
    state = load_file(str(model / "model.safetensors"))
    state["model.norm.weight"][3] = float("nan")
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(5_000))
    cfg = tiny_config(
        model, data, tmp_path / "out", **{"training.steps": 3, "training.batch_size": 2, "checkpoint.interval": 1}
    )
    with pytest.raises(BaigeError, match=r"step 1: loss nan .* not finite"):
        run_training(cfg)
    assert CheckpointManager(tmp_path / "out" / "checkpoints", True, 0).complete_steps() == []
    assert read_metrics(tmp_path / "out") == {}


def test_resume_choices(tmp_path):
    root = tmp_path / "checkpoints"
    m = CheckpointManager(root, True, 2)
    assert m.resolve_resume("auto") is None and m.resolve_resume("none") is None  # first run
    (root / ".tmp-step_00000005").mkdir(parents=True)  # an interrupted first save: a fresh start
    assert m.resolve_resume("auto") is None and m.resolve_resume("none") is None
    for step in (5, 10):
        (root / f"step_{step:08d}").mkdir()
        (root / f"step_{step:08d}" / ".metadata").write_bytes(b"x")
    (root / "step_00000015").mkdir()  # no .metadata: not complete
    assert m.resolve_resume("auto") == root / "step_00000010"
    with pytest.raises(BaigeError, match="already holds checkpoints"):
        m.resolve_resume("none")
    assert m.resolve_resume(str(root / "step_00000005")) == root / "step_00000005"
    with pytest.raises(BaigeError, match="not a complete checkpoint"):
        m.resolve_resume(str(root / "step_00000015"))


@pytest.mark.parametrize("variant", ["llama-tied", "qwen2-bias"])
def test_hf_export_loads_in_transformers_and_baige(tmp_path, variant, one_thread):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from baige.runtime.weights.loader import load_model

    model = tiny_model(tmp_path / "model", variant)
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(5_000))
    run_training(tiny_config(model, data, tmp_path / "out", **{"training.steps": 2, "training.batch_size": 2}))
    export = tmp_path / "out" / "hf"
    assert "lm_head.weight" not in load_file(str(export / "model.safetensors"))  # tied: stored once
    assert (export / "tokenizer.json").is_file()
    theirs = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ours = load_model(export, dtype="float32")
    ids = torch.randint(0, 60, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits
        got = ours.compute_logits(ours(ids, torch.arange(24).expand(2, 24)))
        original = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert (ref - original).abs().max() > 1e-3  # trained weights were exported


def test_cli_user_errors_are_one_line(tmp_path):
    from typer.testing import CliRunner

    from baige.cli.app import app

    runner = CliRunner()
    r = runner.invoke(app, ["train", "--data", str(tmp_path / "missing.txt"), "--output", str(tmp_path / "o")])
    assert (
        isinstance(r.exception, BaigeError) and str(r.exception) == f"{tmp_path / 'missing.txt'}: data file not found"
    )
    r = runner.invoke(app, ["train", "--data", "x.txt", "--set", "training.bogus=1"])
    assert isinstance(r.exception, BaigeError) and "unknown config field 'training.bogus'" in str(r.exception)
    r = runner.invoke(app, ["train", "--data", "x.txt", "--ac", "sometimes"])
    assert isinstance(r.exception, BaigeError) and "activation_checkpointing" in str(r.exception)


def test_default_compile_auto_trains_like_eager(tmp_path, one_thread):
    """The default training path: training.compile = auto resolves to compiled blocks on one CPU
    device (g++ on PATH), and Inductor's compiled steps give the eager run's losses. Slow when cold
    (one Inductor build of the block's forward and backward; less with a warm Inductor cache)."""
    from torch._dynamo.utils import counters

    from baige.runtime.train.base import _has_cxx_compiler
    from baige.runtime.train.config import TrainConfig
    from baige.runtime.train.trainer import Trainer

    assert TrainConfig().training.compile == "auto"  # the default
    assert _has_cxx_compiler()  # part of the test set-up: Inductor's CPU backend builds C++
    model = tiny_model(tmp_path / "model")
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(5_000))
    flags = {"training.steps": 3, "training.batch_size": 2, "checkpoint.export_hf": False}
    runs = {}
    counters.clear()
    for value in (False, "auto"):
        trainer = Trainer(tiny_config(model, data, tmp_path / f"run-{value}", **flags, **{"training.compile": value}))
        assert trainer.compile is (value == "auto")
        compiled = [getattr(layer, "_compiled_call_impl", None) is not None for layer in trainer.model.model.layers]
        assert compiled == [value == "auto"] * 2
        runs[value] = [trainer.train_step()[:2] for _ in range(3)]  # (loss, grad norm) per step
    # Inductor really compiled: one graph (forward + backward) shared by the two blocks
    assert counters["stats"]["unique_graphs"] == 1 and counters["aot_autograd"]["ok"] == 1
    (l1, g1), (l1c, g1c) = runs[False][0], runs["auto"][0]
    # step 1 (the same weights): loss and gradient norm equal to fp32 rounding (measured: 5e-7 of 4.84)
    assert abs(l1c - l1) <= 2e-6 and abs(g1c - g1) <= 1e-5 * g1
    # later steps: AdamW's normalised update spreads the rounding (measured: 1.0e-5), still far below
    # the 0.5 the loss moves in these steps
    for (loss, _), (loss_c, _) in zip(runs[False][1:], runs["auto"][1:]):
        assert abs(loss_c - loss) <= 1e-4, (loss, loss_c)
    assert runs[False][0][0] - runs[False][2][0] > 0.3


def test_clipping_folded_into_fused_adamw_matches_explicit_clipping(tmp_path, one_thread):
    # fused AdamW divides the gradients by optimizer.grad_scale in its own pass; the result must be the
    # in-place clip_grads_with_norm_ followed by a plain step, to fp32 rounding
    from baige.runtime.train.trainer import Trainer

    model = tiny_model(tmp_path / "model")
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(5_000))
    flags = {"training.steps": 4, "training.batch_size": 2, "training.max_norm": 0.05, "checkpoint.export_hf": False}
    runs = {}
    for fold in (True, False):
        trainer = Trainer(tiny_config(model, data, tmp_path / f"fold{fold}", **flags))
        assert trainer._clip_in_optimizer  # fused AdamW on plain CPU tensors
        trainer._clip_in_optimizer = fold
        steps = [trainer.train_step() for _ in range(4)]
        assert all(norm > 0.05 for _, norm, _ in steps)  # every step clipped
        assert not hasattr(trainer.optimizer, "grad_scale")
        runs[fold] = (
            [loss for loss, _, _ in steps],
            {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        )
    for a, b in zip(runs[True][0], runs[False][0]):
        assert abs(a - b) <= 1e-6 * abs(b), (a, b)
    for name, p in runs[False][1].items():
        # Adam's update is ~lr per element whatever the gradient's size: 4 steps of lr 1e-2 agree to ~1e-6
        torch.testing.assert_close(runs[True][1][name], p, rtol=0, atol=2e-6, msg=name)
    # the folded run really differs from no clipping at all (the clip mattered)
    trainer = Trainer(tiny_config(model, data, tmp_path / "noclip", **{**flags, "training.max_norm": 0.0}))
    free = [trainer.train_step()[0] for _ in range(4)]
    assert abs(free[-1] - runs[True][0][-1]) > 1e-4


def test_tied_embedding_gradient_goes_straight_into_the_head_gradient(tmp_path):
    # apply_tied_embedding_grad: the embedding rows' gradient is index-added into the tied weight's
    # gradient; the result equals autograd's dense embedding backward plus the head's gradient
    import copy

    from baige.runtime.train import parallel
    from baige.runtime.weights.loader import load_model

    ref = load_model(tiny_model(tmp_path / "model", "llama-tied"), dtype=torch.float64, device="cpu").train()
    fast = copy.deepcopy(ref)
    fast.tie_weights()
    assert fast.lm_head.weight is fast.model.embed_tokens.weight
    parallel.apply_tied_embedding_grad(fast)
    out = fast.model.embed_tokens(torch.tensor([[1, 2]]))
    assert out.requires_grad and out.grad_fn is None  # the detached lookup, not autograd's embedding
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (3, 2, 16), generator=g)
    ids[0, 0, :4] = 5  # repeated ids accumulate
    labels = torch.randint(0, 97, (3, 2, 16), generator=g)
    pos = torch.arange(16).expand(2, 16)
    for model in (ref, fast):
        for b in range(3):  # three micro-batches accumulate into .grad
            hidden = model(ids[b], pos)
            kernels.fused_linear_cross_entropy(hidden, model.lm_head.weight, labels[b], normalizer=96.0).backward()
    for (name, p), (_, q) in zip(ref.named_parameters(), fast.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-15, msg=name)
    # without a head gradient yet (the loss does not use lm_head) the rows land in a zero gradient
    for model in (ref, fast):
        model.zero_grad(set_to_none=True)
        model(ids[0], pos).pow(2).sum().backward()
    w_ref, w_fast = ref.model.embed_tokens.weight.grad, fast.model.embed_tokens.weight.grad
    torch.testing.assert_close(w_fast, w_ref, rtol=1e-12, atol=1e-15)
    assert w_fast.abs().sum() > 0
    # no grad mode (evaluation): a plain lookup, no hook
    with torch.no_grad():
        assert not fast.model.embed_tokens(ids[0]).requires_grad


def test_compile_defaults_to_on_for_single_device_cpu(tmp_path):
    # training.compile = auto: the blocks are compiled on one CPU device (construction only; no step)
    from baige.runtime.train.trainer import Trainer

    model = tiny_model(tmp_path / "model")
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(2_000))
    for value, expected in (("auto", True), (False, False), (True, True)):
        trainer = Trainer(tiny_config(model, data, tmp_path / f"run-{value}", **{"training.compile": value}))
        assert trainer.compile is expected
        compiled = [getattr(layer, "_compiled_call_impl", None) is not None for layer in trainer.model.model.layers]
        assert compiled == [expected] * len(compiled)


def test_compile_auto_stays_eager_without_a_cxx_compiler(tmp_path, monkeypatch):
    # Inductor's CPU backend needs a C++ compiler: auto must not pick compile where none is on PATH
    import shutil

    from baige.runtime.train.trainer import Trainer

    monkeypatch.delenv("CXX", raising=False)
    reload_settings()
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    model = tiny_model(tmp_path / "model")
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(2_000))
    trainer = Trainer(tiny_config(model, data, tmp_path / "run", **{"training.compile": "auto"}))
    assert trainer.compile is False
    from baige import BaigeError

    with pytest.raises(BaigeError, match=r"--compile \(training.compile = true\) on CPU needs a C\+\+ compiler"):
        Trainer(tiny_config(model, data, tmp_path / "run-true", **{"training.compile": True}))
