"""The engine in its own process: errors from its checks come back, and its death fails requests fast."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvserve import SamplingParams
from kvserve.config import KVServeConfig
from kvserve.server.engine_client import AsyncEngineClient
from kvserve.errors import EngineDeadError, InvalidArgumentError
from kvserve.server.app import create_app


def test_engine_errors_and_death(tiny_model_dir):
    client = AsyncEngineClient(KVServeConfig.from_kwargs(model=str(tiny_model_dir), dtype="float32", num_threads=1,
                                            num_kv_blocks=64))
    app = create_app(client, own_client=False)

    async def run() -> None:
        client.attach()
        greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        # the API process checks prompts itself ...
        with pytest.raises(InvalidArgumentError, match="context window"):
            client.add_request([5] * 600, greedy)
        # ... and what the engine's own check rejects comes back as the same error
        with pytest.raises(InvalidArgumentError, match="context window") as e:
            async for _ in client.add_request([5] * 600, greedy, validate=False):
                pass
        assert e.value.param == "prompt"
        # a request that cannot be pickled fails here and leaves nothing behind (the queue's feeder
        # thread used to drop it silently, and its stream waited forever)
        unpicklable = SamplingParams(max_tokens=4)
        unpicklable.note = lambda: None
        with pytest.raises(Exception, match="pickle"):
            client.add_request([5, 6, 7], unpicklable)
        assert client.num_in_flight == 0
        outs = [o async for o in client.add_request([5, 6, 7], greedy)]
        assert len(outs[-1].token_ids) == 4 and outs[-1].finish_reason == "length"

        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        assert (await http.get("/health")).status_code == 200

        stream = client.add_request([5, 6, 7], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        await anext(stream)
        client._proc.kill()  # the engine dies with a request in flight
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
        assert not client.is_alive
        r = await http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503
        await http.aclose()
        client.shutdown()

    asyncio.run(run())
