"""The soak's request mix: its configuration, and the random requests each client sends."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

# kind: weight in the mix
MIX: dict[str, float] = {
    "completion": 3, "completion_stream": 3, "chat": 3, "chat_stream": 3, "json": 2,
    "abort_mid_stream": 1.5, "abort_early": 1.5, "bad": 0.5,
}
ABORT_KINDS = ("abort_mid_stream", "abort_early")

SCHEMAS = [
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tier": {"enum": ["free", "pro", "enterprise"]},
        "paid": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "tier", "paid", "count"], "additionalProperties": False},
]
WORDS = ("the cache server token block prefix model answer request engine stream batch memory "
         "page queue river mountain orange violet quiet rapid simple careful history number letter "
         "garden window market silver winter summer table").split()
STOPS = [["\n"], ["."], [" a"], ["e", "x"]]


@dataclass
class SoakConfig:
    url: str
    duration: float = 60.0
    concurrency: int = 8
    seed: int = 0
    sample_interval: float = 2.0
    warmup: float | None = None  # seconds; default: the first 25% of the duration
    max_tokens: int = 64  # largest max_tokens of an ordinary request
    num_prefixes: int = 4
    prefix_words: int = 120
    request_timeout: float = 120.0
    idle_timeout: float = 60.0
    mix: dict[str, float] = field(default_factory=lambda: dict(MIX))



@dataclass
class Plan:
    kind: str
    path: str
    body: Any  # a dict sent as JSON, or bytes sent as they are
    stream: bool = False
    expect_status: int = 200
    abort_after_events: int | None = None
    abort_after_s: float | None = None
    schema: Any = None
    stop: list[str] | None = None
    all_length: bool = False  # every choice must end with "length" (ignore_eos, no stop, no grammar)
    max_tokens: int = 16
    num_prompts: int = 1
    n: int = 1
    include_usage: bool = False


class Traffic:
    """Draws requests: one random generator per client, so a seed gives the same mix."""

    def __init__(self, cfg: SoakConfig, model: str, max_model_len: int):
        self.cfg, self.model, self.max_model_len = cfg, model, max_model_len
        rng = random.Random(cfg.seed)
        words = min(cfg.prefix_words, max(8, max_model_len // 5))  # prompts stay well inside the context
        self.prefixes = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(cfg.num_prefixes)]
        self.kinds = list(cfg.mix)
        self.weights = [cfg.mix[k] for k in self.kinds]
        # room for a prompt of prefix_words words (~1.5 tokens each) and the chat template
        self.max_tokens = max(1, min(cfg.max_tokens, (max_model_len - 2 * words - 64) // 2))
        self.words = words

    def _text(self, rng: random.Random, shared: bool, with_prefix: bool = True) -> str:
        """A short question after a shared prefix, or a prompt of its own of any length up to a prefix's."""
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30 if shared else self.words)))
        return f"{rng.choice(self.prefixes)}\n\n{words}" if shared and with_prefix else words

    def _sampling(self, rng: random.Random, body: dict, plan: Plan, *, long: bool = False) -> None:
        plan.max_tokens = body["max_tokens"] = rng.randint(max(1, self.max_tokens // 2) if long else 1,
                                                           self.max_tokens * (3 if long else 1))
        r = rng.random()
        if r < 0.3:
            body["temperature"] = 0.0
        elif r < 0.7:
            body["temperature"], body["seed"] = rng.choice([0.7, 1.0]), rng.randrange(1 << 31)
        else:
            body["temperature"], body["top_p"] = 0.9, 0.95
        if rng.random() < 0.2:
            plan.n = body["n"] = rng.randint(2, 3)
        if not long and rng.random() < 0.2:
            plan.stop = body["stop"] = rng.choice(STOPS)
        body["ignore_eos"] = long or rng.random() < 0.5
        plan.all_length = body["ignore_eos"] and plan.stop is None and plan.schema is None

    def draw(self, rng: random.Random) -> Plan:
        kind = rng.choices(self.kinds, self.weights)[0]
        if kind == "bad":
            return self._bad(rng)
        chat = kind.startswith("chat") or kind == "json" or (kind in ABORT_KINDS and rng.random() < 0.5)
        stream = kind.endswith("_stream") or kind == "abort_mid_stream" or (
            kind in ("json", "abort_early") and rng.random() < 0.5)
        plan = Plan(kind, "/v1/chat/completions" if chat else "/v1/completions", None, stream=stream)
        body: dict[str, Any] = {"model": self.model, "stream": stream}
        shared = rng.random() < 0.7
        if kind == "json":
            plan.schema = rng.choice(SCHEMAS)
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer",
                                                                              "schema": plan.schema}}
        if chat:
            body["messages"] = ([{"role": "system", "content": rng.choice(self.prefixes)}] if shared else []) + [
                {"role": "user", "content": self._text(rng, shared, with_prefix=False)}]
        elif rng.random() < 0.1:
            plan.num_prompts = 2
            body["prompt"] = [self._text(rng, shared), self._text(rng, shared)]
        elif rng.random() < 0.1:
            body["prompt"] = [rng.randrange(3, 200) for _ in range(rng.randint(1, 40))]
        else:
            body["prompt"] = self._text(rng, shared)
        self._sampling(rng, body, plan, long=kind in ABORT_KINDS)
        if kind == "json":
            body["max_tokens"] = plan.max_tokens = max(plan.max_tokens, min(self.max_tokens * 2, 96))
        if rng.random() < 0.15 and kind != "json":
            if chat:
                body["logprobs"], body["top_logprobs"] = True, 2
            else:
                body["logprobs"] = 2
        if stream and rng.random() < 0.7:
            plan.include_usage = True
            body["stream_options"] = {"include_usage": True}
        if kind == "abort_mid_stream":
            plan.abort_after_events = rng.randint(1, 4)
        elif kind == "abort_early":
            plan.abort_after_s = rng.uniform(0.0, 0.05)
        plan.body = body
        return plan

    def _bad(self, rng: random.Random) -> Plan:
        """A request the server must refuse with a 400 (an unknown model: 404) and an OpenAI error body."""
        msgs = [{"role": "user", "content": "hello"}]
        chat = "/v1/chat/completions"
        cases: list[tuple[str, Any]] = [
            (chat, {"model": "no-such-model", "messages": msgs}),
            (chat, {"model": self.model, "messages": []}),
            (chat, {"model": self.model, "messages": msgs, "temperature": -1}),
            (chat, {"model": self.model, "messages": msgs, "n": 0}),
            (chat, {"model": self.model, "messages": msgs, "top_logprobs": 2}),
            (chat, {"model": self.model, "messages": msgs, "response_format": {"type": "json_schema",
                                                                               "json_schema": {"name": "x"}}}),
            ("/v1/completions", {"model": self.model, "prompt": "hi", "max_tokens": 0}),
            ("/v1/completions", {"model": self.model, "prompt": "hello " * (2 * self.max_model_len)}),
            ("/v1/completions", b'{"prompt": "hi", "max_tokens": '),
        ]
        path, body = rng.choice(cases)
        unknown_model = isinstance(body, dict) and body.get("model") == "no-such-model"
        return Plan("bad", path, body, stream=bool(isinstance(body, dict) and rng.random() < 0.5),
                    expect_status=404 if unknown_model else 400)
