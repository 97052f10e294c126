"""`baige serve --enable-lora`'s app on a tiny model (uvicorn in a thread of the test, over its own
engine: no second interpreter to start), through the official `openai` client: /v1/models
lists the adapters under their base; a request's `model` picks its adapter (streaming and not, the
same tokens as the offline engine with that adapter); an unknown name is a 404; adapters loaded and
unloaded at run time while a request streams, which finishes unharmed; bad loads are 400s (the base
model's name among them), an unload of a name not loaded a 404, all in OpenAI's error shape."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from baige.errors import BaigeError
from baige.runtime.infer.llm import LLM
from baige.runtime.infer.lora import LoRARequest
from baige.runtime.infer.sampling import SamplingParams
from tests.tiny import make_checkpoint, make_lora_adapter, write_tiny_tokenizer

PROMPT = [5, 17, 33, 2, 91, 40, 12, 7, 150, 3]
ENGINE = dict(max_model_len=256, max_num_seqs=8, block_size=4, kv_cache_memory=4_000_000)
LONG = 240  # tokens of the request that streams while adapters come and go


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    base = write_tiny_tokenizer(make_checkpoint(root / "base", "llama", seed=4))
    return {
        "base": base,
        "sql": make_lora_adapter(base, root / "sql", 2, ["q_proj", "v_proj"], seed=31),
        "chat": make_lora_adapter(base, root / "chat", 5, ["o_proj", "down_proj", "up_proj"], seed=32),
        "code": make_lora_adapter(base, root / "code", 8, ["q_proj", "k_proj"], seed=33),
    }


def _words(ids: list[int]) -> list[str]:
    return [f"t{i}" for i in ids]


@contextmanager
def serving(engine, name: str):
    """The served app of ``engine`` under ``name`` on a free port; yields its base URL."""
    import uvicorn

    from baige.runtime.infer.async_engine import AsyncEngine
    from baige.runtime.server.app import build_app, listen

    sock = listen("127.0.0.1", 0)
    driver = AsyncEngine(engine)
    server = uvicorn.Server(uvicorn.Config(build_app(driver, name), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.05)
            assert thread.is_alive()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        driver.shutdown()
        sock.close()


def test_adapters_through_the_openai_client(dirs, monkeypatch):
    from openai import NotFoundError, OpenAI

    llm = LLM(str(dirs["base"]), enable_lora=True, max_loras=2, max_lora_rank=5, dtype="float32", **ENGINE)
    names = [None, "sql", "chat"]
    want = {
        n: llm.generate(
            PROMPT,
            SamplingParams(temperature=0, max_tokens=LONG if n == "sql" else 12, ignore_eos=True),
            lora_request=LoRARequest(n, 1, str(dirs[n])) if n else None,
        )[0]
        .outputs[0]
        .token_ids
        for n in names
    }
    assert len({str(v[:12]) for v in want.values()}) == 3  # the adapters change the tokens
    llm.engine.unload_lora_adapter("chat")  # loaded again at run time below
    # 10 ms per engine step while serving: the streamed request stays in flight for >= 2.4 s however
    # fast the host decodes, so the unload below meets it running (the admin calls take milliseconds)
    real_step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda *a, **k: time.sleep(0.01) or real_step(*a, **k))
    with serving(llm.engine, "tiny") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        listed = {m.id: m for m in client.models.list().data}
        assert list(listed) == ["tiny", "sql"] and listed["sql"].parent == "tiny" and listed["tiny"].parent is None
        extra = {"ignore_eos": True}
        stream = client.completions.create(
            model="sql", prompt=PROMPT, max_tokens=LONG, temperature=0, stream=True, extra_body=extra
        )
        pieces = [next(iter(stream)).choices[0].text]  # in flight from here on
        post = lambda path, body: httpx.post(f"{url}/v1/{path}", json=body, timeout=30)  # noqa: E731
        assert post("load_lora_adapter", {"lora_name": "chat", "lora_path": str(dirs["chat"])}).status_code == 200
        unload = post("unload_lora_adapter", {"lora_name": "sql"})  # refused while the stream runs
        assert unload.status_code == 400 and "in use" in unload.json()["error"]["message"], unload.text
        bad = post("load_lora_adapter", {"lora_name": "code", "lora_path": str(dirs["code"])})
        assert bad.status_code == 400 and "rank 8 exceeds --max-lora-rank 5" in bad.json()["error"]["message"]
        assert post("load_lora_adapter", {"lora_name": "sql", "lora_path": str(dirs["sql"])}).status_code == 400
        refused = [  # every refusal in OpenAI's error shape, naming the field at fault
            (post("load_lora_adapter", {"lora_name": "tiny", "lora_path": str(dirs["chat"])}), 400, "lora_name"),
            (post("load_lora_adapter", {"lora_name": "", "lora_path": str(dirs["chat"])}), 400, "lora_name"),
            (post("load_lora_adapter", {"lora_name": "x", "lora_path": str(dirs["base"] / "nope")}), 400, None),
            (post("load_lora_adapter", {"lora_name": "x"}), 400, "lora_path"),
            (post("unload_lora_adapter", {"lora_name": "nope"}), 404, "lora_name"),
            (httpx.post(f"{url}/v1/load_lora_adapter", content=b"{", timeout=30), 400, None),
        ]
        for r, status, param in refused:
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"] and "\n" not in err["message"]
            assert param is None or err["param"] == param, err
        assert "other than the base model's" in refused[0][0].json()["error"]["message"]
        assert refused[4][0].json()["error"]["code"] == "model_not_found"
        for n in names:  # the base and both adapters, one batch with the stream
            r = client.completions.create(
                model=n or "tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body=extra
            )
            assert r.model == (n or "tiny") and r.choices[0].text.split() == _words(want[n][:12]), n
        pieces += [c.choices[0].text for c in stream]
        assert "".join(pieces).split() == _words(want["sql"])  # unharmed by the loads and unloads around it
        assert post("unload_lora_adapter", {"lora_name": "sql"}).status_code == 200
        assert post("unload_lora_adapter", {"lora_name": "sql"}).status_code == 404
        with pytest.raises(NotFoundError) as e:
            client.completions.create(model="sql", prompt=PROMPT, max_tokens=2)
        assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
        assert [m.id for m in client.models.list().data] == ["tiny", "chat"]


def test_a_request_never_loads_an_adapter_the_server_unloaded(dirs):
    """The race a tester found: a completion checks its adapter, the adapter is unloaded before the
    engine adds the request, and the request used to load it again from its old path (the unload
    undone, a reload under that name refused). Now the request is a 404 and the unload stays."""
    import asyncio

    from baige.runtime.infer.async_engine import AsyncEngine
    from baige.runtime.infer.lora import LoRANotFound
    from baige.runtime.server.app import build_app

    llm = LLM(str(dirs["base"]), enable_lora=True, max_loras=2, max_lora_rank=5, dtype="float32", **ENGINE)
    llm.engine.lora.load(LoRARequest("sql", 1, str(dirs["sql"])))
    driver = AsyncEngine(llm.engine)
    try:
        st = build_app(driver, "tiny").state.baige
        request = st.lora_request("sql")  # the route's check, while "sql" is loaded
        asyncio.run(driver.unload_lora_adapter("sql"))  # then the unload

        async def first():
            return await anext(driver.generate(PROMPT, SamplingParams(max_tokens=2), lora_request=request))

        with pytest.raises(LoRANotFound, match="'sql' is not loaded"):
            asyncio.run(first())
        assert "sql" not in llm.engine.lora.loaded
    finally:
        driver.shutdown()
    # offline, on an engine no loop thread steps: one name with another directory is an error, not the
    # first adapter's weights
    llm = LLM(str(dirs["base"]), enable_lora=True, max_loras=2, max_lora_rank=5, dtype="float32", **ENGINE)
    llm.engine.lora.load(LoRARequest("sql", 1, str(dirs["sql"])))
    with pytest.raises(BaigeError, match=r"'sql' is loaded from .*sql, not .*chat: unload it first"):
        llm.generate(PROMPT, SamplingParams(max_tokens=2), lora_request=LoRARequest("sql", 2, str(dirs["chat"])))
    assert (
        llm.generate(
            PROMPT,
            SamplingParams(max_tokens=2),  # the same directory spelled differently
            lora_request=LoRARequest("sql", 3, str(dirs["sql"]) + "/"),
        )[0]
        .outputs[0]
        .token_ids
    )
