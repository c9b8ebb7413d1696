"""The FastAPI app: /v1/completions, /v1/chat/completions (SSE or not), /v1/models, /health,
/metrics; OpenAI-shaped errors; a client that disconnects gets its kvsched request aborted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvsched.client import KvschedClientError, ModelInfo
from kvsched.http.backend import Backend
from kvsched.http.errors import ApiError, from_client_error, model_not_found
from kvsched.http.generation import Generation, raise_if_failed
from kvsched.http.logprobs import ChoiceExtras, TokenTexts
from kvsched.http.metrics import HttpMetrics
from kvsched.http.responses import DONE, Shape, sse
from kvsched.http.samples import sample_options, serve_samples
from kvsched.http.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvsched.http.structured import ToolReply, parse_forced
from kvsched.http.text import TextModel
from kvsched.http.tool_parser import AutoToolParser
from kvsched.http.utility import utility_router


@dataclass
class Settings:
    """What `kvsched http` serves: the model's tokenizer directory, the names clients use for
    it, the model name asked of kvsched ("" = the daemon's default), and the backend."""

    model_dir: str
    served_names: list[str]
    daemon_model: str = ""
    backend: Callable[[], Backend] = field(default=lambda: Backend(["127.0.0.1:50051"]))
    # tool_choice "auto": vLLM's tool parser of this name (vLLM's --tool-call-parser); "": off
    tool_call_parser: str = ""


class State:
    def __init__(self, settings: Settings, text: TextModel) -> None:
        self.settings = settings
        self.text = text
        self.metrics = HttpMetrics()
        self.backend: Backend | None = None
        self.auto_tools = (
            AutoToolParser(settings.tool_call_parser, text.hf)
            if settings.tool_call_parser
            else None
        )
        self.token_texts = TokenTexts(text.hf)


def bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if auth and (scheme.lower() != "bearer" or not token.strip()):
        raise ApiError(401, "Authorization must be 'Bearer <token>'", "authentication_error")
    return token.strip() or None


def create_app(settings: Settings, text: TextModel | None = None) -> FastAPI:
    state = State(settings, text or TextModel(settings.model_dir))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.backend = settings.backend()
        try:
            yield
        finally:
            await state.backend.close()

    app = FastAPI(title="kvsched http", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.kvsched = state
    _install_error_handlers(app)
    app.add_middleware(StatusCounter, metrics=state.metrics)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": await _model_cards(state, bearer(request))}

    async def max_model_len(model: str | None, request: Request) -> int:
        name = model or state.settings.served_names[0]
        _, info = await _resolve(state, name, bearer(request))
        return info.max_model_len if info is not None else 0

    app.include_router(utility_router(state.text, max_model_len))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        body.check()
        prompt = state.text.encode_prompt(body.prompt)
        return await _serve(state, request, body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        mode = body.check(state.auto_tools is not None)
        msgs = [m.rendered() for m in body.messages]
        tools = [t.model_dump() for t in body.tools] if body.tools else None
        prompt = state.text.encode_chat(msgs, body.add_generation_prompt, tools)
        reply = await _tool_reply(state, body, request, mode)
        return await _serve(state, request, body, prompt, chat=True, tools=reply)

    return app


async def _tool_reply(
    state: State, body: ChatCompletionRequest, request: Request, mode: str | None
) -> ToolReply | None:
    """How the answer of a chat with tools is parsed (None: plain text)."""
    if mode is None or mode == "none":
        return None
    if mode != "auto":
        return ToolReply(mode, lambda text: parse_forced(text, mode))
    parser = state.auto_tools
    assert parser is not None  # (check() refuses "auto" without it)
    raw = await request.json()
    body.skip_special_tokens = parser.skip_special_tokens(raw)
    return ToolReply(mode, lambda text: parser.parse(text, raw))


async def _model_cards(state: State, token: str | None) -> list[dict[str, Any]]:
    """The served names first (with the facts of the daemon model they map to), then the
    daemon's other models this front end's tokenizer fits (same vocabulary size)."""
    daemon = await _list_models(state, token)
    names = state.settings.served_names
    entries = [_daemon_entry(daemon, _daemon_name(state, n, daemon)) for n in names]
    cards = [_card(n, e) for n, e in zip(names, entries, strict=True)]
    # A LoRA adapter's parent as vLLM shows it: the served name of its base model.
    served_as = {e.name: n for n, e in reversed(list(zip(names, entries, strict=True))) if e}
    for m in daemon or []:
        if m.name not in names and _fits(state, m):
            card = _card(m.name, m)
            if m.parent:
                card["root"], card["parent"] = m.root, served_as.get(m.parent, m.parent)
            cards.append(card)
    return cards


async def _list_models(state: State, token: str | None) -> list[ModelInfo] | None:
    assert state.backend is not None
    try:
        return await state.backend.list_models(token)
    except KvschedClientError as exc:
        raise from_client_error(exc) from None


def _card(name: str, info: ModelInfo | None) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "kvsched"}
    if info is not None:
        card["max_model_len"] = info.max_model_len
        card["ready_instances"] = info.ready_instances
    return card


def _fits(state: State, m: ModelInfo) -> bool:
    return m.vocab_size in (0, state.text.vocab_size)


def _daemon_name(state: State, model: str, daemon: list[ModelInfo] | None) -> str:
    """What GenerateRequest.model says for a served name: the same name when the daemon serves
    a model so named, else --daemon-model ("" = the daemon's default model)."""
    if daemon is not None and any(m.name == model for m in daemon):
        return model
    return state.settings.daemon_model


def _daemon_entry(daemon: list[ModelInfo] | None, name: str) -> ModelInfo | None:
    if not daemon:
        return None
    if name:
        return next((m for m in daemon if m.name == name), None)
    bases = [m for m in daemon if not m.parent]  # (LoRA adapters are listed beside them)
    return bases[0] if len(bases) == 1 else None


async def _resolve(state: State, model: str, token: str | None) -> tuple[str, ModelInfo | None]:
    """The kvsched model name for a request's `model`, and what the daemon says of it: a served
    name, or a model the daemon serves whose vocabulary this front end's tokenizer fits."""
    daemon = await _list_models(state, token)
    known = {m.name: m for m in daemon or []}
    if model not in state.settings.served_names:
        if model not in known:
            names = state.settings.served_names + [m for m in known if _fits(state, known[m])]
            raise model_not_found(model, list(dict.fromkeys(names)))
        if not _fits(state, known[model]):
            raise ApiError(
                400,
                f"model {model!r} has a {known[model].vocab_size}-token vocabulary; this front "
                f"end's tokenizer has {state.text.vocab_size}: use a kvsched http serving it",
                param="model",
            )
    name = _daemon_name(state, model, daemon)
    return name, _daemon_entry(daemon, name)


async def _serve(
    state: State,
    request: Request,
    body: SamplingFields,
    prompt: list[int],
    chat: bool,
    tools: ToolReply | None = None,
) -> Response:
    assert state.backend is not None
    endpoint = "chat" if chat else "completions"
    arrived = time.monotonic()
    token = bearer(request)
    daemon_model, info = await _resolve(state, body.model, token)
    max_tokens = (
        body.wanted_max_tokens() if isinstance(body, ChatCompletionRequest) else body.max_tokens
    )
    options = body.options(_clamp(max_tokens, len(prompt), info))
    options.update(body.logprob_options(state.text.vocab_size))
    if daemon_model:
        options["model"] = daemon_model
    token_ids = prompt if body.return_token_ids else None
    shape = Shape(chat, body.model, body.include_usage(), token_ids, tools)
    extras = _extras(state, body, prompt)
    if (body.n or 1) > 1:
        gens = [
            Generation(
                state.backend,
                prompt,
                opts,
                token,
                state.text.detokenizer(body.skip_special_tokens, prompt),
                body.stop_strings(),
            )
            for opts in sample_options(options, body.n or 1)
        ]
        for g in gens:
            g.extras = extras()
        return await serve_samples(
            gens, shape, body.stream, request, state.metrics, endpoint, arrived
        )
    gen = Generation(
        state.backend,
        prompt,
        options,
        token,
        state.text.detokenizer(body.skip_special_tokens, prompt),
        body.stop_strings(),
    )
    gen.extras = extras()
    m = state.metrics
    m.in_flight.inc()
    watch = _watch_disconnect(request, gen)
    try:
        await gen.start()
    except BaseException as exc:
        watch.cancel()
        m.in_flight.dec()
        if isinstance(exc, ApiError) and exc.param == "structured_output":
            exc.param = body.constraint_param()
        if not isinstance(exc, ApiError):  # a refusal was never accepted: nothing to abort
            await gen.abort()
        raise
    m.ttft.labels(endpoint).observe(time.monotonic() - arrived)

    def done() -> None:
        watch.cancel()
        m.in_flight.dec()
        reason = "disconnect" if gen.disconnected else gen.finish_reason or "disconnect"
        m.finished.labels(endpoint, reason).inc()
        m.prompt_tokens.inc(gen.prompt_tokens)
        m.completion_tokens.inc(gen.completion_tokens)
        m.resumes.inc(gen.stream.resumes)
        m.latency.labels(endpoint).observe(time.monotonic() - arrived)

    if body.stream:
        return StreamingResponse(
            _stream(gen, shape, done), media_type="text/event-stream", headers=_SSE_HEADERS
        )
    try:
        text = await gen.collect()
    finally:
        done()
    raise_if_failed(gen)
    return JSONResponse(shape.full(gen, text))


def _extras(
    state: State, body: SamplingFields, prompt: list[int]
) -> Callable[[], ChoiceExtras | None]:
    """What makes each choice's extras (None: the request asked for none of them)."""
    echo = isinstance(body, CompletionRequest) and body.echo
    k, prompt_k = body.num_logprobs(), body.num_prompt_logprobs()
    streamed_ids = body.return_token_ids and body.stream
    if k is None and prompt_k is None and not echo and not streamed_ids:
        return lambda: None
    echo_text = None
    if isinstance(body, CompletionRequest) and body.echo:
        echo_text = "" if body.return_token_ids else _prompt_text(state, body.prompt, prompt)
    return lambda: ChoiceExtras(
        state.token_texts,
        chat=isinstance(body, ChatCompletionRequest),
        prompt=prompt,
        k=k,
        prompt_k=prompt_k,
        echo_text=echo_text,
        return_ids=body.return_token_ids,
    )


def _prompt_text(state: State, given: Any, ids: list[int]) -> str:
    """The prompt as echo repeats it: the text sent, or token ids decoded."""
    if isinstance(given, list) and given and isinstance(given[0], str):
        given = given[0]
    if isinstance(given, str):
        return given
    return state.token_texts.decode(ids)


def _clamp(max_tokens: int | None, n: int, info: ModelInfo | None) -> int | None:
    """max_tokens as vLLM's server makes it: at most what the context leaves after the prompt
    (the request then ends with finish_reason length); absent, all of it. A prompt that
    leaves no room is a 400 naming `input_tokens`, as vLLM's."""
    mml = info.max_model_len if info is not None else 0
    if not mml:
        return max_tokens  # the daemon's limits decide (it refuses what does not fit)
    if n >= mml:
        raise ApiError(
            400,
            f"This model's maximum context length is {mml} tokens. However, your prompt "
            f"contains {n} input tokens, which leaves no room for output. Please reduce the "
            "length of the input prompt.",
            param="input_tokens",
        )
    return mml - n if max_tokens is None else min(max_tokens, mml - n)


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _stream(gen: Generation, shape: Shape, done: Callable[[], None]) -> AsyncIterator[bytes]:
    try:
        first = True
        if shape.chat:
            yield shape.role_chunk(gen)
            first = False
        held: list[str] = []  # a tool call's text: parsed when whole
        async for piece in gen.deltas():
            if shape.tools is not None:
                held.append(piece)
                continue
            yield shape.piece_chunk(gen, piece, first=first)
            first = False
        if gen.finish_reason == "error":
            err = ApiError(500, f"kvsched: {gen.message}", "internal_error")
            yield sse(err.body())
        elif shape.tools is not None:
            for chunk in shape.tool_chunks("".join(held), gen):
                yield chunk
            if shape.include_usage:
                yield shape.usage_chunk(gen)
        else:
            yield shape.closing_chunk(gen)
            if shape.include_usage:
                yield shape.usage_chunk(gen)
        yield DONE
    finally:
        done()


def _watch_disconnect(request: Request, gen: Generation) -> asyncio.Task[None]:
    """A task that aborts the request in kvsched when the HTTP client disconnects (the
    generation then ends with reason abort and its response is dropped)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gen.disconnected = True
        await gen.abort()

    return asyncio.get_running_loop().create_task(watch())


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":  # loc is ("body", offset): not a parameter
            at = next((p for p in first.get("loc", ()) if isinstance(p, int)), None)
            msg = f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'invalid')}"
            msg += f" at character {at})" if at is not None else ")"
            return JSONResponse(ApiError(400, msg, param=None).body(), status_code=400)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        msg = f"{param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", exc))
        return JSONResponse(ApiError(400, msg, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = ApiError(exc.status_code, str(exc.detail), type_)
        return JSONResponse(err.body(), status_code=exc.status_code)


_PATHS = frozenset(
    (
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/version",
        "/ping",
    )
)


class StatusCounter:
    """Counts every answer by path and status (a plain ASGI middleware: streams untouched)."""

    def __init__(self, app: Any, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in _PATHS else "other"

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
