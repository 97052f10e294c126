"""Muon (``optimizer.name = muon``): the Newton-Schulz iteration against hand-written fp64 math, the update
against ``torch.optim.Muon``, the parameter split, exact resume, and FSDP2 / TP x 2 ranks (gloo) against
one process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from train_utils import free_port, read_metrics, shakespeare, spawn_worker, tiny_config, tiny_model

from baige.errors import BaigeError
from baige.runtime.train.config import load_train_config
from baige.runtime.train.optimizer import NS_COEFFICIENTS, Muon, build_optimizer, zeropower_via_newtonschulz

A, B, C = NS_COEFFICIENTS


def _ns_reference(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Hand-written fp64 Newton-Schulz: X0 = G / ||G||_F (transposed when tall), X <- aX + b(XX^T)X + c(XX^T)^2 X."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / math.sqrt(float((x * x).sum()))
    for _ in range(steps):
        gram = x @ x.T
        x = A * x + B * (gram @ x) + C * (gram @ (gram @ x))
    return x.T if tall else x


@pytest.mark.parametrize("shape", [(7, 13), (13, 7), (16, 16), (1, 9)])
def test_newton_schulz_equals_fp64_reference(shape):
    g = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for steps in (1, 5):
        got = zeropower_via_newtonschulz(g, steps, torch.float64)
        assert got.dtype == torch.float64 and got.shape == g.shape
        assert (got - _ns_reference(g, steps)).abs().max() < 1e-12
    # Independent of both: the iteration acts on singular values only, U f(S/||S||) V^T with the scalar
    # quintic f(s) = a s + b s^3 + c s^5 applied five times.
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    s = s / s.norm()
    for _ in range(5):
        s = A * s + B * s**3 + C * s**5
    assert (zeropower_via_newtonschulz(g, 5, torch.float64) - u @ torch.diag(s) @ vh).abs().max() < 1e-12
    assert s.min() > 0.5 and s.max() < 1.5  # near-orthogonal (Keller's band), not exactly


def test_stacked_matrices_are_orthogonalised_one_by_one():
    g = torch.randn(3, 6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = zeropower_via_newtonschulz(g, 5, torch.float64)
    for e in range(3):
        assert (got[e] - _ns_reference(g[e], 5)).abs().max() < 1e-12


def test_update_equals_torch_optim_muon_and_fp64_hand_computation():
    """bf16 Newton-Schulz: bitwise torch.optim.Muon (match_rms_adamw). fp32: three steps against the update
    written out in fp64 (momentum EMA, Nesterov, decoupled decay, lr * 0.2 * sqrt(max(A, B)))."""
    gen = torch.Generator().manual_seed(2)
    w0 = torch.randn(24, 40, generator=gen)
    grads = [torch.randn(24, 40, generator=gen) for _ in range(3)]
    lr, wd, mom = 0.02, 0.1, 0.95
    ours, theirs = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt = Muon([{"params": [ours], "algorithm": "muon"}], lr=lr, weight_decay=wd, ns_dtype=torch.bfloat16)
    ref = torch.optim.Muon([theirs], lr=lr, weight_decay=wd, momentum=mom, adjust_lr_fn="match_rms_adamw")
    for g in grads:
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert torch.equal(ours, theirs)

    p = torch.nn.Parameter(w0.clone())
    opt = Muon([{"params": [p], "algorithm": "muon"}], lr=lr, weight_decay=wd, ns_dtype=torch.float32)
    w, buf = w0.double(), torch.zeros(24, 40, dtype=torch.float64)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        g = g.double()
        buf = mom * buf + (1 - mom) * g
        update = g + mom * (buf - g)
        w = w * (1 - lr * wd) - lr * 0.2 * math.sqrt(40) * _ns_reference(update, 5)
    assert (p.double() - w).abs().max() < 1e-6
    assert opt.state[p]["momentum_buffer"].shape == (24, 40)


def test_parameter_split_and_config(tmp_path):
    from baige.runtime.model.config import ModelConfig
    from baige.runtime.model.transformer import Transformer

    model = Transformer(ModelConfig.from_file(tiny_model(tmp_path / "m", "llama") / "config.json"))  # untied
    opt = build_optimizer(model, "muon", lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, fused=True)
    names = {id(p): n for n, p in model.named_parameters()}
    split = {"muon": set(), "adamw": set()}
    for g in opt.param_groups:
        split[g["algorithm"]] |= {names[id(p)] for p in g["params"]}
    hidden = (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
    assert split["muon"] == {f"model.layers.{i}.{m}.weight" for i in range(2) for m in hidden}
    assert split["adamw"] == set(names.values()) - split["muon"]
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= split["adamw"]
    decay = {names[id(p)]: g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert decay["lm_head.weight"] == 0.1 and decay["model.embed_tokens.weight"] == 0.0
    assert decay["model.norm.weight"] == 0.0 and decay["model.layers.0.mlp.up_proj.weight"] == 0.1

    data = tmp_path / "d.txt"
    data.write_text("x")
    cfg = load_train_config(None, {"data.train": [str(data)], "output": str(tmp_path / "o")}, ["optimizer.name=muon"])
    assert cfg.optimizer.name == "muon" and cfg.optimizer.momentum == 0.95 and cfg.optimizer.ns_steps == 5
    for bad, message in (
        ("optimizer.name=lion", "optimizer.name must be adamw or muon"),
        ("optimizer.momentum=1.5", "optimizer.momentum must be"),
        ("optimizer.ns_steps=0", "optimizer.ns_steps must be"),
    ):
        with pytest.raises(BaigeError, match=message):
            load_train_config(None, {"data.train": [str(data)], "output": str(tmp_path / "o")}, [bad])


MUON = {"optimizer.name": "muon"}


def test_muon_resume_is_exact_in_one_process(tmp_path, one_thread):
    from baige.runtime.train.trainer import run_training

    model = tiny_model(tmp_path / "m")
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(20_000))
    full = tiny_config(model, data, tmp_path / "full", **MUON, **{"training.steps": 6, "checkpoint.interval": 3})
    run_training(full)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    import shutil

    shutil.copytree(tmp_path / "full" / "checkpoints" / "step_00000003", resumed / "checkpoints" / "step_00000003")
    run_training(tiny_config(model, data, resumed, **MUON, **{"training.steps": 6}))
    a, b = read_metrics(tmp_path / "full"), read_metrics(resumed)
    assert sorted(b) == [4, 5, 6] and all(a[s] == b[s] for s in (4, 5, 6)), (a, b)
    assert a[6] < a[1] - 0.5  # it trains


def test_bench_train_runs_muon(one_thread):
    """``baige bench train --optimizer muon``: the same first step as AdamW (same init and data), another second."""
    from baige.runtime.bench.train import TrainBenchConfig, run_train

    runs = {
        name: run_train(
            TrainBenchConfig(
                model="debug", seq_len=16, batch_size=2, steps=2, warmup_steps=0, compile=False, optimizer=name
            )
        )
        for name in ("adamw", "muon")
    }
    assert runs["muon"]["args"]["optimizer"] == "muon" and runs["adamw"]["args"]["optimizer"] == "adamw"
    (a1, a2), (m1, m2) = ([s["loss"] for s in runs[n]["samples"]] for n in ("adamw", "muon"))
    assert a1 == m1 and a2 != m2


# ---- 2 ranks (gloo) against one process -------------------------------------------------------------


def job_muon_steps(model: str, data: str, output: str, **flags) -> None:
    """Build the trainer (FSDP2 / TP / one process per ``flags``), then three optimizer steps on seeded
    full-size gradients (each rank keeps its shard of them); rank 0 writes the gathered parameters."""
    import os

    from torch.distributed.tensor import DTensor, distribute_tensor

    from baige.runtime.train.trainer import Trainer

    trainer = Trainer(tiny_config(Path(model), Path(data), Path(output), **MUON, **flags))
    params = dict(trainer.model.named_parameters())
    initial = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params.items()}
    for step in range(3):
        for i, (name, p) in enumerate(sorted(params.items())):
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
            p.grad = (
                distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) if isinstance(p, DTensor) else g
            )
        trainer.optimizer.step()
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in params.items()}
    if os.environ.get("RANK", "0") == "0":
        torch.save({"initial": initial, "final": full}, Path(output) / "params.pt")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    from train_utils import job_train

    root = tmp_path_factory.mktemp("muon_dist")
    odd = tiny_model(root / "odd", "llama-tied", vocab_size=97, intermediate_size=37)  # uneven FSDP shards
    untied = tiny_model(root / "untied", "llama", vocab_size=98, seed=1)
    data = root / "train.txt"
    data.write_text(shakespeare(20_000))
    steps = {"checkpoint.export_hf": False}
    jobs = [
        (job_muon_steps, dict(model=str(odd), data=str(data), output=str(root / "fsdp_steps"), **steps)),
        (
            job_muon_steps,
            dict(
                model=str(untied),
                data=str(data),
                output=str(root / "tp_steps"),
                **steps,
                **{"parallelism.tensor_parallel_degree": 2},
            ),
        ),
        (
            job_train,
            dict(
                model=str(odd),
                data=str(data),
                output=str(root / "fsdp"),
                **MUON,
                **{"training.steps": 6, "training.batch_size": 2, "checkpoint.interval": 3},
            ),
        ),
    ]
    step3 = root / "fsdp" / "checkpoints" / "step_00000003"
    resume = dict(model=str(odd), data=str(data), output=str(root / "fsdp_resumed"), copy_checkpoint=str(step3))
    jobs.append((job_train, dict(resume, **MUON, **{"training.steps": 6, "training.batch_size": 2})))
    mp.spawn(spawn_worker, args=(2, free_port(), jobs), nprocs=2, join=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        job_muon_steps(str(odd), str(data), str(root / "single_steps"), **steps)
        job_muon_steps(str(untied), str(data), str(root / "single_untied_steps"), **steps)
        job_train(
            model=str(odd),
            data=str(data),
            output=str(root / "single"),
            **MUON,
            **{"training.steps": 6, "training.batch_size": 4},
        )
    finally:
        torch.set_num_threads(threads)
    return root


@pytest.mark.parametrize("two, one", [("fsdp_steps", "single_steps"), ("tp_steps", "single_untied_steps")])
def test_two_ranks_take_the_same_muon_steps_as_one_process(two_rank_runs, two, one):
    a = torch.load(two_rank_runs / two / "params.pt")
    b = torch.load(two_rank_runs / one / "params.pt")
    assert a["final"].keys() == b["final"].keys()
    for name in a["final"]:
        assert torch.equal(a["initial"][name], b["initial"][name]), name
        assert (a["final"][name] - b["final"][name]).abs().max() < 1e-6, name
        assert (b["final"][name] - b["initial"][name]).abs().max() > 1e-3, name  # every parameter stepped
    if two == "fsdp_steps":
        assert a["final"]["model.layers.0.mlp.gate_proj.weight"].shape == (37, 64)  # 37 rows: uneven shards


def test_fsdp_muon_training_matches_one_process_and_resumes_exactly(two_rank_runs):
    fsdp, single = read_metrics(two_rank_runs / "fsdp"), read_metrics(two_rank_runs / "single")
    for step in range(1, 7):
        assert abs(fsdp[step] - single[step]) < 1e-5, (step, fsdp[step], single[step])
    resumed = read_metrics(two_rank_runs / "fsdp_resumed")
    assert sorted(resumed) == [4, 5, 6] and all(resumed[s] == fsdp[s] for s in (4, 5, 6)), (resumed, fsdp)


@pytest.mark.slow  # 4 ranks; the 2-rank FSDP and TP steps above stay in the default set
def test_four_ranks_fsdp_x_tp_and_expert_parallel_take_the_same_muon_steps(tmp_path):
    """dp_shard 2 x TP 2 (FSDP's strided shards over TP's) on a dense model and EP 2 in dp_shard 4 on an MoE
    model (stacked experts, sharded by expert and by FSDP): the same Muon steps as one process."""
    untied = tiny_model(tmp_path / "untied", "llama", vocab_size=98, seed=1)
    moe = tiny_model(tmp_path / "moe", "qwen3-moe", num_experts=8)
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(20_000))
    steps = {"checkpoint.export_hf": False}
    runs = {
        "fsdp_tp": (untied, {"parallelism.tensor_parallel_degree": 2}),
        "ep": (moe, {"parallelism.expert_parallel_degree": 2}),
    }
    jobs = [
        (job_muon_steps, dict(model=str(m), data=str(data), output=str(tmp_path / name), **steps, **flags))
        for name, (m, flags) in runs.items()
    ]
    mp.spawn(spawn_worker, args=(4, free_port(), jobs), nprocs=4, join=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, (m, _) in runs.items():
            job_muon_steps(str(m), str(data), str(tmp_path / f"{name}_single"), **steps)
    finally:
        torch.set_num_threads(threads)
    for name in runs:
        a, b = (torch.load(tmp_path / d / "params.pt") for d in (name, f"{name}_single"))
        assert a["final"].keys() == b["final"].keys()
        for key in a["final"]:
            assert (a["final"][key] - b["final"][key]).abs().max() < 1e-6, (name, key)
    assert b["final"]["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 80, 72)  # stacked experts, compared too
