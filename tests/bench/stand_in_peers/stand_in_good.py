"""A stand-in peer of `bench compare` (tests/bench/test_bench_compare_peers.py): converts by writing a
1000-byte file, logs every call (format, what, tokens) beside it, and never fails."""

import json
from pathlib import Path

from baige.runtime.bench.peers import converted, tree_bytes

REQUIRES = ("json",)


def formats(variants):
    return ("int8", "int8_float32") if "int8" in variants else ("int8",)


class Runner:
    def __init__(self, path: Path, fmt: str, threads: int):
        self.log, self.fmt = path.parent / "calls.jsonl", fmt
        self.weight_bytes, self.kv_bytes = tree_bytes(path, (".bin",)), 2
        self.settings = f"stand-in {fmt}, {threads} thread(s)"

    def _note(self, what, *args):
        with open(self.log, "a") as f:
            f.write(json.dumps([self.fmt, what, *args]) + "\n")

    def decode(self, prompt, n):
        self._note("decode", len(prompt), n)

    def prefill(self, prompt):
        self._note("prefill", len(prompt))

    def batch(self, requests, batch_size):
        self._note("batch", len(requests), batch_size)


def open_row(model_dir, fmt, cache, threads, options):
    path = converted(cache, "stand-in", model_dir, "int8", lambda out: (out / "w.bin").write_bytes(b"\0" * 1000))
    return Runner(path, fmt, threads)
