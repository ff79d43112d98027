"""Beam search on the engine (``use_beam_search``), as vLLM's server runs it.

The search (``kvserve.engine.beam_search``) runs here, above the engine: each step sends every
live beam to the engine as a one-token request asking for its ``2 x width`` most likely next
tokens, and the prefix cache keeps those requests from recomputing the prompt and the beams'
shared prefix. A ``BeamSearchRun`` is one prompt's search: a task that runs the steps, and one
stream per beam for ``kvserve.server.streaming.respond``, each yielding its beam's final output once
the search ends (streamed answers come in one piece, at the end, as in vLLM).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

from kvserve.engine.beam_search import Beam, BeamSearch
from kvserve.engine.request import SamplingParams
from kvserve.text.output import RequestOutput

if TYPE_CHECKING:
    from kvserve.server import protocol as P
    from kvserve.server.request_stream import RequestStream
    from kvserve.server.state import ServerState


class BeamSearchRun:
    def __init__(self, state: ServerState, prompt: list[int], body: P._SamplingRequest, max_tokens: int | None):
        self.state, self.prompt, self.body = state, prompt, body
        stops = set(body.stop_token_ids or ())
        if not body.ignore_eos:
            stops.update(state.tokenizer.eos_token_ids)
        room = state.client.max_model_len - len(prompt)
        self.search = BeamSearch(len(prompt), body.n, room if max_tokens is None else min(max_tokens, room),
                                 frozenset(stops), body.length_penalty)
        self.streams = [BeamStream(self, k) for k in range(body.n)]
        self._task: asyncio.Task[list[RequestOutput]] | None = None
        self._steps: list[RequestStream] = []
        self._num_cached = 0

    def results(self) -> asyncio.Task[list[RequestOutput]]:
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        return self._task

    def abort(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for s in self._steps:
            s.abort()

    async def _run(self) -> list[RequestOutput]:
        search, client = self.search, self.state.client
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=search.candidates_per_beam,
                                ignore_eos=True, skip_special_tokens=False)
        try:
            while not search.done:
                client.check_capacity(len(search.live))
                lora = self.state.lora_of(self.body.model)
                self._steps = [client.add_request(self.prompt + list(b.tokens), params, lora_name=lora)
                               for b in search.live]
                outs = await asyncio.gather(*(_final(s) for s in self._steps))
                if search.steps == 0:
                    self._num_cached = outs[0].num_cached_tokens
                search.advance([o.logprobs[0].top if o.logprobs else [] for o in outs])
        finally:
            for s in self._steps:
                s.abort()
        best = search.best()
        best += best[-1:] * (search.width - len(best))  # fewer beams than the width: a vocabulary under it
        return [self._output(b) for b in best]

    def _output(self, beam: Beam) -> RequestOutput:
        tokens = list(beam.tokens)
        shown = tokens[:-1] if beam.ended else tokens  # the ending token is not text
        text = self.state.tokenizer.decode(shown, skip_special_tokens=self.body.skip_special_tokens)
        user_stop = beam.ended and tokens[-1] in (self.body.stop_token_ids or ())
        return RequestOutput(
            request_id=f"beam-{uuid.uuid4().hex}", prompt_token_ids=self.prompt, text=text, token_ids=tokens,
            delta_text=text, delta_token_ids=tokens, finished=True,
            finish_reason="stop" if beam.ended else "length", stop_reason=tokens[-1] if user_stop else None,
            num_cached_tokens=self._num_cached)


async def _final(stream: RequestStream) -> RequestOutput:
    out = None
    async for out in stream:
        pass
    assert out is not None
    return out


class BeamStream:
    """Beam k's final output, for ``respond`` (which merges the streams of a request's choices)."""

    def __init__(self, run: BeamSearchRun, k: int):
        self.run, self.k = run, k
        self.finished = False

    def __aiter__(self) -> BeamStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        self.finished = True
        return (await self.run.results())[self.k]

    def abort(self) -> None:
        self.finished = True
        self.run.abort()


def beam_streams(state: ServerState, prompts: list[list[int]], body: P._SamplingRequest,
                 max_tokens: int | None) -> list[BeamStream]:
    """The streams of a beam search request: prompts x n beams (choice k = prompt * n + beam)."""
    for p in prompts:
        state.client.validate_prompt(p)
    return [s for p in prompts for s in BeamSearchRun(state, p, body, max_tokens).streams]
