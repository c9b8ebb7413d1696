"""`n` > 1: several samples of one prompt in one response. Each sample is a kvsched request of
its own, seeded as vLLM's parallel sampling seeds its children (sample i: seed + i; no seed: each
unseeded), so each equals vLLM's sample of the same index. All n name one `sample_group` (a
fresh id per HTTP request), so the daemon computes the prompt once: the first it accepts
prefills it, the others wait for its first token and take the prompt's full KV blocks from the
prefix cache (docs/HTTP.md). Streamed: each piece is a chunk of its choice's `index`; each
choice closes with its own finish_reason chunk; usage counts the prompt once (as vLLM)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvsched.http.errors import ApiError
from kvsched.http.generation import Generation, raise_if_failed
from kvsched.http.metrics import HttpMetrics
from kvsched.http.responses import DONE, Shape, sse


def sample_options(options: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The kvsched options of each of n samples: one sample group (the daemon computes the
    prompt once), seed + i when seeded, request_id + "-i" when the client named the request."""
    out = []
    group = uuid.uuid4().hex
    for i in range(n):
        o = dict(options)
        o["sample_group"] = group
        if o.get("seed") is not None:
            o["seed"] = (o["seed"] + i) % (1 << 64)
        if o.get("request_id"):
            o["request_id"] = f"{o['request_id']}-{i}"
        out.append(o)
    return out


async def serve_samples(
    gens: list[Generation],
    shape: Shape,
    stream: bool,
    request: Request,
    metrics: HttpMetrics,
    endpoint: str,
    arrived: float,
) -> Response:
    watch = _watch_disconnect(request, gens)
    metrics.in_flight.inc()
    try:
        await asyncio.gather(*(g.start() for g in gens))
    except BaseException:
        watch.cancel()
        metrics.in_flight.dec()
        await asyncio.gather(*(g.abort() for g in gens))  # those accepted; others: no-op
        raise
    metrics.ttft.labels(endpoint).observe(time.monotonic() - arrived)

    def done() -> None:
        watch.cancel()
        metrics.in_flight.dec()
        for g in gens:
            reason = "disconnect" if g.disconnected else g.finish_reason or "disconnect"
            metrics.finished.labels(endpoint, reason).inc()
            metrics.completion_tokens.inc(g.completion_tokens)
            metrics.resumes.inc(g.stream.resumes)
        metrics.prompt_tokens.inc(gens[0].prompt_tokens)
        metrics.latency.labels(endpoint).observe(time.monotonic() - arrived)

    if stream:
        return StreamingResponse(
            _stream(gens, shape, done),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        texts = await asyncio.gather(*(g.collect() for g in gens))
    finally:
        done()
    for g in gens:
        raise_if_failed(g)
    return JSONResponse(shape.full_many(gens, list(texts)))


async def _stream(
    gens: list[Generation], shape: Shape, done: Callable[[], None]
) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for piece in g.deltas():
                await queue.put((i, piece))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.get_running_loop().create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        first = set(range(len(gens)))
        if shape.chat:
            for i in range(len(gens)):
                yield shape.role_chunk(gens[i], index=i)
            first.clear()
        running = len(gens)
        held: dict[int, list[str]] = {i: [] for i in range(len(gens))}  # tool calls: whole
        while running:
            i, piece = await queue.get()
            if piece is None:
                running -= 1
                g = gens[i]
                if g.finish_reason == "error":
                    yield sse(ApiError(500, f"kvsched: {g.message}", "internal_error").body())
                elif shape.tools is not None:
                    for chunk in shape.tool_chunks("".join(held[i]), g, index=i):
                        yield chunk
                else:
                    yield shape.closing_chunk(g, index=i)
                continue
            if shape.tools is not None:
                held[i].append(piece)
                continue
            yield shape.piece_chunk(gens[i], piece, first=i in first, index=i)
            first.discard(i)
        if shape.include_usage:
            yield shape.usage_chunk(*gens)
        yield DONE
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        done()


def _watch_disconnect(request: Request, gens: list[Generation]) -> asyncio.Task[None]:
    """Abort every sample in kvsched when the HTTP client disconnects."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for g in gens:
            g.disconnected = True
        await asyncio.gather(*(g.abort() for g in gens))

    return asyncio.get_running_loop().create_task(watch())
