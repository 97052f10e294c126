"""Batch-invariant mode end to end (``EngineConfig.batch_invariant`` + ``model.logprobs.sequence_logprobs``) on a
tiny Qwen2 checkpoint (q/k/v biases, tied embeddings, GQA), fp32 and bf16, on every native instruction-set variant
and on the PyTorch twins: one request's prompt logprobs, greedy tokens and sampled-token logprobs are bitwise the
same alone, in a batch of 16 mixed-length requests and with 7-token prefill chunks; a generated token's logprob
from its decode step equals the one a prefill over it computes; and they all equal the trainer's forward
(``sequence_logprobs``) bit for bit. The default path differs (so these comparisons can fail), and what the mode
cannot run is refused with one line."""

import pytest
import torch
from tiny import make_checkpoint, write_tiny_tokenizer

from baige.errors import BaigeError
from baige.kernels.cpu import isa
from baige.runtime.config import EngineConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.logprobs import sequence_logprobs
from baige.runtime.model.lora import add_lora
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.settings import reload_settings
from baige.runtime.weights.loader import load_model

LENGTHS = [5, 37, 60, 12, 3, 44, 21, 8, 50, 17, 9, 30, 2, 41, 26, 13]  # 16 prompts; ours is the 37-token one
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=0, logprobs=0)
SAMPLED = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_tokenizer(make_checkpoint(tmp_path_factory.mktemp("bi") / "qwen2", "qwen2-bias"))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 160, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture
def backend(request, monkeypatch, use_isa, native_kernel):
    if request.param == "reference":
        monkeypatch.setenv("BAIGE_KERNELS", "reference")
        reload_settings()
    else:
        use_isa(request.param)


def _engine(ckpt, model, **kw) -> Engine:
    cfg = dict(max_model_len=128, kv_cache_memory=4_000_000, block_size=4, batch_invariant=True, seed=0)
    return Engine(model, Tokenizer.from_dir(ckpt), EngineConfig(**{**cfg, **kw}))


def _run(eng: Engine, reqs: list[tuple[list[int], SamplingParams]]) -> list:
    """Every request added before the first step (they share steps), outputs in request order."""
    for i, (p, sp) in enumerate(reqs):
        eng.add_request(f"r{i}", p, sp)
    return eng.run_to_completion([f"r{i}" for i in range(len(reqs))])


def _lp(logprobs) -> torch.Tensor:
    return torch.tensor([lp.logprob for lp in logprobs], dtype=torch.float32)  # fp32 values: exact


def _greedy(out) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """(prompt logprobs of tokens 1.., greedy tokens, their logprobs)."""
    return _lp(out.prompt_logprobs[1:]), out.outputs[0].token_ids, _lp(out.outputs[0].logprobs)


def _trainer(model, prompt: list[int], tokens: list[int], batch_invariant: bool = True) -> torch.Tensor:
    with torch.no_grad():
        return sequence_logprobs(model, torch.tensor(prompt + tokens), batch_invariant=batch_invariant)


@pytest.mark.parametrize("backend", [*isa.supported(), "reference"], indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_do_not_depend_on_the_batch_or_chunks_and_equal_the_trainers(ckpt, prompts, backend, dtype):
    model = load_model(ckpt, dtype)
    ours = prompts[1]
    alone = _greedy(_run(_engine(ckpt, model), [(ours, GREEDY)])[0])
    # in a batch of 16 mixed lengths (ours 2nd), beside a seeded sampled request and its own continuation's prefill
    extend = ours + alone[1][:-1]  # the greedy tokens but the last, as a prompt: scored by a prefill
    batch = [(p, GREEDY) for p in prompts] + [(prompts[4], SAMPLED), (extend, GREEDY)]
    outs = _run(_engine(ckpt, model), batch)
    chunked = _run(_engine(ckpt, model, max_num_batched_tokens=7, max_num_seqs=4), batch[:4])
    for got in (_greedy(outs[1]), _greedy(chunked[1])):
        assert torch.equal(got[0], alone[0]) and got[1] == alone[1] and torch.equal(got[2], alone[2])
    decode_lps, prefill_lps = alone[2][:-1], _greedy(outs[-1])[0][len(ours) - 1 :]
    assert torch.equal(prefill_lps, decode_lps)  # the same positions as decode steps and inside a prefill
    # the trainer's forward over prompt + completion: the prompt's and the generated tokens' logprobs
    assert torch.equal(_trainer(model, ours, alone[1]), torch.cat([alone[0], alone[2]]))
    sampled = outs[16].outputs[0]
    assert torch.equal(_trainer(model, prompts[4], sampled.token_ids)[len(prompts[4]) - 1 :], _lp(sampled.logprobs))


def test_the_default_path_differs(ckpt, prompts):
    """Without the mode the engine runs the native one-call step and row-count-dependent kernels, the trainer
    torch's: the same comparisons fail (what makes the test above meaningful)."""
    model = load_model(ckpt, "float32")
    eng = _engine(ckpt, model, batch_invariant=False)
    alone = _greedy(_run(eng, [(prompts[1], GREEDY)])[0])
    chunked = _greedy(
        _run(
            _engine(ckpt, model, batch_invariant=False, max_num_batched_tokens=7, max_num_seqs=4),
            [(prompts[1], GREEDY)],
        )[0]
    )
    trainer = _trainer(model, prompts[1], alone[1], batch_invariant=False)
    assert not torch.equal(trainer, torch.cat([alone[0], alone[2]]))
    assert not torch.equal(chunked[0], alone[0])
    torch.testing.assert_close(trainer, torch.cat([alone[0], alone[2]]), rtol=0, atol=1e-5)  # only rounding
    assert eng.runner.fused_decode is not None
    assert _engine(ckpt, model).runner.fused_decode is None


def test_sequence_logprobs_is_differentiable_and_the_plain_forwards_value(ckpt, prompts):
    model = load_model(ckpt, "float32")
    ids = torch.tensor(prompts[2])
    plain = sequence_logprobs(model, ids, batch_invariant=False)
    mode = sequence_logprobs(model, ids, batch_invariant=True)
    assert mode.shape == (len(ids) - 1,) and mode.dtype == torch.float32
    torch.testing.assert_close(mode, plain, rtol=0, atol=1e-5)
    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.autograd.grad(plain.sum(), params)
    for got, exp in zip(torch.autograd.grad(mode.sum(), params), want):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)
    with pytest.raises(BaigeError, match="T >= 2"):
        sequence_logprobs(model, ids[:1], batch_invariant=True)


def test_what_the_mode_cannot_run_is_refused(ckpt, tmp_path):
    for kw, what in [
        (dict(quantization="int8-weight"), "--quantization"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "--speculative-config"),
        (dict(enable_lora=True), "--enable-lora"),
    ]:
        with pytest.raises(BaigeError, match=f"--batch-invariant does not support {what}"):
            EngineConfig(model=str(ckpt), batch_invariant=True, **kw)
    model = load_model(ckpt, "float32")
    with pytest.raises(BaigeError, match="KV cache in the model's dtype"):
        _engine(ckpt, model, kv_cache_dtype="float16")
    moe = load_model(write_tiny_tokenizer(make_checkpoint(tmp_path / "moe", "qwen3-moe")), "float32")
    with pytest.raises(BaigeError, match="Mixture-of-Experts"):
        _engine(tmp_path / "moe", moe)
    model.model.layers[1].compile()
    with pytest.raises(BaigeError, match="runs eagerly; model.layers.1 is compiled"):
        sequence_logprobs(model, torch.tensor([1, 2, 3]), batch_invariant=True)
    model = load_model(ckpt, "float32")
    add_lora(model.model.layers[0].self_attn.q_proj, rank=2, alpha=4)
    with pytest.raises(BaigeError, match="LoRA"):
        sequence_logprobs(model, torch.tensor([1, 2, 3]), batch_invariant=True)
