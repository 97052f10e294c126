"""Writes the crafted-file corpus next to this script (``python tests/weights/corpus/make_corpus.py``) and
``manifest.json``: file name -> [kind, the problem its one-line error must name]. Every file is a few
bytes to a few kilobytes; ``tests/weights/test_crafted_files.py`` runs each through its reader and checks
the committed files are exactly what this script writes."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _st(header: bytes | dict, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def safetensors_files() -> dict[str, tuple[bytes, str]]:
    f32 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    return {
        "st_short.safetensors": (b"\x01\x02", "shorter than the 8-byte header length"),
        "st_header_past_end.safetensors": (_st(b"{}", length=1 << 40), "past the end of the"),
        "st_not_json.safetensors": (_st(b"{not json"), "header is not valid JSON"),
        "st_not_object.safetensors": (_st(b"[1, 2]"), "header is not a JSON object"),
        "st_offsets_outside.safetensors": (
            _st({"w": {**f32, "data_offsets": [0, 1000]}}, bytes(16)),
            "lie outside the 16 data bytes",
        ),
        "st_overlap.safetensors": (_st({"a": f32, "b": f32}, bytes(16)), "overlaps the tensor before it"),
        "st_unknown_dtype.safetensors": (_st({"w": {**f32, "dtype": "Q4"}}, bytes(16)), "unknown dtype 'Q4'"),
        "st_span_mismatch.safetensors": (
            _st({"w": {**f32, "shape": [2**62, 2**62]}}, bytes(16)),
            "but data_offsets span 16",
        ),
        "st_negative_dim.safetensors": (_st({"w": {**f32, "shape": [-4]}}, bytes(16)), "is not a list of at most 8"),
        "st_duplicate.safetensors": (
            _st(b'{"w": ' + json.dumps(f32).encode() + b', "w": ' + json.dumps(f32).encode() + b"}", bytes(16)),
            "appears twice",
        ),
        "st_uncovered.safetensors": (_st({"w": f32}, bytes(48)), "cover 16 of the 48 data bytes"),
    }


def _s(text: str | bytes, length: int | None = None) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw) if length is None else length) + raw


def _gguf(kvs: bytes = b"", n_kv: int = 0, tensors: bytes = b"", n_tensors: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kvs + tensors


def _kv_u32(key: str, value: int) -> bytes:
    return _s(key) + struct.pack("<II", 4, value)


def _tensor(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    return (
        _s(name)
        + struct.pack("<I", len(dims))
        + struct.pack(f"<{len(dims)}Q", *dims)
        + struct.pack("<IQ", ggml_type, offset)
    )


def gguf_files() -> dict[str, tuple[bytes, str]]:
    arch = _s("general.architecture") + struct.pack("<I", 8) + _s("llama")
    return {
        "gguf_bad_magic.gguf": (b"GGML" + bytes(20), "no GGUF magic"),
        "gguf_truncated.gguf": (b"GGUF\x03\x00", "past the end of the"),
        "gguf_version.gguf": (_gguf(version=99), "GGUF version 99 is not supported"),
        "gguf_kv_count.gguf": (_gguf(n_kv=2**60), "the key-value count 1152921504606846976"),
        "gguf_key_length.gguf": (
            _gguf(_s("k", length=2**40) + bytes(16), 1),
            "a metadata key length 1099511627776 at byte 24 cannot fit",
        ),
        "gguf_value_type.gguf": (_gguf(_s("k") + struct.pack("<I", 77) + bytes(8), 1), "unknown value type 77"),
        "gguf_array_count.gguf": (
            _gguf(_s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**62), 1),
            "the array count of 'tokenizer.ggml.tokens' 4611686018427387904",
        ),
        "gguf_not_utf8.gguf": (_gguf(_s(b"\xff\xfe") + bytes(16), 1), "is not UTF-8"),
        "gguf_alignment.gguf": (_gguf(arch + _kv_u32("general.alignment", 3), 2), "power of two, got 3"),
        "gguf_dims.gguf": (_gguf(arch, 1, _tensor("w", [1] * 9), 1), "has 9 dimensions"),
        "gguf_tensor_type.gguf": (_gguf(arch, 1, _tensor("w", [4], ggml_type=999), 1), "unknown ggml type 999"),
        "gguf_tensor_offset.gguf": (
            _gguf(arch, 1, _tensor("w", [4, 4], offset=2**40), 1),
            "64 bytes at offset 1099511627776 run past",
        ),
        "gguf_tensor_size.gguf": (_gguf(arch, 1, _tensor("w", [2**30, 2**30]), 1), "run past the file's"),
        "gguf_duplicate_key.gguf": (_gguf(arch + arch, 2), "metadata key 'general.architecture' is repeated"),
    }


def config_files() -> dict[str, tuple[bytes, str]]:
    base = {
        "model_type": "llama",
        "vocab_size": 160,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }

    def cfg(**kw) -> bytes:
        return json.dumps({**base, **kw}).encode()

    return {
        "config_layers.json": (cfg(num_hidden_layers=10**6), "field 'num_hidden_layers' must be in [1, 65536]"),
        "config_kv_heads.json": (cfg(num_key_value_heads=3), "not a multiple of num_key_value_heads=3"),
        "config_type.json": (cfg(hidden_size="64"), "field 'hidden_size' must be an integer"),
        "config_negative.json": (cfg(vocab_size=-1), "field 'vocab_size' must be in [1,"),
        "config_nan.json": (cfg(rms_norm_eps=float("nan")), "field 'rms_norm_eps' must be a finite number > 0"),
        "config_eos.json": (cfg(eos_token_id=["x"]), "field 'eos_token_id' must be null or a token id"),
        "config_not_object.json": (b"[1, 2]", "not a JSON object but list"),
        "config_deep.json": (b"[" * 20000 + b"]" * 20000, "not a readable JSON file (RecursionError"),
        "config_huge_int.json": (b'{"vocab_size": ' + b"9" * 5000 + b"}", "not a readable JSON file (ValueError"),
        "config_quant_groups.json": (
            cfg(quantization_config={"quant_method": "compressed-tensors", "config_groups": [1]}),
            "field 'quantization_config.config_groups' must be an object of objects",
        ),
        "config_quant_regex.json": (
            cfg(quantization_config={"config_groups": {"g": {"targets": ["re:(("]}}}),
            "must be holding valid re: patterns",
        ),
        "config_moe.json": (
            cfg(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=8, moe_intermediate_size=8),
            "8 experts per token (num_experts_per_tok) but only 4 experts",
        ),
    }


def template_files() -> dict[str, tuple[bytes, str]]:
    return {
        "template_nested_loops.jinja": (
            b"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "its loops ran past 1048576 iterations",
        ),
        "template_range.jinja": (b"{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
        "template_escape.jinja": (
            b"{{ ''.__class__.__mro__[1].__subclasses__() }}",
            "violates the sandbox: access to attribute '__class__'",
        ),
        "template_mutate.jinja": (b"{{ messages.append(1) }}", "violates the sandbox"),
        "template_repeat.jinja": (b"{{ 'x' * 10**10 }}", "a repeated string or list would be 10000000000 long"),
        "template_format_width.jinja": (b"{{ '%0999999999d' % 1 }}", "a format width of 0999999999"),
        "template_recursion.jinja": (b"{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recurses too deep"),
        "template_doubling.jinja": (
            b"{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "a string would be 134217728 long",
        ),
        "template_syntax.jinja": (b"{% for %}", "does not compile"),
    }


def tokenizer_files() -> dict[str, tuple[bytes, str]]:
    return {
        "tokenizer_config_list.json": (b"[1]", "must hold a JSON object, not list"),
        "tokenizer_config_eos.json": (b'{"eos_token": 5}', "eos_token must be a string or an object"),
        "tokenizer_config_template.json": (b'{"chat_template": 7}', "chat_template must be a string or a list"),
        "generation_config_eos.json": (b'{"eos_token_id": "abc"}', "eos_token_id must be null or token ids"),
        "generation_config_temperature.json": (b'{"temperature": -1}', "temperature must be a number in [0, 100]"),
        "tokenizer_bad.json": (b'{"version": "1.0", "model": 5}', "is not a valid tokenizer"),
        "adapter_config_rank.json": (b'{"peft_type": "LORA", "r": -1}', "r must be an integer in [1, 65536]"),
        "adapter_config_pattern.json": (
            b'{"peft_type": "LORA", "r": 4, "rank_pattern": [1]}',
            "rank_pattern must map module names",
        ),
    }


def corpus() -> dict[str, tuple[str, bytes, str]]:
    """File name -> (kind, bytes, problem)."""
    out = {}
    for kind, files in (
        ("safetensors", safetensors_files()),
        ("gguf", gguf_files()),
        ("config", config_files()),
        ("chat_template", template_files()),
        ("side_file", tokenizer_files()),
    ):
        out.update({name: (kind, data, problem) for name, (data, problem) in files.items()})
    return out


def main(out: Path = HERE) -> None:
    manifest = {}
    for name, (kind, data, problem) in sorted(corpus().items()):
        (out / name).write_bytes(data)
        manifest[name] = [kind, problem]
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
