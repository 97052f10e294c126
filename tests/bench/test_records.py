"""A benchmark result's provenance: the commit and the command line it was measured with."""

import shutil
import subprocess
from pathlib import Path

import pytest

from baige.runtime.bench import records

REPO = Path(__file__).resolve().parents[2]


def test_command_line_is_what_a_user_types():
    argv = ["bench", "latency", "--output-len", "8", "--speculative-config", '{"method": "ngram"}']
    assert (
        records.command_line(argv) == 'baige bench latency --output-len 8 --speculative-config \'{"method": "ngram"}\''
    )


def test_command_line_of_a_repository_script(monkeypatch):
    monkeypatch.setattr("sys.argv", [str(REPO / "scripts" / "bench_rl_vs_trl.py"), "--dtype", "bfloat16"])
    assert records.command_line() == "python scripts/bench_rl_vs_trl.py --dtype bfloat16"
    monkeypatch.setattr("sys.argv", [str(REPO / "baige" / "__main__.py"), "bench", "latency"])
    assert records.command_line() == "baige bench latency"


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="not a git checkout")
def test_git_commit_is_head_of_the_checkout():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    commit, dirty = records.git_commit()
    assert commit == head and len(commit) == 40
    assert isinstance(dirty, bool)


def test_provenance_outside_a_git_tree(monkeypatch):
    monkeypatch.setattr(records, "_git", lambda *args: None)
    assert records.provenance()["git_commit"] is None
    assert records.provenance()["git_dirty"] is None
