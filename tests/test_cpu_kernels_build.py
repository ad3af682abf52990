"""The C++ CPU ops at install time and their fallback: setup.py's build step compiles them into the kernel
cache without importing the rest of pagedllm, and a build that fails says so in one warning with its cost."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import cpu_kernels

ROOT = Path(__file__).resolve().parent.parent


def test_a_failed_build_says_so_once_with_its_cost(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    from torch.utils import cpp_extension

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Error building extension 'pagedllm_cpu_ops'\nc++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    cpu_kernels.load_cpu_kernels.cache_clear()
    logging.getLogger("pagedllm").addHandler(caplog.handler)  # pagedllm's logger does not propagate
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm"):
            assert cpu_kernels.load_cpu_kernels() is False
            assert cpu_kernels.load_cpu_kernels() is False  # cached: asked per layer, said once
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "could not be built" in warnings[0] and "c++: command not found" in warnings[0]
        assert f"falling back to torch ops, {cpu_kernels.FALLBACK_COST}" in warnings[0]
    finally:
        logging.getLogger("pagedllm").removeHandler(caplog.handler)
        monkeypatch.undo()
        cpu_kernels.load_cpu_kernels.cache_clear()
        cpu_kernels.load_cpu_kernels()


def test_install_build_step_runs_without_the_rest_of_the_package() -> None:
    """setup.py's build step imports pagedllm.cpu_kernels alone (no transformers, no engine: while pip
    builds, they may not be installed yet) and loads the ops from the cache this process already built."""
    if not cpu_kernels.load_cpu_kernels():
        pytest.skip("the C++ ops do not build on this machine")
    script = ROOT / "pagedllm" / "build_cpu_kernels.py"
    assert str(script.relative_to(ROOT)) in (ROOT / "setup.py").read_text().replace('", "', "/")
    code = (f"import runpy, sys; sys.argv = [{str(script)!r}]\n"
            "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as exit:\n"
            "    assert 'transformers' not in sys.modules and 'pagedllm.llm' not in sys.modules\n"
            "    raise")
    result = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": ""},
                            capture_output=True, text=True, timeout=600, cwd="/")
    assert result.returncode == 0, result.stderr[-2000:]
