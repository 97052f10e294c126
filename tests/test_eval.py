"""Perplexity and model comparison against HF transformers (tiny checkpoints), and the CLI commands."""

import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import DATA_DIR
from tiny import make_checkpoint

from baige.errors import BaigeError
from baige.runtime.evaluate import compare, perplexity, windows
from baige.runtime.weights.loader import load_model
from baige.runtime.weights.safetensors_io import TOKENIZER_FILES


def hf_guide_perplexity(hf, ids: torch.Tensor, max_length: int) -> float:
    """HF's perplexity guide loop (docs: "Perplexity of fixed-length models") with stride = max_length."""
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    seq_len = ids.shape[1]
    for begin in range(0, seq_len, max_length):
        end = min(begin + max_length, seq_len)
        trg_len = end - prev_end
        input_ids = ids[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf(input_ids, labels=target_ids).loss
        valid = (target_ids != -100).sum().item() - target_ids.size(0)  # labels are shifted inside the model
        if valid > 0:
            nll_sum += loss.item() * valid
            n_tokens += valid
        prev_end = end
        if end == seq_len:
            break
    return math.exp(nll_sum / n_tokens)


def test_windows():
    assert windows(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert windows(9, 4) == [(0, 4), (4, 8)]  # a 1-token tail predicts nothing
    with pytest.raises(BaigeError, match="seq-len"):
        windows(10, 1)


def test_perplexity_matches_hf_guide(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path / "m", "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, 160, (61,))
    ref = hf_guide_perplexity(hf, ids[None], 16)
    got = perplexity(load_model(path), ids, 16)
    assert got.predicted_tokens == 15 * 3 + 12 and got.n_windows == 4
    assert got.perplexity == pytest.approx(ref, rel=1e-5)
    assert got.perplexity > 100  # a random model over 160 tokens: near-uniform, not trivially 1


def test_compare_kl_and_agreement_match_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    pa, pb = make_checkpoint(tmp_path / "a", "llama", seed=0), make_checkpoint(tmp_path / "b", "llama", seed=1)
    torch.manual_seed(1)
    ids = torch.randint(0, 160, (40,))
    kl = agree = n = 0.0
    for b, e in [(0, 16), (16, 32), (32, 40)]:
        with torch.no_grad():
            la = F.log_softmax(AutoModelForCausalLM.from_pretrained(pa).eval()(ids[None, b:e]).logits[0, :-1], -1)
            lb = F.log_softmax(AutoModelForCausalLM.from_pretrained(pb).eval()(ids[None, b:e]).logits[0, :-1], -1)
        kl += F.kl_div(lb, la, log_target=True, reduction="sum").item()  # KL(P_a || P_b)
        agree += (la.argmax(-1) == lb.argmax(-1)).sum().item()
        n += e - b - 1
    res = compare(load_model(pa), load_model(pb), ids, 16)
    assert res.kl_divergence == pytest.approx(kl / n, rel=1e-4) and res.kl_divergence > 0.01
    assert res.top1_agreement == pytest.approx(agree / n)
    same = compare(load_model(pa), load_model(pa), ids, 16)
    assert abs(same.kl_divergence) < 1e-6 and same.top1_agreement == 1.0
    assert same.a.perplexity == same.b.perplexity == res.a.perplexity


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory, embedded_dir):
    """A tiny random model that uses the real SmolLM2 tokenizer, so the CLI runs end to end fast."""
    path = make_checkpoint(tmp_path_factory.mktemp("tok") / "m", "llama", vocab_size=49152, intermediate_size=128)
    for fname in TOKENIZER_FILES:
        if (embedded_dir / fname).is_file():
            shutil.copy(embedded_dir / fname, path / fname)
    return path


def _cli(*args):
    from typer.testing import CliRunner

    from baige.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.usefixtures("exact_quant_kernels")  # parity with HF's dequantized int4, not the int-dot rounding
def test_cli_quantize_eval_and_compare(tiny_with_tokenizer, tmp_path):
    out = tmp_path / "int4"
    r = _cli("quantize", "--model", tiny_with_tokenizer, "--method", "int4", "--group-size", "32", "--output", out)
    assert r.exit_code == 0, r.output
    report = json.loads((out / "quantization_report.json").read_text())
    assert len(report["layers"]) == 14 and report["format"] == "pack-quantized"
    assert (out / "tokenizer.json").is_file()
    assert "relative weight error" in r.output and "down_" in r.output  # the rich table

    # the references: HF's tokenizer and HF transformers' own load of both checkpoints (the int4 one
    # through its compressed-tensors integration)
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = DATA_DIR / "wikitext-2-raw-test.txt"
    ids = torch.tensor(AutoTokenizer.from_pretrained(tiny_with_tokenizer)(data.read_text())["input_ids"][:256])
    hf_a = AutoModelForCausalLM.from_pretrained(tiny_with_tokenizer, dtype=torch.float32).eval()
    hf_b = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()

    r = _cli(
        "eval",
        "ppl",
        "--model",
        out,
        "--data",
        data,
        "--seq-len",
        "64",
        "--max-tokens",
        "256",
        "--output",
        tmp_path / "ppl.json",
    )
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "ppl.json").read_text())
    assert res["predicted_tokens"] == 4 * 63 and res["windows"] == 4
    assert res["perplexity"] == pytest.approx(hf_guide_perplexity(hf_b, ids[None], 64), rel=1e-4)

    r = _cli(
        "eval",
        "compare",
        tiny_with_tokenizer,
        out,
        "--data",
        data,
        "--seq-len",
        "64",
        "--max-tokens",
        "128",
        "--output",
        tmp_path / "cmp.json",
    )
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "cmp.json").read_text())
    kl = agree = 0.0
    for b in (0, 64):  # two windows of 64 tokens, 63 predictions each
        with torch.no_grad():
            la = F.log_softmax(hf_a(ids[None, b : b + 64]).logits[0, :-1], -1)
            lb = F.log_softmax(hf_b(ids[None, b : b + 64]).logits[0, :-1], -1)
        kl += F.kl_div(lb, la, log_target=True, reduction="sum").item()  # KL(P_a || P_b)
        agree += (la.argmax(-1) == lb.argmax(-1)).sum().item()
    # (rel 1e-4: KL(P_b || P_a) is 6e-4 away here)
    assert res["mean_kl_divergence_nats"] == pytest.approx(kl / 126, rel=1e-4) and kl > 0
    assert res["top1_agreement"] == pytest.approx(agree / 126, abs=1.01 / 126)  # at most one near-tie flips
    assert res["a"]["perplexity"] == pytest.approx(hf_guide_perplexity(hf_a, ids[None, :128], 64), rel=1e-4)
    assert res["b"]["perplexity"] == pytest.approx(hf_guide_perplexity(hf_b, ids[None, :128], 64), rel=1e-4)


def test_cli_gptq_runs_and_loads(tiny_with_tokenizer, tmp_path):
    out = tmp_path / "gptq"
    r = _cli(
        "quantize",
        "--model",
        tiny_with_tokenizer,
        "--method",
        "gptq",
        "--group-size",
        "32",
        "--act-order",
        "--calib-data",
        DATA_DIR / "tinyshakespeare.txt",
        "--calib-samples",
        "4",
        "--calib-seq-len",
        "64",
        "--output",
        out,
    )
    assert r.exit_code == 0, r.output
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    model = load_model(out)
    with torch.no_grad():
        assert torch.isfinite(model.compute_logits(model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None]))).all()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--method", "gptq"], "needs --calib-data"),
        (["--method", "int8", "--asymmetric"], "int8 is symmetric"),
        (["--method", "int4", "--group-size", "48"], "--group-size 48"),
        (["--method", "int4", "--act-order"], "--act-order applies to --method gptq"),
    ],
)
def test_cli_quantize_bad_options(tiny_with_tokenizer, tmp_path, args, message):
    r = _cli("quantize", "--model", tiny_with_tokenizer, "--output", tmp_path / "o", *args)
    assert isinstance(r.exception, BaigeError) and message in str(r.exception), r.output
    assert not (tmp_path / "o").exists()


def _calibrated_quantize(model, method: str, out, flag: str | None) -> tuple[dict, dict | None]:
    """``baige quantize --method METHOD`` (group 32, asymmetric, two 32-token calibration samples; ``flag``
    added when given) into ``out``: its weights' quantization_config entry and the report's ``clip_search``."""
    args = ["--method", method, "--group-size", "32", "--asymmetric", "--calib-data", DATA_DIR / "tinyshakespeare.txt"]
    args += ["--calib-samples", "2", "--calib-seq-len", "32", "--output", out] + ([flag] if flag else [])
    r = _cli("quantize", "--model", model, *args)
    assert r.exit_code == 0, r.output
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    return groups["group_0"]["weights"], json.loads((out / "quantization_report.json").read_text())["clip_search"]


@pytest.mark.parametrize("flag,observer", [(None, "mse"), ("--no-clip-search", "minmax")])
def test_cli_int4_clip_search_default_with_calib_data(tiny_with_tokenizer, tmp_path, flag, observer):
    weights, clip = _calibrated_quantize(tiny_with_tokenizer, "int4", tmp_path / "o", flag)
    assert weights["observer"] == observer
    if flag:
        assert clip is None
    else:
        assert clip["weighting"].startswith("mean squared input activation") and clip["calib_samples"] == 2
    assert "--clip-search" in _cli("quantize", "--help").output  # (80 columns cut --no-clip-search)


@pytest.mark.parametrize("flag", [None, "--clip-search", "--no-clip-search"])
def test_cli_gptq_clip_search_option(tiny_with_tokenizer, tmp_path, flag):
    from baige.runtime.quantize import GPTQ_CLIP_SEARCH_DEFAULT

    weights, clip = _calibrated_quantize(tiny_with_tokenizer, "gptq", tmp_path / "o", flag)
    on = GPTQ_CLIP_SEARCH_DEFAULT if flag is None else flag == "--clip-search"
    assert weights["observer"] == ("mse" if on else "minmax")
    if on:
        assert clip["weighting"].startswith("GPTQ Hessian diagonal") and clip["calib_samples"] == 2
    else:
        assert clip is None


def test_cli_quantize_refuses_nonempty_output(tiny_with_tokenizer, tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "keep.txt").write_text("x")
    r = _cli("quantize", "--model", tiny_with_tokenizer, "--method", "int8", "--output", tmp_path / "o")
    assert isinstance(r.exception, BaigeError) and "not empty" in str(r.exception)
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["keep.txt"]
