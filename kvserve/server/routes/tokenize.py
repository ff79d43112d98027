"""vLLM's /tokenize and /detokenize: a prompt (or chat messages through the template) to token ids,
and token ids back to text. Outside /v1, as in vLLM (so the API key does not guard them either)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvserve.errors import InvalidArgumentError
from kvserve.server import protocol as P
from kvserve.server.protocol_extras import OmitsNone
from kvserve.server.state import State

router = APIRouter()


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[P.ChatMessageIn] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None  # as in a chat request, so that the counts agree
    return_token_strs: bool = False


class TokenizeResponse(OmitsNone):
    OMIT_IF_NONE = ("token_strs",)

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:  # answered like a body FastAPI refused: a 400 naming the field
        raise RequestValidationError(e.errors()) from None


@router.post("/tokenize")
async def tokenize(state: State, body: dict[str, Any] = Body(...)) -> TokenizeResponse:
    """vLLM's two request shapes: {"prompt": ...} or {"messages": [...]} (chat template applied)."""
    if "messages" in body:
        chat: TokenizeChatRequest = _parse(TokenizeChatRequest, body)
        state.check_model(chat.model)
        if chat.continue_final_message and chat.add_generation_prompt:
            raise InvalidArgumentError("continue_final_message and add_generation_prompt cannot both be true "
                                       "(set add_generation_prompt to false)", param="continue_final_message")
        messages = [m.to_template_dict(i) for i, m in enumerate(chat.messages)]
        state.check_prompt_chars(sum(len(m["content"]) for m in messages) + len(str(chat.chat_template_kwargs or "")))
        tokens = await state.in_tokenizer_thread(lambda: state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message, chat_template_kwargs=chat.chat_template_kwargs))
        want_strs = chat.return_token_strs
    else:
        req: TokenizeCompletionRequest = _parse(TokenizeCompletionRequest, body)
        state.check_model(req.model)
        state.check_prompt_chars(len(req.prompt))
        tokens = await state.in_tokenizer_thread(lambda: state.tokenizer.encode(
            req.prompt, add_special_tokens=req.add_special_tokens))
        want_strs = req.return_token_strs
    strs = [state.token_text(t) for t in tokens] if want_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=state.client.max_model_len, tokens=tokens,
                              token_strs=strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: State) -> DetokenizeResponse:
    state.check_model(body.model)
    vocab = state.client.vocab_size or state.tokenizer.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise InvalidArgumentError(f"tokens must be token ids in [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens, skip_special_tokens=False))
