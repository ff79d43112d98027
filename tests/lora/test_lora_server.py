"""The LoRA routes and model names over HTTP: /v1/models lists adapters with their parent; a request picks one by
its `model` and gets PEFT's merged-model tokens; vLLM's load/unload routes (confined to --lora-dir, behind
--api-key) and their errors; per-adapter metrics."""

from __future__ import annotations

import httpx
import pytest

from conftest import hf_greedy, tiny_hf_model
from lora_utils import write_adapter
from server_utils import TINY_ENGINE, ServerThread

pytest.importorskip("peft")
KEY = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    from kvserve.config import KVServeConfig, ServerConfig
    from kvserve.server.engine_client import AsyncEngineClient

    base = tiny_hf_model(vocab=49152, seed=3)  # the model tiny_model_dir holds
    lora_dir = tmp_path_factory.mktemp("lora-dir")
    merged = {n: write_adapter(base, lora_dir / n, seed=40 + i, r=4) for i, n in enumerate("ab")}
    write_adapter(base, lora_dir / "big", seed=1, r=16)
    client = AsyncEngineClient(KVServeConfig.from_kwargs(
        model=str(tiny_model_dir), **TINY_ENGINE, quantization="none", enable_lora=True, max_lora_rank=8,
        lora_modules=[f"a={lora_dir / 'a'}"], lora_dir=str(lora_dir)))
    with ServerThread(client, ServerConfig(served_model_names=["tiny"], api_key="k")) as server:
        yield server, base, merged, lora_dir


def complete(url: str, model: str, prompt: list[int], **extra) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=KEY, timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **extra})


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_models_requests_and_routes(served):
    server, base, merged, lora_dir = served
    url, prompt = server.url, [5, 900, 17, 4000, 33, 12]
    cards = {c["id"]: c for c in httpx.get(f"{url}/v1/models", headers=KEY).json()["data"]}
    assert set(cards) == {"tiny", "a"} and cards["a"]["parent"] == "tiny" and cards["tiny"]["parent"] is None
    assert tokens(complete(url, "a", prompt)) == hf_greedy(merged["a"], prompt, 5)
    assert tokens(complete(url, "a", prompt, use_beam_search=True)) == hf_greedy(merged["a"], prompt, 5)  # width 1
    assert tokens(complete(url, "tiny", prompt)) == hf_greedy(base, prompt, 5)
    missing = complete(url, "b", prompt)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

    load = f"{url}/v1/load_lora_adapter"
    assert httpx.post(load, json={"lora_name": "b", "lora_path": "b"}).status_code == 401
    outside = httpx.post(load, headers=KEY, json={"lora_name": "b", "lora_path": "../.."})
    assert outside.status_code == 400 and "--lora-dir" in outside.json()["error"]["message"]
    big = httpx.post(load, headers=KEY, json={"lora_name": "big", "lora_path": "big"})
    assert big.status_code == 400 and "max-lora-rank" in big.json()["error"]["message"]
    assert httpx.post(load, headers=KEY, json={"lora_name": "b", "lora_path": str(lora_dir / "b")}).status_code == 200
    taken = httpx.post(load, headers=KEY, json={"lora_name": "b", "lora_path": "b"})
    assert taken.status_code == 400 and "already loaded" in taken.text
    assert tokens(complete(url, "b", prompt)) == hf_greedy(merged["b"], prompt, 5)
    assert httpx.get(f"{url}/v1/models/b", headers=KEY).json()["parent"] == "tiny"

    unload = f"{url}/v1/unload_lora_adapter"
    assert httpx.post(unload, headers=KEY, json={"lora_name": "b"}).status_code == 200
    assert complete(url, "b", prompt).status_code == 404
    assert httpx.post(unload, headers=KEY, json={"lora_name": "b"}).status_code == 404
    assert httpx.post(unload, headers=KEY, json={}).status_code == 400

    assert httpx.get(f"{url}/kv/events", headers=KEY).json()["lora_adapters"] == ["a"]  # what a router reads
    metrics = httpx.get(f"{url}/metrics").text
    assert 'kvserve_lora_requests_total{lora_name="a"} 6.0' in metrics  # 1 + the beam search's 5 steps
    assert 'kvserve_lora_generation_tokens_total{lora_name="b"} 5.0' in metrics
    assert "kvserve_lora_adapters_loaded 1.0" in metrics


def test_an_adapter_whose_folder_vanished_gets_a_clear_error(tiny_model_dir, tmp_path):
    """Its weights dropped (a CPU LRU of one) and its folder removed: a request for it gets an OpenAI-style 400
    saying why; the server goes on serving the other adapter and the base model."""
    import shutil

    from kvserve.config import KVServeConfig, ServerConfig
    from kvserve.server.engine_client import AsyncEngineClient

    base = tiny_hf_model(vocab=49152, seed=3)
    for i, n in enumerate("ab"):
        write_adapter(base, tmp_path / n, seed=50 + i, r=4)
    client = AsyncEngineClient(KVServeConfig.from_kwargs(
        model=str(tiny_model_dir), **TINY_ENGINE, quantization="none", enable_lora=True, max_lora_rank=8,
        max_loras=1, max_cpu_loras=1, lora_modules=[f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"]))
    with ServerThread(client, ServerConfig(served_model_names=["tiny"], api_key="k")) as server:
        want_b = tokens(complete(server.url, "b", [5, 6, 7]))  # b's weights in memory, a's dropped
        shutil.rmtree(tmp_path / "a")
        r = complete(server.url, "a", [5, 6, 7])
        assert r.status_code == 400, r.text
        assert "adapter_config.json" in r.json()["error"]["message"]
        assert tokens(complete(server.url, "b", [5, 6, 7])) == want_b
        assert len(tokens(complete(server.url, "tiny", [5, 6, 7]))) == 5
