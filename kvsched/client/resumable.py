"""A Generate that survives its daemon: `resumable(client, prompt, **options)`.

    stream = resumable(client, prompt, max_tokens=256)
    async for batch in stream:          # every token exactly once, across daemon restarts
        ...
    stream.finished, stream.tokens, stream.resumes

The request gets a client-chosen id (unless one is given). When the stream breaks with
UNAVAILABLE or CANCELLED (daemon killed or restarting, connection lost), the helper calls
Resume with the tokens it holds, retrying with a short backoff for `retry_for_s`. A submit that
broke before `queued` may or may not have been accepted: Resume answers that (NotFound: it
was not, so it is submitted again); a submit refused because the same request is live already
(AlreadyLive: an attempt given up on was accepted after all) is followed by Resume. Any
other error is raised. Use a client whose channel
retries connections quickly (`RESUMABLE_CHANNEL_OPTIONS`).

In a cluster, give it one client per daemon (`resumable([c_a, c_b, c_c], prompt, ...)`): it
submits through the first and, at each break, retries through the next. Any daemon serves a
Resume: one that does not own the request relays it to the daemon that does (the journal names
it; after a daemon's death, the daemon that adopted its requests), so the helper needs no
owner lookup. Its requests are detachable (unless `detachable=False` is given): a request the
daemon you talk to forwarded to a peer's instance then keeps running on that peer when your
daemon dies, instead of being aborted as a dropped stream.

Bounded waits (a paused, hung or cut-off daemon whose kernel still accepts TCP neither breaks
a stream nor answers a call):

- a stream that is open but silent: a request may legitimately send nothing for a long time
  (waiting in the queue, a long prefill), and the protocol has no stream heartbeat, so the
  liveness signal is gRPC keepalive: the daemon's gRPC core answers HTTP/2 pings without its
  event loop, so an unanswered ping means the process or the path is gone, not that it is busy.
  `resumable_channel_options()` (and `RESUMABLE_CHANNEL_OPTIONS`, its defaults) pings every
  `keepalive_s` (5 s: the least interval a kvsched daemon accepts,
  `grpc.http2.min_ping_interval_without_data_ms`; faster pings get the connection closed
  with "too_many_pings") and breaks every stream of a connection whose ping got no answer in
  `ping_timeout_s` (2 s): such a stream is abandoned within keepalive_s + ping_timeout_s;
- each Generate or Resume attempt waits at most `attempt_timeout_s` (2 s) for its first answer
  (`queued`, or an error status); one that gets none is cancelled (NoAnswer) and the next
  daemon is tried, round robin (a connection the channel cannot set up fails at once: a
  paused daemon costs at most `attempt_timeout_s` per round).

Resume carries the tokens received, so a break or an abandoned attempt loses and repeats no
token. A cancelled attempt is a dropped stream for the daemon, so requests are `detachable`
unless `detachable=False` is given (a slow but live daemon then does not abort the request
when the client gives up on one attempt); a stream its reader leaves unfinished (break out of
the loop, task cancelled, retry_for_s spent) is aborted by the helper (best effort).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Unpack

from kvsched.client.aio import AsyncClient, AsyncGenerateStream
from kvsched.client.errors import AlreadyLive, Cancelled, NoAnswer, NotFound, Unavailable
from kvsched.client.types import Finished, RequestOptions, TokenLogprob

ATTEMPT_TIMEOUT_S = 2.0  # default bound on a Generate/Resume attempt's first answer
KEEPALIVE_S = 5.0  # a kvsched daemon refuses pings more often than every 5 s (no data)
PING_TIMEOUT_S = 2.0


def resumable_channel_options(
    keepalive_s: float = KEEPALIVE_S, ping_timeout_s: float = PING_TIMEOUT_S
) -> tuple[tuple[str, int], ...]:
    """gRPC channel options for a resumable client: find a restarted daemon within ~0.5 s
    (the default reconnect backoff starts at 1 s and grows to 120 s) and break a stream whose
    daemon stopped answering pings (keepalive every `keepalive_s`, keep it >= the daemon's
    5 s minimum; broken when a ping is unanswered for `ping_timeout_s`)."""
    ping_timeout_ms = int(ping_timeout_s * 1000)
    return (
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 500),
        ("grpc.keepalive_time_ms", int(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", ping_timeout_ms),
        # Any unanswered ping (also a flow-control BDP ping, sent first when data flows)
        # times out as fast: otherwise it holds back the keepalive pings behind it.
        ("grpc.http2.ping_timeout_ms", ping_timeout_ms),
        ("grpc.http2.max_pings_without_data", 0),  # a silent stream keeps being watched
        ("grpc.keepalive_permit_without_calls", 0),  # no pings on an idle channel
    )


RESUMABLE_CHANNEL_OPTIONS = resumable_channel_options()
_ABORTS: set[asyncio.Task[None]] = set()  # aborts of abandoned requests, until they are done


class ResumableStream:
    """One request followed across broken streams (see the module docstring)."""

    def __init__(
        self,
        client: AsyncClient | Sequence[AsyncClient],
        prompt: Sequence[int],
        options: RequestOptions,
        retry_for_s: float,
        backoff_s: float,
        metadata: Sequence[tuple[str, str]] = (),
        attempt_timeout_s: float | None = ATTEMPT_TIMEOUT_S,
    ) -> None:
        self.clients = [client] if isinstance(client, AsyncClient) else list(client)
        if not self.clients:
            raise ValueError("resumable needs at least one client")
        self.client = self.clients[0]
        self.instance = ""  # the instance the request was first placed on (its `queued`)
        self.prompt = list(prompt)
        self.options: RequestOptions = dict(options)  # type: ignore[assignment]
        self.request_id: str = self.options.get("request_id") or uuid.uuid4().hex
        self.options["request_id"] = self.request_id
        # A dropped stream or an abandoned attempt must not abort the request on a daemon that
        # is slow but alive: the helper aborts it itself when its reader leaves it unfinished.
        self.options.setdefault("detachable", True)
        self.retry_for_s = retry_for_s
        self.backoff_s = backoff_s
        self.metadata = tuple(metadata)  # sent with every Generate and Resume call
        self.attempt_timeout_s = attempt_timeout_s  # None: wait for a first answer forever
        self.attempts = 0  # Generate/Resume calls made
        self.unanswered = 0  # attempts abandoned for want of a first answer (NoAnswer)
        self.last_error: Exception | None = None  # what ended the last stream or attempt
        self.tokens: list[int] = []
        # Only for a request that asked (options `logprobs` / `prompt_logprobs`): one row per
        # token of `tokens`, and the prompt's rows.
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self._asked = "logprobs" in self.options or "prompt_logprobs" in self.options
        self.finished: Finished | None = None
        self.accepted = False  # a stream was opened: the daemon accepted the request
        self.resumes = 0  # Resume calls that succeeded
        self.broken_at: list[float] = []  # time.monotonic() of each break
        self.first_token_after_break: list[float] = []  # seconds, one per break that resumed

    async def _open(self, queued: bool) -> tuple[AsyncGenerateStream, bool]:
        """The stream to read next, and whether the request is known to be accepted."""
        self.attempts += 1
        if self.broken_at or queued:
            try:
                return await self._resume(), True
            except NotFound:
                if queued:
                    raise  # accepted, and now unknown: lost (the journal is off or expired)
        try:
            stream = await self.client.generate(
                self.prompt,
                metadata=self.metadata,
                first_answer_timeout=self.attempt_timeout_s,
                **self.options,
            )
        except AlreadyLive:
            # An earlier submit of it was accepted after all (an attempt this helper gave up
            # on, that a daemon forwarded on): follow that one, never a second copy.
            try:
                return await self._resume(), True
            except NotFound as exc:  # live, its record not stored yet: ask again shortly
                raise Unavailable(exc.message, request_id=self.request_id) from None
        self.instance = self.instance or stream.instance
        return stream, True

    async def _resume(self) -> AsyncGenerateStream:
        """Resume from the tokens held (counted in `resumes` when it succeeds)."""
        stream = await self.client.resume(
            self.request_id,
            self.tokens,
            metadata=self.metadata,
            first_answer_timeout=self.attempt_timeout_s,
        )
        self.resumes += 1
        return stream

    async def __aiter__(self) -> AsyncIterator[list[int]]:
        try:
            async for batch in self._follow():
                yield batch
        finally:
            if self.finished is None and self.attempts:
                self._abort_later()  # left unfinished (dropped, cancelled, or gave up)

    def _abort_later(self) -> None:
        """Abort the request (best effort, not awaited): it is detachable, so no daemon aborts
        it when its stream goes (NotFound, e.g. it was never accepted, is ignored)."""

        async def abort() -> None:
            # Any failure (daemon gone, a duck-typed client without abort) leaves it to the
            # daemon's own limits; nobody waits for this task.
            with contextlib.suppress(Exception):
                await self.client.abort(self.request_id, timeout=5.0, metadata=self.metadata)

        try:
            task = asyncio.get_running_loop().create_task(abort())
        except RuntimeError:  # no running loop (closed at exit): nothing to abort with
            return
        _ABORTS.add(task)
        task.add_done_callback(_ABORTS.discard)

    async def _follow(self) -> AsyncIterator[list[int]]:
        queued = False
        deadline = time.monotonic() + self.retry_for_s
        waiting_first = False
        while True:
            try:
                stream, queued = await self._open(queued)
                self.accepted = True
                async for batch in stream:
                    if waiting_first and batch:
                        self.first_token_after_break.append(time.monotonic() - self.broken_at[-1])
                        waiting_first = False
                    self.tokens.extend(batch)
                    if self._asked:  # (only a request that asked for log-probabilities)
                        self._logprobs(stream, len(batch))
                    yield batch
                self.finished = stream.finished
                return
            except (Unavailable, Cancelled) as exc:
                now = time.monotonic()
                self.last_error = exc
                if isinstance(exc, NoAnswer):
                    self.unanswered += 1
                if now >= deadline:
                    raise
                if not waiting_first:
                    self.broken_at.append(now)
                    waiting_first = True
                # The next daemon (one client: the same one again).
                self.client = self.clients[
                    (self.clients.index(self.client) + 1) % len(self.clients)
                ]
                await asyncio.sleep(self.backoff_s)

    def _logprobs(self, stream: AsyncGenerateStream, n: int) -> None:
        """The rows of the batch just read (a resumed stream's rows follow on; a batch that
        came without them gets unknown rows, rank 0)."""
        rows = stream.last_logprobs if "logprobs" in self.options else []
        if len(rows) != n:
            rows = (rows + [TokenLogprob(0.0, 0, [], [])] * n)[:n]
        self.logprobs.extend(rows)
        stream.last_logprobs = []
        if self.prompt_logprobs is None:
            self.prompt_logprobs = stream.prompt_logprobs

    async def read_all(self) -> list[int]:
        async for _ in self:
            pass
        return self.tokens


def resumable(
    client: AsyncClient | Sequence[AsyncClient],
    prompt: Sequence[int],
    *,
    retry_for_s: float = 60.0,
    backoff_s: float = 0.1,
    metadata: Sequence[tuple[str, str]] = (),
    attempt_timeout_s: float | None = ATTEMPT_TIMEOUT_S,
    **options: Unpack[RequestOptions],
) -> ResumableStream:
    """A Generate that resumes by itself when its stream breaks (see the module docstring).
    `metadata` goes with every call (e.g. a bearer token per request); `attempt_timeout_s`
    bounds each Generate/Resume attempt's wait for its first answer (None: no bound)."""
    return ResumableStream(
        client, prompt, options, retry_for_s, backoff_s, metadata, attempt_timeout_s
    )
