"""The documentation stays true: the site builds without a broken link or anchor, every example marked
runnable runs, the performance page and the README's numbers are what the benchmark records say, and the
README stays a front page.

Runnable examples: an HTML comment ``<!-- run -->`` on the line before a fenced block marks it (options
after a colon, shell-quoted: ``<!-- run: exit=2 timeout=120 expect="Paris" -->``).

- ``console`` blocks: each ``$ command`` line runs (``\\`` continues it on the next line), and every line
  shown under it must appear in what the command printed (stdout and stderr, spaces normalised);
- ``bash`` blocks run as one script (``set -euo pipefail``); ``python`` blocks run with this interpreter.

Blocks of one page run in order in one temporary directory (an example may use what the one before it
wrote), ``baige`` on the PATH is this checkout's, and the suite's environment (its model cache, the fp32
``--dtype auto``) is inherited. ``exit`` is the expected exit status (default 0), ``expect`` a text the
output must contain, ``timeout`` seconds (default 120).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import DATA_DIR
from markdown.extensions.toc import slugify

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README = REPO / "README.md"
RUN_MARK = re.compile(r"^<!--\s*run(?::(?P<opts>.*?))?\s*-->\s*$")
FENCE = re.compile(r"^(?P<fence>```+|~~~+)\s*(?P<lang>[\w+-]*)")
# an internal issue reference: "#19", "issue 3" (an anchor link "(#section)" or an HTML entity "&#39;" is not)
ISSUE_REF = re.compile(r"(?<![\w&(])#\d+\b|\b[Ii]ssues? \d+\b")


@dataclass
class Block:
    page: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    opts: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def markdown_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def runnable_blocks(path: Path) -> list[Block]:
    """The marked blocks of one Markdown file, in order. Raises ValueError for a mark that is not
    followed by a fenced block, or a block without a closing fence."""
    lines = path.read_text().splitlines()
    rel = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
    blocks, i = [], 0
    while i < len(lines):
        m = RUN_MARK.match(lines[i].strip())
        i += 1
        if not m:
            continue
        while i < len(lines) and not lines[i].strip():
            i += 1
        f = FENCE.match(lines[i].strip()) if i < len(lines) else None
        if not f:
            raise ValueError(f"{rel}:{i}: <!-- run --> must be followed by a fenced block")
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(f["fence"]):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{rel}:{start}: the fenced block never closes")
        opts = dict(kv.split("=", 1) for kv in shlex.split(m["opts"] or ""))
        blocks.append(Block(rel, start, f["lang"], "\n".join(body) + "\n", opts))
        i += 1
    return blocks


def console_steps(text: str) -> list[tuple[str, list[str]]]:
    """``$ command`` lines of a console block with the output lines shown under each."""
    steps: list[tuple[str, list[str]]] = []
    lines = iter(text.splitlines())
    for line in lines:
        if line.startswith("$ "):
            cmd = line[2:]
            while cmd.endswith("\\"):
                cmd = cmd[:-1].rstrip() + " " + next(lines).strip()
            steps.append((cmd, []))
        elif steps and line.strip():
            steps[-1][1].append(line.strip())
    return steps


ALL_BLOCKS = [b for p in markdown_pages() for b in runnable_blocks(p)]


def test_runnable_examples_are_found():
    pages = {b.page for b in ALL_BLOCKS}
    assert {"docs/getting-started.md", "docs/commands/quantize.md", "docs/reliability.md"} <= pages
    assert all(b.lang in ("console", "bash", "python") for b in ALL_BLOCKS), [b.id for b in ALL_BLOCKS]


def test_a_mark_without_a_block_is_an_error(tmp_path):
    bad = tmp_path / "bad.md"
    bad.write_text("text\n<!-- run -->\nnot a fence\n")
    with pytest.raises(ValueError, match="must be followed by a fenced block"):
        runnable_blocks(bad)


def test_console_steps_join_continuations_and_collect_output():
    text = "$ baige quantize --method int8 \\\n    --output q\nwrote q\n\n$ ls q\nconfig.json\n"
    assert console_steps(text) == [("baige quantize --method int8 --output q", ["wrote q"]), ("ls q", ["config.json"])]


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory, embedded_dir) -> dict:
    """PATH with ``baige`` = this interpreter's ``-m baige`` on this checkout; the embedded model imported."""
    bin_dir = tmp_path_factory.mktemp("bin")
    shim = bin_dir / "baige"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m baige "$@"\n')
    shim.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(REPO))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("BAIGE_DATA", str(DATA_DIR))  # the examples' "$BAIGE_DATA/wikitext-2-raw-test.txt"
    env.pop("COLUMNS", None)
    return env


@pytest.fixture(scope="module")
def page_dirs(tmp_path_factory) -> dict:
    return {}


def _run(argv: list[str], cwd: Path, env: dict, timeout: float) -> tuple[int, str]:
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def _squash(s: str) -> str:
    return " ".join(s.split())


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=lambda b: b.id)
def test_doc_example_runs(block: Block, shell_env, page_dirs, tmp_path_factory):
    cwd = page_dirs.setdefault(block.page, tmp_path_factory.mktemp("page"))
    timeout = float(block.opts.get("timeout", 120))
    want_rc = int(block.opts.get("exit", 0))
    if block.lang == "console":
        steps = [(["bash", "-c", cmd], cmd, shown) for cmd, shown in console_steps(block.text)]
    elif block.lang == "bash":
        steps = [(["bash", "-euo", "pipefail", "-c", block.text], block.text, [])]
    else:
        steps = [([sys.executable, "-c", block.text], block.text, [])]
    assert steps, f"{block.id}: a runnable block with nothing to run"
    for i, (argv, shown_cmd, shown_out) in enumerate(steps):
        rc, out = _run(argv, cwd, shell_env, timeout)
        last = i == len(steps) - 1
        expected_rc = want_rc if last else 0
        assert rc == expected_rc, f"{block.id}: `{shown_cmd}` exited {rc} (expected {expected_rc}):\n{out[-3000:]}"
        for line in shown_out:
            assert _squash(line) in _squash(out), f"{block.id}: `{shown_cmd}` did not print {line!r}:\n{out[-3000:]}"
    if "expect" in block.opts:
        assert _squash(block.opts["expect"]) in _squash(out), f"{block.id}: no {block.opts['expect']!r} in:\n{out}"


def _mkdocs_build(project: Path, site: Path) -> subprocess.CompletedProcess:
    # not --quiet: it hides the warnings from the counter that makes --strict fail
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_mkdocs_build_strict(tmp_path):
    """No warning: every link and anchor resolves, every page is in the nav."""
    r = _mkdocs_build(REPO, tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr


def test_mkdocs_build_strict_fails_on_a_broken_anchor(tmp_path):
    """The build above could pass by not checking: with the same configuration, a link to a missing
    heading fails it."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n\n[there](other.md#no-such-heading)\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n")
    config = (REPO / "mkdocs.yml").read_text()
    nav = config.index("\nnav:")
    (tmp_path / "mkdocs.yml").write_text(config[:nav] + "\nnav:\n  - index.md\n  - other.md\n")
    r = _mkdocs_build(tmp_path, tmp_path / "site")
    assert r.returncode != 0 and "no-such-heading" in r.stdout + r.stderr, r.stdout + r.stderr


def _bench_report():
    spec = importlib.util.spec_from_file_location("bench_report", REPO / "scripts" / "bench_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_performance_page_is_generated_from_the_records():
    """`python scripts/bench_report.py` regenerates docs/performance.md and the README's numbers."""
    report = _bench_report()
    records = report.load_records(REPO / report.RECORDS)
    assert records, "no benchmark records"
    assert (DOCS / "performance.md").read_text() == report.performance_page(records)
    assert README.read_text() == report.with_headline(README.read_text(), records)


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250)"


@pytest.mark.parametrize("path", [README, *markdown_pages()], ids=lambda p: str(p.relative_to(REPO)))
def test_no_internal_issue_numbers(path: Path):
    found = [
        (n, m.group()) for n, line in enumerate(path.read_text().splitlines(), 1) for m in ISSUE_REF.finditer(line)
    ]
    assert not found, f"{path.relative_to(REPO)}: internal issue references {found}"


def _anchors(md: Path) -> set[str]:
    """The heading ids MkDocs gives a page (Python-Markdown's toc slugify; repeated titles get _1, _2)."""
    seen: dict[str, int] = {}
    fence = False
    for line in md.read_text().splitlines():
        if FENCE.match(line.strip()):
            fence = not fence
        m = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = slugify(re.sub(r"[`*]", "", m.group(1)), "-")
            seen[slug] = seen.get(slug, -1) + 1
            yield slug if seen[slug] == 0 else f"{slug}_{seen[slug]}"


def test_readme_links_resolve():
    """README is read on the forge, outside the site: its relative links must point at files (and
    headings) that exist."""
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = (README.parent / target).resolve() if target else README
        assert path.exists(), f"README links to {link}: no such file"
        if anchor and path.suffix == ".md":
            assert anchor in set(_anchors(path)), f"README links to {link}: no such heading"


def _record(tmp: Path, name: str, record: dict) -> None:
    env = {
        "device": "cpu",
        "cpu_model": "Test CPU",
        "cpu_count": 2,
        "cpu_flags": ["avx2", "fma"],
        "cpu_isa": "avx2",
        "torch_num_threads": 1,
        "load_average": [0.5, 0.5, 0.5],
        "date": "2026-12-07T10:00:00+0000",
        "git_commit": "0123456789abcdef0123456789abcdef01234567",
        "git_dirty": True,
        "command": "baige bench latency --batch-size 1",
    }
    (tmp / name).write_text(json.dumps({**record, "environment": env}))


def test_bench_report_reads_the_numbers_of_hand_made_records(tmp_path):
    report = _bench_report()
    limits = {"dtype": "float32", "bandwidth": 20.0e9, "matmul_peak": 100.0e9}
    _record(
        tmp_path,
        "latency-1.json",
        {
            "benchmark": "latency",
            "args": {"batch_size": 1, "input_len": 32, "output_len": 16, "engine": {"model": None}},
            "limits": limits,
            "summary": {
                "ttft_s": 0.125,
                "tpot_s": 0.04,
                "decode_tokens_per_s": 25.0,
                "decode_roofline": {"pct_of_limit": 62.5},
            },
        },
    )
    _record(
        tmp_path,
        "compare-1.json",
        {
            "benchmark": "compare",
            "args": {"engine": {"model": None}},
            "limits": limits,
            "summary": {
                "decode": {"baige": {"tokens_per_s": 30.0}, "hf-float32": {"tokens_per_s": 10.0}},
                "throughput": {"baige": {"tokens_per_s": 200.0}, "hf-float32": {"tokens_per_s": 80.0}},
                "ratios": {"decode_baige_over_hf-best": 3.0, "throughput_baige_over_hf-best": 2.5},
            },
        },
    )
    _record(  # another model's compare, listed first (same date, later name): the page only, not the headline
        tmp_path,
        "compare-2.json",
        {
            "benchmark": "compare",
            "args": {"engine": {"model": "/tmp/mid/gemma3_text"}},
            "limits": limits,
            "summary": {
                "decode": {"baige": {"tokens_per_s": 14.0}, "hf-float32": {"tokens_per_s": 7.0}},
                "ratios": {"decode_baige_over_hf-best": 2.0, "throughput_baige_over_hf-best": 1.5},
            },
        },
    )
    records = report.load_records(tmp_path)
    page = report.performance_page(records)
    assert "| M1 | Test CPU | 2 | avx2 fma | avx2 | 20.0 GB/s | 100.0 GFLOP/s (float32) | 3 |" in page
    assert "| 1 | 32 / 16 | 125.0 | 40.0 | 25.0 | 62.5 | [latency-1.json](benchmarks/records/latency-1.json) |" in page
    assert "| baige | 30.0 | — | 3.00x | 200.0 | 2.50x |" in page
    assert "commit 0123456+, 2026-12-07 10:00 UTC, 1 thread, load 0.5 on 2 cores" in page
    head = report.headline(records)
    assert "**3.00x HF transformers' batch-1 decode**" in head and "2.50x its offline throughput" in head
    assert "(docs/benchmarks/records/compare-1.json)" in head and "compare-2.json" not in head
    assert "`/tmp/mid/gemma3_text`" in page and "| baige | 14.0 |" in page
    with pytest.raises(ValueError, match="no .* block"):
        report.with_headline("a README without markers", records)
    (tmp_path / "router").mkdir()
    _record(
        tmp_path / "router",
        "router-1.json",
        {
            "benchmark": "router",
            "args": {"model": "m", "backends": 4},
            "num_requests": 32,
            "ideal_hit_tokens": 1000,
            "results": {"prefix": {"hit_tokens": 950.0, "fraction_of_ideal": 0.95, "mean_latency_s": 0.25}},
        },
    )
    page = report.performance_page(report.load_records(tmp_path / "router"))
    assert "| 4 | 32 | `prefix` | 950 of 1,000 | 95.0% | 0.250 | [router-1.json]" in page
    (tmp_path / "cp").mkdir()
    _record(
        tmp_path / "cp",
        "train_cp-1.json",
        {
            "benchmark": "train_cp",
            "args": {"model": "debug", "context_parallel_degree": 2},
            "rows": [
                {
                    "seq_len": 4096,
                    "context_parallel_degree": 2,
                    "context_parallel_method": "ring",
                    "tokens_per_s_per_device": 512.0,
                    "peak_memory_bytes": [2**30, 3 * 2**29],
                    "step_memory_bytes": [2**28, 2**27],
                    "last_loss": 10.5,
                }
            ],
        },
    )
    page = report.performance_page(report.load_records(tmp_path / "cp"))
    assert "| 4096 | 2 (ring) | 512.0 | 1.00 / 1.50 | 0.250 / 0.125 | 10.5000 |" in page


def test_bench_report_marks_a_forced_native_variant(tmp_path):
    """A latency record run with BAIGE_CPU_ISA forcing a variant below its CPU's default is marked so in the
    latency table, and neither the README's headline nor the machine's "native kernels" cell takes it; the
    script's copy of the variant flags ranks variants as baige.kernels.cpu.isa.best does."""
    from baige.kernels.cpu import isa

    report = _bench_report()
    for name, (need, _) in isa.VARIANTS.items():
        assert set(dict(report.VARIANT_FLAGS)[name]) == set(need), name
        assert report.best_isa(need) == isa.best(frozenset(need)) == name
    assert report.best_isa(["avx", "sse4_2"]) is None
    flags = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"]
    for i, (variant, tps) in enumerate([("avx512", 40.0), ("avx2", 30.0)]):
        env = {"device": "cpu", "cpu_model": "Test CPU", "cpu_count": 2, "cpu_flags": flags, "cpu_isa": variant}
        env["date"] = f"2026-12-07T1{i}:00:00+0000"  # the forced avx2 run is the newer one
        summary = {"ttft_s": 0.1, "tpot_s": 0.02, "decode_tokens_per_s": tps, "decode_roofline": {"pct_of_limit": 50}}
        record = {"benchmark": "latency", "args": {"batch_size": 1}, "summary": summary, "environment": env}
        (tmp_path / f"latency-{i}.json").write_text(json.dumps(record))
    records = report.load_records(tmp_path)
    page = report.performance_page(records)
    assert "| M1 (`avx2` forced) | — | 1 |" in page and "| M1 | — | 1 |" in page
    assert "| avx512 | — | — | 2 |" in page  # the machine's default variant
    assert "**40.0 tokens/s batch-1 decode" in report.headline(records)


REPO_PATH = re.compile(r"`((?:baige|scripts|tests|docs)/[\w./*<>-]*)")  # globs and <placeholders> skipped


@pytest.mark.parametrize(
    "path",
    [README, *(p for p in markdown_pages() if p.parent.name != "benchmarks")],  # the archive is history
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_paths_named_in_the_docs_exist(path: Path):
    """A module, script or test the text names by its path is still there (a move updates the docs)."""
    names = {m for m in REPO_PATH.findall(path.read_text()) if not set(m) & set("*<>")}
    missing = sorted(m for m in names if not (REPO / m).exists())
    assert not missing, f"{path.relative_to(REPO)} names paths that do not exist: {missing}"
