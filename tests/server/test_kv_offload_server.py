"""`baige serve --kv-offload-size --kv-offload-dir` on the embedded model: a prompt whose blocks a
second prompt evicted from a one-sequence pool comes back from the tier (its files on disk, the
hits on /metrics) and the reply is the same text."""

import httpx
import openai
from conftest import DATA_DIR

from tests.server_utils import launched, parse_metrics


def counters(url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{url}/metrics").text, "baige:kv_offload")


def test_serve_reloads_an_evicted_prefix_from_the_tier(embedded_dir, tmp_path):
    words = (DATA_DIR / "wikitext-2-raw-test.txt").read_text()[:20000].split()
    a, b = " ".join(words[:130]), " ".join(words[400:530])  # ~180 tokens each: most of the pool
    args = ["--max-model-len", "256", "--kv-cache-memory", "12MB", "--log-level", "warning"]
    with launched(embedded_dir, *args, "--kv-offload-size", "64MB", "--kv-offload-dir", str(tmp_path)) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

        def complete(prompt: str):
            return client.completions.create(model=str(embedded_dir), prompt=prompt, temperature=0, max_tokens=8)

        first = complete(a)
        complete(b)  # evicts a's blocks into the tier
        again = complete(a)
        stats = counters(url)
    assert again.choices[0].text == first.choices[0].text
    assert stats["baige:kv_offload_stores_total"] > 0 and stats["baige:kv_offload_hit_blocks_total"] > 0
    assert stats["baige:kv_offload_hit_tokens_total"] == 16 * stats["baige:kv_offload_hit_blocks_total"]
    assert stats["baige:kv_offload_corrupted_total"] == 0
    assert stats['baige:kv_offload_bytes_total{direction="load"}'] > 0
    assert len(list(tmp_path.glob("*/*.kv"))) == stats["baige:kv_offload_stores_total"]
