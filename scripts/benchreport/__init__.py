"""The generator of docs/performance.md and the README's headline numbers (scripts/bench_report.py runs it):
``records`` reads a record's cells, ``machines`` labels the machines, ``inference``, ``training``,
``compare`` and ``arch`` (scripts/bench_arch.py's) build each benchmark kind's table, ``page`` lays out the
performance page and ``headline`` the README's block. Only the standard library."""

from .headline import BEGIN, END, headline, with_headline
from .machines import VARIANT_FLAGS, best_isa, machines
from .page import performance_page
from .records import RECORDS, load_records

__all__ = [
    "BEGIN",
    "END",
    "RECORDS",
    "VARIANT_FLAGS",
    "best_isa",
    "headline",
    "load_records",
    "machines",
    "performance_page",
    "with_headline",
]
