"""`bench compare` with its child-process peers replaced by stand-ins (tests/bench/stand_in_peers): the rows
`<peer>-<format>` in decode / prefill / throughput, one process per row (a row that dies of SIGSEGV, or
refuses the model, leaves the others' rows and is one note line), the note of a peer not installed."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny import make_checkpoint

from baige.runtime import roofline
from baige.runtime.bench import compare, peers
from baige.runtime.bench.offline import bench_engine

STAND_INS = Path(__file__).parent / "stand_in_peers"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, embedded_dir):
    path = make_checkpoint(tmp_path_factory.mktemp("compare-peers") / "tiny", "llama-tied")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_dir / name, path / name)
    return path


def test_compare_with_stand_in_peers(tiny_model, tmp_path, monkeypatch):
    from baige.runtime.weights import hub

    monkeypatch.syspath_prepend(str(STAND_INS))
    monkeypatch.setattr(
        peers,
        "PEER_MODULES",
        {"ctranslate2": "stand_in_good", "openvino": "stand_in_crash", "onnxruntime-genai": "stand_in_missing"},
    )
    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path / "cache")
    limits = roofline.HardwareLimits("cpu", "float32", bandwidth=10e9, matmul_peak=100e9)  # not measured here
    monkeypatch.setattr(roofline, "hardware_limits", lambda device, dtype: limits)
    monkeypatch.setattr(roofline, "remeasure_limits", lambda first: first)
    cfg = compare.CompareConfig(
        bench_engine(model=str(tiny_model), dtype="float32"),
        input_len=4,
        output_len=3,
        num_prompts=5,
        tp_input_len=6,
        tp_output_len=2,
        hf_batch_size=2,
        repeats=2,
        quantized=("int8",),
        peers=("onnxruntime-genai", "openvino", "ctranslate2"),
        prefill_lens=(8, 16),
    )
    r = compare.run_compare(cfg)
    s = r["summary"]
    good = ["ctranslate2-int8", "ctranslate2-int8_float32"]
    assert list(s["decode"]) == ["baige", "baige-int8", "openvino-int2", *good]
    assert list(s["prefill"]) == ["baige", "baige-int8", "openvino-int2", *good]
    assert list(s["throughput"]) == ["baige", "baige-int8", *good]  # openvino-int2: no batched API
    assert all(set(row) == {"pp8", "pp16"} for row in s["prefill"].values())
    n = torch.get_num_threads()  # the rows' threads: this process's
    assert r["notes"] == [
        "onnxruntime-genai is not installed (baige_stand_in_no_such_module missing): skipped "
        "(scripts/setup.sh --with-peers)",
        "openvino-int8 skipped: the timing process died of SIGSEGV: stand-in: about to crash",
        "openvino-int4 skipped: (its last line)",
        f"openvino-int2: stand-in int2, {n} thread(s)",
        f"ctranslate2-int8: stand-in int8, {n} thread(s)",
        f"ctranslate2-int8_float32: stand-in int8_float32, {n} thread(s)",
    ]
    # each row's child got the same prompts as baige's rows: a warm-up decode, then per round decode,
    # prefill at 8 and 16 tokens and the 5 requests in static batches of 2
    calls = [json.loads(x) for x in next((tmp_path / "cache" / "peers").rglob("calls.jsonl")).read_text().splitlines()]
    per_round = [["decode", 4, 3], ["prefill", 8], ["prefill", 16], ["batch", 5, 2]]
    assert calls == [[f, *c] for f in ("int8", "int8_float32") for c in [["decode", 4, 3], *per_round * 2]]
    assert (
        len(r["samples"]["decode"]["ctranslate2-int8"]) == 2 and len(r["samples"]["prefill"]["ctranslate2-int8"]) == 2
    )
    # the decode roofline reads the converted weights (1000 bytes) and the row's fp16 cache (kv_bytes 2):
    # K+V x 2 layers x 2 kv heads x head_dim 16 x 2 bytes per token, at the mean context 4 + 3 / 2
    assert s["decode"]["ctranslate2-int8"]["roofline"]["bytes_per_step"] == 1000 + 5.5 * (2 * 2 * 2 * 16 * 2)
    for key in (
        "decode_baige_over_ctranslate2-int8",
        "prefill-pp16_baige-int8_over_ctranslate2-int8_float32",
        "throughput_baige-int8_over_ctranslate2-int8",
        "decode_baige-int8_over_fastest-peer-int8",
    ):
        assert key in s["ratios"]
    fastest = max(s["decode"][g]["tokens_per_s"] for g in good)
    assert s["ratios"]["decode_baige-int8_over_fastest-peer-int8"] == pytest.approx(
        s["decode"]["baige-int8"]["tokens_per_s"] / fastest
    )


def test_ratios_by_hand_at_equal_bits_and_per_prefill_length():
    from baige.runtime.bench.compare_ratios import ratios

    s = {
        "decode": {
            "baige": {"tokens_per_s": 50.0},
            "baige-int4-g32": {"tokens_per_s": 120.0},
            "openvino-int4": {"tokens_per_s": 60.0},
            "onnxruntime-genai-int4": {"tokens_per_s": 80.0},
            "ctranslate2-int8": {"tokens_per_s": 40.0},
        },
        "prefill": {
            "baige": {"pp128": {"tokens_per_s": 600.0}, "pp512": {"tokens_per_s": 500.0}},
            "baige-int4-g32": {"pp512": {"tokens_per_s": 450.0}},
            "llama.cpp-Q4_0": {"pp128": {"tokens_per_s": 400.0}, "pp512": {"tokens_per_s": 300.0}},
        },
    }
    assert ratios(s) == pytest.approx(
        {
            "decode_baige_over_openvino-int4": 50 / 60,
            "decode_baige_over_onnxruntime-genai-int4": 50 / 80,
            "decode_baige_over_ctranslate2-int8": 50 / 40,
            "decode_baige-int4-g32_over_openvino-int4": 2.0,
            "decode_baige-int4-g32_over_onnxruntime-genai-int4": 1.5,
            "decode_baige-int4-g32_over_fastest-peer-int4": 1.5,  # ORT's 80 the fastest at 4 bits
            "prefill-pp128_baige_over_llama.cpp-Q4_0": 1.5,
            "prefill-pp512_baige_over_llama.cpp-Q4_0": 500 / 300,
            "prefill-pp512_baige-int4-g32_over_llama.cpp-Q4_0": 1.5,
        }
    )
