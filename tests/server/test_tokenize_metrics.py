"""`baige serve` on the embedded model: ``/tokenize`` then ``/detokenize`` round-trip text and chat messages
(ids equal transformers' tokenizer's and chat template's), ``/version``, and a ``/metrics`` scrape that holds
every ``vllm:`` metric of vLLM's documented list with its type, labels and counted values."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import launched

import baige

NAME = "smol"
MAX_LEN = 256
TEXT = "Hello, world! Émile's café — naïve façade; 1 + 1 = 2.\n\tTabs and  spaces."
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3 + 3?"},
]

# vLLM v1's metrics as its /metrics exposes them (docs/usage/metrics.md; vllm/v1/metrics/loggers.py): the
# sample name (counters carry `_total`) and the Prometheus type. Every one carries model_name and engine.
VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:num_preemptions_total": "counter",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}


@pytest.fixture(scope="module")
def http(embedded_dir):
    args = ("--served-model-name", NAME, "--max-model-len", str(MAX_LEN), "--kv-cache-memory", "60MB")
    with launched(embedded_dir, *args, "--log-level", "warning") as (url, _):
        with httpx.Client(base_url=url, timeout=120) as c:
            yield c


@pytest.fixture(scope="module")
def hf_tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir)


def test_tokenize_detokenize_text(http, hf_tokenizer):
    r = http.post("/tokenize", json={"prompt": TEXT, "return_token_strs": True}).json()
    ids = hf_tokenizer(TEXT)["input_ids"]
    assert r == {
        "count": len(ids),
        "max_model_len": MAX_LEN,
        "tokens": ids,
        "token_strs": hf_tokenizer.convert_ids_to_tokens(ids),
    }
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": TEXT}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tokenize_detokenize_chat(http, hf_tokenizer, add_generation_prompt):
    body = {"model": NAME, "messages": MESSAGES, "add_generation_prompt": add_generation_prompt}
    r = http.post("/tokenize", json=body).json()
    text = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]  # HF's apply_chat_template(tokenize=True)
    assert (r["tokens"], r["count"], r["token_strs"]) == (ids, len(ids), None)
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}


def test_version(http):
    assert http.get("/version").json() == {"version": baige.__version__}


def scrape(http) -> dict:
    return {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}


def test_vllm_metrics(http):
    before = scrape(http)
    prompt = http.post("/tokenize", json={"prompt": "Count to ten:"}).json()["tokens"]
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5, "n": 2, "ignore_eos": True})
    assert r.status_code == 200
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "ignore_eos": True, "stream": True})
    assert r.status_code == 200
    families = scrape(http)
    samples = {s.name: (f.type, s) for f in families.values() for s in f.samples}
    for name, kind in VLLM_METRICS.items():
        probe = name + "_count" if kind == "histogram" else name
        assert probe in samples, f"{name} missing from /metrics"
        assert samples[probe][0] == kind, (name, samples[probe][0])
        assert {"model_name": NAME, "engine": "0"}.items() <= samples[probe][1].labels.items(), name

    def value(name: str, fams: dict, **labels) -> float:
        return sum(
            s.value for f in fams.values() for s in f.samples if s.name == name and labels.items() <= s.labels.items()
        )

    def delta(name: str, **labels) -> float:
        return value(name, families, **labels) - value(name, before, **labels)

    assert delta("vllm:prompt_tokens_total") == 2 * len(prompt)
    assert delta("vllm:generation_tokens_total") == 2 * 5 + 3
    assert delta("vllm:request_success_total", finished_reason="length") == 3  # two sequences, then one
    assert delta("vllm:request_params_n_count") == 2 and delta("vllm:request_params_n_sum") == 2 + 1
    assert delta("vllm:request_params_max_tokens_sum") == 5 + 3
    assert delta("vllm:request_generation_tokens_sum") == 2 * 5 + 3
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:request_decode_time_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 4 + 2  # a step per token after the first
    assert delta("vllm:prefix_cache_queries_total") >= 2 * len(prompt)
    assert value("vllm:num_requests_running", families) == 0
