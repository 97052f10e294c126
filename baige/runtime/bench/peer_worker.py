"""The child process of one ``baige bench compare`` peer row (:mod:`baige.runtime.bench.peers`).

Run as ``python peer_worker.py`` (by path, so that a Python without baige installed can run it) with a
``PeerJob`` as JSON on stdin. Prints one JSON line on stdout: ``{"decode": [s, ...], "prefill": [[s, ...]
per length], "throughput": [s, ...], "weight_bytes", "kv_bytes", "settings"}`` (seconds per round), or
``{"skipped": "<reason>"}`` when the peer refused the model (a RuntimeError or ValueError of its
``open_row``). Anything else (a crash, an exception) ends it non-zero, its last stderr line the reason.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    del sys.path[0]  # this file's directory: its modules (common, serve, ...) must not shadow top-level ones

import importlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def _seconds(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def time_runner(runner, job: dict) -> dict:
    """One warm-up decode, then ``job["repeats"]`` rounds of decode, prefill at each length and (with a
    batched API) the throughput requests; seconds per round."""
    prompt, n = job["decode_prompt"], job["output_len"]
    requests = [(list(p), m) for p, m in job["requests"]]
    runner.decode(prompt, n)
    out: dict = {"decode": [], "prefill": [[] for _ in job["prefill_prompts"]], "throughput": []}
    for _ in range(job["repeats"]):
        out["decode"].append(_seconds(runner.decode, prompt, n))
        for i, p in enumerate(job["prefill_prompts"]):
            out["prefill"][i].append(_seconds(runner.prefill, p))
        if runner.batch is not None:
            out["throughput"].append(_seconds(runner.batch, requests, job["batch_size"]))
    out.update(weight_bytes=runner.weight_bytes, kv_bytes=runner.kv_bytes, settings=runner.settings)
    return out


def main() -> None:
    job = json.loads(sys.stdin.read())
    sys.path[:0] = job["sys_path"]
    module = importlib.import_module(job["module"])
    try:
        runner = module.open_row(
            Path(job["model_dir"]), job["fmt"], Path(job["cache"]), job["threads"], job.get("options") or {}
        )
    except (RuntimeError, ValueError) as e:
        result = {"skipped": str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}
    else:
        result = time_runner(runner, job)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: a peer's native destructors cannot turn a result into a crash
