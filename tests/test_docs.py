"""The README and the documentation site stay true.

The site builds with `mkdocs build --strict` (no broken link, anchor or API reference), the README stays
short, the flag list of docs/serving.md matches the parser, and every page runs verbatim: each fenced
block whose info string is exactly `python` or `bash` is executed, in order, page by page. With no
model given, commands take the default model's offline fallback, the bundled demo model (the models
dir is empty in tests; tests/test_real_model.py runs the real one).

- `bash` blocks run line by line (a trailing backslash continues a line); `pip install ...` commands
  (a line, or a part of an `&&` chain) are skipped, because the package under test is already
  importable. `pagedllm` and `python` resolve to this checkout and this interpreter.
- A `pagedllm serve ...` line starts the server in the background and waits for /health; the blocks
  after it (the client snippets) run against it; it is stopped at the end (or at the next serve line).
- The pages' port 8000 is swapped for a free port, so the test does not collide with a server
  already running on this machine.
- `text`, `console` and untagged blocks are documentation, never run.
- Nothing asserts on the model's text: only that each block exits 0 (the demo model may be retrained).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 150
README_PORT = "8000"
BLOCK_TIMEOUT_S = 300


@dataclass
class Block:
    language: str
    code: str
    line: int  # 1-based line of the opening fence, for failure messages


def readme_blocks(text: str) -> list[Block]:
    """Fenced blocks whose info string is exactly `python` or `bash` (CommonMark: ``` or ~~~ fences)."""
    blocks: list[Block] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        match = re.match(r"^ {0,3}(`{3,}|~{3,})(.*)$", lines[index])
        if not match:
            index += 1
            continue
        fence, info = match.group(1), match.group(2).strip()
        start = index
        body: list[str] = []
        index += 1
        while index < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[index]):
            body.append(lines[index])
            index += 1
        index += 1  # the closing fence
        if info in ("python", "bash"):
            blocks.append(Block(info, "\n".join(body) + "\n", start + 1))
    return blocks


def bash_commands(code: str) -> list[str]:
    """Logical command lines of a bash block: continuations joined, blanks and comments dropped."""
    commands: list[str] = []
    pending = ""
    for raw in code.splitlines():
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line = (pending + raw).strip()
        pending = ""
        if line and not line.startswith("#"):
            commands.append(line)
    return commands


def is_pip_install(command: str) -> bool:
    words = shlex.split(command, comments=True)
    return words[:2] == ["pip", "install"] or words[1:4] == ["-m", "pip", "install"]


def is_serve(command: str) -> bool:
    return shlex.split(command, comments=True)[:2] == ["pagedllm", "serve"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _environment(bin_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(ROOT)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.pop("PAGEDLLM_API_KEY", None)
    return env


def _shims(bin_dir: Path) -> None:
    """`pagedllm` and `python` on PATH run this checkout with this interpreter."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "pagedllm").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pagedllm.entrypoints.cli "$@"\n')
    (bin_dir / "pagedllm").chmod(0o755)
    for name in ("python", "python3"):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (bin_dir / name).chmod(0o755)


class ReadmeRunner:
    def __init__(self, tmp_path: Path, page: Path = README) -> None:
        self.tmp_path = tmp_path
        self.page = page.relative_to(ROOT)
        self.port = str(_free_port())
        bin_dir = tmp_path / "bin"
        _shims(bin_dir)
        self.env = _environment(bin_dir)
        self.server: subprocess.Popen[bytes] | None = None
        self.server_log = tmp_path / "server.log"

    def localize(self, code: str) -> str:
        return code.replace(f":{README_PORT}", f":{self.port}").replace(f"--port {README_PORT}",
                                                                          f"--port {self.port}")

    def run(self, block: Block) -> None:
        code = self.localize(block.code)
        if block.language == "python":
            self._check(block, [sys.executable, "-c", code], code)
            return
        for line in bash_commands(code):
            # `pip install -e . && pagedllm ...`: the install is skipped, the rest runs
            command = " && ".join(part for part in line.split(" && ") if not is_pip_install(part))
            if not command:
                continue
            if is_serve(command):
                self.start_server(block, command)
            else:
                self._check(block, ["bash", "-eo", "pipefail", "-c", command], command)

    def _check(self, block: Block, argv: list[str], shown: str) -> None:
        result = subprocess.run(argv, cwd=ROOT, env=self.env, capture_output=True, text=True,
                                timeout=BLOCK_TIMEOUT_S)
        assert result.returncode == 0, (
            f"{self.page}:{block.line} ({block.language}) failed with exit code {result.returncode}:\n{shown}\n"
            f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-3000:]}")

    def start_server(self, block: Block, command: str) -> None:
        self.stop_server()
        port = re.search(r"--port[ =](\d+)", command)
        port_number = port.group(1) if port else README_PORT
        log = self.server_log.open("ab")
        self.server = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=ROOT, env=self.env,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                pytest.fail(f"{self.page}:{block.line}: `{command}` exited with {self.server.returncode}:\n"
                            f"{self.server_log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port_number}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)  # polling for readiness, not synchronising on a guess
        pytest.fail(f"{self.page}:{block.line}: `{command}` was not healthy within {BLOCK_TIMEOUT_S} s")

    def stop_server(self) -> None:
        if self.server is None:
            return
        if self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        self.server = None


def test_readme_block_extraction() -> None:
    text = ("```python\nprint(1)\n```\n```text\nnot run\n```\n````bash\necho a \\\n  b\n# note\n````\n"
            "```py\nnot run\n```\n```\nnot run\n```\n")
    blocks = readme_blocks(text)
    assert [(b.language, b.line) for b in blocks] == [("python", 1), ("bash", 7)]
    assert bash_commands(blocks[1].code) == ["echo a    b"]
    assert is_pip_install('pip install -e ".[test]"') and is_pip_install("python -m pip install x")
    assert not is_pip_install("pagedllm generate")
    assert is_serve("pagedllm serve --port 8000 --api-key secret   # comment") and not is_serve("pagedllm plan")


def runnable_pages() -> list[Path]:
    return [page for page in PAGES if readme_blocks(page.read_text())]


def test_readme_is_short_and_every_page_has_runnable_examples() -> None:
    assert len(README.read_text().splitlines()) <= README_MAX_LINES
    blocks = readme_blocks(README.read_text())
    assert any(b.language == "python" for b in blocks) and any(b.language == "bash" for b in blocks)
    assert len(runnable_pages()) >= 8


def test_serving_page_lists_every_serve_flag() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import serve_flags_doc
    finally:
        sys.path.remove(str(ROOT / "tools"))
    documented = serve_flags_doc.documented_tables(serve_flags_doc.DOC.read_text())
    assert documented == serve_flags_doc.flag_tables(), "run: python tools/serve_flags_doc.py --write"


@pytest.mark.slow
def test_docs_site_builds_strict(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "index.html").is_file() and (tmp_path / "api" / "index.html").is_file()
    assert "pagedllm.SamplingParams" in (tmp_path / "api" / "index.html").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("page", runnable_pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_page_blocks_run_verbatim(page: Path, tmp_path: Path) -> None:
    runner = ReadmeRunner(tmp_path, page)
    try:
        for block in readme_blocks(page.read_text()):
            runner.run(block)
    finally:
        runner.stop_server()
