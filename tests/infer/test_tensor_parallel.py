"""Tensor-parallel serving on CPU (2 ranks, gloo): token-identical greedy outputs to one process for
an int4 checkpoint with biases, MoE experts split or placed whole, speculative decoding, logprobs and
prompt logprobs (the server test covers fewer KV heads than ranks, q/k/v biases, int8), and the
sharding's pieces against hand-computed values."""

from __future__ import annotations

import pytest
import torch
from tiny import make_checkpoint, write_tiny_tokenizer
from torch import nn

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.llm import LLM
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.infer.tensor_parallel import (
    Comm,
    check_shardable,
    shard_model,
    vocab_ranges,
)
from baige.runtime.quant.apply import quantize_model
from baige.runtime.quant.linear import QuantizedLinear
from baige.runtime.quant.scheme import QuantScheme, quantize_weight
from baige.runtime.quantize import save_quantized
from baige.runtime.weights.loader import load_model

# mixed lengths: the step mixes decodes with prefill chunks (max_num_batched_tokens below the prompts)
PROMPTS = [[(11 * i + 3 * j) % 150 + 1 for j in range(2 + 5 * i)] for i in range(10)]
ENGINE = dict(max_num_batched_tokens=32, max_num_seqs=6, kv_cache_memory="8MB")


def _params(**kw) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=4 + 3 * (i % 4), temperature=0, ignore_eos=True, **kw) for i in range(len(PROMPTS))
    ]


def _checkpoint(root, variant: str, quant: QuantScheme | None = None, **overrides):
    src = write_tiny_tokenizer(make_checkpoint(root / "src", variant, **overrides))
    if quant is None:
        return src
    model = load_model(src)
    return save_quantized(model, quant, quantize_model(model, quant), root / "q", src)


def _generate(model_dir, tp: int, params, **engine):
    llm = LLM(str(model_dir), tensor_parallel_size=tp, **ENGINE, **engine)
    try:
        return llm.generate(PROMPTS, params)
    finally:
        llm.engine.close()


# fewer KV heads than ranks, Qwen2 q/k/v biases and int8 run through the server (tests/server/test_tp_serving.py)
CASES = {
    "int4-g32-asym-bias": dict(
        variant="qwen2-bias", quant=QuantScheme(4, 32, symmetric=False), overrides=dict(intermediate_size=128)
    ),
    "qwen3-moe-split-experts": dict(variant="qwen3-moe"),
    "qwen2-moe-expert-parallel-uneven": dict(variant="qwen2-moe-shared", engine=dict(enable_expert_parallel=True)),
    "ngram-speculation": dict(
        variant="llama-tied",
        engine=dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_tp2_greedy_is_token_identical_to_one_process(tmp_path, case):
    c = CASES[case]
    model_dir = _checkpoint(tmp_path, c["variant"], c.get("quant"), **c.get("overrides", {}))
    engine = c.get("engine", {})
    one = _generate(model_dir, 1, _params(), **engine)
    two = _generate(model_dir, 2, _params(), **engine)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(two, _params()))


def test_tp2_logprobs_and_prompt_logprobs_match_one_process(tmp_path):
    model_dir = _checkpoint(tmp_path, "llama")
    params = _params(logprobs=3, prompt_logprobs=2)
    one = _generate(model_dir, 1, params)
    # two tensor-parallel engines alive in one process (bench compare's case): each has its own groups
    first = LLM(str(model_dir), tensor_parallel_size=2, **ENGINE)
    try:
        two = _generate(model_dir, 2, params)
        again = first.generate(PROMPTS, params)
    finally:
        first.engine.close()
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in one]
    for a, b in zip(one, two):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        lp1 = [lp.logprob for lp in a.outputs[0].logprobs] + [lp.logprob for lp in a.prompt_logprobs[1:]]
        lp2 = [lp.logprob for lp in b.outputs[0].logprobs] + [lp.logprob for lp in b.prompt_logprobs[1:]]
        assert torch.allclose(torch.tensor(lp2), torch.tensor(lp1), atol=1e-4)
        assert [lp.top for lp in b.prompt_logprobs[1:]] and [
            [t for t, _ in lp.top] for lp in b.prompt_logprobs[1:]
        ] == [[t for t, _ in lp.top] for lp in a.prompt_logprobs[1:]]


def test_vocab_ranges_hand_computed():
    assert vocab_ranges(160, 2) == [(0, 80), (80, 80)]
    assert vocab_ranges(10, 3) == [(0, 4), (4, 4), (8, 2)]
    assert vocab_ranges(5, 4) == [(0, 2), (2, 2), (4, 1), (5, 0)]


def test_quantized_linear_narrow_equals_slices_of_the_dequantized_weight():
    torch.manual_seed(0)
    lin = nn.Linear(96, 24, bias=True)
    for scheme in (QuantScheme(8, None), QuantScheme(4, 32, symmetric=False), QuantScheme(4, 32)):
        q = QuantizedLinear.from_quantized(lin, scheme, *quantize_weight(lin.weight.detach(), scheme))
        full = q.dequantized_weight()
        rows, cols = q.narrow(0, 8, 16), q.narrow(1, 32, 64)
        assert torch.equal(rows.dequantized_weight(), full[8:24]) and torch.equal(rows.bias, lin.bias[8:24])
        assert torch.equal(cols.dequantized_weight(), full[:, 32:96]) and torch.equal(cols.bias, lin.bias)
    with pytest.raises(BaigeError, match=r"in_features=96 at \[0, 48\).*groups of 32"):
        q.narrow(1, 0, 48)


def test_unshardable_models_are_one_line_errors(tmp_path):
    cfg = load_model(make_checkpoint(tmp_path / "a", "llama")).config  # 4 heads
    with pytest.raises(BaigeError, match=r"^--tensor-parallel-size 3 does not divide num_attention_heads \(4\)$"):
        check_shardable(cfg, 3)
    cfg = load_model(
        make_checkpoint(
            tmp_path / "b",
            "llama",
            hidden_size=96,
            num_attention_heads=12,
            num_key_value_heads=3,
            intermediate_size=100,
        )
    ).config
    with pytest.raises(BaigeError, match=r"num_key_value_heads \(3\) must be a multiple or a divisor"):
        check_shardable(cfg, 2)
    with pytest.raises(BaigeError, match=r"^--tensor-parallel-size 3 does not divide intermediate_size \(100\)$"):
        check_shardable(cfg, 3)
    with pytest.raises(BaigeError, match="--enable-lora with --tensor-parallel-size"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)


def test_int4_groups_split_across_ranks_are_one_line_errors(tmp_path):
    # intermediate 96 over 2 ranks = 48 columns of down_proj each: not whole groups of 32 (found while
    # sharding, before any collective: no process group needed)
    model = load_model(_checkpoint(tmp_path, "llama", QuantScheme(4, 32)))
    with pytest.raises(
        BaigeError,
        match=r"^this checkpoint cannot be tensor-parallel: cannot split in_features=96 "
        r"at \[0, 48\): int4 groups of 32 columns must stay whole on one rank$",
    ):
        shard_model(model, Comm(None, 0, 2))


def test_cli_refuses_an_unshardable_model_before_starting_workers(tmp_path):
    import subprocess
    import sys

    model_dir = write_tiny_tokenizer(make_checkpoint(tmp_path / "m", "llama"))  # 4 heads
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "baige",
            "generate",
            "--model",
            str(model_dir),
            "-p",
            "t5",
            "--tensor-parallel-size",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert r.stderr.strip() == "error: --tensor-parallel-size 3 does not divide num_attention_heads (4)"


def _broadcast_rank(rank: int, store_path: str, out_path: str) -> None:
    import pickle

    from torch import distributed as dist

    from baige.runtime.infer.tp_worker import STEP_BYTES, TIMEOUT, _broadcast

    pg = dist.ProcessGroupGloo(dist.FileStore(store_path, 2), rank, 2, TIMEOUT)
    comm = Comm(pg, rank, 2)
    small = {"ids": torch.arange(5)}
    large = {"tables": torch.arange(3 * STEP_BYTES // 8).view(3, -1), "text": "x" * 100}  # > STEP_BYTES pickled
    got = [
        _broadcast(small if rank == 0 else None, comm),
        _broadcast(large if rank == 0 else None, comm),
        _broadcast("stop" if rank == 0 else None, comm),
    ]
    if rank == 1:
        with open(out_path, "wb") as f:
            pickle.dump(got, f)


def test_step_broadcast_carries_small_and_larger_than_one_buffer_objects(tmp_path):
    import pickle

    import torch.multiprocessing as mp

    from baige.runtime.infer.tp_worker import STEP_BYTES

    mp.spawn(_broadcast_rank, args=(str(tmp_path / "store"), str(tmp_path / "got.pkl")), nprocs=2)
    small, large, stop = pickle.loads((tmp_path / "got.pkl").read_bytes())
    assert torch.equal(small["ids"], torch.arange(5))
    assert torch.equal(large["tables"], torch.arange(3 * STEP_BYTES // 8).view(3, -1)) and large["text"] == "x" * 100
    assert stop == "stop"


def test_tp2_embeddings_match_one_process(tmp_path):
    """The pooling runner on 2 ranks: every rank runs the prefill-only steps, rank 0 pools its final hidden
    states (replicated after the last all-reduce), equal to one process's."""
    model_dir = _checkpoint(tmp_path, "llama")
    vecs = []
    for tp in (1, 2):
        llm = LLM(str(model_dir), tensor_parallel_size=tp, runner="pooling", dtype="float32", **ENGINE)
        try:
            vecs.append(torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS)]))
        finally:
            llm.engine.close()
    torch.testing.assert_close(vecs[1], vecs[0], atol=1e-5, rtol=0)
