"""The live KV-cache page on the real `pagedllm serve` (issue 18).

- `GET /kv-cache/state` sits behind the API key, `GET /kv-cache` (static HTML, no data) does not.
- Under a real load (a shared prefix, n > 1 samples, streams cut mid-way so the server aborts them)
  every state read keeps the invariants of test_kv_cache_snapshot.check_kv_state, and once the
  server is idle its free-block count equals the Prometheus gauge `pagedllm:kv_cache_free_blocks`.
- The page in a real headless browser (Debian's chromium driven by Playwright): it loads with no
  console errors, draws the grid, shows shared blocks while 8 requests with a common 1,000-token prefix
  run, lights up a clicked request's block table, writes a screenshot, and draws a 100,000-block pool.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_kv_cache_snapshot import check_kv_state
from test_server import RemoteServer
from tiny_models import build_model, random_prompts

from pagedllm.kv_cache.manager import KVCacheManager

API_KEY = "kv-page-key"
PREFIX_LEN = 1000
VOCAB = 512
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT_FOR_README = Path(__file__).resolve().parent.parent / "docs" / "kv-cache-page.png"


def wait_until(condition: Any, timeout: float, what: str, pause: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(pause)  # a polling interval, not synchronisation: the condition is re-checked


def find_chromium() -> str | None:
    for candidate in (os.environ.get("PAGEDLLM_CHROMIUM"), "/usr/bin/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


@pytest.fixture(scope="module")
def long_context_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with room for a 1,000-token prefix and a long generation."""
    return build_model(tmp_path_factory.mktemp("tiny_llama_2k"), "llama", max_position_embeddings=2048, seed=0)


@pytest.fixture(scope="module")
def server(long_context_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    remote = RemoteServer(long_context_dir, tmp_path_factory.mktemp("kv_page_logs"), api_key=API_KEY,
                          # a pool small enough that the page draws big cells with ref counts in them
                          extra_args=["--max-model-len", "2048", "--block-size", "16",
                                      "--num-gpu-blocks-override", "1024"])
    yield remote
    assert remote.terminate() == 0, remote.log()


class StreamingLoad:
    """Streaming completions on background threads; `stop()` hangs up, so the server aborts them."""

    def __init__(self, server: RemoteServer, bodies: list[dict[str, Any]], cut_after: list[int | None]) -> None:
        self.server = server
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(body, cut), daemon=True)
                        for body, cut in zip(bodies, cut_after)]
        for thread in self.threads:
            thread.start()

    def _run(self, body: dict[str, Any], cut_after: int | None) -> None:
        try:
            with httpx.stream("POST", f"{self.server.url}/v1/completions", json={**body, "stream": True},
                              headers=self.server.headers(), timeout=300.0) as response:
                assert response.status_code == 200, response.read()
                for num_events, _ in enumerate(response.iter_lines()):
                    if self.stop_event.is_set() or (cut_after is not None and num_events >= cut_after):
                        return  # leaving the block closes the connection: the server aborts the request
        except BaseException as exc:  # reported by join()
            self.errors.append(exc)

    def stop(self) -> None:
        self.stop_event.set()
        self.join()

    def join(self, timeout: float = 300.0) -> None:
        for thread in self.threads:
            thread.join(timeout)
        assert not self.errors, self.errors


def get_state(server: RemoteServer) -> dict[str, Any]:
    response = server.get("/kv-cache/state")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def test_state_needs_the_key_and_the_page_does_not(server: RemoteServer) -> None:
    response = httpx.get(f"{server.url}/kv-cache/state", timeout=30.0)
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "AuthenticationError"
    page = httpx.get(f"{server.url}/kv-cache", timeout=30.0)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<canvas" in page.text and "kv-cache" in page.text
    assert "http://" not in page.text.replace("http://www.w3.org", "") and "https://" not in page.text, \
        "the page must not load anything from elsewhere"
    state = get_state(server)
    check_kv_state(state)
    assert state["model"] == "tiny" and state["block_size"] == 16
    assert "KV cache page: http://127.0.0.1:" in server.log() and "/kv-cache" in server.log()


@pytest.mark.slow
def test_state_invariants_under_load(server: RemoteServer) -> None:
    prefix = random_prompts(1, VOCAB, lengths=[200], seed=11)[0]
    tails = random_prompts(12, VOCAB, lengths=[5 + i for i in range(12)], seed=12)
    bodies: list[dict[str, Any]] = []
    cut_after: list[int | None] = []
    for i, tail in enumerate(tails):
        body = {"model": "tiny", "prompt": prefix + tail, "max_tokens": 40 + 10 * i, "temperature": 0.8,
                "seed": i, "ignore_eos": True}
        if i % 4 == 1:
            body["n"] = 3  # parallel sampling: three samples share the prompt's blocks
        bodies.append(body)
        cut_after.append(8 if i % 3 == 2 else None)  # a third hang up mid-stream: aborted by the server
    load = StreamingLoad(server, bodies, cut_after)
    seen = {"shared": 0, "children": 0, "reads": 0}
    while any(thread.is_alive() for thread in load.threads):
        state = get_state(server)
        check_kv_state(state)
        seen["reads"] += 1
        seen["shared"] += state["num_shared_blocks"] > 0
        seen["children"] += any(r["parent_id"] is not None for r in state["requests"])
    load.join()
    assert seen["reads"] >= 3 and seen["shared"] and seen["children"], seen

    # idle: nothing steps between the two reads, so the page and the metric see the same pool
    def idle_state() -> dict[str, Any] | None:
        state = get_state(server)
        return state if not state["requests"] else None

    state = wait_until(idle_state, 60.0, "the aborted requests to leave the engine")
    metrics = server.metrics()
    assert metrics["pagedllm:num_requests_running"] == 0
    assert state["num_free_blocks"] == metrics["pagedllm:kv_cache_free_blocks"] == state["num_blocks"]
    assert state["num_blocks"] == metrics["pagedllm:kv_cache_total_blocks"]
    assert state["num_blocks_by_state"]["cached"] > 0, "finished requests leave their prefix cached"
    check_kv_state(state)
    server.assert_healthy()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = find_chromium()
    if executable is None:
        pytest.skip("chromium not found (apt-get install -y chromium, or set PAGEDLLM_CHROMIUM): "
                    "the KV-cache page is not tested in a browser")
    from playwright.sync_api import sync_playwright  # in the test extra: pip install -e ".[test]"

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


class PageProbe:
    """A page plus every console error and uncaught exception it raised."""

    def __init__(self, browser: Any, viewport: dict[str, int]) -> None:
        self.page = browser.new_page(viewport=viewport)
        self.errors: list[str] = []
        self.page.on("console", lambda message: self.errors.append(f"console: {message.text}")
                     if message.type == "error" else None)
        self.page.on("pageerror", lambda error: self.errors.append(f"pageerror: {error}"))


SHARED_PIXELS_JS = """() => {
  const canvas = document.getElementById('grid');
  const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  const count = (rgb) => { let n = 0; for (let i = 0; i < data.length; i += 4)
    if (data[i] === rgb[0] && data[i + 1] === rgb[1] && data[i + 2] === rgb[2]) n++; return n; };
  return {width: canvas.width, height: canvas.height, sharedMost: count([220, 38, 38]),
          selected: count([124, 58, 237]) + count([219, 39, 119]), used: count([34, 197, 94])};
}"""


@pytest.mark.slow
def test_page_in_a_headless_browser(server: RemoteServer, browser: Any, tmp_path: Path) -> None:
    prefix = random_prompts(1, VOCAB, lengths=[PREFIX_LEN], seed=21)[0]
    tails = random_prompts(8, VOCAB, lengths=[8] * 8, seed=22)
    bodies = [{"model": "tiny", "prompt": prefix + tail, "max_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
              for tail in tails]
    probe = PageProbe(browser, {"width": 1400, "height": 900})
    page = probe.page
    page.goto(f"{server.url}/kv-cache?api_key={API_KEY}&interval_ms=200")
    page.wait_for_function("() => window.kvPage && window.kvPage.polls > 0 && window.kvPage.draws > 0",
                           timeout=30_000)
    assert "api_key" not in page.url, "the key is taken out of the address bar"
    load = StreamingLoad(server, bodies, [None] * 8)
    try:
        # the 1,000-token prefix's 62 full blocks are held by all 8 block tables at once; the page is
        # paused in the same breath, so every check below reads one picture however fast the requests end
        page.wait_for_function(
            """() => { const s = window.kvPage.state;
                       const seen = s && s.requests.filter(r => r.status === 'running').length === 8
                                    && s.blocks.some(b => b.ref_cnt === 8) && window.kvPage.numSharedDrawn >= 62;
                       if (seen) window.kvPage.setPaused(true);
                       return seen; }""",
            timeout=120_000, polling=50)
        state = page.evaluate("() => window.kvPage.state")
        check_kv_state(state)
        assert state["num_shared_blocks"] >= PREFIX_LEN // 16
        pixels = page.evaluate(SHARED_PIXELS_JS)
        assert pixels["width"] > 100 and pixels["height"] > 10
        assert pixels["sharedMost"] > 0 and pixels["used"] > 0, pixels  # ref count 8 draws darkest red
        stats = page.inner_text("#stats")
        assert "prefix hit rate" in stats.lower()
        # click a request: its block table lights up on the grid and in the detail panel
        page.click("#reqs tr[data-id]")
        page.wait_for_function("() => window.kvPage.selected !== null", timeout=10_000)
        selected = page.evaluate("() => window.kvPage.selected")
        assert selected.startswith("cmpl-")
        assert "block table of" in page.inner_text("#detail")
        pixels = page.evaluate(SHARED_PIXELS_JS)
        assert pixels["selected"] > 0, pixels
        assert page.evaluate("() => window.kvPage.state") == state, "a paused page keeps its picture"
        screenshot = tmp_path / "kv-cache-page.png"
        page.screenshot(path=str(screenshot), full_page=True)
        assert screenshot.stat().st_size > 10_000
        if os.environ.get("PAGEDLLM_UPDATE_SCREENSHOT"):  # refresh the README's picture
            shutil.copyfile(screenshot, SCREENSHOT_FOR_README)
        polls = page.evaluate("() => window.kvPage.polls")
        page.click("#pause")  # the page's own button resumes the live view
        page.wait_for_function(f"() => !window.kvPage.paused && window.kvPage.polls > {polls}", timeout=30_000)
    finally:
        load.stop()
    # the page keeps polling after the requests are gone, without errors
    page.wait_for_function("() => window.kvPage.state.requests.length === 0", timeout=60_000)
    assert probe.errors == [], probe.errors
    page.close()


def synthetic_state(num_blocks: int) -> dict[str, Any]:
    """A 100,000-block pool in the JSON's shape: 64 requests sharing a prefix, cached blocks, holes."""
    kv = KVCacheManager(num_blocks, 16, enable_caching=True)

    class FakeRequest:
        def __init__(self, request_id: str, token_ids: list[int]) -> None:
            self.request_id, self.num_computed_tokens, self.block_hashes = request_id, 0, []
            self.all_token_ids, self.num_tokens = token_ids, len(token_ids)

    prefix = list(range(16 * 40))
    for i in range(64):
        request = FakeRequest(f"req-{i}", prefix + [1000 + i] * (16 * (20 + 7 * i) + 3))
        cached, num_cached = kv.get_computed_blocks(request, request.num_tokens - 1)
        assert kv.allocate_slots(request, request.num_tokens - num_cached, cached)
        if i % 5 == 4:
            kv.free(request.request_id)  # leaves cached blocks between used ones
    snapshot = kv.snapshot()
    return {"model": "synthetic", **snapshot.to_dict(), "requests": [
        {"request_id": rid, "status": "running", "block_table": table, "num_computed_tokens": 16 * len(table) - 13,
         "num_cached_tokens": 0, "num_tokens": 16 * len(table) - 13, "num_prompt_tokens": 640, "parent_id": None}
        for rid, table in snapshot.block_tables.items()]}


@pytest.mark.slow
def test_page_draws_a_100k_block_pool(server: RemoteServer, browser: Any, tmp_path: Path) -> None:
    state = synthetic_state(100_000)
    check_kv_state(state)
    body = json.dumps(state)
    probe = PageProbe(browser, {"width": 1400, "height": 900})
    page = probe.page
    page.route("**/kv-cache/state", lambda route: route.fulfill(status=200, content_type="application/json",
                                                                body=body))
    page.goto(f"{server.url}/kv-cache?interval_ms=500")
    page.wait_for_function("() => window.kvPage && window.kvPage.draws >= 2", timeout=60_000)
    layout = page.evaluate("() => window.kvPage.layout")
    assert layout["cols"] * layout["rows"] >= 100_000 and layout["cell"] >= 1
    assert page.evaluate("() => window.kvPage.numSharedDrawn") == state["num_shared_blocks"] > 0
    draw_ms = page.evaluate("() => window.kvPage.lastDrawMs")
    print(f"100,000 blocks: {len(state['blocks'])} runs, {len(body)} bytes of JSON, "
          f"{layout['cell']} px cells, drawn in {draw_ms:.1f} ms")
    page.click("#reqs tr[data-id]")
    page.wait_for_function("() => window.kvPage.selected !== null", timeout=10_000)
    page.screenshot(path=str(tmp_path / "kv-cache-100k.png"))
    assert probe.errors == [], probe.errors
    page.close()


@pytest.mark.slow
def test_page_asks_for_the_key(server: RemoteServer, browser: Any) -> None:
    """Opened without ?api_key=, the page shows a key form on the 401 and polls once a key is given."""
    probe = PageProbe(browser, {"width": 1000, "height": 700})
    page = probe.page
    page.goto(f"{server.url}/kv-cache?interval_ms=200")
    page.wait_for_selector("#auth", state="visible", timeout=30_000)
    assert page.evaluate("() => window.kvPage.polls") == 0
    page.fill("#authkey", API_KEY)
    page.click("#auth button[type=submit]")
    page.wait_for_function("() => window.kvPage.polls >= 2 && window.kvPage.draws >= 2", timeout=30_000)
    assert not page.is_visible("#auth")
    # the only error is the browser's own log line for the first, keyless request's 401
    assert all("401" in error for error in probe.errors), probe.errors
    page.close()
