"""The embedded model end to end on the Triton kernels (Triton's interpreter on CPU) against the
PyTorch reference kernels: full-sequence logits, and the serving engine's paged path (store_kv,
paged prefill and decode) producing the same greedy tokens."""

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


def test_engine_greedy_tokens_same_on_triton_paged_kernels(embedded_dir, monkeypatch):
    from baige import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [PROMPT, "1, 2, 3,"]
    monkeypatch.setenv("BAIGE_KERNELS", "reference")
    reload_settings()
    llm = LLM(str(embedded_dir), dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory=64 << 20)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    with triton_kernels(monkeypatch):
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert out == ref and all(len(t) == 3 for t in out)


@pytest.mark.parametrize("env, needle", [({"BAIGE_KERNELS": "bogus"}, "BAIGE_KERNELS='bogus'"),
                                         ({"BAIGE_KERNELS": "triton", "TRITON_INTERPRET": "0"}, "TRITON_INTERPRET=1")])
def test_cli_bad_kernel_setting_is_one_line(env, needle):
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "baige", "generate", "--prompt", "hi", "--max-tokens", "1"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
