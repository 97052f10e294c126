"""The Triton kernels (Triton's interpreter on CPU) end to end against the PyTorch reference kernels:
the embedded model's full-sequence logits, and the serving engine's paged path (store_kv, paged
prefill and decode, across block boundaries) producing the same greedy tokens on a tiny model."""

import pytest
import torch
from kernel_checks import triton_kernels

from baige.runtime.settings import reload_settings

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def model_and_ids(embedded_dir):
    from baige.runtime.model.tokenizer import Tokenizer
    from baige.runtime.weights.loader import load_model

    model = load_model(embedded_dir, "float32")
    ids = Tokenizer.from_dir(embedded_dir).encode(PROMPT)
    return model, torch.tensor([ids])


def _logits(model, ids):
    with torch.inference_mode():
        positions = torch.arange(ids.shape[1])[None]
        return model.compute_logits(model(ids, positions, None))


def test_model_logits_same_on_triton_and_reference_kernels(model_and_ids, monkeypatch):
    model, ids = model_and_ids
    monkeypatch.setenv("BAIGE_KERNELS", "reference")
    reload_settings()
    ref = _logits(model, ids)
    with triton_kernels(monkeypatch):
        out = _logits(model, ids)
    assert out.shape == ref.shape == (1, ids.shape[1], model.config.vocab_size)
    # fp32 through 30 layers: differences are accumulation order only (measured max 4.2e-5 at logits up to 27)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-3)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_engine_greedy_tokens_same_on_triton_paged_kernels(tmp_path, monkeypatch):
    """A tiny llama (the embedded model's 30 layers are far too slow in the interpreter): two
    prompts of 5 and 11 tokens in one batch, 4-token blocks, 9 greedy tokens each, so prefill and
    decode both write and read K/V across block boundaries (no prefix caching: the Triton run recomputes
    every prompt block)."""
    from baige import LLM, SamplingParams
    from tests.tiny import make_checkpoint, write_tiny_tokenizer

    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    prompts = [[5, 17, 33, 2, 91], [60, 61, 62, 63, 64, 65, 66, 7, 150, 3, 3]]
    monkeypatch.setenv("BAIGE_KERNELS", "reference")
    reload_settings()
    llm = LLM(
        str(write_tiny_tokenizer(make_checkpoint(tmp_path / "tiny", "llama", seed=5))),
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        block_size=4,
        kv_cache_memory=1_000_000,
        enable_prefix_caching=False,
    )
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with triton_kernels(monkeypatch):
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert out == ref and all(len(t) == 9 for t in out) and ref[0] != ref[1]


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"BAIGE_KERNELS": "bogus"}, "BAIGE_KERNELS='bogus'"),
        ({"BAIGE_KERNELS": "triton", "TRITON_INTERPRET": "0"}, "TRITON_INTERPRET=1"),
        ({"BAIGE_CPU_INT_DOT_PASSES": "3"}, "BAIGE_CPU_INT_DOT_PASSES='3'"),
    ],
)
def test_cli_bad_kernel_setting_is_one_line(env, needle):
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "baige", "generate", "--prompt", "hi", "--max-tokens", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
