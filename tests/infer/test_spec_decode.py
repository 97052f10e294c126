"""Speculative decoding on the embedded model: greedy outputs token-identical with speculation on
and off (n-gram, the model as its own draft, a random draft), with prefix caching and under
preemption; stop strings and max_tokens inside accepted runs; KV blocks back to idle."""

import shutil

import pytest

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig, SpeculativeConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.loader import load_model
from tests.conftest import DATA_DIR
from tests.tiny import make_checkpoint

MAX_LEN = 256
ROOMY, TIGHT = 120_000_000, 30_000_000  # KV bytes: all 16 sequences fit / preemption (737 KB a block)


@pytest.fixture(scope="module")
def loaded(embedded_dir):
    return load_model(embedded_dir), Tokenizer.from_dir(embedded_dir)


@pytest.fixture(scope="module")
def random_draft(embedded_dir, tmp_path_factory):
    """A one-layer random model with the embedded model's tokenizer: its drafts are almost never right."""
    path = make_checkpoint(
        tmp_path_factory.mktemp("draft"),
        "llama",
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=8192,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_dir / name, path / name)
    return path


def passages(n: int) -> list[str]:
    """n short paragraphs of wikitext (the copy prompts' material)."""
    text = (DATA_DIR / "wikitext-2-raw-test.txt").read_text()
    paras = [p.strip() for p in text.split("\n") if 150 < len(p.strip()) < 300 and not p.strip().startswith("=")]
    return paras[:n]


def prompts(tok: Tokenizer) -> list[tuple[str, SamplingParams]]:
    """16 mixed prompts: 8 that copy a passage, 8 open-ended; varied lengths, penalties and logprobs."""
    chat = lambda text: tok.apply_chat_template([{"role": "user", "content": text}])  # noqa: E731
    out = []
    for i, p in enumerate(passages(8)):
        out.append(
            (
                chat(f"Repeat this text exactly:\n\n{p}"),
                SamplingParams(
                    temperature=0, max_tokens=9 + 2 * i, ignore_eos=True, logprobs=2 if i % 3 == 0 else None
                ),
            )
        )
    opens = [
        "Write a poem about the sea.",
        "What is the capital of France?",
        "Explain gravity to a child.",
        "List three fruits.",
        "Tell me a joke.",
        "How do plants grow?",
        "Describe a cat.",
        "Why is the sky blue?",
    ]
    for i, q in enumerate(opens):
        out.append(
            (
                chat(q),
                SamplingParams(
                    temperature=0,
                    max_tokens=6 + i,
                    ignore_eos=i % 2 == 0,
                    repetition_penalty=1.3 if i % 4 == 1 else 1.0,
                ),
            )
        )
    return out


def run(loaded, spec=None, **cfg) -> tuple[Engine, list]:
    model, tok = loaded
    eng = Engine(
        model,
        tok,
        EngineConfig(
            max_model_len=MAX_LEN, max_num_seqs=16, kv_cache_memory=cfg.pop("kv", ROOMY), speculative_config=spec, **cfg
        ),
    )
    work = prompts(tok)
    for i, (p, sp) in enumerate(work):
        eng.add_request(f"r{i}", p, sp)
    outs = eng.run_to_completion([f"r{i}" for i in range(len(work))])
    assert eng.block_manager.num_used_blocks == 0 and not eng.requests  # every block back to idle
    if getattr(eng.proposer, "block_manager", None) is not None:
        assert eng.proposer.block_manager.num_used_blocks == 0 and not eng.proposer.states
    return eng, outs


@pytest.fixture(scope="module")
def reference(loaded):
    return [o.outputs[0] for o in run(loaded)[1]]


def same(outs, reference):
    for o, ref in zip(outs, reference):
        assert o.outputs[0].token_ids == ref.token_ids
        assert o.outputs[0].text == ref.text
        if ref.logprobs is not None:  # the target's distribution, scored in the verify forward
            for a, b in zip(o.outputs[0].logprobs, ref.logprobs):
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_ngram_greedy_is_token_identical(loaded, reference):
    eng, outs = run(loaded, {"method": "ngram", "num_speculative_tokens": 4})
    assert eng.scheduler.num_preemptions == 0
    same(outs, reference)
    st = eng.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0.3 * st.num_draft_tokens  # the copy prompts accept
    per_req = sum(o.spec_decode.num_accepted_tokens for o in outs)
    assert per_req == st.num_accepted_tokens


def test_ngram_under_preemption_is_token_identical(loaded, reference):
    eng, outs = run(loaded, {"method": "ngram", "num_speculative_tokens": 4}, kv=TIGHT)
    assert eng.scheduler.num_preemptions > 0
    same(outs, reference)


def test_the_model_as_its_own_draft_accepts_everything(loaded, embedded_dir, reference):
    eng, outs = run(loaded, {"method": "draft_model", "model": str(embedded_dir), "num_speculative_tokens": 3})
    same(outs, reference)
    st = eng.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens == st.num_draft_tokens


def test_a_random_draft_accepts_almost_nothing_and_changes_nothing(loaded, random_draft, reference):
    eng, outs = run(
        loaded, {"method": "draft_model", "model": str(random_draft), "num_speculative_tokens": 3}, kv=TIGHT
    )
    assert eng.scheduler.num_preemptions > 0
    same(outs, reference)
    assert eng.spec_stats.num_draft_tokens > 50 and eng.spec_stats.acceptance_rate < 0.05


NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def generate(loaded, spec, work: list[tuple[str, SamplingParams]]):
    model, tok = loaded
    eng = Engine(
        model, tok, EngineConfig(max_model_len=MAX_LEN, max_num_seqs=8, kv_cache_memory=ROOMY, speculative_config=spec)
    )
    for i, (p, sp) in enumerate(work):
        eng.add_request(f"r{i}", p, sp)
    outs = eng.run_to_completion([f"r{i}" for i in range(len(work))])
    assert eng.block_manager.num_used_blocks == 0
    return eng, [o.outputs[0] for o in outs]


def test_stop_strings_inside_an_accepted_run_cut_where_plain_decoding_cuts(loaded):
    tok = loaded[1]
    prompt = tok.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{passages(1)[0]}"}])
    _, (full,) = generate(loaded, None, [(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))])
    stops = [full.text[len(full.text) // 2 :][:6], full.text[-9:-4]]  # mid-run, and near the end
    work = [(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[s])) for s in stops]
    _, plain = generate(loaded, None, work)
    eng, spec = generate(loaded, NGRAM, work)
    assert eng.spec_stats.num_accepted_tokens > 10  # the stops did fall inside accepted runs
    for a, b in zip(spec, plain):
        assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
            b.text,
            b.token_ids,
            b.finish_reason,
            b.stop_reason,
        )
        assert b.finish_reason == "stop" and len(b.token_ids) < 30


def test_max_tokens_is_never_exceeded(loaded):
    tok = loaded[1]
    prompt = tok.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{passages(2)[1]}"}])
    work = [(prompt, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)) for m in (1, 2, 3, 4, 5, 6, 7, 11)]
    _, plain = generate(loaded, None, work[-1:])
    eng, outs = generate(loaded, NGRAM, work)
    assert eng.spec_stats.num_accepted_tokens > 0
    for (_, sp), o in zip(work, outs):
        assert o.token_ids == plain[0].token_ids[: sp.max_tokens] and o.finish_reason == "length"


def test_sampling_with_speculation_runs_to_length_and_frees_its_blocks(loaded):
    tok = loaded[1]
    prompt = tok.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{passages(1)[0]}"}])
    work = [
        (prompt, SamplingParams(temperature=0.7, top_p=0.9, seed=s, max_tokens=20, ignore_eos=True, n=2, logprobs=1))
        for s in range(3)
    ]
    eng, outs = generate(loaded, NGRAM, work)
    assert all(len(o.token_ids) == 20 and len(o.logprobs) == 20 for o in outs)
    assert eng.spec_stats.num_draft_tokens > 0


def test_a_draft_with_another_vocabulary_is_refused_in_one_line(loaded, random_draft, tmp_path):
    import json

    other = tmp_path / "other"
    shutil.copytree(random_draft, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # the same tokens, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(spec))
    model, tok = loaded
    with pytest.raises(BaigeError, match=r"draft model's tokenizer differs .*'hello' is id \d+ in the target") as e:
        Engine(
            model,
            tok,
            EngineConfig(
                max_model_len=MAX_LEN,
                kv_cache_memory=ROOMY,
                speculative_config={"model": str(other), "num_speculative_tokens": 2},
            ),
        )
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "value, message",
    [
        ("{bad", "not valid JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not one of ngram, draft_model"),
        ('{"method": "ngram"}', 'give "num_speculative_tokens"'),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 32\]"),
        ({"method": "ngram", "num_speculative_tokens": 2, "x": 1}, "unknown key 'x'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            r"prompt_lookup_min \(3\) must be <= prompt_lookup_max \(2\)",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, 'method draft_model needs "model"'),
        ([1, 2], "a JSON object"),
    ],
)
def test_bad_speculative_configs_are_one_line_errors(value, message):
    with pytest.raises(BaigeError, match=message):
        SpeculativeConfig.parse(value)


def test_ngram_defaults_and_the_inferred_method():
    c = SpeculativeConfig.parse('{"num_speculative_tokens": 3, "model": "x"}')
    assert (c.method, c.model) == ("draft_model", "x")
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (1, 4)


def test_structured_outputs_speculate_and_give_the_same_tokens(loaded):
    import json

    from baige.runtime.infer.structured import StructuredOutputsParams

    tok = loaded[1]
    schema = {
        "type": "array",
        "minItems": 8,
        "maxItems": 8,
        "items": {
            "type": "object",
            "properties": {"fruit": {"enum": ["apple pie", "banana split"]}},
            "required": ["fruit"],
            "additionalProperties": False,
        },
    }
    prompt = tok.apply_chat_template([{"role": "user", "content": "List eight desserts as JSON."}])
    work = [
        (prompt, SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema)))
    ]
    _, (plain,) = generate(loaded, None, work)
    eng, (spec,) = generate(loaded, NGRAM, work)
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason == "stop"
    assert len(json.loads(spec.text)) == 8
    assert eng.spec_stats.num_accepted_tokens > 10  # the repeated items were copied, and verified under the mask
