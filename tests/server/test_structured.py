"""Structured outputs through `baige serve` and the official openai client on the embedded model:
`chat.completions.parse` with a nested pydantic schema at temperature 1.0 (every answer parses and
validates, streamed too), json_object, choice and regex over 50 samples each, bad constraints as
400s, and free requests unchanged beside constrained ones in one batch."""

import asyncio
import json
import re
from enum import Enum

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from server_utils import launched, parse_metrics
from train_utils import tiny_model

KEY = "so-key"


class Kind(str, Enum):
    capital = "capital"
    village = "village"
    port = "port"


class Landmark(BaseModel):
    name: str = Field(max_length=40)
    year_built: int | None = Field(None, ge=0, le=2100)


class City(BaseModel):
    name: str = Field(max_length=40)
    kind: Kind
    population: int = Field(ge=0, le=50_000_000)
    landmarks: list[Landmark] = Field(max_length=3)
    nickname: str | None = Field(None, max_length=30)


@pytest.fixture(scope="module")
def url(embedded_dir):
    with launched(
        embedded_dir,
        "--served-model-name",
        "x",
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "200MB",
        "--max-num-seqs",
        "32",
        "--log-level",
        "warning",
        api_key=KEY,
    ) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600) as c:
        yield c


ASK = [{"role": "user", "content": "Describe the city of Paris as JSON."}]


def test_parse_nested_schema_20_of_20_at_temperature_1(client):
    r = client.chat.completions.parse(
        model="x", messages=ASK, response_format=City, temperature=1.0, n=20, max_tokens=400, seed=1
    )
    answers = r.choices
    assert len(answers) == 20
    for c in answers:
        assert c.finish_reason == "stop", c.message.content
        assert isinstance(c.message.parsed, City)  # parsed and validated by the openai client
        City.model_validate_json(c.message.content)


def test_streamed_json_schema_joins_to_valid_json(client):
    schema = {"name": "city", "schema": City.model_json_schema(), "strict": True}
    stream = client.chat.completions.create(
        model="x",
        messages=ASK,
        temperature=1.0,
        max_tokens=400,
        stream=True,
        seed=3,
        response_format={"type": "json_schema", "json_schema": schema},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    City.model_validate_json(text)


def test_json_object_is_valid_json_every_time(client):
    """Free-form JSON: at high temperature the 135M model can write one string forever (then it
    stops at max_tokens, incomplete, as OpenAI documents for "length"); at 0.5 it answers."""
    ask = [{"role": "user", "content": "Give a JSON object with the keys name and age for a person."}]
    r = client.chat.completions.create(
        model="x", messages=ask, temperature=0.5, n=8, max_tokens=200, seed=4, response_format={"type": "json_object"}
    )
    for c in r.choices:
        assert c.finish_reason == "stop"
        assert isinstance(json.loads(c.message.content), dict)


def test_choice_over_50_samples(client):
    options = ["red", "green", "blue", "dark purple"]
    r = client.completions.create(
        model="x",
        prompt="My favourite colour is",
        temperature=1.0,
        n=50,
        max_tokens=10,
        seed=5,
        extra_body={"structured_outputs": {"choice": options}},
    )
    texts = [c.text for c in r.choices]
    assert len(texts) == 50 and all(t in options for t in texts), texts
    assert len(set(texts)) > 1  # sampling really samples among the choices


def test_regex_over_50_samples(client):
    pattern = r"[A-Z][a-z]{1,8} [0-9]{2,4}"
    r = client.completions.create(
        model="x",
        prompt="Name and number:",
        temperature=1.0,
        n=50,
        max_tokens=20,
        seed=6,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert all(re.fullmatch(pattern, c.text) and c.finish_reason == "stop" for c in r.choices), [
        c.text for c in r.choices
    ]


def test_choice_past_the_parsers_row_limit(http):
    """2500 choices: llguidance caps a parser row at 2000 items, so choices are one lexeme."""
    words = [f"item{i}" for i in range(2500)]
    r = http.post(
        "/v1/completions",
        json={
            "prompt": "Pick one:",
            "max_tokens": 8,
            "temperature": 1.0,
            "n": 5,
            "seed": 2,
            "structured_outputs": {"choice": words},
        },
    )
    assert r.status_code == 200, r.text
    assert all(c["text"] in words and c["finish_reason"] == "stop" for c in r.json()["choices"]), r.text


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, "nonsense"),
        ({"structured_outputs": {"regex": "(ab"}}, "regex"),
        ({"structured_outputs": {"grammar": "start: ???"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"structured_outputs": {}}, "exactly one"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(http, body, needle):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] in ("structured_outputs", "response_format"), err
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_free_requests_unchanged_beside_constrained_ones(url, http):
    free = [
        {"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        for p in ("The capital of France is", "def add(a, b):", "Once upon a time")
    ]
    solo = [http.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in free]
    constrained = [
        {
            "prompt": "Answer:",
            "max_tokens": 30,
            "temperature": 1.0,
            "seed": i,
            "structured_outputs": {"regex": "(yes|no)( because [a-z ]{1,20})?"},
        }
        for i in range(4)
    ]

    async def main():
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json=b) for b in free + constrained))
        return [r.json()["choices"][0]["text"] for r in rs]

    texts = asyncio.run(main())
    assert texts[:3] == solo
    assert all(re.fullmatch("(yes|no)( because [a-z ]{1,20})?", t) for t in texts[3:]), texts[3:]


def _metrics(http) -> dict[str, float]:
    return parse_metrics(http.get("/metrics").text, "baige:")


def test_structured_metrics_count_requests_compiles_and_masked_tokens(http):
    before = _metrics(http)
    regex = "x{3}"  # one compile (or a cache hit), 3 masked tokens at most ("xxx" may tokenize in fewer)
    for _ in range(2):
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 8, "structured_outputs": {"regex": regex}})
        assert r.json()["choices"][0]["text"] == "xxx"
    after = _metrics(http)
    assert after["baige:structured_output_requests"] - before["baige:structured_output_requests"] == 2
    assert after["baige:grammar_compiles"] - before["baige:grammar_compiles"] == 1  # the second is a cache hit
    n = after["baige:structured_masked_tokens"] - before["baige:structured_masked_tokens"]
    assert 2 <= n <= 6


def test_a_tokenizer_the_grammar_engine_cannot_read_is_a_400(tmp_path):
    """tests/train_utils.py's character tokenizer (a Fuse decoder, which llguidance cannot read): every
    constrained request is a 400 naming the field that asked for the constraint, never a 500; free
    requests still run."""
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    cases = [
        ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_object"}}, "response_format"),
        (
            "/v1/responses",
            {"input": "x", "tools": [tool], "tool_choice": {"type": "function", "name": "f"}},
            "tool_choice",
        ),
        ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_object"}}}, "text"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ]
    with launched(tiny_model(tmp_path), "--max-model-len", "128", "--kv-cache-memory", "10MB") as (url, _):
        for path, body, param in cases:
            r = httpx.post(f"{url}{path}", json={**body, "max_tokens": 2} if "messages" in body else body, timeout=120)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param, err
            assert "not supported for this model's tokenizer" in err["message"], err
        free = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=120)
        assert free.status_code == 200 and free.json()["usage"]["completion_tokens"] == 2, free.text
