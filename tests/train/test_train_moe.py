"""One-process Mixture-of-Experts training: the router losses against transformers' functions, the
balancer's data-parallel decomposition, DeepSeek-V3 bias balancing (update rule, selection, resume),
and the moe-tiny preset end to end (trains on tinyshakespeare, reports expert load, MFU from
active parameters, exports to an HF directory transformers and `baige serve` load)."""

from __future__ import annotations

import json
import math
import shutil

import httpx
import pytest
import torch
from server_utils import launched
from train_utils import read_metrics, shakespeare, tiny_config, tiny_model, write_char_tokenizer

from baige.runtime.train.config import MoESection, load_train_config
from baige.runtime.train.moe import MoEBalancer, RouterLogits, load_balancing_loss, router_z_loss
from baige.runtime.train.trainer import run_training


def _logits(n_layers: int, rows: int, experts: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(2.0 * torch.randn(rows, experts, generator=g)).requires_grad_() for _ in range(n_layers)]


# ---- the losses against transformers ---------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2])
def test_load_balancing_loss_matches_transformers(top_k):
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits = _logits(3, 37, 7, seed=top_k)
    ours = load_balancing_loss(logits, 7, top_k)
    ref = load_balancing_loss_func(tuple(logits), 7, top_k, attention_mask=None)
    assert abs(ours.item() - ref.item()) < 1e-6, (ours.item(), ref.item())
    g_ours = torch.autograd.grad(ours, logits)
    g_ref = torch.autograd.grad(ref, logits)
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert ref.item() > top_k * 0.9  # not degenerate: about top_k when nearly balanced


def test_router_z_loss_matches_transformers():
    from transformers.models.switch_transformers.modeling_switch_transformers import router_z_loss_func

    logits = _logits(3, 37, 7, seed=5)
    ref = router_z_loss_func(torch.cat(logits)[None])  # (1, L * N, E): every layer's rows, as ours
    assert abs(router_z_loss(logits).item() - ref.item()) < 1e-5 * ref.item()


def _balancer(tmp_path, **moe):
    from baige.runtime.weights.loader import load_model

    model = load_model(tiny_model(tmp_path / "m", "qwen3-moe"), dtype=torch.float32, device="cpu")
    return model, MoEBalancer(model, MoESection(**moe), grad_accum=1, all_reduce=lambda t: t)


def test_balancer_shares_sum_to_the_global_batch_loss(tmp_path):
    """Two simulated data-parallel ranks: each forms its share with the summed counts; the shares add
    up to transformers' loss over both ranks' router logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model, _ = _balancer(tmp_path)
    a, b = _logits(2, 24, 7, seed=1), _logits(2, 16, 7, seed=2)
    locals_ = []
    for logits in (a, b):  # what each rank contributes to the all-reduce
        bal = MoEBalancer(model, MoESection(router_aux_loss_coef=1.0), 1, lambda t: locals_.append(t) or t)
        bal.micro_batch_loss(_router(logits))
    shares = []
    for logits, other in ((a, locals_[1]), (b, locals_[0])):
        bal = MoEBalancer(model, MoESection(router_aux_loss_coef=1.0), 1, lambda t, o=other: t + o)
        shares.append(bal.micro_batch_loss(_router(logits)))
    ref = load_balancing_loss_func(tuple(torch.cat([x, y]) for x, y in zip(a, b)), 7, 2)
    assert abs((shares[0] + shares[1]).item() - ref.item()) < 1e-6
    assert abs(bal.step_values()[0] - shares[1].item()) < 1e-6  # the reported value is this rank's share


def _router(logits):
    out = RouterLogits()
    for x in logits:
        out.append(x)
    return out


# ---- DeepSeek-V3 bias balancing ----------------------------------------------------------------------


def test_bias_update_rule_selection_and_state(tmp_path):
    model, bal = _balancer(tmp_path, load_balance="bias", bias_update_rate=0.25)
    keys = set(model.state_dict())
    assert bal.aux_coef == 0.0 and bal.layers == [1, 2]  # aux-loss-free by default; layer 0 is dense
    logits = torch.full((10, 7), -5.0)
    logits[:, :2] = 5.0  # every token picks experts 0 and 1
    bal.micro_batch_loss(_router([logits, logits]))
    bal.end_step()
    expected = 0.25 * torch.tensor([[-1.0, -1, 1, 1, 1, 1, 1]])  # sign(mean load 20/7 - load)
    for block in bal.blocks:
        assert torch.equal(block.moe_statics.e_score_correction_bias, expected)
    assert set(model.state_dict()) == keys  # the state-dict layout is unchanged
    stats = bal.metrics()
    assert stats["expert_load_max_mean"] == [3.5, 3.5]  # 10 / (20 / 7) = E / k: all on 2 experts
    assert stats["expert_load_cv"][0] == pytest.approx(math.sqrt(2.5), rel=1e-9)  # std/mean of [10,10,0*5]
    # The bias picks the experts; the weights stay the unbiased (renormalised) probabilities.
    block = bal.blocks[0]
    with torch.no_grad():
        block.gate.weight.zero_()  # uniform probabilities: only the bias decides
        _, weights, ids = block.route(torch.randn(5, 72))
    assert set(ids.flatten().tolist()) <= {2, 3, 4, 5, 6}
    torch.testing.assert_close(weights, torch.full((5, 2), 0.5))
    state = bal.state_dict()["expert_bias"]
    _, fresh = _balancer(tmp_path / "again", load_balance="bias")
    fresh.load_state_dict({"expert_bias": state})
    assert torch.equal(fresh.blocks[1].moe_statics.e_score_correction_bias, expected)
    # an aux_loss run checkpoints zero biases, so either mode resumes the other's checkpoints
    _, aux = _balancer(tmp_path / "aux")
    assert torch.equal(aux.state_dict()["expert_bias"], torch.zeros(2, 7))


def test_bias_balancing_resumes_exactly(tmp_path, one_thread):
    import torch.distributed.checkpoint as dcp

    model = tiny_model(tmp_path / "m", "qwen3-moe")
    data = tmp_path / "train.txt"
    data.write_text(shakespeare(8_000))
    flags = {
        "training.steps": 4,
        "training.batch_size": 2,
        "moe.load_balance": "bias",
        "moe.bias_update_rate": 0.05,
        "checkpoint.export_hf": False,
    }
    run_training(tiny_config(model, data, tmp_path / "full", **flags, **{"checkpoint.interval": 2}))
    step2 = tmp_path / "full" / "checkpoints" / "step_00000002"
    meta = dcp.FileSystemReader(str(step2)).read_metadata()
    assert "moe.expert_bias" in meta.state_dict_metadata  # the biases travel with the checkpoint
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(step2, tmp_path / "resumed" / "checkpoints" / step2.name)
    run_training(tiny_config(model, data, tmp_path / "resumed", **flags))
    full, resumed = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "resumed")
    assert sorted(resumed) == [3, 4] and all(resumed[s] == full[s] for s in (3, 4))


# ---- the moe-tiny preset end to end ----------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_tiny")
    tok = root / "tok"
    tok.mkdir()
    vocab = write_char_tokenizer(tok, shakespeare(200_000))
    data = root / "train.txt"
    data.write_text(shakespeare(100_000))
    cfg = load_train_config(
        None,
        {
            "model.config": "moe-tiny",
            "model.tokenizer": str(tok),
            "data.train": [str(data)],
            "output": str(root / "out"),
            "training.steps": 40,
            "training.seq_len": 64,
            "training.batch_size": 8,
            "optimizer.lr": 3e-3,
            "lr_scheduler.warmup_steps": 4,
            "metrics.log_every": 1,
            "metrics.tensorboard": False,
            "metrics.peak_tflops": 1.0,
            "checkpoint.interval": 0,
            "checkpoint.export_dtype": "float32",
        },
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_training(cfg)
    finally:
        torch.set_num_threads(threads)
    return root / "out", vocab


def test_moe_tiny_trains_and_reports_expert_load(moe_tiny_run):
    from baige.runtime.model.config import ModelConfig

    out, vocab = moe_tiny_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r["split"] == "train"]  # not the checkpoint records
    assert [r["step"] for r in records] == list(range(1, 41))
    first, last = records[0], records[-1]
    assert abs(first["loss"] - math.log(vocab)) < 0.3  # ~uniform over the characters at init
    assert last["loss"] < first["loss"] - 1.0  # it learns (character statistics at least)
    for r in records:
        assert r["moe_layers"] == [0, 1, 2, 3]
        assert len(r["expert_load_max_mean"]) == len(r["expert_load_cv"]) == 4
        assert all(1.0 <= m <= 8 / 2 for m in r["expert_load_max_mean"])  # between balanced and E / k
        assert r["aux_loss"] > 0 and r["z_loss"] > 0
    # MFU counts the active parameters: 6 N_active(non-embedding) + 12 L H Q T per token (peak 1 TFLOP/s).
    mc = ModelConfig.from_file(out / "hf" / "config.json")
    assert (mc.moe.num_experts, mc.moe.top_k, mc.num_hidden_layers) == (8, 2, 4)
    active = mc.num_params(non_embedding=True, active=True)
    assert active < 0.5 * mc.num_params(non_embedding=True)
    fpt = 6 * active + 12 * 4 * 4 * 16 * 64
    assert last["mfu"] == pytest.approx(last["tokens_per_second_per_device"] * fpt / 1e12, rel=1e-9)


def test_moe_tiny_export_loads_in_baige_and_transformers(moe_tiny_run):
    from transformers import AutoModelForCausalLM

    from baige.runtime.weights.loader import load_model

    export, vocab = moe_tiny_run[0] / "hf", moe_tiny_run[1]
    theirs = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    ours = load_model(export, dtype="float32")
    ids = torch.randint(3, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = theirs(input_ids=ids).logits
        got = ours.compute_logits(ours(ids, torch.arange(24).expand(2, 24)))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_moe_tiny_export_is_served(moe_tiny_run):
    """`baige serve --model EXPORT` answers a greedy completion with transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    from baige.runtime.model.tokenizer import Tokenizer

    export = moe_tiny_run[0] / "hf"
    tok = Tokenizer.from_dir(export)
    prompt = "ROMEO:\nWhat"
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    hf = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, ids.shape[1] :]
    with launched(
        export, "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory", "16MB", "--log-level", "warning"
    ) as (url, _):
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": str(export), "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["text"] == tok.decode(want.tolist())


def test_bench_train_counts_active_parameters(embedded_dir, one_thread, monkeypatch):
    """``baige bench train --model moe-tiny``: FLOPs/token (and so MFU) from the active parameters."""
    from baige.runtime import roofline
    from baige.runtime.bench.train import TrainBenchConfig, run_train

    limits = roofline.HardwareLimits("cpu", "float32", bandwidth=10e9, matmul_peak=100e9)  # no measuring
    monkeypatch.setattr(roofline, "hardware_limits", lambda device, dtype=torch.float32: limits)
    r = run_train(TrainBenchConfig(model="moe-tiny", seq_len=16, batch_size=2, steps=2, warmup_steps=1, compile=False))
    m, s = r["model"], r["summary"]
    assert m["num_params_active"] < 0.5 * m["num_params_non_embedding"]  # top-2 of 8 experts
    fpt = 6 * m["num_params_active"] + 12 * 4 * 4 * 16 * 16  # 6 N_active + 12 L H Q T
    assert s["roofline"]["flops_per_token"] == fpt
    assert s["mfu_pct"] == pytest.approx(100 * s["tokens_per_s_per_device"] * fpt / 100e9)


# ---- configuration ---------------------------------------------------------------------------------


def test_moe_config_and_expert_parallel_errors(tmp_path):
    from types import SimpleNamespace

    from baige.errors import BaigeError
    from baige.runtime.train.expert_parallel import apply_ep
    from baige.runtime.train.parallel import ParallelDims
    from baige.runtime.weights.loader import load_model

    (tmp_path / "d.txt").write_text("x")
    base = {"data.train": [str(tmp_path / "d.txt")], "output": str(tmp_path / "o")}
    cfg = load_train_config(
        None, base, ["moe.router_aux_loss_coef=0.05", "moe.load_balance=bias", "parallelism.expert_parallel_degree=2"]
    )
    assert (cfg.moe.router_aux_loss_coef, cfg.moe.load_balance, cfg.parallelism.expert_parallel_degree) == (
        0.05,
        "bias",
        2,
    )
    assert "[moe]" in cfg.to_toml() and "expert_parallel_degree = 2" in cfg.to_toml()
    for override, field in (
        ("moe.load_balance=loss_free", "moe.load_balance"),
        ("moe.router_z_loss_coef=-1", "moe.router_z_loss_coef"),
        ("moe.bias_update_rate=nan", "moe.bias_update_rate"),
        ("parallelism.expert_parallel_degree=0", "parallelism.expert_parallel_degree"),
    ):
        with pytest.raises(BaigeError, match=field):
            load_train_config(None, base, [override])
    assert ParallelDims.resolve(4, 1, -1, 1, 2) == ParallelDims(1, 4, 1, 2)
    with pytest.raises(BaigeError, match="expert_parallel_degree 2 must divide data_parallel_shard_degree 1"):
        ParallelDims.resolve(2, 2, -1, 1, 2)  # HSDP 2 x 1: no shard dimension to borrow from
    mesh = SimpleNamespace(size=lambda: 2)
    with pytest.raises(BaigeError, match="num_experts=7 is not divisible by expert_parallel_degree=2"):
        apply_ep(load_model(tiny_model(tmp_path / "moe", "qwen3-moe"), dtype=torch.float32, device="cpu"), mesh)
    with pytest.raises(BaigeError, match="needs a Mixture-of-Experts model"):
        apply_ep(load_model(tiny_model(tmp_path / "dense", "llama"), dtype=torch.float32, device="cpu"), mesh)
