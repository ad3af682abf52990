"""Every PAGEDLLM_* environment variable is declared once, in pagedllm/envs.py, and read through it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import envs

PACKAGE = Path(envs.__file__).resolve().parent
NAME = re.compile(r"\bPAGEDLLM_[A-Z][A-Z0-9_]*[A-Z0-9]\b")
# C preprocessor macros of the kernels
NOT_ENV = {"PAGEDLLM_BLOCKED_FP32", "PAGEDLLM_BLOCKED_BF16", "PAGEDLLM_QLINEAR", "PAGEDLLM_QLINEAR_FP32",
           "PAGEDLLM_AMX", "PAGEDLLM_UNIT_PRODUCTS", "PAGEDLLM_BLOCK_SCORES"}


def test_every_variable_named_in_the_package_is_declared_and_read_through_envs() -> None:
    named: set[str] = set()
    for path in PACKAGE.rglob("*"):
        if path.suffix not in (".py", ".cpp", ".h") or path.name == "envs.py":
            continue
        text = path.read_text()
        named |= set(NAME.findall(text)) - NOT_ENV
        direct = re.findall(r"(?:environ(?:\.get)?\(|environ\[|getenv\()\s*[\"'](PAGEDLLM_\w+)", text)
        assert not direct, f"{path.relative_to(PACKAGE)} reads {direct} directly: use envs.value()"
    assert named <= set(envs.ENV_VARS), sorted(named - set(envs.ENV_VARS))


def test_values_parse_by_type_and_bad_text_names_the_variable(monkeypatch) -> None:
    monkeypatch.delenv("PAGEDLLM_CPU_HUGE_PAGES", raising=False)
    assert envs.value("PAGEDLLM_CPU_HUGE_PAGES") is True
    monkeypatch.setenv("PAGEDLLM_CPU_HUGE_PAGES", "0")
    assert envs.value("PAGEDLLM_CPU_HUGE_PAGES") is False
    monkeypatch.setenv("PAGEDLLM_CPU_HUGE_PAGES", "maybe")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_HUGE_PAGES"):
        envs.value("PAGEDLLM_CPU_HUGE_PAGES")
    monkeypatch.setenv("PAGEDLLM_WORKER_EXECUTE_TIMEOUT_S", "2.5")
    assert envs.value("PAGEDLLM_WORKER_EXECUTE_TIMEOUT_S") == 2.5
    monkeypatch.setenv("PAGEDLLM_WORKER_EXECUTE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="PAGEDLLM_WORKER_EXECUTE_TIMEOUT_S"):
        envs.value("PAGEDLLM_WORKER_EXECUTE_TIMEOUT_S")
    monkeypatch.setenv("PAGEDLLM_LOGGING_LEVEL", "  ")
    assert envs.value("PAGEDLLM_LOGGING_LEVEL") == "INFO" and not envs.is_set("PAGEDLLM_LOGGING_LEVEL")


def test_help_env_lists_every_variable() -> None:
    result = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "--help-env"],
                            capture_output=True, text=True, timeout=120, check=True)
    for name in envs.ENV_VARS:
        assert name in result.stdout
