"""``baige bench serve`` end to end: start ``baige serve`` (unless ``--base-url`` is given), run the
load generator of :mod:`baige.runtime.bench.serve`, stop the server, and build the result.

The server is a child process (``python -m baige serve``) on a free local port; the bench waits for
``GET /health`` to answer 200, and stops the server with SIGINT (then SIGKILL after 15 s) whatever
happens, Ctrl-C included. Its log goes to a file whose last lines are shown if it fails to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from baige.errors import BaigeError
from baige.runtime.bench.common import environment
from baige.runtime.bench.serve import (
    RequestInput,
    RequestResult,
    calculate_metrics,
    parse_slo,
    random_requests,
    run_requests,
    sharegpt_requests,
)
from baige.runtime.config import DATA_SEED_RANGE, check_float, check_int


@dataclass
class ServeBenchConfig:
    """Resolved arguments of ``baige bench serve``. Raises BaigeError for no prompts, a bad ``slo``
    or a percentile outside (0, 100]."""

    model: str | None = None
    base_url: str | None = None  # None: start `baige serve` on the model
    served_model_name: str | None = None
    num_prompts: int = 64
    input_len: int = 128  # tokens (random dataset)
    output_len: int = 64  # tokens
    range_ratio: float = 0.0
    dataset_path: str | None = None
    request_rate: float = float("inf")  # requests/s
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    slo: str | None = None  # "ttft:MS,tpot:MS,e2el:MS"
    api_key: str | None = None
    server_args: list[str] = field(default_factory=list)  # extra `baige serve` options
    server_timeout: float = 600.0  # seconds to wait for /health

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise BaigeError("--num-prompts must be >= 1")
        parse_slo(self.slo)  # raises for a bad --slo
        if any(not 0 < p <= 100 for p in self.percentiles):
            raise BaigeError("--percentiles must be in (0, 100]")
        check_float("--request-rate", self.request_rate, 0.0, low_open=True, inf_ok=True)
        check_float("--burstiness", self.burstiness, 0.0, low_open=True)
        check_int("--seed", self.seed, *DATA_SEED_RANGE)
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise BaigeError(f"--base-url {self.base_url!r}: expected http://HOST:PORT (or https://)")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, proc: subprocess.Popen | None, timeout: float, log: Path | None = None) -> None:
    """Poll ``GET {base_url}/health`` every 0.25 s until it answers 200.

    Raises BaigeError if ``proc`` exits first (with the last lines of its ``log``) or after ``timeout`` s.
    """
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BaigeError(f"`baige serve` exited with code {proc.returncode} before it was healthy: {log_tail(log)}")
        try:
            if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise BaigeError(f"{base_url}/health did not answer 200 within {timeout:.0f} s")


def log_tail(log: Path | None, lines: int = 5) -> str:
    """The last ``lines`` non-blank lines of a child process's ``log``, joined by `` | `` (one line)."""
    text = log.read_text(errors="replace") if log is not None and log.exists() else ""
    return " | ".join([t for t in text.splitlines() if t.strip()][-lines:])


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a launched server: SIGINT (a clean shutdown), then SIGKILL after 15 s; nothing when it has exited."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_env(api_key: str | None = None) -> dict[str, str]:
    """The environment of a launched ``baige serve``: this process's, with ``OMP_NUM_THREADS`` =
    this process's torch threads (``baige bench --threads``, else torch's choice), so the server
    computes on as many threads as the bench, and ``BAIGE_API_KEY`` when ``api_key`` is given."""
    import torch

    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    if api_key:
        env["BAIGE_API_KEY"] = api_key
    return env


@contextlib.contextmanager
def launch_server(
    model: str | None, max_model_len: int, extra_args: list[str], timeout: float, api_key: str | None = None
) -> Iterator[str]:
    """Run ``baige serve`` on a free port for the duration of the ``with``; yields its base URL."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "baige",
        "serve",
        "--port",
        str(port),
        "--max-model-len",
        str(max_model_len),
        "--log-level",
        "warning",
        *extra_args,
    ]
    if model:
        cmd += ["--model", model]
    env = server_env(api_key)
    with tempfile.TemporaryDirectory(prefix="baige-bench-serve-") as tmp:
        log = Path(tmp) / "server.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base_url, proc, timeout, log)
            yield base_url
        finally:
            stop_server(proc)


def server_option(args: list[str], name: str) -> str | None:
    """The value of ``baige serve`` option ``name`` (``--x=v`` or ``--x v``) in ``args``, last one wins."""
    value = None
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            value = a.split("=", 1)[1]
        elif a == name and i + 1 < len(args):
            value = args[i + 1]
    return value


def serve_roofline(model_dir: Path, metrics: dict, results: list[RequestResult], server_args: list[str] = ()) -> dict:
    """Decode under load against this machine's bandwidth limit (an estimate from the client side).

    Mean batch C = sum of successful requests' e2e latency / duration (Little's law); decode steps/s
    = output tokens/s / C; bytes per step = checkpoint bytes (the safetensors files, read once per
    step) + C * mean context * KV bytes per token, context = mean prompt + half the mean output.
    The KV bytes follow the server's ``--kv-cache-dtype`` (else ``--dtype``, else the checkpoint's
    dtype) as given in ``server_args``.
    """
    import torch

    from baige.runtime import roofline
    from baige.runtime.model.config import ModelConfig

    mc = ModelConfig.from_file(model_dir / "config.json")
    kv_dtype = mc.torch_dtype
    for opt in ("--dtype", "--kv-cache-dtype"):
        given = server_option(list(server_args), opt)
        if given not in (None, "auto"):
            kv_dtype = given
    dtype_bytes = {"bfloat16": 2, "float16": 2}.get(kv_dtype, 4)
    wbytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    ok = [r for r in results if r.success]
    limits = roofline.hardware_limits("cuda" if torch.cuda.is_available() else "cpu")
    if not ok or metrics["duration"] <= 0:
        return {"limits": limits.to_dict()}
    conc = sum(r.latency for r in ok) / metrics["duration"]
    n = metrics["completed"]
    ctx = metrics["total_input_tokens"] / n + metrics["total_output_tokens"] / n / 2
    counts = {"weight_bytes": wbytes, "num_experts": 0}
    if mc.moe is not None:  # the routed experts' share of the file bytes, by parameter count
        m = mc.moe
        routed = len(m.sparse_layers) * m.num_experts * 3 * mc.hidden_size * m.intermediate_size
        counts.update(num_experts=m.num_experts, top_k=m.top_k, routed_expert_bytes=wbytes * routed / mc.num_params())
    return {
        "limits": limits.to_dict(),
        "mean_concurrency": conc,
        "decode": roofline.decode_roofline(
            metrics["output_throughput"],
            max(conc, 1e-9),
            roofline.step_weight_bytes(counts, max(conc, 1e-9)),
            roofline.kv_read_bytes_per_token(mc, dtype_bytes, ctx),
            ctx,
            limits.bandwidth,
        ),
    }


SPEC_COUNTERS = {
    "baige:spec_decode_num_drafts": "num_drafts",
    "baige:spec_decode_num_draft_tokens": "num_draft_tokens",
    "baige:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


def scrape_spec_decode(base_url: str, api_key: str | None = None) -> dict | None:
    """Speculative decoding's counters from the server's /metrics (baige's names), with the
    acceptance rate and mean acceptance length they give; None when the server does not speculate
    or has no such metrics (another server)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(
            f"{base_url}/metrics", timeout=10.0, headers={"Authorization": f"Bearer {api_key}"} if api_key else None
        )
    except httpx.HTTPError:
        return None
    found = {}
    try:
        for family in text_string_to_metric_families(r.text if r.status_code == 200 else ""):
            if family.name in SPEC_COUNTERS:
                found[SPEC_COUNTERS[family.name]] = int(
                    sum(s.value for s in family.samples if s.name.endswith("_total"))
                )
    except ValueError:  # not Prometheus text (another server's /metrics)
        return None
    if len(found) < len(SPEC_COUNTERS):
        return None
    drafts, proposed, accepted = found["num_drafts"], found["num_draft_tokens"], found["num_accepted_tokens"]
    return {
        **found,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
    }


def describe_target(base_url: str) -> dict:
    """What ``--base-url`` points at, for the record: ``{"kind": "router", "policy", "backends": [{url,
    role}]}`` when its ``/health`` is a ``baige router``'s (or ``baige serve --data-parallel-size``'s),
    else ``{"kind": "server"}``."""
    import httpx

    try:
        info = httpx.get(base_url + "/health", timeout=10.0).json().get("router")
    except (httpx.HTTPError, ValueError, AttributeError):
        info = None
    if not isinstance(info, dict):
        return {"kind": "server", "base_url": base_url}
    backends = [{"url": b.get("url"), "role": b.get("role")} for b in info.get("backends") or []]
    return {"kind": "router", "base_url": base_url, "policy": info.get("policy"), "backends": backends}


def _send_load(
    cfg: ServeBenchConfig,
    base_url: str,
    name: str,
    inputs: list[RequestInput],
    on_done: Callable[[RequestResult], None] | None,
) -> tuple[list[RequestResult], float, bool, dict | None]:
    """Send ``inputs`` to the server at ``base_url`` as model ``name`` with the configured arrival
    process, then read its speculative-decoding counters.

    Returns ``(results, duration, interrupted, spec)``: the finished requests, the load's wall time in
    seconds, whether a Ctrl-C stopped it (then ``results`` holds the requests that finished before it,
    in finishing order) and :func:`scrape_spec_decode`'s counters.
    """
    done: list[RequestResult] = []

    def record(r: RequestResult) -> None:
        done.append(r)
        if on_done:
            on_done(r)

    t0 = time.perf_counter()
    interrupted = False
    try:
        results, duration = asyncio.run(
            run_requests(
                base_url,
                name,
                inputs,
                cfg.request_rate,
                cfg.burstiness,
                cfg.max_concurrency,
                cfg.seed,
                cfg.api_key,
                on_done=record,
            )
        )
    except KeyboardInterrupt:
        interrupted, results, duration = True, done, time.perf_counter() - t0
    return results, duration, interrupted, scrape_spec_decode(base_url, cfg.api_key)


def run_serve(cfg: ServeBenchConfig, on_done: Callable[[RequestResult], None] | None = None) -> dict:
    """Run ``baige bench serve``; returns vLLM's result fields plus args, environment and roofline.

    A Ctrl-C during the load stops sending, and the result covers the requests that finished
    (``"interrupted": true``). Raises BaigeError for a bad dataset or a server that does not start.
    """
    from baige.runtime.model.tokenizer import Tokenizer
    from baige.runtime.weights.hub import resolve_model

    slo = parse_slo(cfg.slo)
    model_dir = resolve_model(cfg.model)
    tok = Tokenizer.from_dir(model_dir)
    if cfg.dataset_path:
        inputs = sharegpt_requests(cfg.dataset_path, tok, cfg.num_prompts, cfg.seed)
    else:
        inputs = random_requests(tok, cfg.num_prompts, cfg.input_len, cfg.output_len, cfg.range_ratio, cfg.seed)
    name = cfg.served_model_name or cfg.model or "smollm2-135m-instruct"
    # the prompt is re-tokenized by the server: leave room for the text not round-tripping exactly
    from baige.runtime.model.config import ModelConfig

    max_pos = ModelConfig.from_file(model_dir / "config.json").max_position_embeddings
    max_model_len = min(max(r.prompt_len + r.output_len for r in inputs) * 2 + 16, max_pos)

    target = {"kind": "server", "base_url": None}  # launched here
    if cfg.base_url:
        wait_healthy(cfg.base_url.rstrip("/"), None, 10.0)
        target = describe_target(cfg.base_url.rstrip("/"))
        results, duration, interrupted, spec = _send_load(cfg, cfg.base_url.rstrip("/"), name, inputs, on_done)
    else:
        extra = [*cfg.server_args]
        if cfg.served_model_name:
            extra += ["--served-model-name", cfg.served_model_name]
        with launch_server(cfg.model, max_model_len, extra, cfg.server_timeout, cfg.api_key) as url:
            results, duration, interrupted, spec = _send_load(cfg, url, name, inputs, on_done)
    if interrupted:  # keep the requests that finished, with their own inputs
        results = sorted(results, key=lambda r: r.index)
        inputs = [inputs[r.index] for r in results]
    metrics = calculate_metrics(inputs, results, duration, tok, cfg.percentiles, slo)
    if not cfg.base_url:
        metrics["roofline"] = serve_roofline(model_dir, metrics, results, cfg.server_args)
    args = asdict(cfg)
    if args["request_rate"] == float("inf"):
        args["request_rate"] = "inf"  # JSON has no infinity
    return {
        "benchmark": "serve",
        "args": args,
        "environment": environment(),
        "interrupted": interrupted,
        "model_id": name,
        "target": target,
        "num_prompts": len(inputs),
        "request_rate": args["request_rate"],
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        **metrics,
        "spec_decode": spec,
    }
