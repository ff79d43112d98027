"""Workloads for ``kvserve bench serve``: which prompts are sent, how long, and when.

Every dataset becomes a list of :class:`Session`: a start time (or none: the load loop's
``--request-rate`` decides) and one or more turns sent one after another, the next only once
the previous answer has arrived. A single request is a session of one turn; a conversation is
a session of many. Prompts are token ids drawn at random from ``[vocab_low, vocab_high)``.
"""

from __future__ import annotations

import argparse
import csv
import random
from dataclasses import dataclass
from importlib import resources

from kvserve.errors import InvalidArgumentError

DATASETS = ["random", "azure-conv", "azure-code", "prefix-rag", "multi-turn", "interference"]
AZURE_FILES = {"azure-conv": "azure_conv.csv", "azure-code": "azure_code.csv"}


@dataclass
class Turn:
    prompt: list[int]
    max_tokens: int


@dataclass
class Session:
    turns: list[Turn]
    start: float | None = None  # seconds after the run starts; None: paced by --request-rate
    group: str = ""  # "cohort" / "burst" for the interference workload


@dataclass
class Workload:
    name: str
    sessions: list[Session]
    # Upper bound of prompt tokens a perfect prefix cache could reuse (prefix-rag, multi-turn).
    shared_prefix_fraction: float | None = None
    description: str = ""

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


@dataclass
class TraceRow:
    arrived_at: float
    input_len: int
    output_len: int


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", default="random", choices=DATASETS)
    p.add_argument("--num-prompts", type=int, default=64, help="random/interference: requests; azure: first N rows")
    p.add_argument("--input-len", type=int, default=128, help="random; interference: cohort prompt length")
    p.add_argument("--output-len", type=int, default=128, help="random, prefix-rag; interference: cohort output")
    p.add_argument("--vocab-low", type=int, default=100)
    p.add_argument("--vocab-high", type=int, default=40000)
    g = p.add_argument_group("azure-conv / azure-code (trace replay)")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies the recorded gaps between arrivals: 10 replays 10x slower, 0.1 10x faster")
    g.add_argument("--max-input-len", type=int, default=None, help="cap recorded prompt lengths")
    g.add_argument("--max-output-len", type=int, default=None, help="cap recorded output lengths")
    g = p.add_argument_group("prefix-rag")
    g.add_argument("--system-len", type=int, default=1000)
    g.add_argument("--tools-len", type=int, default=300)
    g.add_argument("--num-docs", type=int, default=4)
    g.add_argument("--doc-len", type=int, default=500)
    g.add_argument("--question-len", type=int, default=60)
    g.add_argument("--scramble", action="store_true", help="cut system, tools and document into pieces of "
                   "--scramble-piece-len tokens (paragraphs, tool definitions, retrieved chunks) and shuffle them per "
                   "request: the same content, almost no shared prefix")
    g.add_argument("--scramble-piece-len", type=int, default=100)
    g = p.add_argument_group("multi-turn")
    g.add_argument("--num-conversations", type=int, default=8)
    g.add_argument("--turns", type=int, default=4)
    g.add_argument("--user-len", type=int, default=64, help="tokens the user adds each turn")
    g.add_argument("--answer-len", type=int, default=64, help="max_tokens of each answer")
    g = p.add_argument_group("interference")
    g.add_argument("--cohort", type=int, default=8, help="streaming decodes started at once")
    g.add_argument("--burst", type=int, default=4, help="long prompts sent together after --burst-delay (0: the "
                   "cohort alone, a baseline)")
    g.add_argument("--burst-len", type=int, default=4000)
    g.add_argument("--burst-output-len", type=int, default=1)
    g.add_argument("--burst-delay", type=float, default=5.0, help="seconds after the cohort starts")


def load_trace(name: str) -> list[TraceRow]:
    """The rows of a shipped Azure trace file, in file order."""
    text = resources.files("kvserve.bench").joinpath("data", AZURE_FILES[name]).read_text()
    rows = csv.DictReader(text.splitlines())
    return [TraceRow(float(r["arrived_at"]), int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in rows]


def trace_sessions(rows: list[TraceRow], time_scale: float, max_input_len: int | None,
                   max_output_len: int | None, tokens) -> list[Session]:
    """One single-turn session per row, starting at its recorded arrival (relative to the first
    row) times ``time_scale``, with lengths capped."""
    if not rows:
        return []
    t0 = rows[0].arrived_at
    out = []
    for r in rows:
        n_in = min(r.input_len, max_input_len) if max_input_len else r.input_len
        n_out = min(r.output_len, max_output_len) if max_output_len else r.output_len
        out.append(Session([Turn(tokens(max(n_in, 1)), max(n_out, 1))], start=(r.arrived_at - t0) * time_scale))
    return out


def shared_prefix_fraction(prompts: list[list[int]]) -> float:
    """Fraction of all prompt tokens that extend a prefix already sent by an earlier prompt
    (token-exact, so an upper bound for a block-granular prefix cache)."""
    trie: dict = {}
    reused = total = 0
    for p in prompts:
        total += len(p)
        node, matched = trie, True
        for t in p:
            if matched and t in node:
                reused += 1
            else:
                matched = False
            node = node.setdefault(t, {})
    return reused / total if total else 0.0


def build(a: argparse.Namespace) -> Workload:
    """The workload that the arguments describe."""
    rng = random.Random(a.seed)
    if a.vocab_high <= a.vocab_low:
        raise InvalidArgumentError("--vocab-high must be above --vocab-low")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(a.vocab_low, a.vocab_high) for _ in range(n)]

    def positive(*names: str) -> None:
        for n in names:
            if getattr(a, n) < 1:
                raise InvalidArgumentError(f"--{n.replace('_', '-')} must be at least 1")

    if a.dataset == "random":
        positive("num_prompts", "input_len", "output_len")
        sessions = [Session([Turn(tokens(a.input_len), a.output_len)]) for _ in range(a.num_prompts)]
        return Workload("random", sessions, description=f"random in={a.input_len} out={a.output_len}")

    if a.dataset in AZURE_FILES:
        positive("num_prompts")
        if a.time_scale < 0:
            raise InvalidArgumentError("--time-scale must be at least 0")
        rows = load_trace(a.dataset)[: a.num_prompts]
        sessions = trace_sessions(rows, a.time_scale, a.max_input_len, a.max_output_len, tokens)
        caps = ", ".join(f"{k} <= {v}" for k, v in (("input", a.max_input_len), ("output", a.max_output_len)) if v)
        return Workload(a.dataset, sessions, description=(
            f"{a.dataset} first {len(rows)} rows, time-scale {a.time_scale}" + (f", {caps}" if caps else "")))

    if a.dataset == "prefix-rag":
        positive("num_prompts", "num_docs", "output_len")
        system, tools = tokens(a.system_len), tokens(a.tools_len)
        docs = [tokens(a.doc_len) for _ in range(a.num_docs)]
        prompts = []
        for i in range(a.num_prompts):
            segments = [system, tools, docs[rng.randrange(a.num_docs)]]
            if a.scramble:
                n = max(1, a.scramble_piece_len)
                segments = [seg[j : j + n] for seg in segments for j in range(0, len(seg), n)]
                rng.shuffle(segments)
            prompts.append([t for s in segments for t in s] + tokens(a.question_len))
        return Workload("prefix-rag", [Session([Turn(p, a.output_len)]) for p in prompts],
                        shared_prefix_fraction=shared_prefix_fraction(prompts),
                        description=(f"prefix-rag system={a.system_len} tools={a.tools_len} docs={a.num_docs}x"
                                     f"{a.doc_len} question={a.question_len}{' scrambled' if a.scramble else ''}"))

    if a.dataset == "multi-turn":
        positive("num_conversations", "turns", "user_len", "answer_len")
        sessions, prompts = [], []
        for _ in range(a.num_conversations):
            history: list[int] = []
            turns = []
            for _ in range(a.turns):
                history = history + tokens(a.user_len)
                turns.append(Turn(history, a.answer_len))
                prompts.append(history)
                # The answer's own ids are not streamed back; stand-in ids of its length keep the
                # history growing as a real chat's would (the server re-prefills them).
                history = history + tokens(a.answer_len)
            sessions.append(Session(turns))
        return Workload("multi-turn", sessions, shared_prefix_fraction=shared_prefix_fraction(prompts),
                        description=f"multi-turn {a.num_conversations}x{a.turns} user={a.user_len} answer={a.answer_len}")

    if a.dataset == "interference":
        positive("cohort", "burst_len", "input_len", "output_len", "burst_output_len")
        if a.burst < 0:  # 0: the cohort alone, the baseline a burst's run is compared with
            raise InvalidArgumentError("--burst must be at least 0")
        cohort = [Session([Turn(tokens(a.input_len), a.output_len)], start=0.0, group="cohort") for _ in range(a.cohort)]
        burst = [Session([Turn(tokens(a.burst_len), a.burst_output_len)], start=a.burst_delay, group="burst")
                 for _ in range(a.burst)]
        return Workload("interference", cohort + burst, description=(
            f"interference cohort={a.cohort}x(in={a.input_len} out={a.output_len}) then after {a.burst_delay}s "
            f"burst={a.burst}x{a.burst_len}"))

    raise InvalidArgumentError(f"unknown dataset {a.dataset!r}")
