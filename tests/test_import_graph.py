"""tools/import_graph.py: the package keeps its layering (no cycles among engine/, worker/, spec_decode/,
kv_cache/; worker/ and models/ never import engine/; only the planner, the benchmarks and the CLI import
the planner or the benchmarks), and the checker itself catches each kind of violation."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_package_layering_holds(capsys: pytest.CaptureFixture[str]) -> None:
    status = _tool().main(["--root", str(ROOT), "--quiet"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "hot path:" in out and "layering: ok" in out


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / "pagedllm" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize("files, expected", [
    ({"engine/__init__.py": "", "worker/__init__.py": "", "engine/a.py": "",
      "worker/runner.py": "from pagedllm.engine.a import x\n"}, "worker/ imports engine/"),
    ({"models/__init__.py": "", "engine/__init__.py": "", "engine/a.py": "",
      "models/llama.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pagedllm.engine.a\n"},
     "models/ imports engine/"),
    ({"spec_decode/__init__.py": "", "worker/__init__.py": "",
      "spec_decode/d.py": "from pagedllm.worker.r import R\n",
      "worker/r.py": "def f():\n    from pagedllm.spec_decode.d import D\n"}, "import cycle"),
    ({"planner/__init__.py": "", "planner/roofline.py": "", "engine/__init__.py": "",
      "engine/core.py": "from pagedllm.planner import roofline\n"}, "runtime imports planner/"),
])
def test_each_violation_is_reported(tmp_path: Path, files: dict[str, str], expected: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, {"__init__.py": "", **files})
    assert _tool().main(["--root", str(tmp_path), "--quiet"]) == 1
    assert expected in capsys.readouterr().out


def test_cli_and_planner_may_import_the_planner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, {"__init__.py": "", "planner/__init__.py": "", "planner/roofline.py": "",
                      "planner/cli.py": "from pagedllm.planner import roofline\n",
                      "entrypoints/__init__.py": "", "entrypoints/cli.py": "import pagedllm.planner.roofline\n"})
    assert _tool().main(["--root", str(tmp_path), "--quiet"]) == 0, capsys.readouterr().out
