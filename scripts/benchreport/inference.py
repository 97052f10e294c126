"""The tables of the inference benchmarks: ``baige bench latency``, ``throughput``, ``serve`` and ``startup``,
scripts/bench_router.py's routing records and scripts/bench_bf16_linear.py's kernel records. Each builder takes
the records of its kind (newest first), the machine labels and the link prefix, and returns the table's lines."""

from __future__ import annotations

from .machines import forced_note, lead, machine_key
from .records import DASH, commit, date, limits, link, num, table


def latency(rs, labels, prefix) -> list[str]:
    header = (
        "date (UTC) | model | machine | dtype | batch | in / out | TTFT (ms) | TPOT (ms) | decode tokens/s | "
        "% of bandwidth | record"
    )
    rows = []
    for r in rs:
        s, a = r.get("summary") or {}, r.get("args") or {}
        dec = s.get("decode_roofline") or {}
        rows.append(
            [
                *lead(r, labels, forced_note(r)),
                limits(r).get("dtype", DASH),
                a.get("batch_size", DASH),
                f"{a.get('input_len', DASH)} / {a.get('output_len', DASH)}",
                num((s.get("ttft_s") or 0) * 1e3),
                num((s.get("tpot_s") or 0) * 1e3),
                num(s.get("decode_tokens_per_s")),
                num(dec.get("pct_of_limit")),
                link(r, prefix),
            ]
        )
    return table(header, rows)


def throughput(rs, labels, prefix) -> list[str]:
    header = (
        "date (UTC) | model | machine | dtype | prompts | in / out | total tokens/s | output tokens/s | "
        "% of matmul peak | the schedule's bound (% of peak) | record"
    )
    rows = []
    for r in rs:
        s, a = r.get("summary") or {}, r.get("args") or {}
        w = s.get("workload_roofline") or {}
        rr = a.get("range_ratio") or 0
        lens = f"{a.get('input_len', DASH)} / {a.get('output_len', DASH)}" + (f" (±{rr:.0%})" if rr else "")
        rows.append(
            [
                *lead(r, labels),
                limits(r).get("dtype", DASH),
                a.get("num_prompts", DASH),
                lens,
                num(s.get("tokens_per_second")),
                num(s.get("output_tokens_per_second")),
                num((s.get("compute_roofline") or {}).get("pct_of_limit")),
                num(w.get("limit_pct_of_peak")),
                link(r, prefix),
            ]
        )
    return table(header, rows)


def serve(rs, labels, prefix) -> list[str]:
    header = (
        "date (UTC) | model | machine | requests | rate (req/s) | output tokens/s | median TTFT (ms) | "
        "median TPOT (ms) | median ITL (ms) | failed | record"
    )
    rows = []
    for r in rs:
        rate = r.get("request_rate")
        rows.append(
            [
                *lead(r, labels),
                r.get("num_prompts", DASH),
                rate if rate is not None else DASH,
                num(r.get("output_throughput")),
                num(r.get("median_ttft_ms")),
                num(r.get("median_tpot_ms")),
                num(r.get("median_itl_ms")),
                r.get("failed", DASH),
                link(r, prefix),
            ]
        )
    return table(header, rows)


def startup(rs, labels, prefix) -> list[str]:
    """One row per cache state (warm, cold) of each record: medians (and minima) of the three start-ups."""
    header = (
        "date (UTC) | model | machine | caches | `baige --help` (s) | serve ready (s) | generate first token (s) | "
        "runs | record"
    )
    rows = []
    for r in rs:
        s = r.get("summary") or {}
        for cache in ("warm", "cold"):
            cells = []
            for key in ("help_s", "serve_ready_s", "generate_ttft_s"):
                m = (s.get(key) or {}).get(cache)
                cells.append(DASH if not m else f"{m['median']:.2f} (min {m['min']:.2f})")
            runs = max(((s.get(k) or {}).get(cache) or {}).get("runs", 0) for k in ("serve_ready_s", "help_s"))
            if runs:
                rows.append([*lead(r, labels), cache, *cells, runs, link(r, prefix)])
    return table(header, rows)


def router(rs, labels, prefix) -> list[str]:
    """One row per policy of each record of scripts/bench_router.py: prefix-cache hit tokens over the backends."""
    header = (
        "date (UTC) | model | machine | backends | requests | policy | hit tokens | of the ideal | "
        "mean latency (s) | record"
    )
    rows = []
    for r in rs:
        args = r.get("args") or {}
        for policy, x in (r.get("results") or {}).items():
            frac = x.get("fraction_of_ideal")
            rows.append(
                [
                    *lead(r, labels),
                    args.get("backends", DASH),
                    r.get("num_requests", DASH),
                    f"`{policy}`",
                    f"{num(x.get('hit_tokens'), 0)} of {num(r.get('ideal_hit_tokens'), 0)}",
                    f"{num(None if frac is None else 100 * frac)}%",
                    num(x.get("mean_latency_s"), 3),
                    link(r, prefix),
                ]
            )
    return table(header, rows)


def bf16_linear(rs, labels, prefix) -> list[str]:
    """scripts/bench_bf16_linear.py: one decode step's bf16 weight stream per thread and row count."""
    header = "date (UTC) | commit | machine | threads | rows | layers (ms) | lm_head (ms) | total (ms) | GB/s | record"
    rows = []
    for r in rs:
        for x in r.get("results") or []:
            rows.append(
                [
                    date(r),
                    commit(r),
                    labels[machine_key(r)],
                    x.get("threads", DASH),
                    x.get("rows", DASH),
                    num(x.get("layers_ms")),
                    num(x.get("lm_head_ms")),
                    num(x.get("total_ms")),
                    num(x.get("weights_gb_per_s")),
                    link(r, prefix),
                ]
            )
    intro = [
        "SmolLM2-135M's 30 layers of joined bf16 projections and its lm_head (270 MB, in the huge-page weight "
        "arena as the engine places them), fp32 activations, the native kernel called directly; medians of "
        "whole passes.",
        "",
    ]
    return intro + table(header, rows)
