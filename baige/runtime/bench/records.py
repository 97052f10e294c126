"""What makes a benchmark result a record: the commit and the command line it was measured with.

Every ``baige bench`` result carries an ``environment`` (:func:`baige.runtime.bench.common.environment`:
versions, CPU model, instruction-set flags, core count, load average, date); the measured memory
bandwidth and matmul peak sit beside it under ``limits``. This module adds the provenance: which
code ran (``git_commit``, ``git_dirty``) and how it was asked for (``command``). Written into
``docs/benchmarks/records/`` (``baige bench ... --output-dir docs/benchmarks/records``), such files are
the data the documentation's performance page is generated from (``scripts/bench_report.py``).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

# The directory the documentation's performance page is generated from, relative to the repository root.
RECORDS_DIR = Path("docs/benchmarks/records")


PACKAGE = Path(__file__).resolve().parents[2]  # the baige package directory


def _git(*args: str) -> str | None:
    """``git <args>`` run in the baige package directory; None when that is not inside a git work
    tree or git is missing (an installed wheel)."""
    try:
        r = subprocess.run(
            ["git", *args],
            cwd=PACKAGE,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_commit() -> tuple[str | None, bool | None]:
    """(full commit hash of HEAD, whether the package's tracked files differ from it: the code that ran
    is not exactly the commit's); (None, None) outside a git tree. Documentation edits do not count."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".")
    return commit, None if status is None else bool(status)


def command_line(argv: list[str] | None = None) -> str:
    """The command as a user would type it: ``baige`` and the arguments after the program name
    (``python -m baige bench latency`` and the ``baige`` console script give the same string), or for a
    script of this repository (``scripts/*.py``) ``python scripts/NAME.py`` and its arguments."""
    if argv is None:
        prog = Path(sys.argv[0])
        if prog.suffix == ".py" and prog.name != "__main__.py":
            try:
                prog = prog.resolve().relative_to(Path(__file__).resolve().parents[3])
            except ValueError:
                pass
            return shlex.join(["python", str(prog), *sys.argv[1:]])
        argv = sys.argv[1:]
    return shlex.join(["baige", *argv])


def provenance() -> dict[str, str | bool | None]:
    """``git_commit``, ``git_dirty`` and ``command`` of this process, for a result's ``environment``."""
    commit, dirty = git_commit()
    return {"git_commit": commit, "git_dirty": dirty, "command": command_line()}
