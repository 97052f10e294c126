"""``baige bench`` with no subcommand: a short suite (latency, throughput, serve, compare) sized to
finish in a few minutes on a 2-core CPU, each part writing its own JSON, then one summary table and
a ``suite-*.json`` holding the headline numbers."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from baige.runtime.bench.common import environment, write_result
from baige.runtime.bench.report import ratio_label, write_plots


def suite_configs(model: str | None, kv_cache_dtype: str = "auto", peers: tuple[str, ...] | None = None) -> dict:
    """The four parts and their (small) sizes; ``kv_cache_dtype`` goes to every baige engine, the
    launched server included; ``peers`` (default: HF and llama.cpp, compare's default) to compare. Raises
    BaigeError for an unknown peer."""
    from baige.runtime.bench.compare import DEFAULT_PEERS, CompareConfig
    from baige.runtime.bench.offline import LatencyConfig, ThroughputConfig, bench_engine
    from baige.runtime.bench.serve_run import ServeBenchConfig

    eng = bench_engine(model=model, kv_cache_dtype=kv_cache_dtype)
    server_args = [] if kv_cache_dtype == "auto" else ["--kv-cache-dtype", kv_cache_dtype]
    return {
        "latency": LatencyConfig(eng, input_len=32, output_len=32, batch_size=1, num_iters_warmup=1, num_iters=3),
        "throughput": ThroughputConfig(eng, num_prompts=16, input_len=64, output_len=32, range_ratio=0.5),
        "serve": ServeBenchConfig(
            model, num_prompts=16, input_len=64, output_len=32, request_rate=4.0, server_args=server_args
        ),
        "compare": CompareConfig(
            eng,
            input_len=32,
            output_len=32,
            num_prompts=32,
            tp_input_len=64,
            tp_output_len=32,
            peers=DEFAULT_PEERS if peers is None else peers,
        ),
    }


def headline(name: str, r: dict) -> list[tuple[str, float, str, float | None]]:
    """(metric, value, unit, % of limit) rows of one part's result."""
    s = r.get("summary") or {}
    if name == "latency" and s:
        return [
            ("batch-1 decode", s["decode_tokens_per_s"], "tokens/s", s["decode_roofline"]["pct_of_limit"]),
            ("TTFT", s["ttft_s"] * 1e3, "ms", None),
            ("TPOT", s["tpot_s"] * 1e3, "ms", None),
        ]
    if name == "throughput" and s:
        rows = [("total tokens", s["tokens_per_second"], "tokens/s", s["compute_roofline"]["pct_of_limit"])]
        w = s.get("workload_roofline")
        if w:  # the schedule's roofline: the most tokens/s (and % of the matmul peak) this machine allows
            rows.append(("roofline bound", w["limit_tokens_per_s"], "tokens/s", w["limit_pct_of_peak"]))
            if "any_schedule_min_time_s" in w:  # the same for any schedule of these requests
                rows.append(
                    (
                        "any-schedule bound",
                        s["total_num_tokens"] / w["any_schedule_min_time_s"],
                        "tokens/s",
                        w["any_schedule_pct_of_peak"],
                    )
                )
        return rows + [("requests", s["requests_per_second"], "requests/s", None)]
    if name == "serve":
        dec = (r.get("roofline") or {}).get("decode") or {}
        return [
            ("output tokens", r["output_throughput"], "tokens/s", dec.get("pct_of_limit")),
            ("median TTFT", r["median_ttft_ms"], "ms", None),
            ("median TPOT", r["median_tpot_ms"], "ms", None),
            ("failed", r["failed"], "requests", None),
        ]
    if name == "compare" and s:  # "<workload>: <baige row> / <peer row>": baige vs the best HF dtype, baige and
        # its plain checkpoints vs llama.cpp (the "+" combinations are in compare's own tables: too wide here)
        labels = {k: ratio_label(k) for k in s.get("ratios", {})}
        return [
            (f"{kind}: {label}", s["ratios"][k], "x", None)
            for k, (kind, label) in labels.items()
            if label == "baige / hf-best" or ("/ llama.cpp" in label and "+" not in label)
        ]
    return []


def run_suite(
    model: str | None,
    output_dir: str | Path,
    plot: bool = False,
    kv_cache_dtype: str = "auto",
    peers: tuple[str, ...] | None = None,
) -> dict:
    """Run the parts in order; stops after an interrupted part (its JSON is still written).

    Raises BaigeError at once for an ``output_dir`` that cannot be a writable directory or an unknown peer."""
    from baige.runtime.bench.compare import run_compare
    from baige.runtime.bench.offline import run_latency, run_throughput
    from baige.runtime.bench.serve_run import run_serve
    from baige.runtime.config import check_output_path

    check_output_path("--output-dir", output_dir, "dir")

    err = Console(stderr=True)
    runners = {
        "latency": run_latency,
        "throughput": run_throughput,
        "compare": run_compare,
        "serve": lambda cfg, progress: run_serve(cfg, None),
    }
    cfgs = suite_configs(model, kv_cache_dtype, peers)
    rows: dict[str, list] = {}
    files: dict[str, str] = {}
    interrupted = False
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("bench suite", total=len(cfgs))
        for i, (name, cfg) in enumerate(cfgs.items()):
            bar.update(task, completed=i, description=f"bench suite: {name}")
            try:
                result = runners[name](cfg, None)
            except KeyboardInterrupt:
                interrupted = True
                break
            path = write_result(output_dir, name, result)
            files[name] = str(path)
            if plot:
                write_plots(result, output_dir, path.stem)
            rows[name] = headline(name, result)
            if result.get("interrupted"):
                interrupted = True
                break
        bar.update(task, completed=len(rows))
    summary = {
        "benchmark": "suite",
        "environment": environment(),
        "interrupted": interrupted,
        "files": files,
        "summary": {
            k: [dict(zip(("metric", "value", "unit", "pct_of_limit"), row)) for row in v] for k, v in rows.items()
        },
    }
    summary["file"] = str(write_result(output_dir, "suite", summary))
    return summary


def suite_table(result: dict) -> Table:
    """The one summary table of the default suite: a section per part (compare: one per workload, its
    metrics "<baige row> / <peer row>" as in the compare table), 80 columns wide for every metric the
    parts report on the embedded model and on Qwen2.5-Coder-1.5B's GGUF."""
    table = Table(title="baige bench (default suite)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("unit")
    table.add_column("% of limit", justify="right")
    sections: dict[str, list[tuple[str, dict]]] = {}
    for name, rows in result["summary"].items():
        for row in rows:
            kind, sep, label = row["metric"].partition(": ")
            title, metric = (f"{name}: {kind}", label) if name == "compare" and sep else (name, row["metric"])
            sections.setdefault(title, []).append((metric, row))
    for title, rows in sections.items():
        if table.row_count:
            table.add_section()
        table.add_row(f"[bold]{title}[/bold]", "", "", "")
        for metric, row in rows:
            v, pct = row["value"], row["pct_of_limit"]
            table.add_row(
                f"  {metric}",
                f"{v:.2f}" if isinstance(v, float) else str(v),
                row["unit"],
                "" if pct is None else f"{pct:.1f}%",
            )
    return table
