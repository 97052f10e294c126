"""`bench compare`'s llama.cpp rows for an HF checkpoint: the GGUF baige's writer makes of it (cached once), the
notes for fields llama.cpp computes differently and for a checkpoint with no GGUF form; and, where
llama-cpp-python is installed, a real compare run giving the new families a llama.cpp row."""

import importlib.util
import json

import pytest
from mla_tiny import make_mla_checkpoint
from tiny import make_checkpoint, write_bpe_tokenizer

from baige.runtime.bench import compare, llama_peer
from baige.runtime.bench.offline import bench_engine

V = 264


@pytest.fixture
def stand_in_llama_cpp(monkeypatch, tmp_path):
    """llama-cpp-python "installed", its decode and prefill recorded instead of run; the cache in tmp_path."""
    from baige.runtime.weights import hub

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "llama_cpp" else real_find_spec(name, *a)
    )
    decoded = []
    monkeypatch.setattr(
        llama_peer, "llama_cpp_decode", lambda path, prompt, n, threads: (decoded.append(path), lambda: None)[1]
    )
    monkeypatch.setattr(llama_peer, "llama_cpp_prefill", lambda path, n_ctx, threads: lambda prompt: None)
    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path / "cache")
    return decoded


def _rows(model_dir):
    rows, notes = compare.Rows(), []
    cfg = compare.CompareConfig(bench_engine(model=str(model_dir)), quantized=())
    compare._add_llama_cpp(rows, cfg, [1, 2, 3], notes, model_dir)
    return rows, notes


def test_an_hf_checkpoint_is_converted_once_and_timed(stand_in_llama_cpp, tmp_path, monkeypatch):
    ckpt = write_bpe_tokenizer(make_checkpoint(tmp_path / "ernie", "ernie4.5", vocab_size=V))
    rows, notes = _rows(ckpt)
    assert notes == [] and list(rows.decode) == ["llama.cpp-F32"] and list(rows.prefill) == ["llama.cpp-F32"]
    (gguf,) = stand_in_llama_cpp
    assert gguf.parent == tmp_path / "cache" / "llama_cpp" and gguf.name.startswith("ernie-")
    assert gguf.name.endswith("-hf.gguf") and rows.weight_bytes["llama.cpp-F32"] == gguf.stat().st_size
    assert [p.name for p in gguf.parent.iterdir()] == [gguf.name]  # no temporary left
    from baige.runtime.weights import gguf_export

    monkeypatch.setattr(gguf_export, "export_gguf", lambda *a: pytest.fail("converted twice"))
    rows, notes = _rows(ckpt)
    assert stand_in_llama_cpp == [gguf, gguf] and notes == []


def test_fields_llama_cpp_computes_differently_are_notes(stand_in_llama_cpp, tmp_path):
    ckpt = write_bpe_tokenizer(make_checkpoint(tmp_path / "gemma", "gemma3", vocab_size=V))
    rows, notes = _rows(ckpt)
    prefix = "llama.cpp times the checkpoint's shapes, not its exact function: config field "
    assert notes == [
        prefix + "final_logit_softcapping = 2.0: llama.cpp's gemma3 has no final cap",
        prefix + "query_pre_attn_scalar = 20.0: llama.cpp's gemma3 fixes it at 16",
    ]
    assert list(rows.decode) == ["llama.cpp-F32"]


def test_a_checkpoint_with_no_gguf_form_is_one_note(stand_in_llama_cpp, tmp_path):
    ckpt = write_bpe_tokenizer(make_checkpoint(tmp_path / "moe", "qwen3-moe", vocab_size=V))
    rows, notes = _rows(ckpt)
    assert rows.decode == {} and stand_in_llama_cpp == [] and len(notes) == 1
    assert notes[0].startswith("llama.cpp skipped: baige cannot write the checkpoint as a GGUF (model_type 'qwen3_moe'")
    assert not (tmp_path / "cache" / "llama_cpp").exists() or not any((tmp_path / "cache" / "llama_cpp").iterdir())


def test_compare_times_llama_cpp_on_a_deepseek_v3_checkpoint(tmp_path, monkeypatch):
    """The real thing: `bench compare --peers llama.cpp` on a tiny DeepSeek-V3 directory gives a llama.cpp-F32
    row (and its Q8_0 re-quantization beside baige-int8) in the decode and prefill sections."""
    pytest.importorskip("llama_cpp")
    from typer.testing import CliRunner

    from baige.cli import app
    from baige.runtime.weights import hub

    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path / "cache")
    rope = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)
    ckpt = tmp_path / "ds"
    make_mla_checkpoint(
        ckpt, "deepseek-v3", vocab_size=V, rope_parameters={**rope, "mscale": 1.0, "mscale_all_dim": 1.0}
    )
    write_bpe_tokenizer(ckpt)
    args = ["bench", "compare", "--model", str(ckpt), "--peers", "llama.cpp", "--variants", "int8", "--repeats", "1"]
    args += ["--input-len", "8", "--output-len", "4", "--num-prompts", "2", "--tp-input-len", "4"]
    args += ["--tp-output-len", "2", "--prefill-lens", "16", "--output-dir", str(tmp_path / "out")]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    (path,) = (tmp_path / "out").glob("compare-*.json")
    summary = json.loads(path.read_text())["summary"]
    assert {"llama.cpp-F32", "llama.cpp-Q8_0", "baige", "baige-int8"} <= set(summary["decode"])
    assert summary["decode"]["llama.cpp-F32"]["tokens_per_s"] > 0
    assert "llama.cpp-F32" in summary["prefill"]


def test_a_variant_the_quantizer_refuses_is_a_note_and_the_others_still_run(tmp_path, monkeypatch):
    """`--variants int8,fp32,int8+fp16-weight` on a checkpoint the quantizer refuses (one already int8): both
    int8 variants become one note each, quantizing is tried once, and the fp32 row is still built."""
    from baige.runtime import quantize
    from baige.runtime.config import QuantizeConfig

    ckpt = write_bpe_tokenizer(make_checkpoint(tmp_path / "llama", "llama", vocab_size=V, max_position_embeddings=1024))
    int8, _ = quantize.quantize_checkpoint(
        QuantizeConfig(model=str(ckpt), method="int8", output=str(tmp_path / "int8"), device="cpu")
    )
    calls = []
    real = quantize.quantize_checkpoint
    monkeypatch.setattr(quantize, "quantize_checkpoint", lambda cfg: (calls.append(cfg.method), real(cfg))[1])
    cfg = compare.CompareConfig(bench_engine(model=str(int8)), quantized=("int8", "fp32", "int8+fp16-weight"))
    rows, notes = compare.Rows(), []
    (tmp_path / "copies").mkdir()
    compare._add_quantized(rows, cfg, int8, tmp_path / "copies", [1, 2, 3], [([1, 2, 3], 2)], notes)
    refusal = f"{int8}: the model is already quantized"
    assert notes == [f"baige-int8 skipped: {refusal}", f"baige-int8+fp16-weight skipped: {refusal}"]
    assert calls == ["int8"] and list(rows.decode) == ["baige-fp32"]


def test_a_gguf_llama_cpp_refuses_to_load_is_a_note(stand_in_llama_cpp, tmp_path, monkeypatch):
    """llama-cpp-python raises ValueError("Failed to load model from file: ...") for a file its loader rejects:
    one note for that row, no traceback ending the compare."""

    def refuse(path, prompt, n, threads):
        raise ValueError(f"Failed to load model from file: {path}")

    monkeypatch.setattr(llama_peer, "llama_cpp_decode", refuse)
    ckpt = write_bpe_tokenizer(make_checkpoint(tmp_path / "ernie", "ernie4.5", vocab_size=V))
    rows, notes = _rows(ckpt)
    assert rows.decode == {} and len(notes) == 1
    assert notes[0].startswith("llama.cpp-F32 skipped: Failed to load model from file: ") and notes[0].endswith(".gguf")


def test_a_changed_writer_converts_again(stand_in_llama_cpp, tmp_path, monkeypatch):
    """The cache key holds the writer's source: a GGUF an older writer made is not reused."""
    from baige.runtime.bench import llama_peer

    ckpt = write_bpe_tokenizer(make_checkpoint(tmp_path / "ernie", "ernie4.5", vocab_size=V))
    writer = tmp_path / "gguf_export_fake.py"
    writer.write_text("# writer 1\n")
    monkeypatch.setattr(llama_peer, "_writer_sources", lambda: [writer])
    _rows(ckpt)
    writer.write_text("# writer 2\n")
    _rows(ckpt)
    first, second = stand_in_llama_cpp
    assert first != second and first.is_file() and second.is_file()
