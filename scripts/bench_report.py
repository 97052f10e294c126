"""Generate the performance page (docs/performance.md) and the README's headline numbers from the benchmark
records (docs/benchmarks/records/*.json, the JSON results `baige bench ... --output-dir docs/benchmarks/records`
writes).

    python scripts/bench_report.py            # rewrite docs/performance.md and the README's numbers
    python scripts/bench_report.py --check    # exit 1 when either is not what the records give

Only the standard library: the test suite regenerates both and compares (tests/docs/test_docs.py).
Every number printed comes from a record and links to it; nothing is typed in by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDS = Path("docs/benchmarks/records")  # relative to the repository root
PAGE = Path("docs/performance.md")
README = Path("README.md")
BEGIN, END = "<!-- bench-report:begin -->", "<!-- bench-report:end -->"
DEFAULT_MODEL = "smollm2-135m-instruct"
DASH = "—"


def load_records(directory: Path) -> list[dict]:
    """Every ``*.json`` of ``directory``, newest first (by the date it records, then file name), each with
    ``_file`` (its name). Raises ValueError naming a file that is not a JSON object."""
    records = []
    for path in sorted(directory.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}: not a JSON object")
        record["_file"] = path.name
        records.append(record)
    return sorted(records, key=lambda r: (_env(r).get("date") or "", r["_file"]), reverse=True)


def _env(r: dict) -> dict:
    return r.get("environment") or {}


def _kind(r: dict) -> str:
    return r.get("benchmark") or r["_file"].rsplit("-", 2)[0]


def _model(r: dict) -> str:
    args = r.get("args") or {}
    name = (args.get("engine") or {}).get("model") or args.get("model") or r.get("model_id")
    return f"`{name}`" if name else f"`{DEFAULT_MODEL}`"


def _date(r: dict) -> str:
    d = _env(r).get("date") or ""
    return f"{d[:10]} {d[11:16]}" if len(d) >= 16 else DASH


def _commit(r: dict) -> str:
    c = _env(r).get("git_commit")
    return DASH if not c else c[:7] + ("+" if _env(r).get("git_dirty") else "")


def _f(x, digits: int = 1) -> str:
    return DASH if x is None else f"{x:,.{digits}f}"


def _limits(r: dict) -> dict:
    return r.get("limits") or (r.get("roofline") or {}).get("limits") or {}


# baige/kernels/cpu/isa.py's VARIANTS (the flags each native variant needs), highest first as isa.best ranks
# them: a record whose variant is below the highest its CPU's flags allow ran with BAIGE_CPU_ISA forcing it
_AVX2 = ("avx2", "fma", "f16c")
_AVX512 = (*_AVX2, "avx512f", "avx512bw", "avx512vl")
VARIANT_FLAGS = (
    ("avx512_amx", (*_AVX512, "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")),
    ("avx512_bf16", (*_AVX512, "avx512_vnni", "avx512_bf16")),
    ("avx512_vnni", (*_AVX512, "avx512_vnni")),
    ("avx512", _AVX512),
    ("avx2_vnni", (*_AVX2, "avx_vnni")),
    ("avx2", _AVX2),
)


def best_isa(flags) -> str | None:
    """The native variant a CPU with ``flags`` loads by default (isa.best), None without AVX2."""
    return next((name for name, need in VARIANT_FLAGS if set(need) <= set(flags)), None)


def _forced_isa(r: dict) -> str | None:
    """The record's native variant when it is below its CPU's default (forced by BAIGE_CPU_ISA), else None."""
    e = _env(r)
    isa, best = e.get("cpu_isa"), best_isa(e.get("cpu_flags") or ())
    return isa if isa and best and isa != best else None


def _machine_key(r: dict) -> tuple:
    e = _env(r)
    return (e.get("device") or "?", e.get("cpu_model") or "?", e.get("cpu_count"), tuple(e.get("cpu_flags") or ()))


def machines(records: list[dict]) -> dict[tuple, str]:
    """Machine key -> its label (M1, M2, ...), in order of first appearance among the newest records."""
    out: dict[tuple, str] = {}
    for r in records:
        out.setdefault(_machine_key(r), f"M{len(out) + 1}")
    return out


def _link(r: dict, prefix: str) -> str:
    return f"[{r['_file']}]({prefix}{r['_file']})"


def _threads(r: dict) -> str:
    n = _env(r).get("torch_num_threads")
    return f"{n} thread" + ("" if n == 1 else "s") if n is not None else "threads not recorded"


def _load(r: dict) -> str:
    e = _env(r)
    load = (e.get("load_average") or [None])[0]
    return DASH if load is None else f"{load:.1f}"


def _machine_table(records: list[dict], labels: dict[tuple, str]) -> list[str]:
    lines = [
        "| machine | device / CPU | cores | instruction-set flags | native kernels | memory bandwidth (copy) | "
        "matmul peak | records |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, label in labels.items():
        rs = [r for r in records if _machine_key(r) == key]
        bws = sorted(_limits(r)["bandwidth"] / 1e9 for r in rs if _limits(r).get("bandwidth"))
        peaks = sorted(
            (_limits(r)["matmul_peak"] / 1e9, _limits(r).get("dtype")) for r in rs if _limits(r).get("matmul_peak")
        )
        bw = (
            DASH if not bws else f"{bws[-1]:.1f} GB/s" + (f" ({bws[0]:.1f}-{bws[-1]:.1f})" if bws[0] != bws[-1] else "")
        )
        peak = DASH if not peaks else f"{peaks[-1][0]:.1f} GFLOP/s ({peaks[-1][1]})"
        device, cpu, cores, flags = key
        isa = _env(next((r for r in rs if not _forced_isa(r)), rs[0])).get("cpu_isa") or "off"
        what = cpu if device == "cpu" else f"{device} ({cpu})"
        lines.append(
            f"| {label} | {what} | {cores or DASH} | {' '.join(flags) or DASH} | {isa} | {bw} | {peak} | {len(rs)} |"
        )
    return lines


def _provenance(rs: list[dict], prefix: str) -> list[str]:
    """One line per record: its file, command, commit, date, threads and load."""
    out = []
    for r in rs:
        e = _env(r)
        cmd = e.get("command")
        out.append(
            f"- {_link(r, prefix)}: {f'`{cmd}`' if cmd else 'command not recorded'}; commit {_commit(r)}, "
            f"{_date(r)} UTC, {_threads(r)}, load {_load(r)} on "
            f"{e.get('cpu_count', DASH)} cores"
        )
    return out


def _forced_note(r: dict) -> str:
    forced = _forced_isa(r)
    return f" (`{forced}` forced)" if forced else ""


def _latency(rs, labels, prefix) -> list[str]:
    lines = [
        "| date (UTC) | model | machine | dtype | batch | in / out | TTFT (ms) | TPOT (ms) | decode tokens/s | "
        "% of bandwidth | record |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        s, a = r.get("summary") or {}, r.get("args") or {}
        dec = s.get("decode_roofline") or {}
        lines.append(
            f"| {_date(r)} | {_model(r)} | {labels[_machine_key(r)]}{_forced_note(r)} | "
            f"{_limits(r).get('dtype', DASH)} | {a.get('batch_size', DASH)} | "
            f"{a.get('input_len', DASH)} / {a.get('output_len', DASH)} | "
            f"{_f((s.get('ttft_s') or 0) * 1e3)} | {_f((s.get('tpot_s') or 0) * 1e3)} | "
            f"{_f(s.get('decode_tokens_per_s'))} | {_f(dec.get('pct_of_limit'))} | {_link(r, prefix)} |"
        )
    return lines


def _throughput(rs, labels, prefix) -> list[str]:
    lines = [
        "| date (UTC) | model | machine | dtype | prompts | in / out | total tokens/s | output tokens/s | "
        "% of matmul peak | the schedule's bound (% of peak) | record |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        s, a = r.get("summary") or {}, r.get("args") or {}
        w = s.get("workload_roofline") or {}
        rr = a.get("range_ratio") or 0
        lens = f"{a.get('input_len', DASH)} / {a.get('output_len', DASH)}" + (f" (±{rr:.0%})" if rr else "")
        lines.append(
            f"| {_date(r)} | {_model(r)} | {labels[_machine_key(r)]} | {_limits(r).get('dtype', DASH)} | "
            f"{a.get('num_prompts', DASH)} | {lens} | {_f(s.get('tokens_per_second'))} | "
            f"{_f(s.get('output_tokens_per_second'))} | {_f((s.get('compute_roofline') or {}).get('pct_of_limit'))} | "
            f"{_f(w.get('limit_pct_of_peak'))} | {_link(r, prefix)} |"
        )
    return lines


def _serve(rs, labels, prefix) -> list[str]:
    lines = [
        "| date (UTC) | model | machine | requests | rate (req/s) | output tokens/s | median TTFT (ms) | "
        "median TPOT (ms) | median ITL (ms) | failed | record |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        rate = r.get("request_rate")
        lines.append(
            f"| {_date(r)} | {_model(r)} | {labels[_machine_key(r)]} | {r.get('num_prompts', DASH)} | "
            f"{rate if rate is not None else DASH} | {_f(r.get('output_throughput'))} | "
            f"{_f(r.get('median_ttft_ms'))} | {_f(r.get('median_tpot_ms'))} | {_f(r.get('median_itl_ms'))} | "
            f"{r.get('failed', DASH)} | {_link(r, prefix)} |"
        )
    return lines


def _compare(rs, labels, prefix) -> list[str]:
    """One table per compare record: every row's decode and throughput, and its ratio to HF's best dtype."""
    lines: list[str] = []
    for r in rs:
        s, a = r.get("summary") or {}, r.get("args") or {}
        dec, tp, ratios = s.get("decode") or {}, s.get("throughput") or {}, s.get("ratios") or {}
        pre = s.get("prefill") or {}
        pps = list(dict.fromkeys(pp for row in pre.values() for pp in row))  # prompt lengths: "pp128", ...
        pp_head = "".join(f"prefill {pp.removeprefix('pp')} tokens/s | " for pp in pps)
        lines += [
            f"**{_date(r)} UTC, {_model(r)}, machine {labels[_machine_key(r)]}, baige in "
            f"{_limits(r).get('dtype', DASH)}** ({_link(r, prefix)}): decode batch 1, {a.get('input_len', DASH)} in / "
            f"{a.get('output_len', DASH)} out; throughput {a.get('num_prompts', DASH)} prompts, "
            f"{a.get('tp_input_len', DASH)} in / {a.get('tp_output_len', DASH)} out "
            f"(±{(a.get('range_ratio') or 0):.0%}); median of {a.get('repeats', 1)} round(s).",
            "",
            f"| row | decode tokens/s | % of bandwidth | vs HF best (decode) | {pp_head}throughput total tokens/s | "
            "vs HF best (throughput) |",
            "|---|---|---|---|" + "---|" * len(pps) + "---|---|",
        ]
        for row in dict.fromkeys([*dec, *pre, *tp]):
            d, t = dec.get(row) or {}, tp.get(row) or {}
            pp_cells = "".join(f"{_f(((pre.get(row) or {}).get(pp) or {}).get('tokens_per_s'))} | " for pp in pps)
            lines.append(
                f"| {row} | {_f(d.get('tokens_per_s'))} | {_f((d.get('roofline') or {}).get('pct_of_limit'))} | "
                f"{_ratio(ratios.get(f'decode_{row}_over_hf-best'))} | {pp_cells}{_f(t.get('tokens_per_s'))} | "
                f"{_ratio(ratios.get(f'throughput_{row}_over_hf-best'))} |"
            )
        peers = {k: v for k, v in ratios.items() if _equal_bits(k)}
        if peers:
            lines += ["", "At equal bits: " + "; ".join(f"{k} {_ratio(v)}" for k, v in peers.items()) + "."]
        targets = _targets(s)
        if targets:
            lines += ["", "Targets: " + "; ".join(targets) + "."]
        for note in r.get("notes") or []:
            lines += ["", f"Note: {note}"]
        lines.append("")
    return lines[:-1]


# baige's quantized rows and the peer rows at the same bits per weight (as baige/runtime/bench/compare_ratios.py)
BITS = {
    "int8": (
        ("baige-int8", "baige-int8+int8-weight"),
        ("llama.cpp-Q8_0", "openvino-int8", "onnxruntime-genai-int8", "ctranslate2-int8", "ctranslate2-int8_float32"),
    ),
    "int4": (
        ("baige-int4", "baige-int4-g32", "baige-int4-g32+int8-weight"),
        ("llama.cpp-Q4_0", "llama.cpp-Q4_1", "llama.cpp-Q4_K_M", "openvino-int4", "onnxruntime-genai-int4"),
    ),
}


def _best(rows: dict, names) -> tuple[str, float] | None:
    got = [(n, rows[n]["tokens_per_s"]) for n in names if n in rows]
    return max(got, key=lambda x: x[1]) if got else None


def _target(what: str, ratio: float, goal: float) -> str:
    verdict = "met" if ratio >= goal else f"missed by {100 * (1 - ratio / goal):.0f}%"
    return f"{what} {ratio:.2f}x (goal {goal}x: {verdict})"


def _targets(s: dict) -> list[str]:
    """The issue's CPU targets checked on one compare summary: batch-1 decode >= 1.3x and throughput >= 1.5x
    the fastest peer at equal bits, quantized decode >= 75% of the measured bandwidth, prefill >= 1.2x
    llama.cpp at equal bits, throughput >= 2x HF's best dtype."""
    out = []
    dec, tp, pre = s.get("decode") or {}, s.get("throughput") or {}, s.get("prefill") or {}
    for bits, (ours, theirs) in BITS.items():
        for kind, rows, goal in (("decode", dec, 1.3), ("throughput", tp, 1.5)):
            a, b = _best(rows, ours), _best(rows, theirs)
            if a and b:
                out.append(_target(f"{kind} {bits} {a[0]} / fastest peer {b[0]}", a[1] / b[1], goal))
        pct = [(n, dec[n]["roofline"]["pct_of_limit"]) for n in ours if n in dec and "roofline" in dec[n]]
        if pct:
            n, p = max(pct, key=lambda x: x[1])
            verdict = "met" if p >= 75 else f"missed by {75 - p:.0f} points"
            out.append(f"decode {bits} {n} at {p:.0f}% of the bandwidth (goal 75%: {verdict})")
        llama = [n for n in theirs if n.startswith("llama.cpp")]
        for pp in dict.fromkeys(pp for row in pre.values() for pp in row):
            rows = {k: v[pp] for k, v in pre.items() if pp in v}
            a, b = _best(rows, ours), _best(rows, llama)
            if a and b:
                out.append(_target(f"prefill {pp} {bits} {a[0]} / {b[0]}", a[1] / b[1], 1.2))
    hf = _best(tp, [k for k in tp if k.startswith("hf-")])
    ours = _best(tp, [k for k in tp if k.startswith("baige")])
    if hf and ours:
        out.append(_target(f"throughput {ours[0]} / HF's best {hf[0]}", ours[1] / hf[1], 2.0))
    return out


def _equal_bits(key: str) -> bool:
    """A compare ratio of a quantized baige row over a quantized peer row (llama.cpp's, OpenVINO's, ONNX Runtime
    GenAI's, CTranslate2's, or the fastest of them at those bits)."""
    _, _, rest = key.partition("_")
    ours, _, peer = rest.partition("_over_")
    return ours.startswith("baige-") and not peer.startswith(("hf-", "baige"))


def _train(rs, labels, prefix) -> list[str]:
    lines = [
        "| date (UTC) | model | machine | dtype | optimizer | batch x seq | steps | compiled | tokens/s per device | "
        "step time (s) | MFU (%) | peak for MFU | peak memory (GiB) | last loss | record |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        s, a = r.get("summary") or {}, r.get("args") or {}
        peak, mem = s.get("peak_flops"), s.get("peak_memory_bytes")
        peak_text = DASH if peak is None else f"{peak / 1e9:.1f} GFLOP/s ({s.get('peak_source', DASH)})"
        mem_text = DASH if mem is None else f"{mem / 2**30:.2f}"
        samples = r.get("samples") or [{}]
        lines.append(
            f"| {_date(r)} | {_model(r)} | {labels[_machine_key(r)]} | {r.get('dtype', DASH)} | "
            f"{a.get('optimizer', 'adamw')} | {a.get('batch_size', DASH)} x {a.get('seq_len', DASH)} | "
            f"{a.get('steps', DASH)} | {r.get('compiled', DASH)} | {_f(s.get('tokens_per_s_per_device'))} | "
            f"{_f(s.get('step_time_s'), 2)} | {_f(s.get('mfu_pct'))} | {peak_text} | {mem_text} | "
            f"{_f(samples[-1].get('loss'), 3)} | "
            f"{_link(r, prefix)} |"
        )
    return lines


def _train_cp(rs, labels, prefix) -> list[str]:
    """One line per run of a ``baige bench train --cp N`` sweep: per-rank memory lists are ``rank0 / rank1 ...``."""
    lines = [
        "| date (UTC) | model | machine | seq_len | ranks | tokens/s per device | peak memory per rank (GiB) | "
        "step memory per rank (GiB) | last loss | record |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        for row in r.get("rows") or []:
            method = row.get("context_parallel_method")
            ranks = f"{row['context_parallel_degree']}" + (f" ({method})" if method else "")
            peak = " / ".join(f"{b / 2**30:.2f}" for b in row["peak_memory_bytes"])
            step = " / ".join(f"{b / 2**30:.3f}" for b in row["step_memory_bytes"])
            lines.append(
                f"| {_date(r)} | {_model(r)} | {labels[_machine_key(r)]} | {row['seq_len']} | {ranks} | "
                f"{_f(row['tokens_per_s_per_device'])} | {peak} | {step} | {row['last_loss']:.4f} | "
                f"{_link(r, prefix)} |"
            )
    return lines


def _train_vs_hf(rs, labels, prefix) -> list[str]:
    lines = [
        "| date (UTC) | machine | threads | load | baige dtype | baige tokens/s | HF's fastest (dtype) | "
        "HF tokens/s | speedup | HF fp32 tokens/s | record |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        runs, best = r.get("runs") or {}, r.get("best_hf")
        tps = {name: run.get("tokens_per_second") for name, run in runs.items()}
        lines.append(
            f"| {_date(r)} | {labels[_machine_key(r)]} | {_env(r).get('torch_num_threads', DASH)} | {_load(r)} | "
            f"{r.get('baige_dtype', DASH)} | {_f(tps.get('baige'))} | {(best or DASH).removeprefix('hf ')} | "
            f"{_f(tps.get(best))} | {_ratio(r.get('speedup'))} | {_f(tps.get('hf float32'))} | {_link(r, prefix)} |"
        )
    return lines


PROFILE_CATEGORIES = (  # scripts/profile_train_step.py's categories, in the table's order
    ("matmul", "matmul"),
    ("attention", "attention"),
    ("fused kernels (compiled)", "compiled blocks"),
    ("cross-entropy (besides its matmuls)", "cross-entropy"),
    ("optimizer and clipping", "optimizer"),
    ("casts / copies", "casts"),
    ("elementwise / reductions / other", "other"),
)


def _median(xs: list) -> float | None:
    xs = sorted(xs or [])
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def _train_step_profile(rs, labels, prefix) -> list[str]:
    heads = " | ".join(f"{h} (s)" for _, h in PROFILE_CATEGORIES)
    lines = [
        f"| date (UTC) | commit | machine | threads | load | run | CPU s/step | system s/step | page faults/step | "
        f"{heads} | record |",
        "|---" * (10 + len(PROFILE_CATEGORIES)) + "|",
    ]
    for r in rs:
        for name, run in (r.get("runs") or {}).items():
            cats = run.get("categories_s") or {}
            cpu, system = _median(run.get("process_time_s")), _median(run.get("system_s"))
            faults = _median(run.get("minor_page_faults"))
            lines.append(
                f"| {_date(r)} | {_commit(r)} | {labels[_machine_key(r)]} | {_env(r).get('torch_num_threads', DASH)} | "
                f"{_load(r)} | {name} | {_f(cpu, 3)} | {_f(system, 3)} | {_f(faults, 0)} | "
                + " | ".join(_f(cats.get(c), 3) for c, _ in PROFILE_CATEGORIES)
                + f" | {_link(r, prefix)} |"
            )
    return lines


def _startup(rs, labels, prefix) -> list[str]:
    lines = [
        "| date (UTC) | model | machine | caches | `baige --help` (s) | serve ready (s) | generate first token (s) | "
        "runs | record |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        s = r.get("summary") or {}
        for cache in ("warm", "cold"):
            cells = []
            for key in ("help_s", "serve_ready_s", "generate_ttft_s"):
                m = (s.get(key) or {}).get(cache)
                cells.append(DASH if not m else f"{m['median']:.2f} (min {m['min']:.2f})")
            runs = max(((s.get(k) or {}).get(cache) or {}).get("runs", 0) for k in ("serve_ready_s", "help_s"))
            if runs:
                lines.append(
                    f"| {_date(r)} | {_model(r)} | {labels[_machine_key(r)]} | {cache} | {' | '.join(cells)} | "
                    f"{runs} | {_link(r, prefix)} |"
                )
    return lines


def _router(rs, labels, prefix) -> list[str]:
    """One row per policy of each record of scripts/bench_router.py: prefix-cache hit tokens over the backends."""
    lines = [
        "| date (UTC) | model | machine | backends | requests | policy | hit tokens | of the ideal | "
        "mean latency (s) | record |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        args = r.get("args") or {}
        for policy, x in (r.get("results") or {}).items():
            frac = x.get("fraction_of_ideal")
            lines.append(
                f"| {_date(r)} | {_model(r)} | {labels[_machine_key(r)]} | {args.get('backends', DASH)} | "
                f"{r.get('num_requests', DASH)} | `{policy}` | {_f(x.get('hit_tokens'), 0)} of "
                f"{_f(r.get('ideal_hit_tokens'), 0)} | {_f(None if frac is None else 100 * frac)}% | "
                f"{_f(x.get('mean_latency_s'), 3)} | {_link(r, prefix)} |"
            )
    return lines


def _ratio(x) -> str:
    return DASH if x is None else f"{x:.2f}x"


def _other(rs, labels, prefix) -> list[str]:
    lines = ["| date (UTC) | benchmark | model | machine | record |", "|---|---|---|---|---|"]
    for r in rs:
        lines.append(f"| {_date(r)} | {_kind(r)} | {_model(r)} | {labels[_machine_key(r)]} | {_link(r, prefix)} |")
    return lines


SECTIONS = [  # (benchmark, heading, table builder)
    ("compare", "Against the peers: `baige bench compare`", _compare),
    ("latency", "Latency and batch-1 decode: `baige bench latency`", _latency),
    ("throughput", "Offline throughput: `baige bench throughput`", _throughput),
    ("serve", "Online serving: `baige bench serve`", _serve),
    ("train", "Training: `baige bench train`", _train),
    (
        "train_cp",
        "Context parallelism: `baige bench train --cp N` (memory per rank against sequence length)",
        _train_cp,
    ),
    ("train_vs_hf", "Training against a plain HF loop: `scripts/bench_train_vs_hf.py`", _train_vs_hf),
    (
        "train_step_profile",
        "Where a training step's CPU time goes: `scripts/profile_train_step.py`",
        _train_step_profile,
    ),
    ("startup", "Start-up: `baige bench startup` (medians from process start)", _startup),
    ("router", "Routing: `scripts/bench_router.py` (prefix-cache hit tokens over the backends)", _router),
]

INTRO = """\
# Performance

<!-- Generated by scripts/bench_report.py from docs/benchmarks/records/*.json; edit the script, not this page. -->

Every number on this page comes from a benchmark record: the JSON a `baige bench` run writes, kept in
`docs/benchmarks/records/` (each row links to its file). A record holds the command, the git commit (a `+`
after it: the package differed from that commit), the date, the versions, the CPU model, its instruction-set
flags, the core count, the thread count, the load average while measuring and the measured memory bandwidth and
matmul peak it is compared against ([bench](commands/bench.md#what-every-result-records)). To add numbers, run
a benchmark with `--output-dir docs/benchmarks/records`, then `python scripts/bench_report.py`, and commit both.

Read a record with its machine: numbers of different machines are not comparable, and a load average above the
core count means other work shared the machine while it was measured (timings and the measured limits are then
noisy). Older measurements, from before the records, are in the [archive](benchmarks/archive.md).
"""


def performance_page(records: list[dict]) -> str:
    """docs/performance.md for ``records`` (newest first, as :func:`load_records` returns them)."""
    if not records:
        raise ValueError("no benchmark records")
    labels = machines(records)
    prefix = "benchmarks/records/"
    out = [INTRO, "## Machines", "", *_machine_table(records, labels), ""]
    shown = set()
    for kind, heading, table in SECTIONS:
        rs = [r for r in records if _kind(r) == kind]
        if not rs:
            continue
        shown.add(kind)
        out += [
            f"## {heading}",
            "",
            *table(rs, labels, prefix),
            "",
            "How each was run:",
            "",
            *_provenance(rs, prefix),
            "",
        ]
    rest = [r for r in records if _kind(r) not in shown]
    if rest:
        out += ["## Other records", "", *_other(rest, labels, prefix), "", *_provenance(rest, prefix), ""]
    return "\n".join(out)


def headline(records: list[dict]) -> str:
    """The README's block of current numbers: the newest compare against HF transformers and the newest
    latency (on its CPU's default native variant, not a forced lower one) and throughput runs, each with its
    machine and a link to its record."""
    prefix = str(RECORDS) + "/"
    lines = []
    cmp = next((r for r in records if _kind(r) == "compare" and (r.get("summary") or {}).get("ratios")), None)
    if cmp:
        ratios = cmp["summary"]["ratios"]
        best = max(
            (k for k in ratios if k.startswith("decode_") and k.endswith("_over_hf-best")), key=lambda k: ratios[k]
        )
        row = best[len("decode_") : -len("_over_hf-best")]
        lines.append(
            f"- **{_ratio(ratios.get('decode_baige_over_hf-best'))} HF transformers' batch-1 decode** (its fastest "
            f"dtype), {_ratio(ratios.get('throughput_baige_over_hf-best'))} its offline throughput (static "
            f"batching), on {_model(cmp)} in {_limits(cmp).get('dtype', DASH)}; {_ratio(ratios[best])} at batch 1 "
            f"with `{row}` ({_where(cmp)}; {_link(cmp, prefix)})."
        )
    lat = next((r for r in records if _kind(r) == "latency" and r.get("summary") and not _forced_isa(r)), None)
    if lat:
        s = lat["summary"]
        lines.append(
            f"- **{_f(s['decode_tokens_per_s'])} tokens/s batch-1 decode, "
            f"{_f(s['decode_roofline']['pct_of_limit'])}% of the measured memory bandwidth**, TTFT "
            f"{_f(s['ttft_s'] * 1e3)} ms ({_where(lat)}; {_link(lat, prefix)})."
        )
    tp = next((r for r in records if _kind(r) == "throughput" and r.get("summary")), None)
    if tp:
        s = tp["summary"]
        w = s.get("workload_roofline") or {}
        lines.append(
            f"- **{_f(s['tokens_per_second'])} tokens/s offline throughput, "
            f"{_f(s['compute_roofline']['pct_of_limit'])}% of the measured matmul peak**, where the schedule's own "
            f"bound is {_f(w.get('limit_pct_of_peak'))}% ({_where(tp)}; {_link(tp, prefix)})."
        )
    return "\n".join(lines)


def _where(r: dict) -> str:
    e = _env(r)
    return (
        f"{e.get('cpu_model') or e.get('device')}, {_threads(r)}, load "
        f"{_load(r)} on {e.get('cpu_count', DASH)} cores, {_date(r)[:10]}, commit {_commit(r)}"
    )


def with_headline(readme: str, records: list[dict]) -> str:
    """``readme`` with the text between its BEGIN and END markers replaced by :func:`headline`.
    Raises ValueError when the markers are missing."""
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{headline(records)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a generated file is stale; write nothing")
    args = ap.parse_args(argv)
    records = load_records(REPO / RECORDS)
    wanted = {
        REPO / PAGE: performance_page(records),
        REPO / README: with_headline((REPO / README).read_text(), records),
    }
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"stale: {p.relative_to(REPO)} (run python scripts/bench_report.py)", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(wanted[p])
        print(f"wrote {p.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
