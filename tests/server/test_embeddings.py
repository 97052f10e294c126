"""`baige serve --runner pooling` with the official openai client: ``client.embeddings.create`` vectors equal
transformers' pooled hidden states of the same tiny checkpoint (fp32, within 1e-5) for a batch of
mixed-length texts and for token-id inputs, base64 and float encodings, ``dimensions`` (Matryoshka
truncation, then normalisation), usage; the generate runner refuses embeddings and the pooling runner
refuses completions."""

import json

import httpx
import openai
import pytest
import torch
from server_utils import launched
from tiny import make_checkpoint, write_tiny_tokenizer

NAME = "tiny-embed"
TEXTS = ["t5 t6 t7", " ".join(f"t{i}" for i in range(1, 50)), "t9", " ".join(f"t{i}" for i in range(100, 130))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = write_tiny_tokenizer(make_checkpoint(tmp_path_factory.mktemp("embed"), "llama"))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "is_matryoshka": True}))
    return d


@pytest.fixture(scope="module")
def server(checkpoint):
    args = ("--runner", "pooling", "--dtype", "float32", "--served-model-name", NAME, "--kv-cache-memory", "8MB")
    # a small step budget: the long inputs are prefilled in chunks, batched with the short ones
    with launched(
        checkpoint, *args, "--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--log-level", "warning"
    ) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """(token ids, last-token hidden state) of each text, from transformers' AutoModel in fp32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    for text in TEXTS:
        ids = [int(w[1:]) for w in text.split()]  # the tiny tokenizer: word t{i} is token i
        with torch.no_grad():
            out.append((ids, model(torch.tensor([ids])).last_hidden_state[0, -1]))
    return out


def close(got, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, atol=1e-5, rtol=0)


def test_embeddings_equal_transformers(client, reference):
    resp = client.embeddings.create(model=NAME, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in resp.data] == list(range(len(TEXTS)))
    for d, (_, h) in zip(resp.data, reference):
        close(d.embedding, torch.nn.functional.normalize(h, dim=0))
    n = sum(len(ids) for ids, _ in reference)
    assert (resp.usage.prompt_tokens, resp.usage.total_tokens, resp.model) == (n, n, NAME)
    floats = client.embeddings.create(model=NAME, input=TEXTS[1], encoding_format="float")
    close(floats.data[0].embedding, torch.nn.functional.normalize(reference[1][1], dim=0))


def test_token_id_inputs(client, reference):
    ids = [ids for ids, _ in reference]
    resp = client.embeddings.create(model=NAME, input=ids)
    for d, (_, h) in zip(resp.data, reference):
        close(d.embedding, torch.nn.functional.normalize(h, dim=0))
    one = client.embeddings.create(model=NAME, input=ids[0])
    close(one.data[0].embedding, torch.nn.functional.normalize(reference[0][1], dim=0))


def test_vllm_fields(server, checkpoint, reference):
    """vLLM's ``truncate_prompt_tokens`` (the last k tokens) and ``normalize: false`` (the raw hidden state)."""
    ids, _ = reference[1]
    body = {"input": [ids, ids[-5:]], "truncate_prompt_tokens": 5, "normalize": False}
    r = httpx.post(f"{server}/v1/embeddings", json=body).json()
    assert r["usage"]["prompt_tokens"] == 10
    from transformers import AutoModel

    model = AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([ids[-5:]])).last_hidden_state[0, -1]
    for d in r["data"]:
        close(d["embedding"], want)


def test_dimensions_truncate_then_normalise(client, reference):
    resp = client.embeddings.create(model=NAME, input=TEXTS, dimensions=16)
    for d, (_, h) in zip(resp.data, reference):
        assert len(d.embedding) == 16
        close(d.embedding, torch.nn.functional.normalize(h[:16], dim=0))
    with pytest.raises(openai.BadRequestError, match="between 1 and 64"):
        client.embeddings.create(model=NAME, input="t1", dimensions=65)


def test_pooling_runner_refuses_generation(server):
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "t1 t2", "max_tokens": 2})
    assert r.status_code == 400 and "pooling runner" in r.json()["error"]["message"], r.text
    # chat and responses: the runner is named, not the chat template the embedding model lacks
    chat = {"messages": [{"role": "user", "content": "t1"}]}
    for path, body in (("/v1/chat/completions", chat), ("/v1/responses", {"input": "t1"})):
        r = httpx.post(f"{server}{path}", json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and "pooling runner" in err["message"] and err["param"] == "model", r.text
        assert "chat template" not in err["message"]


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"input": "t1", "truncate_prompt_tokens": "MAX+1"}, "truncate_prompt_tokens", "larger than max_model_len"),
        ({"input": "t1", "truncate_prompt_tokens": 10**9}, "truncate_prompt_tokens", "larger than max_model_len"),
        ({"messages": [{"role": "user", "content": "t1"}]}, "messages", "chat-style"),
        ({"input": "t1", "messages": [{"role": "user", "content": "t1"}]}, "messages", "chat-style"),
    ],
)
def test_pooling_bad_input_is_named(server, body, param, needle):
    max_len = httpx.post(f"{server}/tokenize", json={"prompt": "t1"}).json()["max_model_len"]
    if body.get("truncate_prompt_tokens") == "MAX+1":
        body = {**body, "truncate_prompt_tokens": max_len + 1}
    r = httpx.post(f"{server}/v1/embeddings", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and needle in err["message"], r.text
    if param == "truncate_prompt_tokens":
        assert f"({body['truncate_prompt_tokens']})" in err["message"] and f"({max_len})" in err["message"]
    # the largest truncation there is: the whole context
    ok = httpx.post(f"{server}/v1/embeddings", json={"input": "t1 t2", "truncate_prompt_tokens": max_len})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 2


def test_generate_runner_refuses_embeddings(checkpoint):
    with launched(checkpoint, "--runner", "generate", "--kv-cache-memory", "8MB", "--log-level", "warning") as (url, _):
        r = httpx.post(f"{url}/v1/embeddings", json={"input": "t1"})
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "model"


def test_metrics_count_embedding_requests(server, client, reference):
    def scrape() -> dict[tuple, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{server}/metrics").text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    labels = (("engine", "0"), ("model_name", NAME))
    before = scrape()
    client.embeddings.create(model=NAME, input=TEXTS)
    after = scrape()

    def delta(name: str, extra: tuple = ()) -> float:
        key = (name, tuple(sorted(labels + extra)))
        return after[key] - before.get(key, 0.0)

    n = sum(len(ids) for ids, _ in reference)
    assert delta("vllm:request_success_total", (("finished_reason", "stop"),)) == len(TEXTS)
    assert delta("vllm:prompt_tokens_total") == n and delta("vllm:request_prompt_tokens_sum") == n
    assert delta("vllm:e2e_request_latency_seconds_count") == len(TEXTS)
    assert delta("vllm:request_queue_time_seconds_count") == len(TEXTS)
    assert delta("vllm:generation_tokens_total") == 0
