"""The engine's RL hooks: in-place weight sync (``update_weights`` / ``update_weights_from_disk``),
``sleep`` / ``wake_up`` and ``reset_prefix_cache``, on tiny random fp32 checkpoints (bf16 once). The
oracle of a weight update is a fresh engine loaded from the same weights on disk: greedy tokens,
sampled-token logprobs and prompt logprobs must be equal, exactly, on the native CPU decode path."""

import asyncio
import time
import weakref

import pytest
import torch
from safetensors.torch import load_file

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.async_engine import AsyncEngine
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.lora import LoRANotFound, LoRARequest
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.quant.fp16_weight import apply_quantization
from baige.runtime.weights.loader import load_model
from baige.runtime.weights.safetensors_io import load_state_dict
from tests.tiny import make_checkpoint, make_lora_adapter, write_tiny_tokenizer

CFG = dict(max_model_len=96, max_num_seqs=8, block_size=4, kv_cache_memory=2_000_000)
PROMPTS = [[5, 17, 33, 2, 91, 40, 12, 7, 150, 3], [60, 61, 62], [5, 17, 33, 2, 91, 40, 12, 7, 9, 9, 9, 14, 20]]


def _params(i: int, prompt_logprobs: bool = True) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=6 + 3 * i, ignore_eos=True, logprobs=2, prompt_logprobs=2 if prompt_logprobs else None
    )


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Per variant two checkpoints of one architecture (seeds 0 and 1) with a tokenizer."""
    root = tmp_path_factory.mktemp("weight_sync")
    return {
        v: [write_tiny_tokenizer(make_checkpoint(root / f"{v}-{s}", v, seed=s)) for s in (0, 1)]
        for v in ("qwen2-bias", "llama", "qwen3-moe")
    }


def _engine(model_dir, dtype=torch.float32, **kw) -> Engine:
    return Engine(load_model(model_dir, dtype), Tokenizer.from_dir(model_dir), EngineConfig(**{**CFG, **kw}))


def _run(eng: Engine, prompt_logprobs: bool = True) -> list[tuple]:
    """Every request's greedy tokens, their logprobs (the sampled token's and the top 2, exact floats),
    prompt logprobs and cached prompt tokens."""
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, _params(i, prompt_logprobs))
    outs = eng.run_to_completion([f"r{i}" for i in range(len(PROMPTS))])
    return [
        (
            o.outputs[0].token_ids,
            [(lp.logprob, lp.top) for lp in o.outputs[0].logprobs],
            None
            if o.prompt_logprobs is None
            else [None if lp is None else (lp.logprob, lp.top) for lp in o.prompt_logprobs],
            o.num_cached_tokens,
        )
        for o in outs
    ]


@pytest.mark.parametrize(
    "variant, dtype, source",
    [
        ("qwen2-bias", torch.float32, "safetensors"),  # tied, q/k/v biases (joined copies in the native table)
        ("qwen2-bias", torch.bfloat16, "safetensors"),  # fp32 copies of a bf16 model's norms and biases
        ("llama", torch.float32, "disk"),  # untied lm_head, through update_weights_from_disk
        ("qwen3-moe", torch.float32, "safetensors"),  # published per-expert names -> slices of the stacks
        ("qwen3-moe", torch.float32, "baige"),  # baige's own state dict (stacked experts), as a trainer's
    ],
)
def test_update_weights_equals_a_fresh_engine(ckpts, variant, dtype, source):
    old, new = ckpts[variant]
    eng = _engine(old, dtype)
    native = eng.runner.fused_decode is not None
    before = _run(eng)
    _run(eng, prompt_logprobs=False)  # fills the prefix cache with the old weights' K/V
    if source == "disk":
        eng.update_weights_from_disk(str(new))
    elif source == "safetensors":
        eng.update_weights(load_state_dict(new).items())  # HF names, fp32 tensors
    else:
        eng.update_weights(load_model(new, torch.float32).named_parameters())
    assert (eng.runner.fused_decode is not None) == native  # the native table is rebuilt, not dropped
    fresh = _engine(new, dtype)
    expected = _run(fresh)
    got = _run(eng)
    assert got == expected
    assert [g[0] for g in got] != [b[0] for b in before]  # the update changed the tokens
    # a prompt seen before the update is not served from K/V of the old weights
    assert _run(eng, prompt_logprobs=False) == _run(fresh, prompt_logprobs=False)


def test_updates_between_steps_keep_each_step_on_one_weight_version(ckpts):
    """Requests in flight (decoding and in chunked prefill) when ``lm_head`` is replaced by 2x itself:
    the logits double exactly, so the greedy tokens (and every K/V) stay those of either weight version
    and only the logprobs tell which version computed a token. Each token's logprobs equal, exactly,
    the old weights' run up to the update step and the new weights' run after it, for every sequence."""
    old, _ = ckpts["llama"]
    kw = dict(max_num_batched_tokens=8)  # prompts of 10 and 13 tokens prefill over several steps

    def steps(eng: Engine) -> list[dict]:
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", p, _params(i, prompt_logprobs=False))
        out = []
        while eng.has_unfinished():
            out.append({o.request_id: (o.outputs[0].delta_token_ids, o.outputs[0].delta_logprobs) for o in eng.step()})
        return out

    eng_old = _engine(old, **kw)
    head2 = 2 * eng_old.model.lm_head.weight.detach()
    ref_old = steps(eng_old)
    eng_new = _engine(old, **kw)
    eng_new.update_weights([("lm_head.weight", head2)])
    ref_new = steps(eng_new)
    eng = _engine(old, **kw)
    assert eng.runner.fused_decode is not None
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, _params(i, prompt_logprobs=False))
    got, k = [], 4
    while eng.has_unfinished():
        if len(got) == k:
            eng.update_weights([("lm_head.weight", head2)])
        got.append({o.request_id: (o.outputs[0].delta_token_ids, o.outputs[0].delta_logprobs) for o in eng.step()})
    assert len(got) == len(ref_old) == len(ref_new) > k + 2
    switched = 0
    for step, (g, a, b) in enumerate(zip(got, ref_old, ref_new)):
        ref = a if step < k else b
        assert {r: t for r, (t, _) in g.items()} == {r: t for r, (t, _) in ref.items()}
        for rid, (_, lps) in g.items():
            assert [lp.logprob for lp in lps] == [lp.logprob for lp in ref[rid][1]]
            assert all(x.logprob != y.logprob for x, y in zip(a[rid][1], b[rid][1]))  # the versions differ
            switched += step >= k and bool(lps)
    assert switched > 0  # tokens were produced after the update too


def test_async_update_drains_streams_in_flight(ckpts):
    """``AsyncEngine.update_weights`` with a stream in flight: it finishes on the old weights (every
    token's logprob equals the old weights' run); a request sent during the drain waits and runs
    wholly on the new weights. (One request at a time, so each runs as in its reference.)"""
    old, _ = ckpts["llama"]

    def collect(eng: Engine, i: int) -> list[float]:
        eng.add_request("x", PROMPTS[i], _params(i, prompt_logprobs=False))
        return [lp.logprob for lp in eng.run_to_completion(["x"])[0].outputs[0].logprobs]

    ref = _engine(old, enable_prefix_caching=False)  # each prompt computed whole, as in the async run
    head2 = 2 * ref.model.lm_head.weight.detach()
    old_lps = [collect(ref, i) for i in range(3)]
    ref.update_weights([("lm_head.weight", head2)])
    new_lps = [collect(ref, i) for i in range(3)]

    async def main() -> tuple[list, list]:
        eng = _engine(old)
        step = eng.step
        eng.step = lambda: time.sleep(0.01) or step()  # the stream is surely in flight at the update
        aeng = AsyncEngine(eng)

        async def stream(i: int) -> list[float]:
            last = None
            async for out in aeng.generate(PROMPTS[i], _params(i, prompt_logprobs=False)):
                last = out
                started.set()
            return [lp.logprob for lp in last.outputs[0].logprobs]

        started = asyncio.Event()
        in_flight = asyncio.create_task(stream(2))
        await started.wait()
        update = asyncio.create_task(aeng.update_weights([("lm_head.weight", head2)]))
        await asyncio.sleep(0)
        assert not in_flight.done()
        during = asyncio.create_task(stream(1))  # queued while the update waits for the drain
        await update
        result = await in_flight, await during
        aeng.shutdown()
        return result

    first, late = asyncio.run(main())
    assert first == old_lps[2] != new_lps[2]
    assert late == new_lps[1] != old_lps[1]


def test_sleep_releases_the_kv_cache_and_wake_up_restores_it(ckpts):
    old, new = ckpts["qwen2-bias"]
    eng = _engine(old)
    before = _run(eng, prompt_logprobs=False)
    pool = weakref.ref(eng.kv_cache.k[0])
    eng.sleep()
    assert eng.is_sleeping and pool() is None  # nothing (the native table included) holds the pools
    with pytest.raises(BaigeError, match="asleep"):
        eng.add_request("z", PROMPTS[0], _params(0))
    eng.sleep()  # already asleep: nothing to do
    eng.wake_up()
    assert not eng.is_sleeping and eng.runner.fused_decode is not None
    after = _run(eng, prompt_logprobs=False)
    assert [a[:2] for a in after] == [b[:2] for b in before]
    assert after[0][3] == 0  # the prefix cache did not survive the KV it pointed into
    eng.sleep()
    eng.update_weights_from_disk(str(new))  # weights change while asleep (the RL colocation order)
    eng.wake_up()
    assert _run(eng) == _run(_engine(new))


def test_sleep_refusals(ckpts):
    eng = _engine(ckpts["llama"][0])
    with pytest.raises(BaigeError, match="level 2 is not supported"):
        eng.sleep(level=2)
    eng.add_request("r", PROMPTS[0], _params(0))
    with pytest.raises(BaigeError, match="1 request\\(s\\) in flight"):
        eng.sleep()
    assert not eng.is_sleeping
    eng.run_to_completion(["r"])


def test_bad_updates_leave_the_model_unchanged(ckpts, tmp_path):
    old, new = ckpts["llama"]
    eng = _engine(old)
    snapshot = {k: v.clone() for k, v in eng.model.state_dict().items()}
    good = ("model.norm.weight", torch.zeros(64))
    for pairs, match in [
        ([good, ("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3))], r"q_proj.weight has shape \(3, 3\)"),
        ([good, ("model.layers.9.mlp.up_proj.weight", torch.zeros(96, 64))], "no tensor 'model.layers.9.mlp.up_proj"),
        ([good, ("model.norm.weight", [1.0] * 64)], "a floating-point tensor is needed, got list"),
        ([good, ("model.norm.weight", torch.zeros(64, dtype=torch.int32))], "needed, got a torch.int32 tensor"),
        ({"model.norm.weight": torch.zeros(64)}, r"takes \(name, tensor\) pairs, .* got an item str 'model.norm"),
        ([good, "model.norm.weight"], r"takes \(name, tensor\) pairs"),
    ]:
        with pytest.raises(BaigeError, match=match):
            eng.update_weights(pairs)
    assert all(torch.equal(v, snapshot[k]) for k, v in eng.model.state_dict().items())
    wide = make_checkpoint(tmp_path / "wide", "llama", hidden_size=96)
    for path, match in [
        (str(tmp_path / "nowhere"), "no such directory"),
        (str(wide), "hidden_size is 96, the served model's is 64"),
        (str(ckpts["qwen2-bias"][1]), "model_type is 'qwen2', the served model's is 'llama'"),
    ]:
        with pytest.raises(BaigeError, match=match):
            eng.update_weights_from_disk(path)
    assert all(torch.equal(v, snapshot[k]) for k, v in eng.model.state_dict().items())
    model = load_model(old, torch.float32)
    apply_quantization(model, "fp16-weight")
    quantized = Engine(model, Tokenizer.from_dir(old), EngineConfig(**CFG))
    with pytest.raises(BaigeError, match="q_proj is a Fp16WeightLinear"):
        quantized.update_weights(load_state_dict(new).items())


def test_lora_update_syncs_only_the_adapter(ckpts, tmp_path):
    """``update_weights(pairs, lora_name=...)`` replaces a loaded adapter's lora_A/lora_B in place
    (PEFT's keys, or a training model's without the ``base_model.model.`` prefix): its requests then
    equal a fresh engine serving the new adapter from disk, on the native decode with adapter stacks."""
    base = ckpts["llama"][0]
    targets = ["q_proj", "v_proj", "down_proj"]
    old, new = (make_lora_adapter(base, tmp_path / f"a{s}", 4, targets, seed=s) for s in (40, 41))

    def served(adapter) -> Engine:
        eng = _engine(base, enable_lora=True, max_lora_rank=4)
        eng.lora.load(LoRARequest("policy", 1, str(adapter)))
        return eng

    def run(eng: Engine) -> list:
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", p, _params(i, prompt_logprobs=False), lora_request=LoRARequest("policy", 1, ""))
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in eng.run_to_completion(["r0", "r1", "r2"])]

    eng = served(old)
    before = run(eng)
    pairs = sorted(load_file(str(new / "adapter_model.safetensors")).items())
    pairs = [(k.removeprefix("base_model.model.") if j % 2 else k, t) for j, (k, t) in enumerate(pairs)]
    eng.update_weights(pairs, lora_name="policy")
    assert eng.runner.fused_decode is not None
    got = run(eng)
    assert got == run(served(new)) and got != before
    with pytest.raises(BaigeError, match="'model.layers.0.self_attn.k_proj.lora_A.weight' is not a lora_A/lora_B"):
        eng.update_weights([("model.layers.0.self_attn.k_proj.lora_A.weight", torch.zeros(4, 64))], lora_name="policy")
    with pytest.raises(BaigeError, match=r"q_proj.lora_B.weight is \(64, 2\), the adapter's is \(64, 4\)"):
        eng.update_weights([("model.layers.0.self_attn.q_proj.lora_B.weight", torch.zeros(64, 2))], lora_name="policy")
    with pytest.raises(LoRANotFound):
        eng.update_weights(pairs, lora_name="other")
    with pytest.raises(BaigeError, match="LoRA is not enabled"):
        _engine(base).update_weights(pairs, lora_name="policy")
    assert run(eng) == got  # the refused updates changed nothing
