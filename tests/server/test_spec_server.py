"""`baige serve --speculative-config`: the openai client streams accepted runs, streamed and
non-streamed text agree, and /metrics carries the spec_decode counters (vLLM's names)."""

import json

import httpx
import openai
import pytest

from tests.server_utils import launched, parse_metrics

PASSAGE = (
    "The Tower of London is a historic castle on the north bank of the River Thames in central London. "
    "It was founded towards the end of 1066 as part of the Norman Conquest."
)
COPY = [{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}]


@pytest.fixture(scope="module")
def server(embedded_dir):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    with launched(
        embedded_dir,
        "--served-model-name",
        "smol",
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        "60MB",
        "--speculative-config",
        spec,
        "--log-level",
        "warning",
    ) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)


def counters(client) -> dict[str, float]:
    return parse_metrics(httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text, "baige:spec_decode")


def test_streamed_accepted_runs_equal_the_non_streamed_reply(client):
    before = counters(client)
    kw = dict(model="smol", messages=COPY, temperature=0, max_tokens=40)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    assert "".join(chunks) == whole and len(whole) > 40
    after = counters(client)
    drafts = after["baige:spec_decode_num_drafts_total"] - before.get("baige:spec_decode_num_drafts_total", 0)
    accepted = after["baige:spec_decode_num_accepted_tokens_total"] - before.get(
        "baige:spec_decode_num_accepted_tokens_total", 0
    )
    assert drafts > 0 and accepted > 0
    assert len([c for c in chunks if c]) < 40  # several tokens arrived in one chunk: accepted runs stream together
    proposed = after["baige:spec_decode_num_draft_tokens_total"]
    assert after["baige:spec_decode_acceptance_rate"] == pytest.approx(
        after["baige:spec_decode_num_accepted_tokens_total"] / proposed
    )
    per_pos = sum(v for k, v in after.items() if k.startswith("baige:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == after["baige:spec_decode_num_accepted_tokens_total"]


def test_completions_with_stop_and_n_under_speculation(client):
    out = client.completions.create(
        model="smol", prompt=PASSAGE + " " + PASSAGE[:60], temperature=0, max_tokens=30, n=2, stop=["Norman"]
    )
    texts = [c.text for c in out.choices]
    assert texts[0] == texts[1] and "Norman" not in texts[0]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
