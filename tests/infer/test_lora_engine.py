"""LoRA serving through the Engine on a tiny model: one batch mixing the base and three PEFT adapters
(ranks 2/5/8, different targets, rsLoRA) gives every request the greedy tokens of peft's merged
model of its adapter run alone (prefill, CPU decode steps in the native step with the adapters'
stacks and in the per-op path, shared prompt prefixes that must not share KV across adapters);
``max_loras`` per step; load, unload and mistakes as one-line errors; the CLI refuses a bad adapter at start-up."""

from __future__ import annotations

import pytest
import torch

from baige.errors import BaigeError
from baige.kernels import NativeDecodeLayers
from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.llm import LLM
from baige.runtime.infer.lora import LoRANotFound, LoRARequest
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.lora import LORA_TARGETS
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.loader import load_model
from tests.tiny import make_checkpoint, make_lora_adapter, merge_lora_adapter, write_tiny_tokenizer

ADAPTERS = {  # name -> (rank, targets, use_rslora)
    "sql": (2, ["q_proj", "v_proj"], False),
    "chat": (5, list(LORA_TARGETS), True),
    "code": (8, ["o_proj", "gate_proj", "down_proj"], False),
}
CFG = dict(max_model_len=64, max_num_seqs=8, block_size=4, kv_cache_memory=1_000_000)
PREFIX = [5, 17, 33, 2, 91, 40, 12, 7, 150]  # every prompt starts with it: two full blocks to (not) share
TAILS = [[3, 3, 8], [60, 61, 62, 63, 64, 65, 66]]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_engine")
    base = write_tiny_tokenizer(make_checkpoint(root / "base", "llama", seed=3))
    out = {None: base}
    for i, (name, (r, targets, rs)) in enumerate(ADAPTERS.items()):
        out[name] = make_lora_adapter(base, root / name, r, targets, seed=20 + i, use_rslora=rs)
    return out


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True)


def _alone(model_dir, tok: Tokenizer) -> list[list[int]]:
    """The greedy tokens of each prompt on ``model_dir`` in a plain engine (no LoRA)."""
    eng = Engine(load_model(model_dir, torch.float32), tok, EngineConfig(**CFG))
    for i, tail in enumerate(TAILS):
        eng.add_request(f"r{i}", PREFIX + tail, _params(i))
    return [o.outputs[0].token_ids for o in eng.run_to_completion([f"r{i}" for i in range(len(TAILS))])]


def test_mixed_batch_matches_merged_models(dirs, tmp_path, monkeypatch):
    tok = Tokenizer.from_dir(dirs[None])
    expected = {None: _alone(dirs[None], tok)}
    for name in ADAPTERS:
        expected[name] = _alone(merge_lora_adapter(dirs[None], dirs[name], tmp_path / f"merged-{name}"), tok)
    assert len({str(v) for v in expected.values()}) == 4  # every adapter changes the tokens

    llm = LLM(str(dirs[None]), enable_lora=True, max_loras=3, dtype="float32", **CFG)
    assert llm.engine.runner.fused_decode is not None  # decode steps on this CPU model take the native step
    seen, native = [], []  # adapters of every step; per native decode step, its tokens' adapter slots
    set_batch, call, step = llm.engine.lora.set_batch, NativeDecodeLayers.__call__, NativeDecodeLayers.step
    monkeypatch.setattr(llm.engine.lora, "set_batch", lambda ids: seen.append(set(ids)) or set_batch(ids))

    def counting(self, *a):  # the layers-only call: lora_ids is its 7th argument
        native.append(None if a[6] is None else set(a[6].tolist()))
        return call(self, *a)

    def counting_step(self, *a):  # the whole step in C: its 10th
        native.append(None if a[9] is None else set(a[9].tolist()))
        return step(self, *a)

    monkeypatch.setattr(NativeDecodeLayers, "__call__", counting)
    monkeypatch.setattr(NativeDecodeLayers, "step", counting_step)
    names = [None, *ADAPTERS]
    requests = [LoRARequest(n, k, str(dirs[n])) if n else None for k, n in enumerate(names)]
    work = [(PREFIX + tail, _params(i), lora) for i, tail in enumerate(TAILS) for lora in requests]
    outs = llm.generate([p for p, _, _ in work], [sp for _, sp, _ in work], lora_request=[r for _, _, r in work])
    for (_, _, lora), out, k in zip(work, outs, range(len(work))):
        name = lora.lora_name if lora else None
        assert out.outputs[0].token_ids == expected[name][k // len(names)], name
    assert {0, 1, 2, 3} in seen  # one step held the base and all three adapters
    assert {-1, 0, 1, 2} in native  # ... and that decode step ran natively, with the adapters' stacks
    assert all(ids is not None for ids in native)  # every step had an adapter
    # afterwards the base alone takes the native decode step without adapter ids, with the same tokens
    native.clear()
    assert [
        o.outputs[0].token_ids for o in llm.generate([PREFIX + t for t in TAILS], [_params(i) for i in range(2)])
    ] == expected[None]
    assert native and all(ids is None for ids in native)
    # the per-op path (native step off) gives the same adapter tokens through the module hooks
    monkeypatch.setattr(llm.engine.runner, "fused_decode", None)
    native.clear()
    outs = llm.generate([p for p, _, _ in work], [sp for _, sp, _ in work], lora_request=[r for _, _, r in work])
    assert not native
    for (_, _, lora), out, k in zip(work, outs, range(len(work))):
        assert out.outputs[0].token_ids == expected[lora.lora_name if lora else None][k // len(names)]


def test_max_loras_load_unload_and_mistakes(dirs, tmp_path):
    tok = Tokenizer.from_dir(dirs[None])
    model = load_model(dirs[None], torch.float32)
    eng = Engine(
        model,
        tok,
        EngineConfig(
            **CFG,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=5,
            lora_modules={"sql": str(dirs["sql"]), "chat": str(dirs["chat"])},
        ),
    )
    with pytest.raises(BaigeError, match=r"rank 8 exceeds --max-lora-rank 5") as e:
        eng.lora.load(LoRARequest("code", 3, str(dirs["code"])))
    assert "\n" not in str(e.value) and "code" not in eng.lora.loaded
    wide = make_checkpoint(tmp_path / "wide", "llama", hidden_size=96)
    with pytest.raises(BaigeError, match=r"do not fit rank 2 on a 96 -> 96 linear"):
        Engine(
            load_model(wide, torch.float32),
            tok,
            EngineConfig(**CFG, enable_lora=True, lora_modules={"sql": str(dirs["sql"])}),
        )
    with pytest.raises(LoRANotFound, match="'nope' is not loaded"):
        eng.add_request("x", [1, 2], _params(0), lora_request=LoRARequest("nope", 9, ""))
    with pytest.raises(BaigeError, match="LoRA is not enabled"):
        Engine(model, tok, EngineConfig(**CFG)).add_request(
            "x", [1, 2], _params(0), lora_request=LoRARequest("sql", 1, "")
        )
    with pytest.raises(BaigeError, match="needs --enable-lora"):
        EngineConfig(lora_modules={"sql": "x"})

    sql_id = eng.lora.get("sql").engine_id
    for i, name in enumerate(["sql", "chat", "sql", None]):
        eng.add_request(f"r{i}", PREFIX, _params(1), lora_request=LoRARequest(name, 0, "") if name else None)
    eng.step()
    with pytest.raises(BaigeError, match="in use by 2 request"):  # in flight: refused, they go on
        eng.unload_lora_adapter("sql")
    outs = eng.run_to_completion([f"r{i}" for i in range(4)])
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids != outs[3].outputs[0].token_ids
    eng.unload_lora_adapter("sql")
    assert list(eng.lora.loaded) == ["chat"]
    with pytest.raises(LoRANotFound):
        eng.unload_lora_adapter("sql")
    assert eng.lora.load(LoRARequest("sql", 1, str(dirs["sql"]))) != sql_id  # a fresh id: no stale KV keys
    eng.add_request("again", PREFIX, _params(1), lora_request=LoRARequest("sql", 1, ""))
    assert eng.run_to_completion(["again"])[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_cli_refuses_a_bad_adapter_at_start_up(dirs, cli_error):
    err = cli_error(
        "serve",
        "--model",
        dirs[None],
        "--port",
        "0",
        "--enable-lora",
        "--max-lora-rank",
        "4",
        "--lora-modules",
        f"sql={dirs['sql']}",
        f"code={dirs['code']}",
    )
    assert "rank 8 exceeds --max-lora-rank 4" in err
    assert "--lora-modules: 'sql' is not NAME=DIR" in cli_error("serve", "--enable-lora", "--lora-modules", "sql")
