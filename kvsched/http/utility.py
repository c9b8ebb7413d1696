"""vLLM's utility endpoints: /tokenize and /detokenize (the model's own tokenizer and chat
template, the very encoding /v1/completions and /v1/chat/completions send), /version, /ping."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from kvsched import __version__
from kvsched.http.errors import invalid
from kvsched.http.schemas import ChatMessage, check_content
from kvsched.http.text import TextModel

# (model or None, the caller's bearer header) -> the model's max_model_len (0: not announced)
MaxModelLen = Callable[[str | None, Request], Awaitable[int]]


class TokenizeRequest(BaseModel):
    """Either `prompt` (special tokens added by default) or `messages` (the chat template with
    the generation prompt by default, no special tokens beyond the template's), as vLLM's."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(...)


def utility_router(text: TextModel, max_model_len: MaxModelLen) -> APIRouter:
    router = APIRouter()

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.get("/ping")
    @router.post("/ping")
    async def ping() -> Response:
        return Response(status_code=200)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, object]:
        if (body.prompt is None) == (body.messages is None):
            raise invalid("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            check_content(body.messages)
            msgs = [m.rendered() for m in body.messages]
            ids = text.encode_chat(msgs, body.add_generation_prompt)
            if body.add_special_tokens:
                ids = text.with_special_tokens(ids)
        else:
            assert body.prompt is not None
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = list(text.hf(body.prompt, add_special_tokens=add).input_ids)
        strs = text.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": await max_model_len(body.model, request),
            "tokens": ids,
            "token_strs": strs,
        }

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
        await max_model_len(body.model, request)  # an unknown model is a 404, as vLLM's
        bad = [t for t in body.tokens if not 0 <= t < text.vocab_size]
        if bad:
            raise invalid(
                f"token id {bad[0]} is outside the vocabulary [0, {text.vocab_size})", "tokens"
            )
        return {"prompt": text.decode(body.tokens, skip_special_tokens=False)}

    return router
