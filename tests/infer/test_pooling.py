"""The pooling runner: pooling configs read from sentence-transformers files, Matryoshka checks, the pooled
state of chunked prefills (and of a prompt computed again after a preemption), and ``LLM.embed`` against
transformers' hidden states (fp32, within 1e-5) for last-token, mean and CLS pooling (the latter two from a
sentence-transformers bare-decoder checkpoint) through chunked prefill."""

import json

import pytest
import torch
from tiny import make_checkpoint, write_tiny_tokenizer

from baige.errors import BaigeError
from baige.runtime.infer.llm import LLM
from baige.runtime.infer.pooling import PoolerConfig, PoolingParams, PoolingState, pooler_config, pooling_runner

ST = "sentence_transformers.models."


def write_st(path, mode: str, normalize: bool = True, extra_modules=()):
    """sentence-transformers' files: modules.json (Transformer, Pooling[, Normalize]) and the pooling config."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"}]
    modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"})
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST + "Normalize"})
    modules += list(extra_modules)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    keys = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens", "pooling_mode_lasttoken")
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, **{k: k == mode for k in keys}})
    )
    return path


def test_pooler_config_from_sentence_transformers_files(tmp_path):
    assert pooler_config(write_st(tmp_path, "pooling_mode_mean_tokens"), {}) == PoolerConfig("MEAN", True)
    assert pooler_config(write_st(tmp_path, "pooling_mode_cls_token", normalize=False), {}) == PoolerConfig(
        "CLS", False
    )
    assert pooler_config(write_st(tmp_path, "pooling_mode_lasttoken"), {"is_matryoshka": True}).is_matryoshka
    cfg = pooler_config(write_st(tmp_path, "pooling_mode_lasttoken"), {"matryoshka_dimensions": [8, 32]})
    assert (cfg.is_matryoshka, cfg.matryoshka_dimensions) == (True, (8, 32))
    with pytest.raises(BaigeError, match="pooling_mode_max_tokens"):
        pooler_config(write_st(tmp_path, "pooling_mode_max_tokens"), {})
    dense = [{"idx": 3, "name": "3", "path": "3_Dense", "type": ST + "Dense"}]
    with pytest.raises(BaigeError, match="Dense"):
        pooler_config(write_st(tmp_path, "pooling_mode_mean_tokens", extra_modules=dense), {})
    with pytest.raises(BaigeError, match="matryoshka_dimensions"):
        pooler_config(write_st(tmp_path, "pooling_mode_mean_tokens"), {"matryoshka_dimensions": [0]})


def test_runner_auto(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert pooling_runner("auto", tmp_path) is None
    assert pooling_runner("pooling", tmp_path) == PoolerConfig()  # last token, normalised (vLLM's default)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3Model"]}))
    assert pooling_runner("auto", tmp_path) == PoolerConfig()
    assert pooling_runner("generate", tmp_path) is None
    with pytest.raises(BaigeError, match="--runner"):
        pooling_runner("embed", tmp_path)


def test_dimensions_checks():
    plain, any_dims, listed = (
        PoolerConfig(),
        PoolerConfig(is_matryoshka=True),
        PoolerConfig("LAST", True, True, (8, 16)),
    )
    PoolingParams().check(plain, 64)
    with pytest.raises(BaigeError, match="Matryoshka") as e:
        PoolingParams(dimensions=8).check(plain, 64)
    assert e.value.param == "dimensions"
    PoolingParams(dimensions=64).check(any_dims, 64)
    with pytest.raises(BaigeError, match="between 1 and 64"):
        PoolingParams(dimensions=65).check(any_dims, 64)
    PoolingParams(dimensions=16).check(listed, 64)
    with pytest.raises(BaigeError, match="8, 16"):
        PoolingParams(dimensions=12).check(listed, 64)


def test_pooling_state_over_chunks():
    h = torch.arange(12.0).reshape(4, 3)  # 4 prompt positions, hidden 3
    mean = PoolingState(PoolerConfig("MEAN", False), PoolingParams(), 4)
    assert list(mean.positions(0, 3)) == [0, 1, 2] and list(mean.positions(3, 4)) == [3]
    mean.add(h[:3], 0)
    mean.add(h[3:], 3)
    assert mean.result() == [4.5, 5.5, 6.5]
    mean.add(h[:2], 0)  # a preempted sequence's prompt computed again: the sum starts afresh
    mean.add(h[2:], 2)
    assert mean.result() == [4.5, 5.5, 6.5]
    cls = PoolingState(PoolerConfig("CLS", True), PoolingParams(dimensions=2), 4)
    assert list(cls.positions(0, 2)) == [0] and list(cls.positions(2, 4)) == []
    cls.add(h[1:2] * 0 + torch.tensor([[3.0, 4.0, 12.0]]), 0)
    assert cls.result() == pytest.approx([0.6, 0.8])  # cut to 2, then normalised
    last = PoolingState(PoolerConfig("LAST", True), PoolingParams(normalize=False), 4)
    assert list(last.positions(0, 3)) == [] and list(last.positions(3, 4)) == [3]
    last.add(h[3:], 3)
    assert last.result() == [9.0, 10.0, 11.0]


def hf_hidden(path, prompts):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in prompts]


PROMPTS = [[5, 6, 7], list(range(1, 40)), [9], list(range(10, 30)), list(range(100, 160))]


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    return write_tiny_tokenizer(make_checkpoint(tmp_path_factory.mktemp("causal"), "llama"))


def test_last_token_embeddings_equal_transformers(causal):
    """Last-token pooling of a causal checkpoint (--runner pooling), prompts chunked over several steps."""
    llm = LLM(
        str(causal), runner="pooling", dtype="float32", kv_cache_memory="4MB", max_num_batched_tokens=32, max_num_seqs=4
    )
    outs = llm.embed(PROMPTS)
    for p, o, h in zip(PROMPTS, outs, hf_hidden(causal, PROMPTS)):
        ref = torch.nn.functional.normalize(h[-1], dim=0)
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), ref, atol=1e-5, rtol=0)
        assert o.prompt_token_ids == p
    with pytest.raises(BaigeError, match="pooling runner"):
        llm.generate("t1 t2")


def test_generate_runner_refuses_embed(causal):
    with pytest.raises(BaigeError, match="pooling runner"):
        LLM(str(causal), dtype="float32", kv_cache_memory="4MB").embed("t1 t2")


@pytest.mark.parametrize("mode", ["pooling_mode_mean_tokens", "pooling_mode_cls_token"])
def test_sentence_transformers_bare_decoder(tmp_path, mode):
    """A sentence-transformers checkpoint of a bare decoder (transformers' LlamaModel: no lm_head, names
    without ``model.``) is a pooling model for --runner auto and pools as its Pooling config says, prompts
    chunked over several steps (the mean sums over chunks)."""
    from transformers import AutoModel

    src = make_checkpoint(tmp_path / "src", "llama")
    AutoModel.from_pretrained(src, dtype=torch.float32).save_pretrained(tmp_path / "st")
    d = write_st(write_tiny_tokenizer(tmp_path / "st"), mode)
    llm = LLM(str(d), dtype="float32", kv_cache_memory="4MB", max_num_batched_tokens=16, max_num_seqs=4)
    assert llm.engine.pooler.pooling_type == ("MEAN" if "mean" in mode else "CLS")
    outs = llm.embed(PROMPTS)
    for o, h in zip(outs, hf_hidden(d, PROMPTS)):
        pooled = h.mean(0) if "mean" in mode else h[0]
        torch.testing.assert_close(
            torch.tensor(o.outputs.embedding), torch.nn.functional.normalize(pooled, dim=0), atol=1e-5, rtol=0
        )
