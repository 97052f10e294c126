"""MTP speculative decoding (``--speculative-config '{"method": "mtp"}'``) on tiny checkpoints whose MTP
modules are written under DeepSeek-V3's names: greedy outputs token-identical to plain decoding in a
mixed batch (prefix caching, chunked prefill), the acceptance counters, and the one-line error for a
checkpoint without MTP weights."""

from __future__ import annotations

import pytest
import torch
from train_utils import tiny_model

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig, SpeculativeConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.train.mtp import set_mtp_depth
from baige.runtime.weights.loader import load_model
from baige.runtime.weights.safetensors_io import save_hf_checkpoint


def _with_mtp(src, out, depth: int, echo: bool):
    """``src`` plus ``depth`` MTP modules, written as a checkpoint. ``echo``: each module's block is the
    identity (zero o_proj / down_proj) and eh_proj reads only the token embedding, so on a tied model
    every draft repeats the last token (accepted wherever greedy decoding repeats one); else random."""
    model = load_model(src, dtype="float32")
    torch.manual_seed(1)
    set_mtp_depth(model, depth, 0.1)
    if echo:
        h = model.config.hidden_size
        with torch.no_grad():
            for m in model.mtp:
                m.eh_proj.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], 1))
                m.block.self_attn.o_proj.weight.zero_()
                m.block.mlp.down_proj.weight.zero_()
    save_hf_checkpoint(model.state_dict(), dict(model.config.raw), out, src)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    plain = tiny_model(root / "plain", "llama-tied")
    return {
        "plain": plain,
        "echo": _with_mtp(plain, root / "echo", 1, echo=True),
        "random2": _with_mtp(plain, root / "random2", 2, echo=False),
    }


def _work():
    """Mixed prompts (token ids): shared prefixes (prefix-cache hits), one longer than the chunk."""
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, 97, (40,), generator=g).tolist()
    out = []
    for i in range(6):
        tail = torch.randint(3, 97, (3 + 5 * i,), generator=g).tolist()
        prompt = (base if i % 2 else base[:12]) + tail
        out.append((prompt, SamplingParams(temperature=0, max_tokens=12 + 3 * i, ignore_eos=True)))
    return out


def _run(path, spec=None):
    model, tok = load_model(path, dtype="float32"), Tokenizer.from_dir(path)
    cfg = EngineConfig(
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=32,  # chunked prefill of the long prompts
        kv_cache_memory=4_000_000,
        enable_prefix_caching=True,
        speculative_config=SpeculativeConfig.parse(spec),
    )
    eng = Engine(model, tok, cfg)
    work = _work()
    for i, (p, sp) in enumerate(work):
        eng.add_request(f"r{i}", p, sp)
    outs = eng.run_to_completion([f"r{i}" for i in range(len(work))])
    assert eng.block_manager.num_used_blocks == 0
    if eng.proposer is not None:
        assert not eng.proposer.states  # every sequence's hidden states released
    return eng, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name, k", [("echo", 3), ("random2", 3)])
def test_mtp_greedy_is_token_identical(ckpts, one_thread, name, k):
    _, ref = _run(ckpts["plain"])
    eng, got = _run(ckpts[name], {"method": "mtp", "num_speculative_tokens": k})
    assert got == ref
    stats = eng.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    repeats = sum(a == b for toks in ref for a, b in zip(toks, toks[1:]))
    if name == "echo":  # a draft repeating the last token is accepted where decoding repeats it
        assert repeats > 0 and stats.num_accepted_tokens > 0


def test_mtp_without_mtp_weights_is_one_line(ckpts):
    model, tok = load_model(ckpts["plain"], dtype="float32"), Tokenizer.from_dir(ckpts["plain"])
    with pytest.raises(BaigeError) as e:
        Engine(
            model, tok, EngineConfig(max_model_len=128, speculative_config=SpeculativeConfig.parse('{"method": "mtp"}'))
        )
    msg = str(e.value)
    assert "\n" not in msg and "model.layers.2.enorm.weight" in msg and "method mtp" in msg


def test_mtp_speculative_config_keys():
    assert SpeculativeConfig.parse('{"method": "mtp"}').num_speculative_tokens == 1  # vLLM's default for DS-V3
    with pytest.raises(BaigeError, match="method mtp proposes with the target's own MTP modules"):
        SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2, "model": "x"}')


def test_mtp_drafts_equal_the_training_path_predictions(ckpts):
    """Draft 1 is depth 1's prediction at the last fed position and draft 2 depth 2's (the training
    forward's ``mtp_hidden`` over the tokens plus draft 1); draft 3 reuses depth 2 one position further."""
    from baige.runtime.infer.sampling import SamplerRow
    from baige.runtime.infer.scheduler import Sequence, SequenceStatus
    from baige.runtime.infer.spec_decode.mtp import MTPProposer

    model = load_model(ckpts["random2"], dtype="float32")
    tokens = torch.randint(3, 97, (17,), generator=torch.Generator().manual_seed(5)).tolist()
    n = len(tokens)
    seq = Sequence(list(tokens), max_tokens=8, status=SequenceStatus.RUNNING)
    prop = MTPProposer(model, 3, model.config.vocab_size)
    with torch.no_grad():
        hidden = model(torch.tensor([tokens[:-1]]), torch.arange(n - 1)[None])[0]  # the target fed n-1 tokens
        prop.observe([(seq, 0, hidden[:5]), (seq, 5, hidden[5:])])  # two chunks
        drafts = prop.propose([seq], [3], [SamplerRow(SamplingParams(temperature=0))])[0].token_ids
        mtp: list = []
        ext = tokens + drafts[:1]
        model(torch.tensor([ext]), torch.arange(len(ext))[None], mtp_hidden=mtp)
    assert len(drafts) == 3
    assert drafts[0] == int(model.compute_logits(mtp[0][0, n - 2]).argmax())
    assert drafts[1] == int(model.compute_logits(mtp[1][0, n - 2]).argmax())
    prop.release(seq)
    assert not prop.states


def test_deepseek_v3_mtp_block_is_mla_and_speculates_token_identically(tmp_path, one_thread):
    """On a tiny deepseek_v3 the MTP block is built by the model's own DecoderLayer (MLA attention), loads
    and saves under layer ``num_hidden_layers``, and greedy MTP speculation equals plain decoding."""
    from mla_tiny import make_mla_checkpoint
    from train_utils import shakespeare, write_char_tokenizer

    from baige.runtime.model.mla import MLAttention

    src = make_mla_checkpoint(tmp_path / "ds", "deepseek-v3", vocab_size=97, max_position_embeddings=256)
    write_char_tokenizer(src, shakespeare(200_000))
    ckpt = _with_mtp(src, tmp_path / "ds-mtp", 1, echo=False)
    model = load_model(ckpt, dtype="float32")
    assert len(model.mtp) == 1 and isinstance(model.mtp[0].block.self_attn, MLAttention)
    _, ref = _run(src)
    eng, got = _run(ckpt, {"method": "mtp", "num_speculative_tokens": 2})
    assert got == ref and eng.spec_stats.num_draft_tokens > 0
