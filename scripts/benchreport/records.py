"""Reading one benchmark record: loading the records' directory and the cells every table shares (date,
commit, model, threads, load, links), formatted for the performance page. Only the standard library."""

from __future__ import annotations

import json
from pathlib import Path

RECORDS = Path("docs/benchmarks/records")  # relative to the repository root
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
    return sorted(records, key=lambda r: (env(r).get("date") or "", r["_file"]), reverse=True)


def env(r: dict) -> dict:
    """The record's ``environment`` (empty when it has none)."""
    return r.get("environment") or {}


def kind(r: dict) -> str:
    """The benchmark that wrote the record: its ``benchmark`` field, else its file name before the date."""
    return r.get("benchmark") or r["_file"].rsplit("-", 2)[0]


def model(r: dict) -> str:
    args = r.get("args") or {}
    name = (args.get("engine") or {}).get("model") or args.get("model") or r.get("model_id")
    return f"`{name}`" if name else f"`{DEFAULT_MODEL}`"


def date(r: dict) -> str:
    """``YYYY-MM-DD HH:MM`` (UTC) of the record's date, a dash without one."""
    d = env(r).get("date") or ""
    return f"{d[:10]} {d[11:16]}" if len(d) >= 16 else DASH


def commit(r: dict) -> str:
    """The short commit, ``+`` after it when the package differed from that commit."""
    c = env(r).get("git_commit")
    return DASH if not c else c[:7] + ("+" if env(r).get("git_dirty") else "")


def num(x, digits: int = 1) -> str:
    """``x`` with thousands separators and ``digits`` decimals, a dash for None."""
    return DASH if x is None else f"{x:,.{digits}f}"


def ratio(x) -> str:
    return DASH if x is None else f"{x:.2f}x"


def median(xs: list) -> float | None:
    xs = sorted(xs or [])
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def limits(r: dict) -> dict:
    """The measured limits (bandwidth in bytes/s, matmul peak in FLOP/s, their dtype) the record compares to."""
    return r.get("limits") or (r.get("roofline") or {}).get("limits") or {}


def link(r: dict, prefix: str) -> str:
    return f"[{r['_file']}]({prefix}{r['_file']})"


def threads(r: dict) -> str:
    n = env(r).get("torch_num_threads")
    return f"{n} thread" + ("" if n == 1 else "s") if n is not None else "threads not recorded"


def load(r: dict) -> str:
    """The one-minute load average while measuring, a dash when not recorded."""
    e = env(r)
    load = (e.get("load_average") or [None])[0]
    return DASH if load is None else f"{load:.1f}"


def table(header: str, rows) -> list[str]:
    """A Markdown table: ``header`` (the column names joined by `` | ``), its rule, then one line per list of
    cells in ``rows``."""
    return [
        f"| {header} |",
        "|" + "---|" * (header.count(" | ") + 1),
        *("| " + " | ".join(str(c) for c in cells) + " |" for cells in rows),
    ]
