"""Start-up: the command line imports nothing heavy until a command runs, every ``--help`` included, and
importing baige compiles no native code.

Each check runs in a fresh interpreter (this test process has torch loaded already)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from baige.runtime.settings import reload_settings

# what a `--help` must not import: the tensor and model stack, the web stack, plotting
HEAVY = (
    "torch",
    "numpy",
    "transformers",
    "triton",
    "safetensors",
    "tokenizers",
    "jinja2",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "matplotlib",
    "gguf",
)
COMMANDS = {"convert", "generate", "chat", "quantize", "serve", "router", "train", "bench", "eval"}
BENCH_COMMANDS = {"latency", "throughput", "serve", "kernels", "train", "grpo", "compare", "startup"}


def run_python(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object last, which is returned."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_help_imports_nothing_heavy():
    """``baige --help``, every command's and every bench/eval subcommand's: exit 0, each group's help
    lists its commands, and not one heavy module is imported on the way."""
    out = run_python(
        f"""
        import contextlib, io, json, sys
        from typer.main import get_command
        from baige.cli import main
        from baige.cli.app import app

        def paths(cmd, prefix):
            yield prefix, sorted(getattr(cmd, "commands", {{}}))
            for name, sub in getattr(cmd, "commands", {{}}).items():
                yield from paths(sub, [*prefix, name])

        helps = {{}}
        for argv, subcommands in paths(get_command(app), []):
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                try:
                    main([*argv, "--help"])
                except SystemExit as e:
                    code = e.code
            helps[" ".join(argv)] = {{"code": code, "text": text.getvalue(), "subcommands": subcommands}}
        print(json.dumps({{"helps": helps, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
        """
    )
    helps = out["helps"]
    assert set(helps[""]["subcommands"]) == COMMANDS and set(helps["bench"]["subcommands"]) == BENCH_COMMANDS
    assert {f"bench {c}" for c in BENCH_COMMANDS} | {"eval ppl", "eval compare"} <= set(helps)
    for argv, h in helps.items():
        assert h["code"] == 0 and "Usage:" in h["text"], (argv, h)
        assert all(f" {c} " in h["text"] for c in h["subcommands"]), (argv, h["text"])
    assert out["heavy"] == []


def test_baige_help_lists_the_commands_in_a_real_process():
    proc = subprocess.run([sys.executable, "-m", "baige", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("│ ") and len(line.split()) > 2}
    assert COMMANDS <= listed, proc.stdout


def test_kernel_settings_are_checked_when_a_command_runs_not_for_its_help(cli_error, monkeypatch, capsys):
    """A bad BAIGE_KERNELS: every command refuses to run (bench subcommands and the default suite
    included), while its help still shows."""
    from baige.cli import main

    monkeypatch.setenv("BAIGE_KERNELS", "bogus")
    reload_settings()
    for args in (["bench", "kernels", "--op", "rms_norm"], ["bench", "--peers", "none"], ["convert", "x", "y"]):
        assert "BAIGE_KERNELS='bogus' is not one of auto, reference, triton" in cli_error(*args)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0 and "Usage:" in capsys.readouterr().out


def test_serve_help_names_every_openai_endpoint(capsys):
    from baige.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert e.value.code == 0
    for path in (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/models",
        "/tokenize",
    ):
        assert f"{path}," in text or f"{path})" in text, (path, text[:600])


def test_importing_baige_compiles_no_native_code(tmp_path):
    """Every baige module imported, and the command line built, with an empty cache and a C compiler
    that records its calls: nothing compiled, nothing written to the cache. Then the first use of the
    native kernels does call the compiler (the check above can see a build)."""
    calls = tmp_path / "cc-calls"
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 1\n')
    cc.chmod(0o755)
    cache = tmp_path / "cache"
    out = run_python(
        f"""
        import contextlib, importlib, io, json, os, pkgutil, sys, warnings
        import baige
        from baige.cli import main

        for m in pkgutil.walk_packages(baige.__path__, "baige."):
            if m.name != "baige.__main__":  # that one runs the command line
                importlib.import_module(m.name)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main(["--help"])
        before = {{"cc_called": os.path.exists({str(calls)!r}), "cache": sorted(os.listdir({str(tmp_path)!r}))}}

        from baige import kernels
        from baige.kernels.cpu import cpu_has_avx2

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the recording compiler fails: one warning, then PyTorch
            kernels.native_cpu_available()
        after = {{"cc_called": os.path.exists({str(calls)!r}), "avx2": cpu_has_avx2()}}
        print(json.dumps({{"before": before, "after": after}}))
        """,
        BAIGE_CACHE=str(cache),
        CC=str(cc),
    )
    assert out["before"] == {"cc_called": False, "cache": ["cc"]}  # no cache directory created either
    if out["after"]["avx2"]:
        assert out["after"]["cc_called"] and "--version" in calls.read_text()
