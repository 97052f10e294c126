"""Helpers for the training tests: tiny checkpoints with a character-level tokenizer, metrics readers."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import DATA_DIR
from tiny import make_checkpoint

# A minimal chat template: "<s>role\ncontent</s>" per turn; assistant turns end with the EOS "</s>".
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def shakespeare(chars: int) -> str:
    return (DATA_DIR / "tinyshakespeare.txt").read_text()[:chars]


def write_char_tokenizer(out: Path, text: str) -> int:
    """A character-level tokenizer.json (+ config with a chat template) for ``text``; returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models

    specials = ["<unk>", "<s>", "</s>"]
    chars = sorted(set(text) | set("abcdefghijklmnopqrstuvwxyz\n "))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return len(vocab)


def tiny_model(path: Path, variant: str = "llama-tied", vocab_size: int = 97, seed: int = 0, **overrides) -> Path:
    """A random tiny HF checkpoint (tests/tiny.py; ``overrides``: config fields) plus a character
    tokenizer over tinyshakespeare."""
    make_checkpoint(path, variant, seed=seed, vocab_size=vocab_size, **overrides)
    n = write_char_tokenizer(path, shakespeare(200_000))
    assert n <= vocab_size
    return path


def read_metrics(output: Path, split: str = "train") -> dict[int, float]:
    """step -> loss from ``output/metrics.jsonl`` (later records of a step win, as after a resume)."""
    out = {}
    for line in (output / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["split"] == split:
            out[r["step"]] = r["loss"]
    return out


def tiny_config(model: Path, data: Path, output: Path, **flags):
    """A TrainConfig for the tiny model: seq_len 32, lr 1e-2 cosine, metrics every step, keep all checkpoints,
    eager (no torch.compile: seconds of inductor builds per test)."""
    from baige.runtime.train.config import load_train_config

    base = {
        "model.name": str(model),
        "data.train": [str(data)],
        "output": str(output),
        "training.seq_len": 32,
        "optimizer.lr": 1e-2,
        "lr_scheduler.warmup_steps": 2,
        "metrics.log_every": 1,
        "checkpoint.keep_latest": 0,
        "checkpoint.interval": 0,
        "metrics.tensorboard": False,
        "training.compile": False,
    }
    base.update(flags)
    return load_train_config(None, base)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_train(nproc: int) -> list[str]:
    """The documented launch form, ``torchrun --nproc-per-node N --no-python baige train`` (this interpreter's
    torch.distributed.run and its environment's ``baige``, a free master port); the train flags follow."""
    import sys

    baige = str(Path(sys.executable).parent / "baige")
    port = str(free_port())
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", port]
    return [*run, "--no-python", baige, "train"]


def spawn_worker(rank: int, world_size: int, port: int, jobs: list) -> None:
    """torch.multiprocessing entry: join a gloo group, then run each job ``(fn, kwargs)`` in order."""
    import os

    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    for fn, kwargs in jobs:
        fn(**kwargs)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def job_train(model: str, data: str, output: str, copy_checkpoint: str | None = None, **flags) -> None:
    """One training run (every rank calls it); ``copy_checkpoint`` is first copied into the output's
    checkpoints folder by rank 0, as if this run had written it and stopped."""
    import shutil

    import torch.distributed as dist

    from baige.runtime.train.trainer import run_training

    if copy_checkpoint is not None and int(__import__("os").environ.get("RANK", "0")) == 0:
        src = Path(copy_checkpoint)
        shutil.copytree(src, Path(output) / "checkpoints" / src.name)
    if dist.is_initialized():
        dist.barrier()
    run_training(tiny_config(Path(model), Path(data), Path(output), **flags))


def job_train_dump_experts(model: str, data: str, output: str, **flags) -> None:
    """:func:`job_train`, then each rank writes ``output/experts_rank{R}.pt``: every sparse layer's
    ``expert_ids``, local expert count and local ``gate_up_proj`` / ``down_proj`` after training."""
    import os

    import torch

    from baige.runtime.train.trainer import Trainer

    trainer = Trainer(tiny_config(Path(model), Path(data), Path(output), **flags))
    trainer.train()
    layers = {}
    for i, layer in enumerate(trainer.model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            layers[i] = {
                "expert_ids": list(experts.expert_ids),
                "num_local_experts": experts.num_local_experts,
                "global_shape": tuple(experts.gate_up_proj.shape),
                "gate_up_proj": experts.gate_up_proj.to_local().detach().clone(),
                "down_proj": experts.down_proj.to_local().detach().clone(),
            }
    torch.save(layers, Path(output) / f"experts_rank{os.environ['RANK']}.pt")


def chat_data(path: Path, n: int = 60) -> Path:
    """SFT records with replies of 1 to 5 lines of Shakespeare: the loss-carrying tokens differ per window."""
    import numpy as np

    lines = [ln for ln in shakespeare(40_000).splitlines() if ln.strip()]
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            k = int(rng.integers(1, 6))
            msgs = [
                {"role": "user", "content": lines[i]},
                {"role": "assistant", "content": " ".join(lines[i + 1 : i + 1 + k])},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path
