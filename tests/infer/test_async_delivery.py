"""AsyncEngine's delivery: the outputs of one engine step reach all their streams, in order, through one
wake-up of the server's event loop (not one per stream)."""

import asyncio

from tiny import make_checkpoint, write_tiny_tokenizer

from baige.runtime.config import EngineConfig
from baige.runtime.infer.async_engine import AsyncEngine
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.sampling import SamplingParams

STREAMS, TOKENS = 4, 6


def test_one_wakeup_per_step_for_every_stream(tmp_path):
    model_dir = write_tiny_tokenizer(make_checkpoint(tmp_path / "llama", "llama"))
    eng = Engine.from_config(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=64))
    per_step = []  # outputs of each step that produced any
    real_step = eng.step

    def step():
        outs = real_step()
        if outs:
            per_step.append(len(outs))
        return outs

    eng.step = step
    aeng = AsyncEngine(eng)
    try:

        async def main():
            loop = asyncio.get_running_loop()
            wakeups = []
            real_call = loop.call_soon_threadsafe

            def counting(callback, *args, **kw):
                wakeups.append(len(args[0]) if args and isinstance(args[0], list) else 1)
                return real_call(callback, *args, **kw)

            loop.call_soon_threadsafe = counting
            params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)

            async def collect(i):
                return [out async for out in aeng.generate([5 + i, 9, 13, 21], params)]

            streams = await asyncio.gather(*(collect(i) for i in range(STREAMS)))
            loop.call_soon_threadsafe = real_call
            return streams, wakeups

        streams, wakeups = asyncio.run(main())
    finally:
        aeng.shutdown()
    assert [len(s[-1].outputs[0].token_ids) for s in streams] == [TOKENS] * STREAMS
    assert all(s[-1].finished for s in streams)
    assert sum(per_step) == STREAMS * TOKENS  # one output per stream per token (no prefill-only steps)
    assert wakeups == per_step  # each step: one wake-up carrying all its outputs
    assert len(wakeups) < STREAMS * TOKENS  # the streams did share steps
