"""Shared steps of the model-family tests against transformers (tests/model/test_mla.py, test_moe.py,
test_model_families.py, test_gpt_oss.py): the engine's tokenizer beside a tiny checkpoint, the mixed batch
(prompts of several lengths, two sharing a 32-token prefix so the later one hits the prefix cache),
transformers' greedy tokens for it, the engine's run of it, and the HF export's reload check."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.weights.safetensors_io import TOKENIZER_FILES, save_hf_checkpoint


def copy_tokenizer(embedded_dir: Path, path: Path) -> None:
    """The embedded model's tokenizer files into ``path``: ids < 160 decode with any byte-level tokenizer, and
    the engine needs one."""
    for name in TOKENIZER_FILES:
        if (embedded_dir / name).is_file():
            shutil.copy(embedded_dir / name, path / name)


def mixed_prompts(vocab: int, lens: tuple[int, ...] = (3, 17, 40)) -> list[list[int]]:
    """Random prompts of ``lens`` tokens, then two that share a 32-token prefix (generator seed 5, the shared
    prefix drawn first)."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, vocab, (32,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    return prompts + [shared + [7, 8], shared + [9]]


def hf_greedy(hf, prompts: list[list[int]], n_new: list[int]) -> list[list[int]]:
    """transformers' ``generate`` greedy tokens: exactly ``n_new[i]`` new tokens for prompt ``i`` (no EOS)."""
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


def run_mixed_batch(eng, prompts: list[list[int]], n_new: list[int], warm_steps: int, logprobs: int | None = None):
    """Greedy requests ``r0``, ``r1``, ... (``n_new[i]`` tokens each, EOS ignored) through ``eng``: the last
    prompt is added after ``warm_steps`` steps, once the shared prefix is computed and cached. Returns the
    finished ``CompletionOutput`` of each request id."""
    finals = {}

    def step():
        finals.update((o.request_id, o.outputs[0]) for o in eng.step() if o.finished)

    for i, (p, n) in enumerate(zip(prompts, n_new)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=logprobs))
        if i == 3:
            for _ in range(warm_steps):
                step()
    while eng.has_unfinished():
        step()
    return finals


def assert_hf_export_reloads(model, path: Path, out_dir: Path, name: str) -> None:
    """``model`` (loaded from ``path``) saved as an HF checkpoint into ``out_dir`` has ``path``'s tensor names
    (the published layout, e.g. per-expert weights, not baige's stacked ones), and transformers' logits on it
    equal those on ``path`` bit for bit."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = save_hf_checkpoint(model.state_dict(), model.config.raw, out_dir, path)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert keys == set(f.keys())
    ids = torch.randint(0, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
    assert torch.equal(a, b), name
