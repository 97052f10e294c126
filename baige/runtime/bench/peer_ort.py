"""ONNX Runtime GenAI as a peer of ``baige bench compare`` (:mod:`baige.runtime.bench.peers`).

Conversion: its model builder (``python -m onnxruntime_genai.models.builder -p int4|int8 -e cpu``) with the
builder's CPU defaults: ``MatMulNBits`` weights in blocks of 32 with ``accuracy_level`` 4 (activations
quantized to int8 inside the matmul: its fastest CPU path), the lm_head included. Timing: ``og.Model``
with ``intra_op_num_threads`` = the run's threads (a config overlay); greedy, exactly the asked tokens
(``min_length = max_length``, which count the prompt). Batched generation: one ``Generator`` over
``batch_size`` prompts, right-padded with the model's ``pad_token_id`` (as its tokenizer's
``encode_batch`` pads), with one ``max_length`` (the longest prompt plus the longest asked output; only the
asked tokens count, as HF's static batching).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from baige.runtime.bench.peers import converted, run_tool, tree_bytes

REQUIRES = ("onnxruntime_genai", "onnx", "onnx_ir", "transformers")
FORMATS = ("int4", "int8")


def formats(variants: tuple[str, ...]) -> tuple[str, ...]:
    """int4 and int8 (the peers of baige's int4 and int8 rows)."""
    return FORMATS


def _convert(model_dir: Path, fmt: str, out: Path) -> None:
    argv = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir), "-o", str(out)]
    argv += ["-p", fmt, "-e", "cpu", "-c", str(out / "_hf_cache")]
    run_tool(argv, f"onnxruntime_genai's model builder (-p {fmt} -e cpu)")
    shutil.rmtree(out / "_hf_cache", ignore_errors=True)  # the builder's download cache (none from a directory)


class Runner:
    def __init__(self, path: Path, threads: int) -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(path))
        opts = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": opts}}}))
        self.model = og.Model(config)
        self.pad = json.loads((path / "genai_config.json").read_text())["model"]["pad_token_id"]
        self.pad = self.pad[0] if isinstance(self.pad, list) else self.pad
        self.weight_bytes = tree_bytes(path, (".onnx", ".onnx.data"))
        self.kv_bytes = 4  # the CPU model's float32 key/value cache
        self.settings = f"MatMulNBits block 32, accuracy_level 4, intra_op_num_threads {threads}"

    def _generate(self, prompts: list[list[int]], n: int) -> None:
        import numpy as np

        width = max(len(p) for p in prompts)
        ids = np.array([p + [self.pad] * (width - len(p)) for p in prompts], dtype=np.int32)  # (B, width)
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=width + n, min_length=width + n, do_sample=False, batch_size=len(prompts))
        gen = self.og.Generator(self.model, params)
        gen.append_tokens(ids)
        while not gen.is_done():
            gen.generate_next_token()

    def decode(self, prompt: list[int], n: int) -> None:
        self._generate([prompt], n)

    def prefill(self, prompt: list[int]) -> None:
        self._generate([prompt], 1)

    def batch(self, requests: list[tuple[list[int], int]], batch_size: int) -> None:
        for i in range(0, len(requests), batch_size):
            chunk = requests[i : i + batch_size]
            self._generate([p for p, _ in chunk], max(n for _, n in chunk))


def open_row(model_dir: Path, fmt: str, cache: Path, threads: int, options: dict) -> Runner:
    """``model_dir`` built for CPU at ``fmt`` (int4 / int8; cached), loaded on ``threads`` threads."""
    path = converted(cache, "onnxruntime-genai", model_dir, fmt, lambda out: _convert(model_dir, fmt, out))
    return Runner(path, threads)
