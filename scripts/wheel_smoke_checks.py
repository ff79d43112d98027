"""The wheel smoke test's requests (scripts/wheel_smoke.sh runs this with the fresh venv's Python).

Usage: python wheel_smoke_checks.py BASE_URL "kvserve VERSION"
Waits for the server, then: /version agrees with `kvserve --version`; a chat answer; a JSON-schema
answer that parses and validates; a bad schema answered 400 in OpenAI's error shape.
"""

from __future__ import annotations

import json
import sys
import time

import httpx
import jsonschema

STARTUP_TIMEOUT_S = 900  # generous: a wheel without prebuilt kernels compiles them at its first start
# Both fields bounded, so the grammar ends the object within max_tokens: a 135M model under greedy
# decoding can repeat one digit forever (on an AMX CPU, whose bf16 prefill rounds differently, it
# wrote "population": 8111222232333... until max_tokens), which is valid JSON cut short, not a bug.
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
BAD_SCHEMA = {"type": "nosuchtype"}  # xgrammar: Unsupported type


def wait_ready(base: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    sys.exit(f"the server did not answer /health within {STARTUP_TIMEOUT_S} s")


def chat(base: str, model: str, content: str, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 48,
            "temperature": 0, **extra}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=600)


def main(base: str, version: str) -> None:
    started = time.monotonic()  # the server was started just before this script
    wait_ready(base)
    served = httpx.get(f"{base}/version").json()["version"]
    assert version == f"kvserve {served}", (version, served)
    model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]

    r = chat(base, model, "What is the capital of France? One word.")
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert answer.strip(), r.text
    print(f"chat: {answer!r} (the first answer {time.monotonic() - started:.1f} s after the server started)")

    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    r = chat(base, model, "A large city and its population, as JSON.", response_format=fmt, max_tokens=64)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop", f"the grammar did not end the answer: {r.text}"
    jsonschema.validate(json.loads(text), SCHEMA)
    print(f"json schema: {text}")

    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": BAD_SCHEMA}}
    r = chat(base, model, "Anything.", response_format=bad)
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.json()["error"]["type"] == "invalid_request_error", r.text
    print(f"bad schema: 400 {r.json()['error']['message'][:120]!r}")


if __name__ == "__main__":
    main(sys.argv[1].rstrip("/"), sys.argv[2])
