"""The offline Python API: ``LLM(...).generate(prompts, params)`` and ``LLM.chat(messages)``.

An in-process client of the engine core: requests go in as commands, each step's deltas come
back through the same ``OutputProcessor`` the server uses, so text, stop strings and the end of
a request are decided the same way here and there.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from kvserve.build import build_engine, build_handoff
from kvserve.config import KVServeConfig
from kvserve.engine.core import EngineCore
from kvserve.engine.engine import Engine
from kvserve.engine.messages import AddRequest, LoRACommand, Sleep, UpdateWeights, WakeUp
from kvserve.engine.request import Request, SamplingParams
from kvserve.errors import InvalidArgumentError
from kvserve.model.config import ModelConfig
from kvserve.text.output import OutputProcessor, RequestOutput
from kvserve.text.tokenizer import bad_words_token_ids

PromptLike = str | list[int]
GRAMMAR_WAIT_S = 0.05  # with nothing to step, how long to sleep on a compiling grammar before looking again


class LLM:
    """Generate from a model in this process. With no ``model``, the embedded SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        from kvserve.model.loader import load_model, resolve_model_path
        from kvserve.text.tokenizer import Tokenizer

        from kvserve.runner.weight_update import ModelSource

        self.config = KVServeConfig.from_kwargs(model=model, **engine_args)
        m = self.config.model
        path = resolve_model_path(model)
        loaded = load_model(path, keep_quantized=m.quantization != "none", load_format=m.load_format, seed=m.seed)
        self.tokenizer = Tokenizer(loaded.tokenizer, loaded.config)
        self.model_name = loaded.name
        self._start(build_engine(self.config, loaded.config, loaded.hand_over(), self.tokenizer.eos_token_ids,
                                 hf_tokenizer=loaded.tokenizer, source=ModelSource(str(path), m.load_format, m.seed)))

    @classmethod
    def from_weights(cls, model_config: ModelConfig, weights: dict[str, torch.Tensor], tokenizer=None,
                     draft: tuple[ModelConfig, dict[str, torch.Tensor]] | None = None, **engine_args: Any) -> "LLM":
        """An LLM over weights already in memory (tests use tiny random models this way)."""
        self = cls.__new__(cls)
        self.config = KVServeConfig.from_kwargs(**engine_args)
        self.tokenizer = tokenizer
        self.model_name = "in-memory"
        eos = tokenizer.eos_token_ids if tokenizer is not None else model_config.eos_token_ids
        self._start(build_engine(self.config, model_config, weights, eos, draft,
                                 hf_tokenizer=tokenizer.hf if tokenizer is not None else None))
        return self

    def _start(self, engine: Engine) -> None:
        self.engine = engine
        self.core = EngineCore(engine, self.model_name, build_handoff(self.config, engine))
        self._ids = itertools.count()

    # -- inputs -----------------------------------------------------------------------
    def _encode(self, prompt: PromptLike) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidArgumentError("this model has no tokenizer: pass token ids", param="prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise InvalidArgumentError("a prompt must be a string or a list of token ids", param="prompt")

    @staticmethod
    def _as_list(prompts: PromptLike | Sequence[PromptLike]) -> list[PromptLike]:
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]
        return list(prompts)

    # -- running requests through the core --------------------------------------------
    def _add(self, processor: OutputProcessor, prompt_token_ids: list[int], params: SamplingParams,
             lora: str | None = None) -> str:
        rid = str(next(self._ids))
        if params.bad_words and params.bad_words_token_ids is None:
            if self.tokenizer is None:
                raise InvalidArgumentError("bad_words need a tokenizer: pass bad_words_token_ids", param="bad_words")
            # this tokenizer's ids, on a copy: the caller may use its params with another model
            params = replace(params, bad_words_token_ids=bad_words_token_ids(params.bad_words, self.tokenizer))
        processor.add(Request(rid, prompt_token_ids, params, max_total_tokens=self.engine.max_model_len))
        self.core.add(AddRequest(rid, prompt_token_ids, params, lora_name=lora))
        return rid

    def _step(self, processor: OutputProcessor) -> list[RequestOutput]:
        """One engine step; the outputs of the requests it changed. A request the engine refused
        raises its error here."""
        msg = self.core.step()
        if msg is None:
            self.core.wait_for_grammars(GRAMMAR_WAIT_S)
            return []
        if msg.rejected:
            raise msg.rejected[0].error()
        outs = []
        for delta in msg.deltas:
            out, stopped = processor.apply(delta.request_id, [delta])
            if stopped:  # a stop string ended it: the engine still thinks it runs
                self.core.abort([delta.request_id])
            outs.append(out)
        return outs

    # -- the model: sleep, wake, new weights (kvserve.engine.model_ops) --------------------------
    @property
    def is_sleeping(self) -> bool:
        return self.core.model_ops.sleeping

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Free the KV cache (level 2: the weights too; ``wake_up`` reloads them from disk). ``generate``
        refuses prompts while asleep (ServiceUnavailableError)."""
        return self._model_command(Sleep("sleep", level))

    def wake_up(self) -> dict[str, Any]:
        return self._model_command(WakeUp("wake_up"))

    def update_weights_from_disk(self, model_path: str, load_format: str = "auto") -> dict[str, Any]:
        """Serve the checkpoint at ``model_path`` (a folder or a .gguf of the same architecture and shapes;
        else InvalidArgumentError and the weights stay). Prefix-cache and tier entries of the old weights
        become misses. The tokenizer stays the one loaded first."""
        return self._model_command(UpdateWeights("update", str(model_path), load_format))

    def _model_command(self, cmd: Sleep | WakeUp | UpdateWeights) -> dict[str, Any]:
        """Run a model command now (between ``generate`` calls no request is in the engine)."""
        self.core.submit(cmd)
        msg = self.core.step()
        assert msg is not None and msg.replies, "the engine did not run the command"
        reply = msg.replies[0]
        if reply.error is not None:
            raise reply.error
        return reply.data

    def _busy(self) -> bool:
        return self.core.has_work or self.core.is_compiling

    # -- generation -------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptLike | Sequence[PromptLike],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion in continuous batches; outputs in prompt order. ``lora``: the
        adapter's name (one, or one per prompt; None: the base model)."""
        items = self._as_list(prompts)
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(items)
        if len(plist) != len(items):
            raise InvalidArgumentError("give one SamplingParams, or one per prompt")
        encoded = [self._encode(p) for p in items]
        finals: dict[str, RequestOutput] = {}
        order: list[str] = []
        processor = OutputProcessor(self.tokenizer)
        try:
            loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(items)
            for ids, p, name in zip(encoded, plist, loras, strict=True):
                order.append(self._add(processor, ids, p, name))
            bar = None
            if use_tqdm:
                from tqdm import tqdm

                bar = tqdm(total=len(order), desc="requests", unit="req")
            while self._busy():
                for out in self._step(processor):
                    if out.finished:
                        finals[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
            if bar is not None:
                bar.close()
        except BaseException:
            self.core.abort(order)  # leave no half-run request behind (Ctrl-C, errors)
            raise
        for rid, text in zip(order, items):
            finals[rid].prompt = text if isinstance(text, str) else None
        return [finals[rid] for rid in order]

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter (needs ``enable_lora``); requests then name it in ``generate(lora=...)``."""
        self._lora(LoRACommand("llm", "load", name, path))

    def unload_lora_adapter(self, name: str) -> None:
        self._lora(LoRACommand("llm", "unload", name))

    def _lora(self, cmd: LoRACommand) -> None:
        reply = self.core.lora_command(cmd)
        if reply.error is not None:
            raise reply.error

    def stream(self, prompt: PromptLike, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield one output per new token for a single prompt (for terminals and tests)."""
        processor = OutputProcessor(self.tokenizer)
        rid = self._add(processor, self._encode(prompt), params or SamplingParams())
        try:
            while self._busy():
                for out in self._step(processor):
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.core.abort([rid])

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        if self.tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer or chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params, use_tqdm=use_tqdm)
