"""Fuzzing the file readers: mutations of real files (bits flipped, files truncated, length and offset
fields enlarged) and hypothesis-generated headers and configs. Each reader either accepts a file, and then
the library behind it reads the file without error, or refuses it with one BaigeError line; no other
exception escapes, and a refused GGUF import leaves nothing behind. Fixed seeds and counts bound each
fuzzer to a few seconds."""

from __future__ import annotations

import json
import random
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import embedded_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.weights.gguf_import import import_gguf
from baige.runtime.weights.validate import SAFETENSORS_DTYPES, read_safetensors_header
from baige.runtime.weights.validate_gguf import parse_gguf

SIZES = [0, 1, 3, 7, 255, 2**16, 2**31, 2**32 + 1, 2**40, 2**63, 2**64 - 1]


def _mutate(data: bytes, rng: random.Random, region: int) -> bytes:
    """One mutation inside the first ``region`` bytes: flip bits, truncate, or overwrite a 4- or 8-byte
    little-endian field with an absurd value (the lengths, counts and offsets of binary headers)."""
    b = bytearray(data)
    region = min(region, len(b) - 8)
    kind = rng.randrange(4)
    if kind == 0:
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(region)] ^= 1 << rng.randrange(8)
    elif kind == 1:
        del b[rng.randrange(len(b)) :]
    elif kind == 2:
        i = rng.randrange(region)
        b[i : i + 8] = struct.pack("<Q", rng.choice(SIZES) % 2**64)
    else:
        i = rng.randrange(region)
        b[i : i + 4] = struct.pack("<I", rng.choice(SIZES) % 2**32)
    return bytes(b)


# ------------------------------------------------------------------------------------------------ GGUF
def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A 2-layer llama GGUF written with the gguf package: byte-level vocabulary, merges, chat template,
    one Q8_0 tensor and the rest F32."""
    import gguf
    from gguf import quants

    from baige.runtime.weights.gguf_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(seed)
    hidden, inter, layers, heads, kv = 64, 96, 2, 4, 2
    tokens = [*bytes_to_unicode().values(), "he", "<|end|>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_context_length(128)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(["h e"])
    w.add_eos_token_id(len(tokens) - 1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}")
    vocab, head_dim = len(tokens), hidden // heads

    def add(name: str, *shape: int) -> None:
        w.add_tensor(name, rng.normal(0, 0.1, shape).astype(np.float32))

    embd = rng.normal(0, 0.1, (vocab, hidden)).astype(np.float32)
    w.add_tensor(
        "token_embd.weight",
        quants.quantize(embd, gguf.GGMLQuantizationType.Q8_0),
        raw_shape=quants.quant_shape_to_byte_shape(embd.shape, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    add("output_norm.weight", hidden)
    for i in range(layers):
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", kv * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        add(f"blk.{i}.ffn_gate.weight", inter, hidden)
        add(f"blk.{i}.ffn_up.weight", inter, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, inter)
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_the_tiny_gguf_imports_and_loads(tiny_gguf, tmp_path):
    from baige.runtime.weights.loader import load_model

    out = import_gguf(tiny_gguf, tmp_path / "imported")
    model = load_model(out, torch.float32)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 258
    assert model.config.tie_word_embeddings  # no output.weight in the file


def test_gguf_mutations_import_or_fail_in_one_line(tiny_gguf, tmp_path):
    """Mutations of the whole import (structure, metadata, tokenizer, tensors): accepted or one
    BaigeError naming the file; a refused import leaves no directory."""
    rng = random.Random(0)
    data = tiny_gguf.read_bytes()
    header = len(data) - sum(4 * n for n in (258 * 64 // 4,))  # mutate mostly the metadata and tensor infos
    outcomes = {"imported": 0, "refused": 0}
    for i in range(120):
        path = tmp_path / "m.gguf"
        path.write_bytes(_mutate(data, rng, min(header, 6000)))
        out = tmp_path / f"out{i}"
        try:
            import_gguf(path, out)
            outcomes["imported"] += 1
        except BaigeError as e:
            assert str(e).startswith(f"{path}: ") and "\n" not in str(e), str(e)
            assert not out.exists()
            outcomes["refused"] += 1
    assert outcomes["refused"] > 60 and outcomes["imported"] > 0, outcomes


_META_KEYS = [
    "general.architecture",
    "llama.block_count",
    "llama.embedding_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.context_length",
    "llama.attention.layer_norm_rms_epsilon",
    "llama.rope.scaling.type",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.chat_template",
]


def _meta_values():
    from gguf import GGUFValueType as T

    return [
        (5, T.UINT32),
        (-3, T.INT32),
        (0, T.UINT32),
        (2**40, T.UINT64),
        (1.5, T.FLOAT32),
        (float("nan"), T.FLOAT32),
        ("x", T.STRING),
        (True, T.BOOL),
        ([1, 2, 3], T.ARRAY),
        (["a", "b c"], T.ARRAY),
        ("llama", T.STRING),
        ("yarn", T.STRING),
    ]


def test_gguf_metadata_of_wrong_types(tiny_gguf, tmp_path):
    """Well-formed files whose metadata the importer reads has the wrong type or value (a string head
    count, an array architecture, a float token id ...): one BaigeError naming the file, never a TypeError."""
    import gguf

    reader = gguf.GGUFReader(str(tiny_gguf))
    rng = random.Random(3)
    refused = 0
    for _ in range(40):
        path = tmp_path / "m.gguf"
        override = {k: rng.choice(_meta_values()) for k in rng.sample(_META_KEYS, rng.randint(1, 3))}
        w = gguf.GGUFWriter(str(path), "llama")
        w.kv_data[0].pop("general.architecture")
        for f in reader.fields.values():
            if not f.name.startswith("GGUF.") and f.name not in override:
                sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
        for key, (value, vtype) in override.items():
            w.add_key_value(key, value, vtype)
        for t in reader.tensors:
            w.add_tensor(t.name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        try:
            import_gguf(path, tmp_path / "out")
        except BaigeError as e:
            assert str(e).startswith(f"{path}: ") and "\n" not in str(e), str(e)
            refused += 1
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
    assert refused > 20


def test_embedded_gguf_header_mutations():
    """The real model's header (3 MB of metadata: a 49152-token vocabulary, merges): its first bytes
    mutated in place in memory, or the whole file cut short, checked by the structure validator alone
    (accepted, or refused with one BaigeError line)."""
    data = bytearray(embedded_gguf().read_bytes())
    parse_gguf(memoryview(data))
    original = bytes(data[:4096])
    rng = random.Random(1)
    refused = 0
    for i in range(16):
        mutated = _mutate(original, rng, 4096) if i % 4 else original[:0]
        if len(mutated) < len(original):  # cut short: the header, or (i % 4 == 0) anywhere in the file
            view = memoryview(data)[: len(mutated) or rng.randrange(len(data))]
        else:
            data[:4096] = mutated
            view = memoryview(data)
        try:
            parse_gguf(view)
        except BaigeError as e:
            assert "\n" not in str(e)
            refused += 1
        finally:
            view.release()
            data[:4096] = original
    assert refused >= 8


# ----------------------------------------------------------------------------------------- safetensors
@pytest.fixture(scope="module")
def tiny_safetensors(tmp_path_factory) -> Path:
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            "a": torch.randn(4, 8, generator=g),
            "b": torch.randn(3, dtype=torch.float64, generator=g).to(torch.float16),
            "c": torch.arange(5, dtype=torch.int64),
            "d": torch.zeros(0, 2),
        },
        str(path),
        metadata={"format": "pt"},
    )
    return path


def _agrees_with_safetensors(path: Path) -> str:
    """Our header check against the safetensors library: what we accept, it reads whole."""
    from safetensors import safe_open

    try:
        tensors = read_safetensors_header(path)
    except BaigeError as e:
        assert str(e).startswith(f"{path}: not a valid safetensors file: ") and "\n" not in str(e)
        return "refused"
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        for name in f.keys():
            t = f.get_tensor(name)
            assert (t.dtype, tuple(t.shape)) == (tensors[name].dtype, tensors[name].shape)
    return "accepted"


def test_safetensors_mutations(tiny_safetensors, tmp_path):
    rng = random.Random(2)
    data = tiny_safetensors.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    seen = {"accepted": 0, "refused": 0}
    for _ in range(300):
        path = tmp_path / "m.safetensors"
        if rng.random() < 0.3:  # enlarge a number inside the JSON header (a shape, an offset)
            header = data[8 : 8 + n].decode()
            numbers = list(re.finditer(r"\d+", header))
            m = rng.choice(numbers)
            new = header[: m.start()] + str(rng.choice(SIZES)) + header[m.end() :]
            path.write_bytes(struct.pack("<Q", len(new)) + new.encode() + data[8 + n :])
        else:
            path.write_bytes(_mutate(data, rng, 8 + n))
        seen[_agrees_with_safetensors(path)] += 1
    assert seen["refused"] > 150 and seen["accepted"] > 0, seen


_DTYPES = st.sampled_from([*SAFETENSORS_DTYPES, "Q4", "F128", 7])
_SHAPES = st.lists(st.integers(-2, 2**40), max_size=3) | st.just("x")
_OFFSETS = st.lists(st.integers(-1, 2**40), min_size=0, max_size=3) | st.none()


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    entries=st.dictionaries(
        st.text(min_size=1, max_size=6),
        st.fixed_dictionaries({"dtype": _DTYPES, "shape": _SHAPES, "data_offsets": _OFFSETS})
        | st.fixed_dictionaries(
            {"dtype": st.sampled_from(["F32", "I8"]), "shape": st.lists(st.integers(0, 4), max_size=2)}
        ),
        max_size=4,
    ),
    data_len=st.integers(0, 96),
    tile=st.booleans(),
)
def test_hypothesis_safetensors_headers(tmp_path, entries, data_len, tile):
    """Random headers; with ``tile`` the offsets are made consistent (so some are valid files)."""
    if tile:
        position = 0
        for info in entries.values():
            size = SAFETENSORS_DTYPES.get(info["dtype"], (1,))[0] if isinstance(info["dtype"], str) else 1
            numel = (
                int(np.prod(info["shape"]))
                if isinstance(info["shape"], list) and all(isinstance(d, int) and 0 <= d < 8 for d in info["shape"])
                else 1
            )
            info["data_offsets"] = [position, position + numel * size]
            position += numel * size
        data_len = position
    path = tmp_path / "h.safetensors"
    header = json.dumps(entries).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(data_len))
    _agrees_with_safetensors(path)


# ------------------------------------------------------------------------------------------ config.json
BASE_CONFIG = {
    "model_type": "llama",
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "eos_token_id": 2,
}
_VALUES = (
    st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, 2, 3, 4, 8, 16, 2**31, 2**16 + 1])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.booleans()
    | st.none()
    | st.text(max_size=5)
    | st.lists(st.integers(-3, 300), max_size=3)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)
_FIELDS = st.sampled_from(
    [
        *BASE_CONFIG,
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "torch_dtype",
        "rope_scaling",
        "rope_parameters",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "decoder_sparse_step",
        "mlp_only_layers",
        "bos_token_id",
        "quantization_config",
    ]
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    changes=st.dictionaries(_FIELDS, _VALUES, min_size=1, max_size=4),
    model_type=st.sampled_from(["llama", "qwen2", "qwen3_moe", "qwen2_moe", "mixtral", "ernie4_5_moe"]),
)
def test_hypothesis_configs(changes, model_type):
    """Any mutated config either parses into a model the decoder can build, or is one BaigeError line."""
    from baige.runtime.model.transformer import Transformer

    raw = {
        **BASE_CONFIG,
        "model_type": model_type,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_num_experts": 4,
        **changes,
    }
    try:
        cfg = ModelConfig.from_dict(raw)
    except BaigeError as e:
        assert "\n" not in str(e)
        return
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0 and cfg.head_dim % 2 == 0
    assert cfg.num_params() > 0
    if cfg.num_hidden_layers <= 4 and cfg.num_params() < 10**12:
        with torch.device("meta"):
            Transformer(cfg)
