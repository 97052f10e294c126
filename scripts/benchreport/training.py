"""The tables of the training benchmarks: ``baige bench train`` (and its ``--cp N`` sweep),
scripts/bench_train_vs_hf.py and scripts/profile_train_step.py. Each builder takes the records of its kind
(newest first), the machine labels and the link prefix, and returns the table's lines."""

from __future__ import annotations

from .machines import lead, machine_key
from .records import DASH, commit, date, env, link, load, median, num, ratio, table

PROFILE_CATEGORIES = (  # scripts/profile_train_step.py's categories, in the table's order
    ("matmul", "matmul"),
    ("attention", "attention"),
    ("fused kernels (compiled)", "compiled blocks"),
    ("cross-entropy (besides its matmuls)", "cross-entropy"),
    ("optimizer and clipping", "optimizer"),
    ("casts / copies", "casts"),
    ("elementwise / reductions / other", "other"),
)


def train(rs, labels, prefix) -> list[str]:
    header = (
        "date (UTC) | model | machine | dtype | optimizer | batch x seq | steps | compiled | tokens/s per device | "
        "step time (s) | MFU (%) | peak for MFU | peak memory (GiB) | last loss | record"
    )
    rows = []
    for r in rs:
        s, a = r.get("summary") or {}, r.get("args") or {}
        peak, mem = s.get("peak_flops"), s.get("peak_memory_bytes")
        samples = r.get("samples") or [{}]
        rows.append(
            [
                *lead(r, labels),
                r.get("dtype", DASH),
                a.get("optimizer", "adamw"),
                f"{a.get('batch_size', DASH)} x {a.get('seq_len', DASH)}",
                a.get("steps", DASH),
                r.get("compiled", DASH),
                num(s.get("tokens_per_s_per_device")),
                num(s.get("step_time_s"), 2),
                num(s.get("mfu_pct")),
                DASH if peak is None else f"{peak / 1e9:.1f} GFLOP/s ({s.get('peak_source', DASH)})",
                DASH if mem is None else f"{mem / 2**30:.2f}",
                num(samples[-1].get("loss"), 3),
                link(r, prefix),
            ]
        )
    return table(header, rows)


def train_cp(rs, labels, prefix) -> list[str]:
    """One line per run of a ``baige bench train --cp N`` sweep: per-rank memory lists are ``rank0 / rank1 ...``."""
    header = (
        "date (UTC) | model | machine | seq_len | ranks | tokens/s per device | peak memory per rank (GiB) | "
        "step memory per rank (GiB) | last loss | record"
    )
    rows = []
    for r in rs:
        for row in r.get("rows") or []:
            method = row.get("context_parallel_method")
            rows.append(
                [
                    *lead(r, labels),
                    row["seq_len"],
                    f"{row['context_parallel_degree']}" + (f" ({method})" if method else ""),
                    num(row["tokens_per_s_per_device"]),
                    " / ".join(f"{b / 2**30:.2f}" for b in row["peak_memory_bytes"]),
                    " / ".join(f"{b / 2**30:.3f}" for b in row["step_memory_bytes"]),
                    f"{row['last_loss']:.4f}",
                    link(r, prefix),
                ]
            )
    return table(header, rows)


def train_vs_hf(rs, labels, prefix) -> list[str]:
    header = (
        "date (UTC) | machine | threads | load | baige dtype | baige tokens/s | HF's fastest (dtype) | "
        "HF tokens/s | speedup | HF fp32 tokens/s | record"
    )
    rows = []
    for r in rs:
        runs, best = r.get("runs") or {}, r.get("best_hf")
        tps = {name: run.get("tokens_per_second") for name, run in runs.items()}
        rows.append(
            [
                date(r),
                labels[machine_key(r)],
                env(r).get("torch_num_threads", DASH),
                load(r),
                r.get("baige_dtype", DASH),
                num(tps.get("baige")),
                (best or DASH).removeprefix("hf "),
                num(tps.get(best)),
                ratio(r.get("speedup")),
                num(tps.get("hf float32")),
                link(r, prefix),
            ]
        )
    return table(header, rows)


def train_step_profile(rs, labels, prefix) -> list[str]:
    """One row per run of each profile: CPU and system seconds, page faults and each category's seconds per
    step (medians over the profiled steps)."""
    heads = " | ".join(f"{h} (s)" for _, h in PROFILE_CATEGORIES)
    header = (
        f"date (UTC) | commit | machine | threads | load | run | CPU s/step | system s/step | page faults/step | "
        f"{heads} | record"
    )
    rows = []
    for r in rs:
        for name, run in (r.get("runs") or {}).items():
            cats = run.get("categories_s") or {}
            rows.append(
                [
                    date(r),
                    commit(r),
                    labels[machine_key(r)],
                    env(r).get("torch_num_threads", DASH),
                    load(r),
                    name,
                    num(median(run.get("process_time_s")), 3),
                    num(median(run.get("system_s")), 3),
                    num(median(run.get("minor_page_faults")), 0),
                    *(num(cats.get(c), 3) for c, _ in PROFILE_CATEGORIES),
                    link(r, prefix),
                ]
            )
    return table(header, rows)
