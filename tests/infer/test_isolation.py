"""One request's failure stays its own: engine-level retry of a failing batched step, per-request
detokenizer failures, atomic add_request, the AsyncEngine loop's containment and death, and the
validation of SamplingParams (finite numbers, 64-bit seeds, vocabulary-bound ids, stop caps)."""

import asyncio
import math
import threading

import pytest

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.async_engine import AsyncEngine
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.outputs import EngineDeadError, RequestFailed
from baige.runtime.infer.sampling_params import MAX_STOP_STRINGS, SamplingParams
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.loader import load_model

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(embedded_dir):
    return load_model(embedded_dir), Tokenizer.from_dir(embedded_dir)


def make_engine(loaded) -> Engine:
    model, tok = loaded
    return Engine(model, tok, EngineConfig(max_model_len=256, kv_cache_memory=30_000_000, max_num_seqs=8))


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def solo(loaded):
    out = {}
    for p in PROMPTS:
        eng = make_engine(loaded)
        eng.add_request("s", p, SamplingParams(max_tokens=10, **GREEDY))
        out[p] = eng.run_to_completion(["s"])[0].outputs[0].token_ids
    return out


def drain(eng: Engine) -> tuple[dict, dict]:
    finals, failures = {}, {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        failures.update(eng.take_failures())
    return finals, failures


def test_a_step_that_raises_for_one_row_fails_only_that_request(loaded, solo):
    eng = make_engine(loaded)
    real = eng.runner.execute
    calls = []

    def execute(batch, rows, token_masks=None):
        calls.append(len(batch))
        if any(r is not None and r.params.seed == 7 for r in rows):
            raise RuntimeError("bad row")
        return real(batch, rows, token_masks)

    eng.runner.execute = execute
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=10, **GREEDY))
    eng.add_request("bad", "Hello there", SamplingParams(max_tokens=10, seed=7, **GREEDY))
    finals, failures = drain(eng)
    assert set(failures) == {"bad"} and isinstance(failures["bad"], RequestFailed)
    assert "bad row" in str(failures["bad"])
    assert {f"r{i}": solo[p] for i, p in enumerate(PROMPTS)} == finals  # the others: exactly their solo tokens
    assert calls[0] == 4 and 1 in calls  # the batched step, then one sequence at a time
    assert eng.block_manager.num_used_blocks == 0 and not eng.requests


def test_run_to_completion_raises_for_a_failed_request_after_the_others(loaded):
    eng = make_engine(loaded)
    real = eng.runner.execute

    def execute(batch, rows, token_masks=None):
        if any(r.params.seed == 7 for r in rows):
            raise RuntimeError("x")
        return real(batch, rows, token_masks)

    eng.runner.execute = execute
    eng.add_request("ok", PROMPTS[0], SamplingParams(max_tokens=4, **GREEDY))
    eng.add_request("bad", PROMPTS[1], SamplingParams(max_tokens=4, seed=7, **GREEDY))
    with pytest.raises(RequestFailed, match="request bad failed"):
        eng.run_to_completion(["ok", "bad"])
    assert eng.block_manager.num_used_blocks == 0


def test_a_detokenizer_failure_fails_its_request_alone(loaded, solo, monkeypatch):
    eng = make_engine(loaded)
    real = eng.output_processor.process_token

    def process(seq, token, lp, last=True):
        if seq.request_id == "bad":
            raise UnicodeError("broken detokenizer")
        return real(seq, token, lp, last)

    monkeypatch.setattr(eng.output_processor, "process_token", process)
    eng.add_request("ok", PROMPTS[2], SamplingParams(max_tokens=10, **GREEDY))
    eng.add_request("bad", PROMPTS[0], SamplingParams(max_tokens=10, **GREEDY))
    finals, failures = drain(eng)
    assert set(failures) == {"bad"} and finals == {"ok": solo[PROMPTS[2]]}
    assert eng.block_manager.num_used_blocks == 0


def test_add_request_is_all_or_nothing(loaded, monkeypatch):
    eng = make_engine(loaded)
    real = SamplingParams.seed_for

    def seed_for(self, index):
        if index == 2:
            raise RuntimeError("generator failed")
        return real(self, index)

    monkeypatch.setattr(SamplingParams, "seed_for", seed_for)
    with pytest.raises(RuntimeError):
        eng.add_request("r", PROMPTS[0], SamplingParams(n=3, seed=1, max_tokens=4))
    assert not eng.has_unfinished() and not eng.requests  # no orphaned sequence left queued


def test_seeds_wrap_to_64_bits_per_sequence():
    p = SamplingParams(seed=2**64 - 1, n=3)
    assert [p.seed_for(i) for i in range(3)] == [2**64 - 1, 0, 1]


async def _collect(aeng: AsyncEngine, prompt, params):
    return [out async for out in aeng.generate(prompt, params)]


def test_async_loop_contains_add_and_step_errors(loaded, solo):
    eng = make_engine(loaded)
    real_add = eng.add_request

    def add(rid, prompt, params, arrival=None, **kw):
        if params.seed == 9:
            raise RuntimeError("add failed")
        return real_add(rid, prompt, params, arrival, **kw)

    eng.add_request = add
    aeng = AsyncEngine(eng)
    try:

        async def main():
            bad = asyncio.create_task(_collect(aeng, "x", SamplingParams(max_tokens=2, seed=9)))
            good = asyncio.create_task(_collect(aeng, PROMPTS[0], SamplingParams(max_tokens=10, **GREEDY)))
            with pytest.raises(RequestFailed, match="add failed"):
                await bad
            return await good

        outs = asyncio.run(main())
        assert outs[-1].outputs[0].token_ids == solo[PROMPTS[0]] and aeng.is_alive
    finally:
        aeng.shutdown()


def test_async_loop_death_fails_waiting_clients_and_refuses_new_ones(loaded):
    eng = make_engine(loaded)

    class Fatal(BaseException):
        pass

    real_step = eng.step

    def step():
        if any(r.params.seed == 5 for r in eng.requests.values()):
            raise Fatal("boom")
        return real_step()

    eng.step = step
    died = threading.Event()
    aeng = AsyncEngine(eng, on_dead=died.set)
    try:

        async def main():
            waiting = asyncio.create_task(_collect(aeng, PROMPTS[1], SamplingParams(max_tokens=200, **GREEDY)))
            await asyncio.sleep(0.3)
            killer = asyncio.create_task(_collect(aeng, "x", SamplingParams(max_tokens=2, seed=5)))
            for task in (waiting, killer):
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(task, 60)
            with pytest.raises(EngineDeadError):
                await _collect(aeng, "y", SamplingParams(max_tokens=2))

        asyncio.run(main())
        assert died.wait(10) and not aeng.is_alive and isinstance(aeng.dead, Fatal)
    finally:
        aeng.shutdown()


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": math.inf}, "top_p"),
        ({"presence_penalty": -math.inf}, "presence_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"n": True}, "n"),
        ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["x" * 10_000]}, "stop"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {3: math.nan}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
    ],
)
def test_sampling_params_refuse_out_of_range_values(kwargs, param):
    with pytest.raises(BaigeError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"top_k": 161}, "top_k"),
        ({"stop_token_ids": [160]}, "stop_token_ids"),
        ({"allowed_token_ids": [5, 160]}, "allowed_token_ids"),
        ({"logit_bias": {160: 1.0}}, "logit_bias"),
    ],
)
def test_token_ids_must_be_inside_the_vocabulary(kwargs, param):
    SamplingParams(**kwargs)  # fine without a vocabulary
    SamplingParams(
        **{k: ([159] if isinstance(v, list) else {159: 1.0} if isinstance(v, dict) else 160) for k, v in kwargs.items()}
    ).check_vocab(160)  # the last id / top_k = vocab are in range
    with pytest.raises(BaigeError) as e:
        SamplingParams(**kwargs).check_vocab(160)
    assert e.value.param == param


def test_tiny_temperature_is_greedy():
    assert SamplingParams(temperature=1e-7).greedy and not SamplingParams(temperature=1e-3).greedy
