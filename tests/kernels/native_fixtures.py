"""Fixtures of the native CPU kernel tests (test_kernels_cpu.py, test_cpu_attention.py, test_moe_cpu.py),
registered by ``tests/conftest.py``'s ``pytest_plugins`` (not a conftest.py of their own: the tests import the
top-level ``conftest`` module by name, which a second conftest.py would shadow)."""

import shutil

import pytest

from baige.kernels.cpu import build as cpu_library


@pytest.fixture
def native_kernel():
    """Skip only where the kernel is not meant to build (no C compiler, no AVX2); elsewhere it must."""
    if not (shutil.which("cc") or shutil.which("gcc")) or not cpu_library.cpu_has_avx2():
        pytest.skip("no C compiler or no AVX2: the native kernel is not built here")
    assert cpu_library.library() is not None, "the native CPU kernels failed to build (see the warning)"


@pytest.fixture
def use_isa(monkeypatch):
    """``use_isa(variant)``: force BAIGE_CPU_ISA and check the loaded library is that variant."""
    from baige.runtime.settings import reload_settings

    def use(variant):
        monkeypatch.setenv("BAIGE_CPU_ISA", variant)
        reload_settings()
        assert cpu_library.library().baige_isa().decode() == variant

    return use
