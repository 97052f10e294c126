"""The engines ``baige bench compare`` times in child processes: OpenVINO, ONNX Runtime GenAI and
CTranslate2, each on the model converted by the peer's own tool, one child process per row.

A peer is a module (:data:`PEER_MODULES`) with

- ``REQUIRES``: the import names it needs in this Python; one missing is one note for the peer, no row;
- ``formats(variants) -> tuple[str, ...]``: the weight formats timed, given baige's variants (``int8`` and
  ``int4`` rows of the peer pair with baige's int8 / int4 rows at equal bits);
- ``open_row(model_dir, fmt, cache, threads, options) -> runner``, run in the child: converts the HF
  directory ``model_dir`` once into ``cache`` (see :func:`converted`) and loads it with ``threads`` threads.
  The runner has ``decode(prompt, n)``, ``prefill(prompt)``, ``batch(requests, batch_size)`` (None without
  a batched API), ``weight_bytes`` (bytes of the converted weights on disk: read once per decode step) and
  ``kv_bytes`` (bytes per cached K/V element), and ``settings`` (one line: what was chosen for this CPU).

Each row ``<peer>-<format>`` runs ``python peer_worker.py`` with a :class:`PeerJob` as JSON on stdin; the
child converts (cached), warms up with one decode, then times ``repeats`` rounds of decode, prefill at
each length and the batched throughput, and writes the seconds as one JSON line on stdout. A child that
crashes, times out or fails to convert costs its row only: one note line naming the row and why.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from baige.runtime.bench.llama_peer import _exit_reason

# peer name (``--peers``) -> its module
PEER_MODULES = {
    "openvino": "baige.runtime.bench.peer_openvino",
    "onnxruntime-genai": "baige.runtime.bench.peer_ort",
    "ctranslate2": "baige.runtime.bench.peer_ct2",
}
ROW_TIMEOUT_S = 3600  # seconds per row: conversion (once) and timing; a 1.5B model converts in minutes
WORKER = Path(__file__).with_name("peer_worker.py")
PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the directory holding the ``baige`` package


@dataclass
class PeerJob:
    """What a row's child process does (JSON on its stdin): the same prompts and lengths as baige's rows."""

    module: str
    peer: str
    fmt: str
    model_dir: str
    cache: str  # the baige cache root; conversions go under <cache>/peers/<peer>/
    threads: int
    decode_prompt: list[int]
    output_len: int  # tokens decoded after decode_prompt
    prefill_prompts: list[list[int]]  # one per prefill length
    requests: list[tuple[list[int], int]]  # throughput: (prompt ids, output tokens)
    batch_size: int  # requests per call where the peer's batched API takes one length limit per call
    repeats: int
    options: dict = field(default_factory=dict)  # peer-specific (e.g. the export venv's python)
    sys_path: list[str] = field(default_factory=lambda: [str(PACKAGE_ROOT)])


@dataclass
class PeerRow:
    """A row's timings (seconds per round) and its roofline inputs."""

    name: str
    decode: list[float]
    prefill: list[list[float]]  # per prefill length, per round
    throughput: list[float]  # empty without a batched API
    weight_bytes: int
    kv_bytes: int
    settings: str


def last_line(text: str) -> str:
    """The last non-blank line of ``text``, stripped ("" when none)."""
    return next((ln.strip() for ln in reversed(text.splitlines()) if ln.strip()), "")


def missing(module) -> str | None:
    """The first of ``module.REQUIRES`` this Python cannot import, or None."""
    return next((m for m in module.REQUIRES if importlib.util.find_spec(m) is None), None)


def run_row(job: PeerJob, python: str = sys.executable, timeout: float = ROW_TIMEOUT_S) -> PeerRow:
    """Time one row in a child process. Raises RuntimeError (one line: how the child ended and its last
    stderr line, or the reason it gave) when the child crashes, fails, times out or gives no result."""
    name = f"{job.peer}-{job.fmt}"
    try:
        proc = subprocess.run(
            [python, str(WORKER)],
            input=json.dumps(asdict(job)),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the timing process took over {timeout:.0f} s") from None
    last = last_line(proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"the timing process {_exit_reason(proc.returncode)}" + (f": {last[:200]}" if last else ""))
    lines = proc.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError("the timing process wrote no result" + (f": {last[:200]}" if last else "")) from None
    if "skipped" in out:
        raise RuntimeError(out["skipped"])
    return PeerRow(name=name, **out)


def run_peers(
    peers: tuple[str, ...],
    variants: tuple[str, ...],
    make_job: Callable[[str, str, str], PeerJob],
    notes: list[str],
    progress: Callable[[str], None] | None = None,
) -> list[PeerRow]:
    """The rows of every peer in ``peers`` (names of :data:`PEER_MODULES`), each timed by :func:`run_row`
    on ``make_job(peer, module, fmt)``; a peer not installed, or a row whose child fails, is one line in
    ``notes``."""
    rows = []
    for peer in peers:
        module_name = PEER_MODULES[peer]
        module = importlib.import_module(module_name)
        absent = missing(module)
        if absent is not None:
            notes.append(f"{peer} is not installed ({absent} missing): skipped (scripts/setup.sh --with-peers)")
            continue
        for fmt in module.formats(variants):
            if progress:
                progress(f"{peer}-{fmt}")
            try:
                rows.append(run_row(make_job(peer, module_name, fmt)))
            except RuntimeError as e:
                notes.append(f"{peer}-{fmt} skipped: {e}")
    return rows


def conversion_dir(cache: Path, peer: str, model_dir: Path, fmt: str) -> Path:
    """Where ``peer``'s ``fmt`` conversion of ``model_dir`` is cached: ``<cache>/peers/<peer>/<name>-<key>-<fmt>``,
    key = the model directory's path and its files' sizes and mtimes."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    stamp = ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    key = hashlib.sha256(f"{model_dir.resolve()}|{stamp}".encode()).hexdigest()[:16]
    return cache / "peers" / peer / f"{model_dir.name}-{key}-{fmt}"


def converted(cache: Path, peer: str, model_dir: Path, fmt: str, convert: Callable[[Path], None]) -> Path:
    """``model_dir`` converted by ``convert(out)`` into :func:`conversion_dir`, made once. ``convert`` writes
    into a temporary directory renamed only when it returns; on an exception nothing is left under the final
    name."""
    out = conversion_dir(cache, peer, model_dir, fmt)
    if out.is_dir():
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        convert(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tree_bytes(path: Path, suffixes: tuple[str, ...]) -> int:
    """Bytes of the files under ``path`` whose name ends with one of ``suffixes`` (a converted model's weights)."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.name.endswith(suffixes))


def run_tool(argv: list[str], what: str, timeout: float = ROW_TIMEOUT_S) -> None:
    """Run a peer's conversion tool. Raises RuntimeError (``what`` and the tool's last output line) when it fails."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        last = last_line(proc.stderr) or last_line(proc.stdout)
        raise RuntimeError(f"{what} {_exit_reason(proc.returncode)}" + (f": {last[:200]}" if last else ""))


def job_factory(cfg, model_dir: Path, prompt: list[int], prefill_prompts, requests, threads: int):
    """``make_job(peer, module, fmt)`` for :func:`run_peers` from a ``CompareConfig``: the same prompts and
    lengths as baige's rows, ``threads`` threads; ``cfg.peer_venv``'s python exports where a peer needs it."""
    from baige.runtime.weights.hub import cache_dir

    options = {"export_python": str(Path(cfg.peer_venv) / "bin" / "python")} if cfg.peer_venv else {}
    return lambda peer, module, fmt: PeerJob(
        module=module,
        peer=peer,
        fmt=fmt,
        model_dir=str(model_dir.resolve()),
        cache=str(cache_dir()),
        threads=threads,
        decode_prompt=list(prompt),
        output_len=cfg.output_len,
        prefill_prompts=[list(p) for p in prefill_prompts],
        requests=[(list(p), n) for p, n in requests],
        batch_size=cfg.hf_batch_size,
        repeats=cfg.repeats,
        options=options,
        sys_path=[str(PACKAGE_ROOT), *(p for p in sys.path if p)],
    )


def add_rows(cfg, rows, samples: dict, make_job, notes: list[str], progress=None) -> None:
    """The rows of the child-process peers in ``cfg.peers`` (:func:`run_peers`), merged into the compare
    run's ``rows`` (their roofline inputs: ``weight_bytes``, ``dtype_bytes``) and ``samples``; each row's
    settings as a note."""
    asked = tuple(p for p in cfg.peers if p in PEER_MODULES)
    tell = (lambda row: progress(0, None, f"{row} (in its own process)")) if progress else None
    for row in run_peers(asked, cfg.quantized, make_job, notes, tell):
        rows.weight_bytes[row.name], rows.dtype_bytes[row.name] = row.weight_bytes, row.kv_bytes
        samples["decode"][row.name] = row.decode
        if any(row.prefill):
            samples["prefill"][row.name] = row.prefill
        if row.throughput:
            samples["throughput"][row.name] = row.throughput
        notes.append(f"{row.name}: {row.settings}")
