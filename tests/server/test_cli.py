"""The kvserve command line: one-line errors, generate and chat on a tiny model folder."""

import subprocess
import sys

import pytest

TINY = ["--dtype", "float32", "--num-threads", "1", "--kv-cache-memory-gb", "0.05"]


def kvserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvserve", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("args,needle", [
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--model", "meta-llama/Llama-3.1-8B"], "never downloads"),
    (["generate", "hi", "--model", "/no/such/folder"], "no such file"),
    (["generate", "hi", "--block-size", "0"], "--block-size"),
    (["serve", "--reasoning-parser", "nope"], "--reasoning-parser must be one of deepseek_r1, qwen3"),
])
def test_bad_arguments_give_one_line(args, needle):
    r = kvserve(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvserve: error:") and needle in lines[0]
    assert "Traceback" not in r.stderr


def test_generate_and_chat_on_a_model_folder(tiny_model_dir):
    r = kvserve("generate", "Hello", "--model", str(tiny_model_dir), "--max-tokens", "8", "--ignore-eos", *TINY)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    r = kvserve("chat", "--model", str(tiny_model_dir), "--max-tokens", "6", "--ignore-eos", *TINY,
                stdin="hello there\n/reset\nagain\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) >= 2  # two streamed answers
