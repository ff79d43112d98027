"""Without xgrammar, structured output is refused with 501 naming the package; the rest still serves."""

from __future__ import annotations

import os

import httpx

from kvserve.server.errors import error_body
from kvserve.errors import MissingPackageError
from server_utils import tiny_server

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_missing_package_error_is_a_501_naming_the_package():
    status, body = error_body(MissingPackageError.of("structured output", "xgrammar"))
    assert status == 501
    assert body.error.code == "missing_package"
    assert "pip install xgrammar" in body.error.message


def test_server_without_xgrammar_answers_501_for_a_schema(tiny_model_dir, tmp_path, monkeypatch):
    # the engine process (spawned, so it runs sitecustomize) cannot import xgrammar
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['xgrammar'] = None\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    with tiny_server(tiny_model_dir) as srv:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={**chat, "response_format": fmt}, timeout=120)
        assert r.status_code == 501, r.text
        error = r.json()["error"]
        assert "xgrammar" in error["message"] and "pip install xgrammar" in error["message"]
        assert error["code"] == "missing_package"
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=120)
        assert r.status_code == 200, r.text  # unconstrained requests are served as before
