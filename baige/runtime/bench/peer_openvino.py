"""OpenVINO as a peer of ``baige bench compare`` (:mod:`baige.runtime.bench.peers`).

Conversion: optimum-intel's exporter (``optimum-cli export openvino --task text-generation-with-past
--weight-format int8|int4``; NNCF weight compression: int8 per output channel, int4 in groups of 128 (64 or
32 where 128 does not divide the widths: :func:`group_size`) with ``--ratio 1.0``, every matmul int4 but the
embedding and lm_head, which NNCF's default keeps int8). optimum-intel pins transformers and torch versions
of its own, so it is run from another Python when this one cannot import it
(``options["export_python"]``: ``baige bench compare --peer-venv``; ``scripts/setup.sh --with-peers`` makes
``.peers-venv``); the timing needs only ``openvino-genai``, which shares baige's environment.

Timing: OpenVINO GenAI on ``CPU`` with ``INFERENCE_NUM_THREADS`` = the run's threads and the latency
hint: ``LLMPipeline`` for batch-1 decode and prefill, ``ContinuousBatchingPipeline`` (paged KV cache,
each request its own output length) for the throughput requests all at once; greedy, EOS ignored.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from baige.runtime.bench.peers import conversion_dir, converted, run_tool, tree_bytes

REQUIRES = ("openvino", "openvino_genai")
FORMATS = ("int8", "int4")
KV_CACHE_GIB = 1  # ContinuousBatchingPipeline's KV cache (SchedulerConfig.cache_size, GB)


def formats(variants: tuple[str, ...]) -> tuple[str, ...]:
    """int8 and int4 (the peers of baige's int8 and int4 rows)."""
    return FORMATS


def group_size(model_dir: Path) -> int:
    """The int4 group: 128 (NNCF's default, OpenVINO's fastest), else the largest of 64 / 32 that divides every
    matmul's input width (``hidden_size``, ``intermediate_size``: SmolLM2-135M's 576 takes 64); NNCF refuses
    a group that does not divide a channel."""
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    widths = [cfg.get("hidden_size") or 0, cfg.get("intermediate_size") or 0]
    return next((g for g in (128, 64, 32) if all(w % g == 0 for w in widths)), 32)


def export_argv(model_dir: Path, fmt: str, out: Path, python: str) -> list[str]:
    """optimum-intel's export command line, run by ``python``."""
    argv = [python, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(model_dir)]
    argv += ["--task", "text-generation-with-past", "--weight-format", fmt]
    if fmt == "int4":
        argv += ["--group-size", str(group_size(model_dir)), "--ratio", "1.0"]
    return [*argv, str(out)]


def _export_python(options: dict) -> str:
    """The Python that runs optimum-intel: this one when it can, else ``options["export_python"]``.
    Raises RuntimeError when neither has it."""
    if importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.intel") is not None:
        return sys.executable
    python = options.get("export_python")
    if not python or not Path(python).is_file():
        raise RuntimeError(
            "optimum-intel is not installed here and no --peer-venv holds it (scripts/setup.sh --with-peers)"
        )
    return python


class Runner:
    def __init__(self, path: Path, threads: int) -> None:
        import openvino as ov
        import openvino_genai as og

        self.og, self.ov = og, ov
        self.props = {"INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"}
        self.path = path
        self.pipe = og.LLMPipeline(str(path), "CPU", **self.props)
        self.cb = None  # the ContinuousBatchingPipeline, made at the first batch
        core = ov.Core()
        kv, math = core.get_property("CPU", "KV_CACHE_PRECISION"), core.get_property("CPU", "INFERENCE_PRECISION_HINT")
        self.kv_bytes = kv.size  # bytes per cached element (u8 by default on x86)
        self.weight_bytes = tree_bytes(path, ("_model.bin",))
        self.settings = (
            f"INFERENCE_NUM_THREADS {threads}, PERFORMANCE_HINT LATENCY, KV cache {kv.get_type_name()}, "
            f"inference precision {math.get_type_name()}"
        )

    def _config(self, n: int):
        cfg = self.og.GenerationConfig()
        cfg.max_new_tokens, cfg.min_new_tokens, cfg.ignore_eos, cfg.do_sample = n, n, True, False
        return cfg

    def _ids(self, prompt: list[int]):
        import numpy as np

        return self.ov.Tensor(np.array([prompt], dtype=np.int64))  # (1, len)

    def decode(self, prompt: list[int], n: int) -> None:
        self.pipe.generate(self._ids(prompt), self._config(n))

    def prefill(self, prompt: list[int]) -> None:
        self.pipe.generate(self._ids(prompt), self._config(1))

    def batch(self, requests: list[tuple[list[int], int]], batch_size: int) -> None:
        if self.cb is None:
            sc = self.og.SchedulerConfig()
            sc.cache_size, sc.max_num_seqs = KV_CACHE_GIB, max(len(requests), 1)
            sc.max_num_batched_tokens, sc.dynamic_split_fuse = 2048, True
            self.cb = self.og.ContinuousBatchingPipeline(str(self.path), sc, "CPU", self.props)
        self.cb.generate([self._ids(p) for p, _ in requests], [self._config(n) for _, n in requests])


def open_row(model_dir: Path, fmt: str, cache: Path, threads: int, options: dict) -> Runner:
    """``model_dir`` exported at ``fmt`` (int8 / int4; cached), loaded on ``threads`` threads. Raises
    RuntimeError when the export is not cached and no Python here has optimum-intel, or the export fails."""
    if conversion_dir(cache, "openvino", model_dir, fmt).is_dir():
        python = sys.executable  # cached: nothing to export
    else:
        python = _export_python(options)

    def export(out: Path) -> None:
        run_tool(export_argv(model_dir, fmt, out, python), f"optimum-cli export openvino --weight-format {fmt}")

    return Runner(converted(cache, "openvino", model_dir, fmt, export), threads)
