"""Where a live decode step's time goes: GEMMs, attention, sampling, and the rest.

Runs a batch of sequences through the in-process ``LLM`` and times, inside each step whose chunks
are all decodes (the full batch of them), every linear layer's forward (the LM head included),
the attention backend's forward, the native decode stack (every layer in one call, where the
model runs one: its GEMMs and attention are inside it, not in those parts), and the sampler;
"rest" is the step minus those (embedding, norms, rotary, the runner's Python and input
building). CPU ops are synchronous, so wall-clock timers around them measure them. Used by
``kvserve bench roofline --measure-step``.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from typing import Any, Callable

from kvserve.bench.stats import median

# head_draw: the LM head that draws the tokens itself (amx_head.cpp), its GEMM and sampling in one
PARTS = ("gemm", "attention", "native_layers", "sampling", "head_draw")


class StepTimer:
    """Wraps a runner's parts with timers; ``steps`` holds one dict of seconds per timed step."""

    def __init__(self, runner: Any, batch: int):
        self.batch = batch
        self.steps: list[dict[str, float]] = []
        self._acc: dict[str, float] = defaultdict(float)
        self._inside: set[str] = set()  # the parts being timed now
        for module in runner.model.modules():
            if type(module).__name__.endswith("Linear"):
                module.forward = self._timed(module.forward, "gemm")
        runner.attention.forward = self._timed(runner.attention.forward, "attention")
        if runner.model.native_stack is not None:
            stack = runner.model.native_stack
            runner.model.native_stack = _TimedStack(stack, self._timed(stack.forward, "native_layers"))
        runner.model.draw_in_head = self._timed(runner.model.draw_in_head, "head_draw")
        # the runner calls self.sampler(...): swap in a stand-in whose calls are timed
        runner.sampler = _Callable(self._timed(runner.sampler.__call__, "sampling"), runner.sampler)
        execute = runner.execute

        def timed_execute(batch_: Any) -> Any:
            self._acc.clear()
            t0 = time.perf_counter()
            out = execute(batch_)
            total = time.perf_counter() - t0
            chunks = batch_.chunks
            if len(chunks) == self.batch and all(c.is_decode for c in chunks):
                step = {part: self._acc.get(part, 0.0) for part in PARTS}
                step["total"] = total
                step["rest"] = total - sum(step[p] for p in PARTS)
                self.steps.append(step)
            return out

        runner.execute = timed_execute

    def _timed(self, fn: Callable[..., Any], part: str) -> Callable[..., Any]:
        acc, inside = self._acc, self._inside

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if part in inside:  # a linear inside a linear (QuantLinear's bf16 PackedLinear): counted once
                return fn(*args, **kwargs)
            inside.add(part)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[part] += time.perf_counter() - t0
                inside.discard(part)

        return wrapper


class _TimedStack:
    """Stands in for the model's native decode stack: its forward goes through the timer, anything
    else reaches the stack."""

    def __init__(self, stack: Any, forward: Callable[..., Any]):
        self._stack, self.forward = stack, forward

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stack, name)


class _Callable:
    """Stands in for the sampler: calls go through the timer, attributes reach the sampler."""

    def __init__(self, call: Callable[..., Any], target: Any):
        self._call, self._target = call, target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target, name)


def measure_step_split(engine_args: dict[str, Any], batch: int, prompt_len: int, output_len: int,
                       temperature: float = 1.0, seed: int = 0) -> dict[str, Any]:
    """Median milliseconds of each part over the full-batch decode steps of one run."""
    from kvserve.engine.request import SamplingParams
    from kvserve.llm import LLM

    llm = LLM(**engine_args)
    timer = StepTimer(llm.engine.runner, batch)
    vocab = llm.engine.runner.cfg.vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True)
    llm.generate(prompts, params)
    if not timer.steps:
        return {"steps": 0}
    split = {part: 1e3 * median([s[part] for s in timer.steps]) for part in (*PARTS, "rest", "total")}
    return {"steps": len(timer.steps), "batch": batch, "prompt_len": prompt_len, "output_len": output_len,
            "temperature": temperature, "ms_p50": split}
