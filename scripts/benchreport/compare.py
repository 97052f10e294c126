"""``baige bench compare``'s records: one table per record (every row's decode, prefill and throughput and its
ratio to HF's best dtype), the equal-bits ratios against the peers, and the CPU targets checked on them."""

from __future__ import annotations

from .machines import machine_key
from .records import DASH, date, limits, link, model, num, ratio, table

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


def compare(rs, labels, prefix) -> list[str]:
    """One table per compare record: every row's decode and throughput, and its ratio to HF's best dtype."""
    lines: list[str] = []
    for r in rs:
        s, a = r.get("summary") or {}, r.get("args") or {}
        dec, tp, ratios = s.get("decode") or {}, s.get("throughput") or {}, s.get("ratios") or {}
        pre = s.get("prefill") or {}
        pps = list(dict.fromkeys(pp for row in pre.values() for pp in row))  # prompt lengths: "pp128", ...
        pp_head = "".join(f"prefill {pp.removeprefix('pp')} tokens/s | " for pp in pps)
        rows = [
            [
                row,
                num((dec.get(row) or {}).get("tokens_per_s")),
                num(((dec.get(row) or {}).get("roofline") or {}).get("pct_of_limit")),
                ratio(ratios.get(f"decode_{row}_over_hf-best")),
                *(num(((pre.get(row) or {}).get(pp) or {}).get("tokens_per_s")) for pp in pps),
                num((tp.get(row) or {}).get("tokens_per_s")),
                ratio(ratios.get(f"throughput_{row}_over_hf-best")),
            ]
            for row in dict.fromkeys([*dec, *pre, *tp])
        ]
        lines += [
            f"**{date(r)} UTC, {model(r)}, machine {labels[machine_key(r)]}, baige in "
            f"{limits(r).get('dtype', DASH)}** ({link(r, prefix)}): decode batch 1, {a.get('input_len', DASH)} in / "
            f"{a.get('output_len', DASH)} out; throughput {a.get('num_prompts', DASH)} prompts, "
            f"{a.get('tp_input_len', DASH)} in / {a.get('tp_output_len', DASH)} out "
            f"(±{(a.get('range_ratio') or 0):.0%}); median of {a.get('repeats', 1)} round(s).",
            "",
            *table(
                f"row | decode tokens/s | % of bandwidth | vs HF best (decode) | {pp_head}throughput total tokens/s | "
                "vs HF best (throughput)",
                rows,
            ),
        ]
        peers = {k: v for k, v in ratios.items() if equal_bits(k)}
        if peers:
            lines += ["", "At equal bits: " + "; ".join(f"{k} {ratio(v)}" for k, v in peers.items()) + "."]
        met = targets(s)
        if met:
            lines += ["", "Targets: " + "; ".join(met) + "."]
        for note in r.get("notes") or []:
            lines += ["", f"Note: {note}"]
        lines.append("")
    return lines[:-1]


def _best(rows: dict, names) -> tuple[str, float] | None:
    got = [(n, rows[n]["tokens_per_s"]) for n in names if n in rows]
    return max(got, key=lambda x: x[1]) if got else None


def _target(what: str, x: float, goal: float) -> str:
    verdict = "met" if x >= goal else f"missed by {100 * (1 - x / goal):.0f}%"
    return f"{what} {x:.2f}x (goal {goal}x: {verdict})"


def targets(s: dict) -> list[str]:
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


def equal_bits(key: str) -> bool:
    """A compare ratio of a quantized baige row over a quantized peer row (llama.cpp's, OpenVINO's, ONNX Runtime
    GenAI's, CTranslate2's, or the fastest of them at those bits)."""
    _, _, rest = key.partition("_")
    ours, _, peer = rest.partition("_over_")
    return ours.startswith("baige-") and not peer.startswith(("hf-", "baige"))
