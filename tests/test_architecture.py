"""DESIGN.md's dependency direction: cli -> runtime -> kernels, enforced on the import statements."""

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "baige"
STDLIB = set(sys.stdlib_module_names)


def imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports count too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def top(name: str) -> str:
    return name.split(".")[0]


def files(sub: str = "") -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


def test_package_has_modules():
    assert len(files()) > 10 and (PKG / "runtime" / "model.py").is_file()


def test_kernels_import_only_torch_and_triton():
    for f in files("kernels"):
        for name in imports(f):
            assert top(name) in STDLIB | {"torch", "triton", "__future__"} or name.startswith("baige.kernels"), (f, name)


def test_runtime_never_imports_cli_or_typer_or_transformers():
    bench_compare = PKG / "runtime" / "bench" / "compare.py"  # DESIGN: transformers in tests and benchmarks only
    for f in files("runtime"):
        for name in imports(f):
            assert not name.startswith("baige.cli"), (f, name)
            assert top(name) not in ({"typer"} if f == bench_compare else {"typer", "transformers"}), (f, name)


def test_model_stays_plain():
    for name in imports(PKG / "runtime" / "model.py"):
        assert not any(name.startswith(f"baige.runtime.{m}") for m in ("parallel", "engine", "train", "server")), name


def test_only_server_imports_the_web_framework():
    web = {"fastapi", "starlette", "uvicorn"}
    for f in files():
        if f.name == "server.py":
            continue
        assert not {top(n) for n in imports(f)} & web, f


def test_bookkeeping_modules_do_not_import_torch():
    for name in ("scheduler.py", "block_manager.py"):
        f = PKG / "runtime" / name
        if f.is_file():  # present once the serving engine lands
            assert "torch" not in {top(n) for n in imports(f)}, f
