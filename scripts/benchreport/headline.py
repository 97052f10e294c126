"""The README's block of current numbers, between its BEGIN and END markers."""

from __future__ import annotations

from .machines import forced_isa
from .records import (
    DASH,
    DEFAULT_MODEL,
    RECORDS,
    commit,
    date,
    env,
    kind,
    limits,
    link,
    load,
    model,
    num,
    ratio,
    threads,
)

BEGIN, END = "<!-- bench-report:begin -->", "<!-- bench-report:end -->"


def headline(records: list[dict]) -> str:
    """The README's block of current numbers: the newest compare against HF transformers and the newest
    latency (on its CPU's default native variant, not a forced lower one) and throughput runs of the default
    model (records of other models, e.g. the random checkpoints of scripts/bench_arch.py, stay on the
    performance page only), each with its machine and a link to its record."""
    prefix = str(RECORDS) + "/"
    lines = []
    records = [r for r in records if model(r) == f"`{DEFAULT_MODEL}`"]
    cmp = next((r for r in records if kind(r) == "compare" and (r.get("summary") or {}).get("ratios")), None)
    if cmp:
        ratios = cmp["summary"]["ratios"]
        best = max(
            (k for k in ratios if k.startswith("decode_") and k.endswith("_over_hf-best")), key=lambda k: ratios[k]
        )
        row = best[len("decode_") : -len("_over_hf-best")]
        lines.append(
            f"- **{ratio(ratios.get('decode_baige_over_hf-best'))} HF transformers' batch-1 decode** (its fastest "
            f"dtype), {ratio(ratios.get('throughput_baige_over_hf-best'))} its offline throughput (static "
            f"batching), on {model(cmp)} in {limits(cmp).get('dtype', DASH)}; {ratio(ratios[best])} at batch 1 "
            f"with `{row}` ({_where(cmp)}; {link(cmp, prefix)})."
        )
    lat = next((r for r in records if kind(r) == "latency" and r.get("summary") and not forced_isa(r)), None)
    if lat:
        s = lat["summary"]
        lines.append(
            f"- **{num(s['decode_tokens_per_s'])} tokens/s batch-1 decode, "
            f"{num(s['decode_roofline']['pct_of_limit'])}% of the measured memory bandwidth**, TTFT "
            f"{num(s['ttft_s'] * 1e3)} ms ({_where(lat)}; {link(lat, prefix)})."
        )
    tp = next((r for r in records if kind(r) == "throughput" and r.get("summary")), None)
    if tp:
        s = tp["summary"]
        w = s.get("workload_roofline") or {}
        lines.append(
            f"- **{num(s['tokens_per_second'])} tokens/s offline throughput, "
            f"{num(s['compute_roofline']['pct_of_limit'])}% of the measured matmul peak**, where the schedule's own "
            f"bound is {num(w.get('limit_pct_of_peak'))}% ({_where(tp)}; {link(tp, prefix)})."
        )
    return "\n".join(lines)


def _where(r: dict) -> str:
    e = env(r)
    return (
        f"{e.get('cpu_model') or e.get('device')}, {threads(r)}, load "
        f"{load(r)} on {e.get('cpu_count', DASH)} cores, {date(r)[:10]}, commit {commit(r)}"
    )


def with_headline(readme: str, records: list[dict]) -> str:
    """``readme`` with the text between its BEGIN and END markers replaced by :func:`headline`.
    Raises ValueError when the markers are missing."""
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{headline(records)}\n{END}{tail}"
