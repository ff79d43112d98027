"""OutputProcessor: each RequestOutput is a snapshot of its step."""

from __future__ import annotations

from kvserve.engine.messages import RequestDelta
from kvserve.engine.request import Request, SamplingParams, TokenLogprobs
from kvserve.text.output import OutputProcessor


def _delta(rid: str, token: int) -> RequestDelta:
    return RequestDelta(request_id=rid, new_token_ids=[token], new_logprobs=[TokenLogprobs(token, -0.5)],
                        finished=False, finish_reason=None, stop_reason=None, num_prompt_tokens=3,
                        num_cached_tokens=0)


def test_an_output_keeps_its_logprobs_when_later_steps_arrive():
    # a streaming reader may render a step's output after the next step's delta was applied; the
    # renderer takes the delta's logprobs from the end of out.logprobs, so that list must not grow
    proc = OutputProcessor(tokenizer=None)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4, logprobs=0))
    proc.add(req)
    first, _ = proc.apply("r", [_delta("r", 7)])
    second, _ = proc.apply("r", [_delta("r", 8)])
    assert [lp.token_id for lp in first.logprobs] == [7] and first.token_ids == [7]
    assert [lp.token_id for lp in second.logprobs] == [7, 8]
