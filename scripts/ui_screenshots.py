"""Screenshots of the web page's two views for the docs: docs/img/ui-chat.png and docs/img/ui-engine.png.

    python scripts/ui_screenshots.py                      # starts `kvserve serve` on the embedded model
    python scripts/ui_screenshots.py --url http://127.0.0.1:8000 [--api-key KEY]   # a server already up

It drives Debian's chromium (/usr/bin/chromium, or --chromium PATH) with Playwright: asks two
questions in the chat (the second with a JSON schema), then loads the server with chat requests
that share a system prompt (so the prefix tree has something to show) and photographs the Engine
view while they run.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = ("You are a concise assistant for a team that runs LLM inference servers. Answer in at most two "
          "sentences, plainly, without lists.")
TOPICS = ["paged attention", "continuous batching", "a radix prefix cache", "speculative decoding", "KV offload",
          "chunked prefill", "preemption", "quantization", "a router", "structured output"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--uvicorn-log-level", "warning",
           *(["--model", args.model] if args.model else []), *(["--api-key", args.api_key] if args.api_key else []),
           *args.serve_args]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kvserve serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("kvserve serve did not come up")


def load(url: str, headers: dict, model: str, stop: threading.Event, concurrency: int) -> None:
    """Chat requests sharing SYSTEM, ``concurrency`` at a time, until ``stop``."""

    def worker(k: int) -> None:
        i = k
        while not stop.is_set():
            body = {"model": model, "max_tokens": 48, "temperature": 0.7, "stream": True,
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"What is {TOPICS[i % len(TOPICS)]}? (#{i})"}]}
            try:
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
                    for _ in r.iter_bytes():
                        if stop.is_set():
                            break
            except httpx.HTTPError:
                time.sleep(0.5)
            i += concurrency

    for k in range(concurrency):
        threading.Thread(target=worker, args=(k,), daemon=True).start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a kvserve server already running (default: start one)")
    ap.add_argument("--model", help="--model for the server this script starts (default: the embedded model)")
    ap.add_argument("--api-key")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--concurrency", type=int, default=6, help="chat requests at once while the Engine view is taken")
    ap.add_argument("--max-tokens", type=int, default=96, help="per answer in the chat view")
    ap.add_argument("serve_args", nargs="*", help="more flags for kvserve serve (after --)")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    stop = threading.Event()
    try:
        model = httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
        # the grammar compiler's child process starts on the first constrained request (seconds): start it
        # now, so that the chat's structured answer shows a typical time to first token
        httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "response_format": {"type": "json_object"}})
        args.out.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(url)
            if args.api_key:
                page.get_by_test_id("api-key").fill(args.api_key)
                page.get_by_test_id("api-key-submit").click()
            page.wait_for_selector("body.ready")
            page.get_by_test_id("system").fill(SYSTEM)
            page.get_by_test_id("max-tokens").fill(str(args.max_tokens))
            ask(page, "What does a KV cache store, and why does it make decoding faster?", 1)
            page.get_by_test_id("use-schema").check()
            ask(page, "Name the city with the Eiffel Tower and its country.", 2)
            page.screenshot(path=args.out / "ui-chat.png")

            load(url, headers, model, stop, args.concurrency)
            page.get_by_test_id("tab-engine").click()
            page.wait_for_function("Number(document.body.dataset.engineFrames || 0) > 40", timeout=120_000)
            # the whole view: it scrolls inside the page, so the window grows to its height
            height = page.evaluate("document.querySelector('header').offsetHeight"
                                   " + document.getElementById('view-engine').scrollHeight")
            page.set_viewport_size({"width": 1440, "height": height})
            page.wait_for_timeout(600)
            page.screenshot(path=args.out / "ui-engine.png")
            browser.close()
        print(f"wrote {args.out / 'ui-chat.png'} and {args.out / 'ui-engine.png'}")
    finally:
        stop.set()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)


def ask(page, question: str, n: int) -> None:
    page.get_by_test_id("prompt").fill(question)
    page.get_by_test_id("send").click()
    page.wait_for_function(f"document.querySelectorAll('[data-testid=answer]:not(.live)').length >= {n}",
                           timeout=300_000)


if __name__ == "__main__":
    main()
