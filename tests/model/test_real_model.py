"""The embedded SmolLM2-135M-Instruct end to end, against transformers loading the same GGUF."""

import json
import os
import subprocess
import sys

import pytest
import torch
from oracle_generate import generate_tokens

from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.loader import load_model

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
]


@pytest.fixture(scope="module")
def baige_model(embedded_dir):
    return load_model(embedded_dir, "float32"), Tokenizer.from_dir(embedded_dir)


def hf_prompt_ids(hf_tok, prompt):
    enc = hf_tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc)


def hf_greedy(hf, ids, n):
    """transformers' cached greedy decode with EOS ignored (``generate`` would stop at EOS, and
    ``min_new_tokens`` masks EOS, which changes the argmax)."""
    out = hf(torch.tensor([ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(n - 1):
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_imported_directory_is_hf_layout(embedded_dir):
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (embedded_dir / name).is_file(), name
    cfg = json.loads((embedded_dir / "config.json").read_text())
    # SmolLM2-135M: 30 layers, 576 hidden, 9 heads / 3 KV heads, tied embeddings (the model card's numbers)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        30,
        576,
        9,
        3,
    )
    assert cfg["tie_word_embeddings"] is True


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_greedy_32_tokens_and_logits_match_transformers(prompt, baige_model, hf_embedded):
    model, tok = baige_model
    hf, hf_tok = hf_embedded
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
    assert ids == hf_prompt_ids(hf_tok, prompt)

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with torch.no_grad():
        ref = hf_greedy(hf, ids, 32)
    if prompt == CHAT_PROMPTS[0]:  # the plain oracle loop, once (a full forward per token: slow)
        assert list(generate_tokens(model, ids, params)) == ref
    # what `baige generate` / `chat` / `serve` run: the Engine (paged KV, native CPU decode step)
    engine = Engine(model, tok, EngineConfig(max_num_seqs=4, max_model_len=512, kv_cache_memory="64MiB"))
    engine.add_request("r", ids, params)
    (out,) = engine.run_to_completion(["r"])
    assert out.outputs[0].token_ids == ref

    full = torch.tensor([ids + ref])
    with torch.no_grad():
        ref_logits = hf(full).logits
        our_logits = model.compute_logits(model(full, torch.arange(full.shape[1])[None]))
    assert (our_logits - ref_logits).abs().max().item() < 1e-3


def test_generate_cli_answers_paris():
    proc = subprocess.run(
        [sys.executable, "-m", "baige", "generate", "--prompt", "What is the capital of France?", "--temperature", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_generate_cli_user_errors_are_one_line(tmp_path):
    for args, needle in [
        (["--model", str(tmp_path / "missing.gguf")], "missing.gguf"),
        (["--max-tokens", "0"], "max-tokens"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "baige", "generate", "--prompt", "hi", *args],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode != 0
        assert "Traceback" not in proc.stderr and needle in proc.stderr, proc.stderr


def test_chat_repl_two_turns_then_exit():
    proc = subprocess.run(
        [sys.executable, "-m", "baige", "chat", "--temperature", "0", "--max-tokens", "8"],
        input="What is the capital of France?\n/reset\nAnd of Italy?\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    replies = [r.strip() for r in proc.stdout.split(">>>")[1:] if r.strip()]
    assert len(replies) == 2 and "Paris" in replies[0], proc.stdout


def test_chat_session_carries_history(embedded_dir):
    from baige.runtime.config import GenerateConfig
    from baige.runtime.infer.session import ChatSession

    session = ChatSession.load(GenerateConfig(model=str(embedded_dir), temperature=0.0, max_tokens=6))
    first = "".join(d for d, _ in session.chat_turn("Hi, I am Ada."))
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.messages[1]["content"] == first
    "".join(d for d, _ in session.chat_turn("Who am I?"))
    rendered = session.tokenizer.render_chat_template(session.messages[:3])
    assert rendered.count("<|im_start|>user") == 2 and first in rendered
    session.reset()
    assert session.messages == []


def test_sampling_with_seed_is_reproducible(baige_model):
    model, tok = baige_model
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}])
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    a, b = list(generate_tokens(model, ids, p)), list(generate_tokens(model, ids, p))
    assert a == b
    greedy = list(generate_tokens(model, ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))
    assert a != greedy  # sampling actually samples
