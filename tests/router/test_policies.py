"""The router's policies and load parsing, as plain Python: the prefix key, the consistent-hash ring
(a removed backend moves only its own keys), round robin, least load, the prefix policy's balance
threshold, and reading running + waiting requests from baige's and vLLM's metrics."""

from __future__ import annotations

from baige.runtime.router.backends import parse_load
from baige.runtime.router.policies import HashRing, LeastLoad, Prefix, RoundRobin, _h64, prompt_prefix

URLS = ["http://a:1", "http://b:1", "http://c:1", "http://d:1"]


def test_prompt_prefix_keys_on_the_leading_characters():
    long = "x" * 300
    assert prompt_prefix({"model": "m", "prompt": long + "one"}) == prompt_prefix(
        {"model": "m", "prompt": long + "two"}
    )
    assert prompt_prefix({"model": "m", "prompt": "a" + long}) != prompt_prefix({"model": "m", "prompt": "b" + long})
    assert prompt_prefix({"model": "m", "prompt": "abc"}, prefix_chars=2) == b"m\x1dab"
    assert prompt_prefix({"model": "other", "prompt": "abc"}) != prompt_prefix({"model": "m", "prompt": "abc"})
    # a batch keys on its first prompt; token ids count 4 characters each
    assert prompt_prefix({"model": "m", "prompt": ["abc", "zzz"]}) == prompt_prefix({"model": "m", "prompt": "abc"})
    assert prompt_prefix({"model": "m", "prompt": list(range(100))}, prefix_chars=12) == b"m\x1d0 1 2"
    assert prompt_prefix({"model": "m", "prompt": [list(range(5))]}, prefix_chars=8) == b"m\x1d0 1"
    # chat: roles and contents in order (parts by their text), the rest of the request left out
    sys = {"role": "system", "content": "s" * 300}
    a = {"model": "m", "messages": [sys, {"role": "user", "content": "q1"}], "temperature": 0}
    b = {"model": "m", "messages": [sys, {"role": "user", "content": [{"type": "text", "text": "q2"}]}], "n": 2}
    assert prompt_prefix(a) == prompt_prefix(b)
    assert prompt_prefix(a, 10) == b"m\x1d\x1esystem\x1fss"  # 10 characters: separator, role, separator, 2
    assert prompt_prefix(
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    ) == (prompt_prefix({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    assert prompt_prefix(None) == b"" and prompt_prefix([1, 2]) == b""


def test_hash_is_sha256_so_every_router_agrees():
    # SHA-256("abc") = ba7816bf 8f01cfea ... (FIPS 180-2, appendix B.1)
    assert _h64(b"abc") == 0xBA7816BF8F01CFEA


def test_ring_moves_only_the_removed_backends_keys():
    full, without_d = HashRing(URLS), HashRing(URLS[:3])
    keys = [f"key-{i}".encode() for i in range(2000)]
    firsts = {u: 0 for u in URLS}
    for k in keys:
        walk = full.walk(k)
        assert sorted(walk) == sorted(URLS)  # every backend once: the retry order
        firsts[walk[0]] += 1
        expected = walk[0] if walk[0] != "http://d:1" else walk[1]
        assert without_d.walk(k)[0] == expected
    assert all(n > 2000 / 4 / 2 for n in firsts.values()), firsts  # 64 points each: no backend starved


def test_round_robin_and_least_load():
    rr = RoundRobin()
    assert [rr.order(URLS[:3], {}, b"")[0] for _ in range(4)] == [
        "http://a:1",
        "http://b:1",
        "http://c:1",
        "http://a:1",
    ]
    assert rr.order(URLS[:3], {}, b"") == ["http://b:1", "http://c:1", "http://a:1"]
    assert rr.order([], {}, b"") == []
    ll = LeastLoad()
    loads = {"http://a:1": 3.0, "http://b:1": 0.0, "http://c:1": 1.0}
    assert ll.order(URLS[:3], loads, b"") == ["http://b:1", "http://c:1", "http://a:1"]
    idle = {u: 0.0 for u in URLS[:3]}
    assert [ll.order(URLS[:3], idle, b"")[0] for _ in range(3)] == ["http://b:1", "http://c:1", "http://a:1"]


def test_prefix_policy_follows_the_ring_and_balances_a_hot_backend():
    p = Prefix(URLS, balance_abs_threshold=4)
    key = prompt_prefix({"model": "m", "prompt": "a shared system prompt"})
    walk = HashRing(URLS).walk(key)
    assert p.order(URLS, {}, key) == walk
    healthy = [u for u in URLS if u != walk[0]]  # its backend down: the next on the ring
    assert p.order(healthy, {}, key) == walk[1:]
    loads = {u: 0.0 for u in URLS}
    loads[walk[0]] = 4.0  # at the threshold: still the prefix's backend
    assert p.order(URLS, loads, key)[0] == walk[0]
    loads[walk[0]] = 5.0  # over it: least load
    assert p.order(URLS, loads, key)[0] != walk[0] and p.order(URLS, loads, key)[-1] == walk[0]
    assert p.order([], {}, key) == []


def test_parse_load():
    baige = "# HELP x\nbaige:num_requests_running 2.0\nbaige:num_requests_waiting 3.0\nbaige:kv_cache_blocks_used 9\n"
    assert parse_load(baige) == 5.0
    vllm = (
        'vllm:num_requests_running{model_name="a",engine="0"} 1.0\n'
        'vllm:num_requests_running{model_name="a",engine="1"} 4.0\n'
        'vllm:num_requests_waiting{model_name="a",engine="0"} 2.0\n'
    )
    assert parse_load(vllm) == 7.0
    assert parse_load(vllm + baige) == 7.0  # both exported: vLLM's names, counted once
    assert parse_load("baige:num_requests_running 1\n") == 1.0
    assert parse_load("up 1\n") is None and parse_load("") is None


def test_pooled_connections_expire_before_the_backends_close_them():
    # a pooled connection reused just as the backend's uvicorn closes it (its keep-alive timeout, which
    # `baige serve` leaves at uvicorn's default) fails with ReadError and marks the backend down
    import uvicorn

    from baige.runtime.router.app import KEEPALIVE_EXPIRY_S

    assert 0 < KEEPALIVE_EXPIRY_S < uvicorn.Config(app=None).timeout_keep_alive
