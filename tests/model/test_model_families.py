"""ERNIE-4.5 dense, Gemma 2 and Gemma 3 (text) against transformers on tiny random checkpoints: greedy
generation through the Engine (a mixed batch with prefix-cache hits and chunked prefill, prompts longer
than the sliding window) token-identical to transformers' ``generate``, and the HF export reloading in
transformers with identical logits. Full-forward and cached-decode parity run for these variants in
test_model_parity.py (they are part of tiny.VARIANTS)."""

import shutil

import pytest
import torch
from tiny import FAMILY_VARIANTS, make_checkpoint

from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.loader import load_model
from baige.runtime.weights.safetensors_io import TOKENIZER_FILES, save_hf_checkpoint


@pytest.fixture(scope="module", params=sorted(FAMILY_VARIANTS))
def ckpt(request, tmp_path_factory, embedded_dir):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)
    for name in TOKENIZER_FILES:  # ids < vocab decode with any byte-level tokenizer; the engine needs one
        if (embedded_dir / name).is_file():
            shutil.copy(embedded_dir / name, path / name)
    return request.param, path


def _hf_greedy(path, prompts, n_new):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for p, n in zip(prompts, n_new):
            out = hf.generate(
                torch.tensor([p]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            expected.append(out[0, len(p) :].tolist())
    return expected


def test_engine_greedy_equals_transformers_generate(ckpt):
    """Prompts of 3..45 tokens (the tiny Gemmas' window is 12), two sharing a 32-token prefix (prefix-cache
    hits); a 16-token step budget splits the long prompts into chunks that join decode steps."""
    name, path = ckpt
    model = load_model(path)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, vocab, (32,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 17, 45)]
    prompts += [shared + [7, 8], shared + [9]]
    n_new = [12, 9, 20, 10, 8]
    expected = _hf_greedy(path, prompts, n_new)
    eng = Engine(
        model,
        Tokenizer.from_dir(path),
        EngineConfig(
            max_model_len=128, kv_cache_memory=4_000_000, block_size=4, max_num_seqs=8, max_num_batched_tokens=16
        ),
    )
    finals = {}

    def step():
        finals.update((o.request_id, o.outputs[0].token_ids) for o in eng.step() if o.finished)

    for i, (p, n) in enumerate(zip(prompts, n_new)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        if i == 3:  # the last prompt arrives once the shared prefix is computed and cached
            for _ in range(4):
                step()
    while eng.has_unfinished():
        step()
    assert [finals[f"r{i}"] for i in range(len(prompts))] == expected, name
    assert eng.block_manager.prefix_hits >= 32  # the shared prefix was served from the cache
    assert eng.block_manager.num_used_blocks == 0


def test_hf_export_reloads_in_transformers_with_identical_logits(ckpt, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    name, path = ckpt
    model = load_model(path)
    out = save_hf_checkpoint(model.state_dict(), model.config.raw, tmp_path / "export", path)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert keys == set(f.keys())
    ids = torch.randint(0, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    assert torch.equal(a, b), name
