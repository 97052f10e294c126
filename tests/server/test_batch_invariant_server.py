"""`baige serve --batch-invariant` on a tiny model: two concurrent completions report the same prompt and token
logprobs as one alone, and they equal the trainer's forward (``sequence_logprobs`` in batch-invariant mode) in
this process bit for bit -- which the default path does not (tests/infer/test_batch_invariant.py)."""

import asyncio

import httpx
import torch
from server_utils import launched
from tiny import make_checkpoint, write_tiny_tokenizer

from baige.runtime.model.logprobs import sequence_logprobs
from baige.runtime.weights.loader import load_model

PROMPTS = [[(7 * i + 3 * j) % 150 + 1 for j in range(n)] for i, n in enumerate([29, 11])]


def _body(ids: list[int]) -> dict:
    return {"prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "echo": True, "logprobs": 0}


def test_concurrent_requests_report_the_logprobs_of_one_alone_and_the_trainers(tmp_path):
    ckpt = write_tiny_tokenizer(make_checkpoint(tmp_path / "llama", "llama"))
    args = ["--batch-invariant", "--block-size", "4", "--kv-cache-memory", "4MB", "--max-model-len", "64"]
    with launched(ckpt, *args, "--log-level", "warning") as (url, _):
        with httpx.Client(base_url=url, timeout=120) as c:
            alone = c.post("/v1/completions", json=_body(PROMPTS[0])).json()["choices"][0]["logprobs"]

        async def both():
            async with httpx.AsyncClient(base_url=url, timeout=120) as c:
                rs = await asyncio.gather(*(c.post("/v1/completions", json=_body(p)) for p in PROMPTS))
            return [r.json()["choices"][0]["logprobs"] for r in rs]

        together = asyncio.run(both())
    assert together[0]["token_logprobs"] == alone["token_logprobs"] and together[0]["tokens"] == alone["tokens"]
    model = load_model(ckpt, "float32")
    for ids, lp in zip(PROMPTS, together):
        completion = [int(t.removeprefix("t")) for t in lp["tokens"][len(ids) :]]  # word-level: token i is "t{i}"
        with torch.no_grad():
            want = sequence_logprobs(model, torch.tensor(ids + completion), batch_invariant=True)
        got = torch.tensor(lp["token_logprobs"][1:], dtype=torch.float32)  # JSON floats of fp32 values: exact
        assert len(completion) == 5 and torch.equal(got, want)
