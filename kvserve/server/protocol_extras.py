"""vLLM's extras in the wire format: ``structured_outputs``, the entries of ``prompt_logprobs``, and
``OmitsNone``, the base of the responses whose extras appear only when they carry something."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from kvserve.errors import InvalidArgumentError


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (the newer name of its guided_* fields): one constraint."""

    model_config = ConfigDict(extra="ignore")  # vLLM's tuning knobs (whitespace, fallback) are ignored

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None

    def asked(self) -> list[tuple[str, Any]]:
        """(GuidedSpec kind, value) of each constraint set."""
        if self.structural_tag is not None:
            raise InvalidArgumentError("structured_outputs.structural_tag is not supported",
                                       param="structured_outputs")
        out: list[tuple[str, Any]] = []
        for kind, value in (("json_schema", self.json_), ("regex", self.regex), ("choice", self.choice),
                            ("grammar", self.grammar)):
            if value is not None:
                out.append((kind, value))
        if self.json_object:
            out.append(("json_object", None))
        if not out:
            raise InvalidArgumentError("structured_outputs needs one of json, regex, choice, grammar or "
                                       "json_object", param="structured_outputs")
        return out


class OmitsNone(BaseModel):
    """Leaves the fields named in ``OMIT_IF_NONE`` out of its JSON when they are None, and those in
    ``OMIT_IF_UNSET`` unless they were given (even as None): kvserve's and vLLM's extras appear only
    when asked for, or when they carry something."""

    OMIT_IF_NONE: ClassVar[tuple[str, ...]] = ()
    OMIT_IF_UNSET: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in self.OMIT_IF_NONE:
            if key in data and data[key] is None:
                del data[key]
        for key in self.OMIT_IF_UNSET:
            if key not in self.model_fields_set:
                data.pop(key, None)
        return data


class PromptLogprob(BaseModel):
    """vLLM's shape of one token's entry in ``prompt_logprobs``."""

    logprob: float
    rank: int | None = None  # 1: the most likely token
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]  # per prompt token; the first one's is None
