"""Rich tables and matplotlib charts of bench results (the JSON dicts the runners return).

Every value shown carries its unit; "% of limit" is the roofline fraction (see ``roofline.py``):
bandwidth for decode, matmul peak for prefill, offline throughput and training (MFU).
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.1f}%"


def metric_table(title: str, rows: list[tuple[str, str, str, float | None]]) -> Table:
    """A (metric, value, unit, % of limit) table."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("unit")
    table.add_column("% of limit", justify="right")
    for name, value, unit, pct in rows:
        table.add_row(name, value, unit, _pct(pct))
    return table


def _limit_rows(limits: dict) -> list[tuple[str, str, str, None]]:
    return [
        ("limit: memory bandwidth (copy)", f"{limits['bandwidth'] / 1e9:.1f}", "GB/s", None),
        (f"limit: matmul peak ({limits['dtype']})", f"{limits['matmul_peak'] / 1e12:.4g}", "TFLOP/s", None),
    ]


def spec_rows(r: dict) -> list[tuple[str, str, str, None]]:
    """Speculative decoding's counters (vLLM's names), when the run speculated."""
    sd = r.get("spec_decode")
    if not sd:
        return []
    return [
        ("spec decode: drafts", f"{sd['num_drafts']}", "steps", None),
        ("spec decode: draft tokens", f"{sd['num_draft_tokens']}", "tokens", None),
        ("spec decode: accepted tokens", f"{sd['num_accepted_tokens']}", "tokens", None),
        ("spec decode: acceptance rate", f"{100 * sd['acceptance_rate']:.1f}", "%", None),
        ("spec decode: mean acceptance length", f"{sd['mean_acceptance_length']:.2f}", "tokens/step", None),
    ]


def latency_rows(r: dict) -> list[tuple[str, str, str, float | None]]:
    s = r["summary"]
    if not s:
        return []
    rows = [
        ("avg latency", f"{s['avg_latency_s']:.4f}", "s", None),
        ("std latency", f"{s['std_latency_s']:.4f}", "s", None),
    ]
    rows += [(f"p{p} latency", f"{s[f'p{p}_latency_s']:.4f}", "s", None) for p in (10, 25, 50, 75, 90, 99)]
    pre, dec = s["prefill_roofline"], s["decode_roofline"]
    rows += [
        ("TTFT", f"{s['ttft_s'] * 1e3:.2f}", "ms", None),
        ("TPOT", f"{s['tpot_s'] * 1e3:.2f}", "ms", None),
        ("prefill throughput", f"{s['prefill_tokens_per_s']:.1f}", "tokens/s", pre["pct_of_limit"]),
        ("prefill compute", f"{pre['achieved_tflop_s']:.4g}", "TFLOP/s", pre["pct_of_limit"]),
        ("decode throughput", f"{s['decode_tokens_per_s']:.1f}", "tokens/s", dec["pct_of_limit"]),
        ("decode bandwidth (weights + KV)", f"{dec['achieved_gb_s']:.2f}", "GB/s", dec["pct_of_limit"]),
    ]
    return rows + spec_rows(r) + _limit_rows(r["limits"])


def throughput_rows(r: dict) -> list[tuple[str, str, str, float | None]]:
    s = r["summary"]
    if not s:
        return []
    c = s["compute_roofline"]
    return (
        [
            ("requests", f"{s['num_requests']}", "requests", None),
            ("elapsed", f"{s['elapsed_time_s']:.2f}", "s", None),
            ("request throughput", f"{s['requests_per_second']:.2f}", "requests/s", None),
            ("total token throughput", f"{s['tokens_per_second']:.1f}", "tokens/s", c["pct_of_limit"]),
            ("output token throughput", f"{s['output_tokens_per_second']:.1f}", "tokens/s", None),
            ("achieved compute", f"{c['achieved_tflop_s']:.4g}", "TFLOP/s", c["pct_of_limit"]),
        ]
        + _workload_rows(s.get("workload_roofline"))
        + spec_rows(r)
        + _limit_rows(r["limits"])
    )


def _workload_rows(w: dict | None) -> list[tuple[str, str, str, float | None]]:
    """The workload roofline's rows: the least time this schedule needs here (its "% of limit": that
    time over the run's), and the most of the matmul peak it allows; the same for any schedule."""
    if not w:
        return []
    rows = [
        ("least time for this schedule (roofline)", f"{w['min_time_s']:.2f}", "s", w["pct_of_limit"]),
        ("  of which bandwidth-bound steps", f"{w['bandwidth_bound_s']:.2f}", "s", None),
        ("most of the matmul peak it allows", f"{w['limit_pct_of_peak']:.1f}", "%", None),
    ]
    if "any_schedule_min_time_s" in w:
        rows += [
            ("least time for any schedule", f"{w['any_schedule_min_time_s']:.2f}", "s", None),
            ("most of the peak any schedule allows", f"{w['any_schedule_pct_of_peak']:.1f}", "%", None),
        ]
    return rows


def serve_rows(r: dict) -> list[tuple[str, str, str, float | None]]:
    dec = (r.get("roofline") or {}).get("decode") or {}
    pct = dec.get("pct_of_limit")
    rows = [
        ("successful requests", f"{r['completed']}", "requests", None),
        ("failed requests", f"{r['failed']}", "requests", None),
        ("benchmark duration", f"{r['duration']:.2f}", "s", None),
        ("total input tokens", f"{r['total_input_tokens']}", "tokens", None),
        ("total output tokens", f"{r['total_output_tokens']}", "tokens", None),
        ("request throughput", f"{r['request_throughput']:.2f}", "requests/s", None),
    ]
    if r.get("request_goodput") is not None:
        rows.append(("request goodput", f"{r['request_goodput']:.2f}", "requests/s", None))
    rows += [
        ("output token throughput", f"{r['output_throughput']:.1f}", "tokens/s", pct),
        ("total token throughput", f"{r['total_token_throughput']:.1f}", "tokens/s", None),
    ]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        keys = [k for k in r if k.endswith(f"_{name}_ms") and not k.startswith(("std", "p50_"))]  # p50 = median
        for k in keys:
            rows.append((f"{k.split('_')[0]} {label}", f"{r[k]:.2f}", "ms", None))
    rows += spec_rows(r)
    if dec:
        rows.append(("decode bandwidth (weights + KV, est.)", f"{dec['achieved_gb_s']:.2f}", "GB/s", pct))
        rows += _limit_rows(r["roofline"]["limits"])
    return rows


def train_rows(r: dict) -> list[tuple[str, str, str, float | None]]:
    s = r["summary"]
    if not s:
        return []
    return [
        ("throughput", f"{s['tokens_per_s_per_device']:.1f}", "tokens/s/device", s["mfu_pct"]),
        ("step time", f"{s['step_time_s']:.3f}", "s", None),
        ("MFU", f"{s['mfu_pct']:.2f}", "%", s["mfu_pct"]),
        ("achieved compute", f"{s['roofline']['achieved_tflop_s']:.4g}", "TFLOP/s", s["mfu_pct"]),
        (f"peak for MFU ({s['peak_source']})", f"{s['peak_flops'] / 1e12:.4g}", "TFLOP/s", None),
        ("peak memory", f"{s['peak_memory_bytes'] / 2**30:.2f}", "GiB", None),
        ("last loss", f"{r['samples'][-1]['loss']:.4f}", "nats/token", None),
    ]


def train_cp_table(r: dict) -> Table:
    """``baige bench train --cp N``: one row per run (sequence length x ranks), memory per rank in GiB."""
    table = Table(title=f"baige bench train --cp {r['args']['context_parallel_degree']} (per rank)")
    for name in (
        "seq_len",
        "ranks",
        "step time (s)",
        "tokens/s/device",
        "peak memory (GiB)",
        "step memory (GiB)",
        "loss",
    ):
        table.add_column(name, justify="right")
    for row in r["rows"]:
        table.add_row(
            str(row["seq_len"]),
            f"{row['context_parallel_degree']}"
            + (f" ({row['context_parallel_method']})" if row["context_parallel_method"] else ""),
            f"{row['step_time_s']:.3f}",
            f"{row['tokens_per_s_per_device']:.1f}",
            " / ".join(f"{b / 2**30:.2f}" for b in row["peak_memory_bytes"]),
            " / ".join(f"{b / 2**30:.3f}" for b in row["step_memory_bytes"]),
            f"{row['last_loss']:.4f}",
        )
    return table


def grpo_rows(r: dict) -> list[tuple[str, str, str, float | None]]:
    s = r["summary"]
    if not s:
        return []
    quarter = max(1, len(r["samples"]) // 4)
    return [
        ("step time (median)", f"{s['step_time_s']:.2f}", "s", None),
        ("  rollout", f"{s['rollout_s']:.2f}", "s", None),
        ("  train", f"{s['train_s']:.2f}", "s", None),
        ("  weight sync", f"{s['weight_sync_s']:.3f}", "s", None),
        ("rollout throughput", f"{s['rollout_tokens_per_s']:.1f}", "tokens/s", None),
        ("train throughput", f"{s['train_tokens_per_s']:.1f}", "tokens/s", None),
        (f"reward, first {quarter} step(s)", f"{s['reward_first']:.3f}", "mean", None),
        (f"reward, last {quarter} step(s)", f"{s['reward_last']:.3f}", "mean", None),
        ("engine/trainer logprob mismatch (max)", f"{s['logprob_mismatch_max']:.2e}", "nats", None),
        ("peak memory", f"{s['peak_memory_bytes'] / 2**30:.2f}", "GiB", None),
    ]


def kernels_table(r: dict) -> Table:
    table = Table(title="baige bench kernels")
    for col in ("op", "tokens", "impl", "pass"):
        table.add_column(col)
    for col in ("time (µs)", "GB/s", "TFLOP/s", "% of limit", "peak MiB"):
        table.add_column(col, justify="right")
    for row in r["samples"]:
        peak = row.get("peak_mem_bytes")
        table.add_row(
            row["op"],
            str(row["tokens"]),
            row["impl"],
            row.get("pass", "fwd"),
            f"{row['time_s'] * 1e6:.1f}",
            f"{row['gb_s']:.2f}",
            f"{row['tflop_s']:.4g}",
            _pct(row["pct_of_limit"]),
            "" if peak is None else f"{peak / 2**20:.1f}",
        )
    return table


STARTUP_LABELS = {
    "serve_ready_s": "baige serve: time to ready (/health 200)",
    "generate_ttft_s": "baige generate: time to first token",
    "generate_exit_s": "baige generate: time to exit",
    "help_s": "baige --help: time to exit",
}


def startup_table(r: dict) -> Table:
    """One row per measurement and cache state: runs, median, min and max (seconds)."""
    table = Table(title=f"baige bench startup ({r['model_id']}; from process start)")
    table.add_column("measurement")
    table.add_column("cache")
    for col in ("runs", "median (s)", "min (s)", "max (s)"):
        table.add_column(col, justify="right")
    for name, by_cache in r["summary"].items():
        for cache, st in by_cache.items():
            stats = (f"{st[k]:.3f}" for k in ("median", "min", "max"))
            table.add_row(STARTUP_LABELS.get(name, name), cache, str(st["runs"]), *stats)
    return table


def compare_table(r: dict) -> Table:
    """One section per workload (its name on a row of its own), one row per system: the system's name
    never wraps or gets cut (``no_wrap``: the numbers' columns give way on a narrow terminal)."""
    s = r["summary"]
    table = Table(title="baige bench compare (median of repeats; ratio = baige / row)")
    table.add_column("system", no_wrap=True)
    for col in ("tokens/s", "achieved", "% of limit", "baige / row"):
        table.add_column(col, justify="right")
    sections = {"decode": s.get("decode") or {}}
    for name, by_len in (s.get("prefill") or {}).items():  # one section per prompt length, as llama-bench's pp
        for pp, row in by_len.items():
            sections.setdefault(pp, {})[name] = row
    sections["throughput"] = s.get("throughput") or {}
    kinds = [k for k, rows in sections.items() if rows]
    for i, kind in enumerate(kinds):
        rows = sections[kind]
        ours = rows.get("baige", {}).get("tokens_per_s")
        label = {
            "decode": "batch-1 decode",
            "throughput": f"offline throughput ({r['args']['num_prompts']} prompts)",
        }.get(kind, f"prefill {kind.removeprefix('pp')} tokens (batch 1)")
        table.add_row(f"[bold]{label}[/bold]", "", "", "", "")
        for j, (name, row) in enumerate(rows.items()):
            rf = row["roofline"]
            achieved = (
                f"{rf['achieved_gb_s']:.2f} GB/s" if kind == "decode" else f"{rf['achieved_tflop_s']:.4g} TFLOP/s"
            )
            ratio = f"{ours / row['tokens_per_s']:.2f}x" if ours else ""
            w = row.get("workload_roofline")
            pct = _pct(rf["pct_of_limit"])
            if w:  # (the schedule's bound[ / any schedule's])
                anys = f" / {_pct(w['any_schedule_pct_of_peak'])}" if "any_schedule_pct_of_peak" in w else ""
                pct += f" ({_pct(w['limit_pct_of_peak'])}{anys})"
            table.add_row(
                f"  {name}",
                f"{row['tokens_per_s']:.1f}",
                achieved,
                pct,
                ratio,
                end_section=j == len(rows) - 1 and i < len(kinds) - 1,
            )
    if any("workload_roofline" in row for row in s.get("throughput", {}).values()):
        table.caption = (
            "(x% / y%): the most of the matmul peak baige's offline schedule allows on this machine (each "
            "step at least max(FLOPs / peak, bytes / bandwidth)) / that any schedule of the same requests "
            "allows (at least as many steps as the longest output, each reading every weight)"
        )
    return table


def ratio_label(key: str) -> tuple[str, str]:
    """A ratio key of ``bench compare`` (``<workload>_<baige row>_over_<peer row>``) as (workload,
    ``"<baige row> / <peer row>"``), the row names as the compare table prints them."""
    kind, _, rest = key.partition("_")
    ours, _, peer = rest.partition("_over_")
    return kind, f"{ours} / {peer}"


def compare_ratios_table(r: dict) -> Table | None:
    """The ratios the compare table's "baige / row" column does not show: each baige variant against
    the fastest HF dtype, and baige against llama.cpp at equal bits per weight; None when there is none."""
    table = Table(title="baige bench compare: ratios of tokens/s")
    table.add_column("workload")
    table.add_column("baige row / peer row")
    table.add_column("ratio", justify="right")
    for key, value in r["summary"].get("ratios", {}).items():
        kind, label = ratio_label(key)
        if not label.startswith("baige /") or label.endswith("/ hf-best"):
            table.add_row(kind, label, f"{value:.2f}x")
    return table if table.row_count else None


def write_plots(r: dict, output_dir: str | Path, stem: str) -> list[Path]:
    """PNG charts of a result into ``output_dir``; returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []

    def save(fig, name: str) -> None:
        p = out / f"{stem}-{name}.png"
        fig.tight_layout()
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)

    kind = r["benchmark"]
    if kind == "latency" and r["samples"]:
        fig, ax = plt.subplots()
        ax.hist([s["latency"] for s in r["samples"]], bins=20)
        ax.set(xlabel="batch latency (s)", ylabel="iterations", title="baige bench latency")
        save(fig, "latency")
    elif kind == "throughput" and r["samples"]:
        fig, ax = plt.subplots()
        ax.scatter([s["prompt_len"] + s["output_len"] for s in r["samples"]], [s["e2el_s"] for s in r["samples"]])
        ax.set(xlabel="prompt + output (tokens)", ylabel="request latency (s)", title="baige bench throughput")
        save(fig, "requests")
    elif kind == "serve":
        fig, axes = plt.subplots(1, 3, figsize=(12, 4))
        ok = [t for t, e in zip(r["ttfts"], r["errors"]) if not e]
        axes[0].hist([t * 1e3 for t in ok], bins=20)
        axes[0].set(xlabel="TTFT (ms)", ylabel="requests")
        axes[1].hist([g * 1e3 for gaps in r["itls"] for g in gaps], bins=30)
        axes[1].set(xlabel="ITL (ms)", ylabel="token gaps")
        axes[2].hist(r["output_lens"], bins=20)
        axes[2].set(xlabel="output length (tokens)", ylabel="requests")
        fig.suptitle(f"baige bench serve: {r['completed']} ok, {r['failed']} failed, {r['duration']:.1f} s")
        save(fig, "serve")
    elif kind == "kernels" and r["samples"]:
        for op in sorted({s["op"] for s in r["samples"]}):
            fig, ax = plt.subplots()
            for impl in sorted({s["impl"] for s in r["samples"]}):
                pts = [s for s in r["samples"] if s["op"] == op and s["impl"] == impl]
                ax.plot([s["tokens"] for s in pts], [s["gb_s"] for s in pts], marker="o", label=impl)
            ax.axhline(r["limits"]["bandwidth"] / 1e9, linestyle="--", color="gray", label="measured bandwidth")
            ax.set(xscale="log", xlabel="tokens", ylabel="effective GB/s", title=op)
            ax.legend()
            save(fig, op)
    elif kind == "train" and r["samples"]:
        fig, ax = plt.subplots()
        ax.plot([s["step"] for s in r["samples"]], [s["time_s"] for s in r["samples"]], marker="o")
        ax.set(xlabel="step", ylabel="step time (s)", title="baige bench train")
        save(fig, "steps")
    elif kind == "grpo" and r["samples"]:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
        steps = [s["step"] for s in r["samples"]]
        top.plot(steps, [s["reward"] for s in r["samples"]], marker="o")
        top.set(ylabel="reward (mean)", title="baige bench grpo")
        for key in ("rollout_s", "train_s", "weight_sync_s"):
            bottom.plot(steps, [s[key] for s in r["samples"]], marker=".", label=key.removesuffix("_s"))
        bottom.set(xlabel="step", ylabel="seconds")
        bottom.legend()
        save(fig, "reward")
    elif kind == "compare":
        for wl in ("decode", "throughput"):
            rows = r["summary"].get(wl, {})
            if rows:
                fig, ax = plt.subplots()
                ax.bar(list(rows), [v["tokens_per_s"] for v in rows.values()])
                ax.set(ylabel="tokens/s", title=f"baige bench compare: {wl}")
                ax.tick_params(axis="x", rotation=30)
                save(fig, wl)
    return paths
