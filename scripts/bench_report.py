"""Generate the performance page (docs/performance.md) and the README's headline numbers from the benchmark
records (docs/benchmarks/records/*.json, the JSON results `baige bench ... --output-dir docs/benchmarks/records`
writes).

    python scripts/bench_report.py            # rewrite docs/performance.md and the README's numbers
    python scripts/bench_report.py --check    # exit 1 when either is not what the records give

Only the standard library: the test suite regenerates both and compares (tests/docs/test_docs.py).
Every number printed comes from a record and links to it; nothing is typed in by hand. The tables are built by
the package beside this script (scripts/benchreport/).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the benchreport package beside this script, also when loaded by its path
    sys.path.insert(0, str(HERE))

from benchreport import (  # noqa: E402
    RECORDS,
    VARIANT_FLAGS,
    best_isa,
    headline,
    load_records,
    performance_page,
    with_headline,
)

__all__ = ["RECORDS", "VARIANT_FLAGS", "best_isa", "headline", "load_records", "performance_page", "with_headline"]

REPO = HERE.parent
PAGE = Path("docs/performance.md")
README = Path("README.md")


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
