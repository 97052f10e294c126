"""The layout's rules (docs/design.md, docs/architecture.md), enforced on the import statements of baige/.

Every import counts, function-level ones included. Imports are resolved to baige modules: ``from
baige.x import y`` is an edge to ``baige.x.y`` when that is a module, else to ``baige.x``.
"""

import ast
import functools
import re
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "baige"
STDLIB = set(sys.stdlib_module_names)

# The dependency direction: a module may import modules of its own group or of a lower rank.
# kernels <- model <- quant <- weights <- infer <- {train, server, quantize, evaluate} <- bench <- cli:
# train sits above infer because GRPO's rollouts come from the engine (train/rl/, DESIGN.md "RL").
RANKS = {
    "baige.errors": 0,
    "baige.kernels": 0,
    "baige.runtime.config": 1,
    "baige.runtime.kv_transfer_config": 0.5,  # below config, which parses --kv-transfer-config into it
    "baige.runtime.json_flag": 0.25,  # the JSON-object flags' parser both of those use
    "baige.runtime.settings": 1,
    "baige.runtime.roofline": 1,
    "baige.runtime.model": 2,
    "baige.runtime.quant": 3,
    "baige.runtime.weights": 4,
    "baige.runtime.infer": 5,
    "baige.runtime.train": 6,
    "baige.runtime.server": 6,
    "baige.runtime.router": 6,  # an HTTP proxy over servers: it imports no engine
    "baige.runtime.quantize": 6,
    "baige.runtime.evaluate": 6,
    "baige.runtime.bench": 7,
    "baige.cli": 8,
    "baige.__main__": 9,
    "baige": 9,  # the package root: lazy re-exports of the public API (LLM, SamplingParams, BaigeError)
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


MODULES = all_modules()


def raw_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) for every import statement at any depth; relative imports resolved."""
    out = []
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.append((mod, [a.name for a in node.names]))
    return out


def baige_edges(path: Path, modules: dict[str, Path]) -> set[str]:
    """The baige modules a file imports."""
    edges = set()
    for mod, names in raw_imports(path):
        if mod != "baige" and not mod.startswith("baige."):
            continue
        subs = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in modules]
        edges.update(subs)
        if len(subs) < len(names) or not names:
            edges.add(mod)
    edges.discard(module_name(path))
    return edges


def graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    if modules is MODULES:  # the repository's graph, parsed once per session
        return _repo_graph()
    return {m: baige_edges(p, modules) for m, p in modules.items()}


@functools.cache
def _repo_graph() -> dict[str, set[str]]:
    return {m: baige_edges(p, MODULES) for m, p in MODULES.items()}


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (c := visit(m)):
            return c
    return None


def group(mod: str) -> str:
    """The longest RANKS key that is ``mod`` or a package above it."""
    parts = mod.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in RANKS:
            return ".".join(parts[:k])
    raise AssertionError(f"{mod} belongs to no layer of RANKS; add it")


def top(name: str) -> str:
    return name.split(".")[0]


def third_party(path: Path) -> set[str]:
    return {top(m) for m, _ in raw_imports(path)} - STDLIB - {"baige", "__future__"}


# ---- the rules ----------------------------------------------------------------------------------
def test_layout_has_the_subsystem_packages():
    for sub in ("model", "weights", "quant", "infer", "server", "train", "bench"):
        assert (PKG / "runtime" / sub / "__init__.py").is_file(), sub
    assert len(MODULES) > 40


def test_no_import_cycle():
    cycle = find_cycle(graph(MODULES))
    assert cycle is None, " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    # the check above could pass by never seeing an edge: it must see this one
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    edges = graph(MODULES)
    assert "baige.runtime.weights.loader" in edges["baige.runtime.infer.tp_worker"]


def test_dependency_direction():
    for mod, edges in graph(MODULES).items():
        g = group(mod)
        for dep in edges:
            d = group(dep)
            assert d == g or RANKS[d] < RANKS[g], f"{mod} imports {dep}: {d} is not below {g}"


def test_runtime_uses_only_the_public_kernel_api():
    import baige.kernels

    public = set(baige.kernels.__all__)
    for mod, path in MODULES.items():
        if mod.startswith("baige.kernels"):
            continue
        for imported, names in raw_imports(path):
            if imported.startswith("baige.kernels."):
                pytest.fail(f"{mod} imports {imported}: use `from baige import kernels`")
            if imported == "baige.kernels":
                assert set(names) <= public, f"{mod} imports {set(names) - public} from baige.kernels (not in __all__)"


def test_kernels_import_only_torch_and_triton():
    for mod, path in MODULES.items():
        if mod.startswith("baige.kernels"):
            # the native build's cache is shared by processes: its lock file is filelock's
            allowed = {"torch", "triton"} | ({"filelock"} if mod == "baige.kernels.cpu.build" else set())
            assert third_party(path) <= allowed, (mod, third_party(path))
            assert all(d.startswith("baige.kernels") for d in baige_edges(path, MODULES)), mod


def test_bookkeeping_modules_do_not_import_torch():
    for mod in ("baige.runtime.infer.scheduler", "baige.runtime.infer.block_manager"):
        assert "torch" not in third_party(MODULES[mod]), mod


def test_only_cli_imports_typer():
    for mod, path in MODULES.items():
        if not mod.startswith("baige.cli"):
            assert not third_party(path) & {"typer", "click"}, mod


def test_only_server_imports_the_web_framework():
    """The server and the router (an HTTP front door over servers, ``baige router``) serve HTTP."""
    for mod, path in MODULES.items():
        if not mod.startswith(("baige.runtime.server", "baige.runtime.router")):
            assert not third_party(path) & {"fastapi", "starlette", "uvicorn"}, mod


def test_router_imports_no_engine():
    """``baige router`` is an HTTP proxy: no engine, model or torch behind it (it starts in a moment)."""
    routers = [m for m in MODULES if m.startswith("baige.runtime.router")]
    assert "baige.runtime.router.proxy" in routers
    for mod in routers:
        for dep in baige_edges(MODULES[mod], MODULES):
            assert dep in ("baige.errors", "baige.runtime.config") or dep.startswith("baige.runtime.router"), (mod, dep)
        assert "torch" not in third_party(MODULES[mod]), mod


def test_transformers_only_in_the_peer_benchmark():
    for mod, path in MODULES.items():
        if mod != "baige.runtime.bench.compare":
            assert "transformers" not in third_party(path), mod


def test_model_stays_plain():
    for mod, path in MODULES.items():
        if mod.startswith("baige.runtime.model"):
            for dep in baige_edges(path, MODULES):
                assert not dep.startswith(("baige.runtime.infer", "baige.runtime.train", "baige.runtime.server")), (
                    mod,
                    dep,
                )


def test_modules_and_functions_stay_small():
    """No module over 500 lines, no function body over 80 (docs/design.md: split at ~400 / one screen).

    A function is measured from its first body statement (its docstring) to its end: the formatter puts
    each parameter of a long signature (a Typer command's options, a Triton kernel's pointers and strides)
    on its own line, and a signature is a list of names, not code to read."""
    for mod, path in MODULES.items():
        src = path.read_text()
        assert len(src.splitlines()) <= 500, f"{mod}: {len(src.splitlines())} lines"
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.body[0].lineno + 1
                assert n <= 80, f"{mod}.{node.name}: {n} lines"


def test_environment_is_read_in_the_settings_modules_only():
    """BAIGE_*/TRITON_INTERPRET/CC/CXX are read once (kernels.settings, runtime.settings); the
    distributed launcher's variables stay where torch.distributed needs them."""
    allowed = {
        "baige.kernels.settings",
        "baige.runtime.settings",
        "baige.runtime.train.parallel",
        "baige.runtime.bench.common",
        "baige.runtime.bench.serve_run",
        "baige.runtime.infer.tp_worker",
        "baige.runtime.router.dp",  # the data-parallel ranks' environments (devices, threads)
    }
    for mod, path in MODULES.items():
        if mod in allowed:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("environ", "getenv")
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
            ):
                pytest.fail(f"{mod}:{node.lineno} reads the environment; add it to a settings module")


# ---- the server's seams -------------------------------------------------------------------------
# Route modules (``routes``, ``*_routes``) share plumbing through ``server.serving`` and are imported by
# the app alone; the server reaches the engine through AsyncEngine's public API only and writes no
# engine state (DESIGN.md "server/"; vLLM's serving_engine seam).
SERVER = "baige.runtime.server"
SERVER_APP = f"{SERVER}.app"


def is_route_module(mod: str) -> bool:
    return mod.startswith(f"{SERVER}.") and mod.rpartition(".")[2].endswith("routes")


def route_import_violations(g: dict[str, set[str]]) -> list[str]:
    """Imports of a route module by anything but the app (another route module above all)."""
    out = []
    for mod, edges in sorted(g.items()):
        for dep in sorted(edges):
            if is_route_module(dep) and mod != SERVER_APP:
                who = "route module" if is_route_module(mod) else "module"
                out.append(f"{mod} imports {dep}: a {who} may not import a route module (share code via serving)")
    return out


def async_engine_api() -> set[str]:
    """What the server may touch on an AsyncEngine: its public methods and properties (its own and those
    of its base classes in baige.runtime.infer, the mixins it is split into) and the public attributes
    ``__init__`` sets, less ``engine`` (the Engine it wraps) and ``call`` (runs any function on that
    Engine: the server asks for a named method instead)."""
    classes = {
        n.name: n
        for m, path in MODULES.items()
        if m.startswith("baige.runtime.infer")
        for n in ast.parse(path.read_text()).body
        if isinstance(n, ast.ClassDef)
    }
    assert "AsyncEngine" in classes, "no AsyncEngine class in baige.runtime.infer"
    todo, names = ["AsyncEngine"], set()
    while todo:
        cls = classes[todo.pop()]
        todo += [b.id for b in cls.bases if isinstance(b, ast.Name) and b.id in classes]
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
                if node.name == "__init__":
                    names |= {
                        t.attr
                        for t in ast.walk(node)
                        if isinstance(t, ast.Attribute)
                        and isinstance(t.ctx, ast.Store)
                        and isinstance(t.value, ast.Name)
                        and t.value.id == "self"
                    }
    return {n for n in names if not n.startswith("_")} - {"engine", "call"}


def _engine_like(name: str) -> bool:
    return name == "engine" or name.endswith("_engine")


class EngineRefs:
    """Which expressions of one module are an AsyncEngine: a name or attribute called ``engine`` or
    ``*_engine`` (``st.engine``, ``self._engine``), a parameter annotated ``AsyncEngine``, and any name
    assigned from one of these (``eng = st.engine``)."""

    def __init__(self, tree: ast.AST):
        self.names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and node.annotation is not None:
                if {"AsyncEngine", "Engine"} & set(re.findall(r"\w+", ast.unparse(node.annotation))):
                    self.names.add(node.arg)
        grew = True
        while grew:  # aliases of aliases
            before = len(self.names)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                    for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        self._bind(target, node.value)
            grew = len(self.names) > before

    def _bind(self, target: ast.AST, value: ast.AST) -> None:
        if isinstance(target, ast.Name) and self.is_engine(value):
            self.names.add(target.id)
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            for t, v in zip(target.elts, value.elts):  # eng, bm = st.engine, ...
                self._bind(t, v)

    def is_engine(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return _engine_like(node.id) or node.id in self.names
        return isinstance(node, ast.Attribute) and _engine_like(node.attr)

    def chain_has_engine(self, node: ast.AST) -> bool:
        """``node`` or anything it is taken from (``a.b[c].d()`` -> ``a.b[c]``, ``a.b``, ``a``) is an engine."""
        while True:
            if self.is_engine(node):
                return True
            if isinstance(node, (ast.Attribute, ast.Subscript)):
                node = node.value
            elif isinstance(node, ast.Call):
                node = node.func
            else:
                return False


_ATTR_BUILTINS = ("getattr", "setattr", "delattr", "vars")


def engine_reach_violations(src: str, api: set[str]) -> list[str]:
    """Attribute chains that go past AsyncEngine's public API: into the Engine it wraps
    (``st.engine.engine``), its private state (``engine._engine``), its ``call`` (a function run on the
    Engine), or by name (``getattr(engine, ...)``)."""
    tree = ast.parse(src)
    refs, out = EngineRefs(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and refs.is_engine(node.value) and node.attr not in api:
            out.append(f"line {node.lineno}: {ast.unparse(node)} is not AsyncEngine's public API")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _ATTR_BUILTINS
            and node.args
            and refs.chain_has_engine(node.args[0])
        ):
            out.append(f"line {node.lineno}: {ast.unparse(node)} reaches into the engine by name")
    return out


def engine_write_violations(src: str) -> list[str]:
    """Assignments (``=``, ``+=``, ``del``, ``setattr``) to an attribute or item of an engine or of
    anything reached through one (``engine.on_output = f``, ``st.engine.engine.lora.base_name = x``)."""
    tree = ast.parse(src)
    refs, out = EngineRefs(tree), []
    for node in ast.walk(tree):
        stored = isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del))
        if stored and refs.chain_has_engine(node.value):
            out.append(f"line {node.lineno}: {ast.unparse(node)} writes engine state; call a public method")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
            and refs.chain_has_engine(node.args[0])
        ):
            out.append(f"line {node.lineno}: {ast.unparse(node)} writes engine state; call a public method")
    return out


SERVER_MODULES = {m: p for m, p in MODULES.items() if m == SERVER or m.startswith(f"{SERVER}.")}


def test_server_route_modules_do_not_import_each_other():
    assert route_import_violations(graph(MODULES)) == []
    routes = [m for m in SERVER_MODULES if is_route_module(m)]
    assert {f"{SERVER}.routes", f"{SERVER}.chat_routes", f"{SERVER}.lora_routes"} <= set(routes)
    for mod in routes:
        assert f"{SERVER}.serving" in graph(MODULES)[mod], f"{mod} should use the shared plumbing of serving"


def test_server_reaches_the_engine_through_the_public_api_only():
    api = async_engine_api()
    for mod, path in SERVER_MODULES.items():
        assert engine_reach_violations(path.read_text(), api) == [], mod
        assert "baige.runtime.infer.engine" not in baige_edges(path, MODULES), f"{mod}: talk to AsyncEngine"


def test_server_writes_no_engine_state():
    for mod, path in SERVER_MODULES.items():
        assert engine_write_violations(path.read_text()) == [], mod


def test_server_seam_checks_catch_what_they_forbid():
    # the three checks above could pass by seeing nothing: each must flag these snippets
    api = async_engine_api()
    assert {"generate", "is_alive", "tokenizer", "abort", "sleep"} <= api and not api & {"engine", "call", "_thread"}
    bad_graph = {f"{SERVER}.chat_routes": {f"{SERVER}.routes"}, f"{SERVER}.serving": {f"{SERVER}.lora_routes"}}
    assert len(route_import_violations(bad_graph)) == 2
    assert route_import_violations({SERVER_APP: {f"{SERVER}.routes", f"{SERVER}.chat_routes"}}) == []
    reaches = [
        "def f(st):\n    return st.engine.engine.tokenizer",
        "def f(request):\n    return request.app.state.baige.engine._engine",
        "def f(engine):\n    return engine.engine.lora.loaded",
        "async def f(st):\n    await st.engine.call(lambda e: e.lora.add(1))",
        "def f(st):\n    eng = st.engine\n    return eng.scheduler.running",
        "def f(st):\n    n, eng = 1, st.engine\n    return eng.block_manager",
        "def f(core: AsyncEngine):\n    return core.block_manager",
        "def f(st):\n    return getattr(st.engine, 'engine')",
    ]
    for snippet in reaches:
        assert engine_reach_violations(snippet, api), snippet
    fine = "async def f(st):\n    st.engine.abort('x')\n    return st.engine.tokenizer, st.engine.generate(1, 2)"
    assert engine_reach_violations(fine, api) == []
    writes = [
        "def f(engine, g):\n    engine.on_output = g",
        "def f(st):\n    st.engine.engine.lora.base_name = 'm'",
        "def f(st):\n    st.engine.stats().grammar['compiles'] += 1",
        "def f(st):\n    del st.engine.on_dead",
        "def f(st):\n    setattr(st.engine, 'dead', None)",
    ]
    for snippet in writes:
        assert engine_write_violations(snippet), snippet
    assert engine_write_violations("def f(self, engine):\n    self.engine = engine\n    x = engine.stats()") == []
