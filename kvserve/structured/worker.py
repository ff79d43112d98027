"""Compiling grammars in a child process, so that a grammar too costly to compile is stopped.

Compile cost is not bounded by a grammar's size: a 1.2 KB regex (``((a|b)*)`` 200 times) takes
~18 s here, a 300 KB EBNF ~50 s, a JSON schema nested 500 deep ~25 s, and xgrammar cannot be
interrupted inside a thread. ``CompileWorker`` runs xgrammar in a child process: a compile that
outlasts its time limit kills the child (a new one starts on the next compile), and a compile that
crashes xgrammar costs the child, not the engine.

Wire format, both ways over the child's stdin and stdout: an 8-byte length, then a pickle. The
parent sends ``("init", tokenizer_info_json, threads)`` once, then ``(kind, text, any_whitespace)``
per compile; the child answers ``("ok", compiled_grammar_json)`` or ``("invalid", reason)``.
Serializing a compiled grammar both ways costs ~10 ms.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from typing import IO, Any

import xgrammar as xgr

_HEADER = struct.Struct("<Q")
START_TIMEOUT_S = 120.0  # starting the child: Python, xgrammar, the tokenizer description (~1 s)


class CompileTimeout(Exception):
    """The compile outlasted its time limit; the child was killed."""


class CompileCrashed(Exception):
    """The child died while compiling."""


class InvalidGrammar(Exception):
    """xgrammar refused the grammar; the message is its reason."""


def compile_grammar(compiler: xgr.GrammarCompiler, kind: str, text: str, any_whitespace: bool) -> xgr.CompiledGrammar:
    """Compile ``text`` of ``kind`` ("json_schema", "regex" or "grammar") with ``compiler``."""
    if kind == "json_schema":
        return _compile_json_schema(compiler, text, any_whitespace)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "grammar":
        return compiler.compile_grammar(text)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(_schemas_as_grammars(text, any_whitespace))
    raise ValueError(f"unknown grammar kind {kind!r}")


def _compile_json_schema(compiler: xgr.GrammarCompiler, schema: str, any_whitespace: bool) -> xgr.CompiledGrammar:
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    if _BARE_STRING_CHAR in grammar:
        # xgrammar <= 0.2.9 (issue mlc-ai/xgrammar#800) lowers a string with minLength /
        # maxLength to a repeat of [^"\\\r\n], which admits raw control characters: invalid
        # JSON (json.loads rejects it). Exclude them. Such strings still cannot hold escapes
        # (\n, \", \uXXXX) as upstream; adding the escape branch made some masks ~100x slower.
        return compiler.compile_grammar(grammar.replace(_BARE_STRING_CHAR, _JSON_STRING_CHAR))
    return compiler.compile_json_schema(schema, any_whitespace=any_whitespace)


def _schemas_as_grammars(structural_tag: str, any_whitespace: bool) -> str:
    """The structural tag with each JSON schema in it replaced by its grammar as kvserve lays JSON out
    (``any_whitespace``, the string fix above): a structural tag's own JSON allows any whitespace."""
    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and "json_schema" in node:
            grammar = str(xgr.Grammar.from_json_schema(json.dumps(node["json_schema"]), any_whitespace=any_whitespace))
            return {"type": "grammar", "grammar": grammar.replace(_BARE_STRING_CHAR, _JSON_STRING_CHAR)}
        return {k: walk(v) for k, v in node.items()}

    return json.dumps(walk(json.loads(structural_tag)))


# How xgrammar prints the character class above, and its replacement.
_BARE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def error_text(error: BaseException) -> str:
    """xgrammar's message for ``error``."""
    if isinstance(error, UnicodeDecodeError):  # its message quotes one byte of a multi-byte character
        return error.object.decode(errors="replace")
    return str(error)


class CompileWorker:
    """The parent's handle on the child process; ``compile`` is thread-safe (one compile at a time)."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, timeout_s: float, threads: int = 1):
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.tokenizer_info = tokenizer_info
        self.timeout_s = timeout_s
        self.threads = threads
        self.restarts = 0  # children started after the first (a timeout or a crash each)
        self._info_json: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def compile(self, kind: str, text: str, any_whitespace: bool) -> xgr.CompiledGrammar:
        """The compiled grammar; raises InvalidGrammar, CompileTimeout or CompileCrashed."""
        with self._lock:
            proc = self._child()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                _send(proc.stdin, (kind, text, any_whitespace))
                status, payload = _receive(proc.stdout, time.monotonic() + self.timeout_s)
            except TimeoutError:
                self._stop()
                raise CompileTimeout(f"took longer than {self.timeout_s:g} s to compile") from None
            except (EOFError, OSError):
                self._stop()
                raise CompileCrashed("the grammar compiler crashed on it") from None
        if status == "invalid":
            raise InvalidGrammar(payload)
        return xgr.CompiledGrammar.deserialize_json(payload, self.tokenizer_info)

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _child(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        if self._proc is not None:
            self.restarts += 1
        if self._info_json is None:
            self._info_json = self.tokenizer_info.serialize_json()
        # run as a script: the child imports xgrammar and the standard library only, not kvserve (torch)
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            _send(proc.stdin, ("init", self._info_json, self.threads))
            _receive(proc.stdout, time.monotonic() + START_TIMEOUT_S)
        except (TimeoutError, EOFError, OSError):
            proc.kill()
            proc.wait()
            raise CompileCrashed("the grammar compiler process did not start") from None
        self._proc = proc
        return proc

    def _stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes], deadline: float | None) -> Any:
    """One message; TimeoutError past ``deadline`` (None: wait), EOFError if the other side closed."""
    fd = stream.fileno()
    if deadline is not None:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise TimeoutError
    (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
    return pickle.loads(_read_exactly(fd, size))


def _read_exactly(fd: int, size: int) -> bytes:
    parts, left = [], size
    while left:
        part = os.read(fd, min(left, 1 << 20))
        if not part:
            raise EOFError
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _serve() -> None:
    """The child: answer compiles until stdin closes (the parent exited or killed us)."""
    requests = sys.stdin.buffer
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints (ours or a library's) go to stderr, not into the replies
    _, info_json, threads = _receive(requests, None)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=threads,
                                   cache_enabled=False)
    _send(replies, ("ready", None))
    while True:
        try:
            kind, text, any_whitespace = _receive(requests, None)
        except EOFError:
            return
        try:
            compiled = compile_grammar(compiler, kind, text, any_whitespace)
        except Exception as e:  # noqa: BLE001 - xgrammar's reasons go back to the parent
            _send(replies, ("invalid", error_text(e)))
        else:
            _send(replies, ("ok", compiled.serialize_json()))


if __name__ == "__main__":
    _serve()
