"""The engine on the embedded real model: greedy outputs token-identical to the plain generate path
(prefix caching on/off, a pool small enough to preempt, chunked prefill), stop strings, sampling."""

import pytest
import torch
from conftest import DATA_DIR
from oracle_generate import generate_tokens

from baige import LLM, SamplingParams  # the lazy public exports
from baige.errors import BaigeError
from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.loader import load_model

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(embedded_dir):
    return load_model(embedded_dir), Tokenizer.from_dir(embedded_dir)


@pytest.fixture(scope="module")
def prompts(loaded):
    """Mixed lengths (3 to ~150 tokens); two share a 40+ token prefix (prefix-cache hits)."""
    _, tok = loaded
    text = (DATA_DIR / "wikitext-2-raw-test.txt").read_text()[:20000]
    words = text.split()
    shared = " ".join(words[100:140])
    return [
        tok.encode("The capital of France is"),
        tok.encode(" ".join(words[:120])),
        tok.encode(shared + " In summary,"),
        tok.encode(shared + " However, the"),
        tok.encode("def fibonacci(n):"),
        tok.encode(" ".join(words[300:330])),
    ]


@pytest.fixture(scope="module")
def expected(loaded, prompts):
    model, tok = loaded
    return [
        list(generate_tokens(model, p, SamplingParams(max_tokens=n, **GREEDY)))
        for p, n in zip(prompts, [12, 20, 16, 9, 14, 18])
    ]


def engine(loaded, **kw) -> Engine:
    model, tok = loaded
    cfg = dict(max_model_len=512, kv_cache_memory=60_000_000, enforce_eager=True)
    cfg.update(kw)
    return Engine(model, tok, EngineConfig(**cfg))


def run(eng, prompts, params_list):
    ids = []
    for i, (p, sp) in enumerate(zip(prompts, params_list)):
        eng.add_request(f"r{i}", p, sp)
        ids.append(f"r{i}")
    return eng.run_to_completion(ids)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_plain_generate(loaded, prompts, expected, prefix_caching):
    eng = engine(loaded, enable_prefix_caching=prefix_caching)
    params = [SamplingParams(max_tokens=len(e), **GREEDY) for e in expected]
    outs = run(eng, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # again: with prefix caching, the prompts' full blocks now come from the cache
    outs = run(eng, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    bm = eng.block_manager
    assert (bm.prefix_hits > 0) == prefix_caching
    assert bm.num_used_blocks == 0 and not eng.has_unfinished()


def test_greedy_matches_with_preemption_and_chunked_prefill(loaded, prompts, expected):
    # 20 blocks of 16 tokens = 320 slots for ~450 tokens of demand; 64-token steps split long prompts
    model, _ = loaded
    per_block = 16 * model.config.kv_bytes_per_token(4)
    eng = engine(loaded, max_model_len=320, kv_cache_memory=20 * per_block, max_num_batched_tokens=64, max_num_seqs=8)
    assert eng.block_manager.num_blocks == 20
    params = [SamplingParams(max_tokens=len(e), **GREEDY) for e in expected]
    outs = run(eng, prompts, params)
    assert eng.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert eng.block_manager.num_used_blocks == 0


def test_greedy_matches_with_long_prefill_token_threshold(loaded, prompts, expected):
    # every prompt past 24 tokens is computed 24 tokens a step (several steps beside the others' decodes)
    eng = engine(loaded, long_prefill_token_threshold=24)
    chunks = []
    schedule = eng.scheduler.schedule

    def recording():
        batch = schedule()
        chunks.extend(n for i, n in enumerate(batch.num_new_tokens) if i >= batch.num_decodes)
        return batch

    eng.scheduler.schedule = recording
    params = [SamplingParams(max_tokens=len(e), **GREEDY) for e in expected]
    outs = run(eng, prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert max(chunks) == 24 and chunks.count(24) >= len(prompts[1]) // 24


def test_llm_offline_api(embedded_dir, prompts, expected):
    llm = LLM(str(embedded_dir), max_model_len=512, kv_cache_memory=40_000_000, enforce_eager=True)
    outs = llm.generate(
        [{"prompt_token_ids": prompts[0]}, "The capital of France is"],
        SamplingParams(max_tokens=len(expected[0]), **GREEDY),
    )
    assert outs[0].outputs[0].token_ids == expected[0] == outs[1].outputs[0].token_ids
    assert outs[1].outputs[0].text == llm.get_tokenizer().decode(expected[0])
    with pytest.raises(BaigeError, match="512"):
        llm.generate("hello", SamplingParams(max_tokens=600))


def collect_stream(eng, prompt, params):
    """Deltas of request 's' as the engine emits them, and the final output."""
    eng.add_request("s", prompt, params)
    deltas, final = [], None
    while final is None:
        for out in eng.step():
            deltas.append(out.outputs[0].delta_text)
            if out.finished:
                final = out
    return deltas, final


def test_stop_strings_inside_tokens_never_leak(loaded, prompts):
    model, tok = loaded
    eng = engine(loaded)
    full = run(eng, [prompts[1]], [SamplingParams(max_tokens=20, **GREEDY)])[0].outputs[0]
    text = full.text
    # a stop string that starts in the middle of one token and ends in the middle of a later one
    ids = full.token_ids
    starts = [len(tok.decode(ids[:i])) for i in range(len(ids) + 1)]
    boundary = starts[6]
    stop = text[boundary - 1 : boundary + 3]
    assert len(stop) == 4 and stop not in text[: boundary - 1]
    for stream in (False, True):
        deltas, final = collect_stream(eng, prompts[1], SamplingParams(max_tokens=20, stop=[stop, "@@never"], **GREEDY))
        out = final.outputs[0]
        assert out.text == text[: boundary - 1]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert "".join(deltas) == out.text
        assert all(stop not in "".join(deltas[: i + 1]) for i in range(len(deltas)))


def test_multibyte_characters_stream_cleanly(loaded):
    model, tok = loaded
    eng = engine(loaded)
    prompt = tok.encode("Emoji list: 😀 😃 😄 😁 😆 😅 🤣 😂 🙂 🙃 😉 😊 😇 🥰 😍 🤩 😘")
    deltas, final = collect_stream(eng, prompt, SamplingParams(max_tokens=24, **GREEDY))
    out = final.outputs[0]
    assert any(ord(c) > 0xFFFF for c in out.text)  # the model did continue with emoji
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) == out.text == tok.decode(out.token_ids)


def test_sampling_seed_n_penalties_logprobs(loaded, prompts):
    eng = engine(loaded)
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=123, n=3, max_tokens=8, ignore_eos=True, logprobs=2)
    a = run(eng, [prompts[0]], [p])[0]
    b = run(eng, [prompts[4], prompts[0]], [SamplingParams(max_tokens=5, **GREEDY), p])[1]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]  # seeded: batch-independent
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # the n samples differ
    for o in a.outputs:
        assert len(o.logprobs) == 8 and all(len(lp.top) == 2 and lp.logprob <= 0 for lp in o.logprobs)
        assert [lp.token_id for lp in o.logprobs] == o.token_ids
    # greedy logprobs: the chosen token is the top-1
    g = run(eng, [prompts[0]], [SamplingParams(max_tokens=4, logprobs=1, **GREEDY)])[0].outputs[0]
    assert all(lp.top[0][0] == lp.token_id and lp.top[0][1] == pytest.approx(lp.logprob) for lp in g.logprobs)
    # a strong repetition penalty changes a repetitive greedy continuation
    base = run(eng, [prompts[0]], [SamplingParams(max_tokens=12, **GREEDY)])[0].outputs[0].token_ids
    pen = run(eng, [prompts[0]], [SamplingParams(max_tokens=12, repetition_penalty=3.0, **GREEDY)])[0]
    assert pen.outputs[0].token_ids != base
    # min_tokens masks EOS: a chat prompt the model answers with one word then EOS (the control),
    # and the same prompt with min_tokens=10 (the same first word, then no EOS before token 10)
    eos = eng.eos_token_ids[0]
    _, tok = loaded
    chat = tok.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no. Is the sky blue?"}])
    control = run(eng, [chat], [SamplingParams(temperature=0, max_tokens=30)])[0].outputs[0]
    assert len(control.token_ids) == 2 and control.token_ids[1] == eos and control.finish_reason == "stop"
    o = run(eng, [chat], [SamplingParams(temperature=0, max_tokens=30, min_tokens=10)])[0].outputs[0]
    assert o.token_ids[0] == control.token_ids[0] and len(o.token_ids) >= 10 and eos not in o.token_ids[:10]
    # stop_token_ids end generation (the control), and min_tokens masks them too
    first = base[0]
    o = run(eng, [prompts[0]], [SamplingParams(max_tokens=12, stop_token_ids=[first], **GREEDY)])[0].outputs[0]
    assert o.token_ids == [first] and o.finish_reason == "stop" and o.stop_reason == first
    o = run(eng, [prompts[0]], [SamplingParams(max_tokens=12, stop_token_ids=[first], min_tokens=3, **GREEDY)])[0]
    assert len(o.outputs[0].token_ids) >= 3 and first not in o.outputs[0].token_ids[:3]


def test_abort_frees_blocks(loaded, prompts):
    eng = engine(loaded)
    eng.add_request("x", prompts[1], SamplingParams(max_tokens=50, **GREEDY))
    eng.step()
    assert eng.block_manager.num_used_blocks > 0
    eng.abort("x")
    assert eng.block_manager.num_used_blocks == 0 and not eng.has_unfinished()


def test_bad_requests_raise(loaded):
    eng = engine(loaded)
    with pytest.raises(BaigeError, match="empty"):
        eng.add_request("a", [], SamplingParams())
    with pytest.raises(BaigeError, match="vocabulary"):
        eng.add_request("a", [10**6], SamplingParams())
    with pytest.raises(BaigeError, match=r"512 tokens.*513.*13 in the prompt, 500"):
        eng.add_request("a", list(range(13)), SamplingParams(max_tokens=500))
    assert not eng.has_unfinished()


def test_kv_budget_keeps_the_warm_up_activation_peak_free(monkeypatch):
    from baige.runtime.infer import kv_cache
    from baige.runtime.model.config import ModelConfig

    cfg = ModelConfig.from_dict(
        {
            "model_type": "llama",
            "vocab_size": 160,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
        }
    )
    per_block = kv_cache.KVCache.bytes_per_block(cfg, 16, torch.float32)  # 2 layers x K,V x 2 heads x 16 x 16 x 4 B
    assert per_block == 2 * 2 * 2 * 16 * 16 * 4
    monkeypatch.setattr(kv_cache, "available_memory", lambda device: 1000 * per_block)
    cpu = torch.device("cpu")
    # 10% of free memory on CPU = 100 blocks; an activation peak of 30.5 blocks' bytes leaves 69
    assert kv_cache.num_blocks_for(cfg, 16, torch.float32, cpu, None, 256) == 100
    assert kv_cache.num_blocks_for(cfg, 16, torch.float32, cpu, None, 256, activation_peak=int(30.5 * per_block)) == 69
    assert kv_cache.num_blocks_for(cfg, 16, torch.float32, cpu, 20 * per_block, 256, activation_peak=10**9) == 20
    with pytest.raises(BaigeError, match="max_model_len=256"):
        kv_cache.num_blocks_for(cfg, 16, torch.float32, cpu, None, 256, activation_peak=95 * per_block)
    # the warm-up measures only where allocator statistics exist
    from baige.runtime.model.transformer import Transformer

    assert kv_cache.profile_activation_peak(Transformer(cfg), 8, 2) == 0


def test_kv_cache_dtype_resolution():
    from baige.runtime.infer.kv_cache import resolve_kv_cache_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_kv_cache_dtype("float16", torch.float32, cpu) == torch.float16
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, cuda) == torch.bfloat16
    with pytest.raises(BaigeError, match=r"--kv-cache-dtype float16 under a float32 model is supported on CPU only"):
        resolve_kv_cache_dtype("float16", torch.float32, cuda)
    with pytest.raises(BaigeError, match=r"unknown --kv-cache-dtype 'fp8' \(choose auto, float32, float16, bfloat16\)"):
        resolve_kv_cache_dtype("fp8", torch.float32, cpu)


def test_prompt_logprobs_equal_the_full_forward_with_chunks_and_prefix_cache(loaded, prompts):
    model, _ = loaded
    shared_a, shared_b = prompts[2], prompts[3]  # share a 40+ token prefix: b would hit the cache
    with torch.inference_mode():
        lp = torch.log_softmax(
            model.compute_logits(model(torch.tensor([shared_b]), torch.arange(len(shared_b))[None], None))[0].float(),
            -1,
        )
    expected = [lp[j - 1, shared_b[j]].item() for j in range(1, len(shared_b))]
    top2 = lp[len(shared_b) // 2 - 1].topk(2)
    # 16-token steps: the prompt is scored across several prefill chunks
    eng = engine(loaded, max_num_batched_tokens=16, max_num_seqs=4)
    run(eng, [shared_a], [SamplingParams(max_tokens=2, **GREEDY)])  # caches the shared blocks
    out = run(eng, [shared_b], [SamplingParams(max_tokens=2, prompt_logprobs=2, **GREEDY)])[0]
    plp = out.prompt_logprobs
    assert out.num_cached_tokens == 0 and len(plp) == len(shared_b) and plp[0] is None
    assert [x.token_id for x in plp[1:]] == shared_b[1:]
    assert max(abs(x.logprob - e) for x, e in zip(plp[1:], expected)) < 1e-4
    mid = plp[len(shared_b) // 2]
    assert [t for t, _ in mid.top] == top2.indices.tolist()
    # without prompt_logprobs the same prompt reuses the cache and reports none
    again = run(eng, [shared_b], [SamplingParams(max_tokens=2, **GREEDY)])[0]
    assert again.prompt_logprobs is None and again.num_cached_tokens > 0
    with pytest.raises(BaigeError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
