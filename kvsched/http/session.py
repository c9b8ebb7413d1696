"""The front end's requests over the daemons' Session streams (RequestService.Session): one
bidirectional stream per daemon address and bearer token, opened on first use, carries every
submit and abort in and every token delta out, batched by the daemon (one message per engine
step or more, columnar); `SessionLink` demultiplexes each message to the `RequestStream` of each
request it names. One stream instead of one Generate call per request: no call set-up per
request, one read per step instead of one per request and step.

When a session breaks (the daemon died or restarts, the connection dropped), each of its
requests goes on by itself:
- not accepted yet (its `accepted` never came): submitted again, through the next address,
  until `retry_for_s` has passed (the daemon aborted whatever it had of a non-detachable one);
- accepted and detachable (a front end with several --server addresses): followed alone by
  kvsched.client.resumable, Resume with the tokens it holds (submitted again when the daemons
  never accepted it), through the next address first; a detachable request that its session
  does not accept within ATTEMPT_TIMEOUT_S (2 s: a paused daemon) is followed alone the same
  way;
- accepted and not detachable (one address): the daemon aborted it when the stream dropped;
  it ends in error, which the HTTP client sees;
- a refusal that is the caller's (UNAUTHENTICATED, PERMISSION_DENIED) ends its requests with
  that error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kvsched.client import AsyncClient, KvschedClientError
from kvsched.client.aio import AsyncSession
from kvsched.client.errors import Cancelled, Unavailable, error_for
from kvsched.client.resumable import ATTEMPT_TIMEOUT_S, ResumableStream
from kvsched.client.types import (
    Finished,
    TokenLogprob,
    build_submit,
    logprob_rows,
    session_abort,
)
from kvsched.v1 import request_service_pb2 as rpb

_BACKOFF_S = 0.1
_UNKNOWN = TokenLogprob(0.0, 0, [], [])  # the row of a token that came without one


class SessionLink:
    """One Session stream to one daemon, for one bearer token: a writer task sends what
    `submit` and `abort` queue, in order; a reader task hands each response's parts to the
    requests it names. `dead` once the stream ended; its requests were told (`broke`)."""

    def __init__(self, client: AsyncClient, metadata: Sequence[tuple[str, str]]) -> None:
        self.client = client
        self.streams: dict[str, RequestStream] = {}  # by request id (also its client tag)
        self.dead = False
        self._closing = False
        self._session: AsyncSession = client.session(metadata=metadata)
        self._outbox: asyncio.Queue[rpb.SessionRequest] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self._write_loop())
        self._reader = loop.create_task(self._read_loop())

    def submit(self, stream: RequestStream) -> None:
        # Built in place: nesting a built request copies it (~10 ms for an 87k-token prompt).
        msg = build_submit(stream.prompt, stream.options, stream.request_id)  # type: ignore[arg-type]
        self.streams[stream.request_id] = stream
        self._outbox.put_nowait(msg)

    def abort(self, request_id: str, stop: bool) -> None:
        self._outbox.put_nowait(rpb.SessionRequest(abort=session_abort(request_id, stop)))

    def detach(self, stream: RequestStream) -> None:
        """Stop delivering to `stream` (it is followed elsewhere now)."""
        if self.streams.get(stream.request_id) is stream:
            del self.streams[stream.request_id]

    async def _write_loop(self) -> None:
        """Writes what is queued, in order. Whatever else is queued already when one message
        is taken goes with it (no waiting for more): consecutive submits in one message
        (SessionRequest.batch, once the daemon said it takes them), so a burst of requests is
        read by the daemon at once; an abort ends the run of submits before it."""
        outbox, session = self._outbox, self._session
        with contextlib.suppress(KvschedClientError):  # the reader sees the break too
            while True:
                queued = [await outbox.get()]
                while not outbox.empty():
                    queued.append(outbox.get_nowait())
                run: list[rpb.SessionRequest] = []
                for msg in queued:
                    if msg.HasField("abort"):
                        await session.submit_many_built(run)
                        run = []
                        await session._write(msg)
                    else:
                        run.append(msg)
                await session.submit_many_built(run)

    @property
    def batched_submits(self) -> int:
        """Submits this link sent inside batches (several in one message)."""
        return self._session.batched_submits

    async def _read_loop(self) -> None:
        why: KvschedClientError = Unavailable("the daemon ended the Session stream")
        try:
            async for batch in self._session:
                self._dispatch(batch.raw)
        except KvschedClientError as exc:
            why = exc
        except asyncio.CancelledError:
            raise
        finally:
            if self._closing:
                why = _Closing("the front end is shutting down")
            self.dead = True
            self._writer.cancel()
            streams, self.streams = self.streams, {}
            for s in streams.values():
                s.broke(self, why)

    def _dispatch(self, raw: rpb.SessionResponse) -> None:
        """One response, in the contract's order: accepted, tokens, finished, errors."""
        streams = self.streams
        acc = raw.accepted
        for rid, instance in zip(acc.request_ids, acc.instances, strict=True):
            if (s := streams.get(rid)) is not None:
                s.accepted = True
                s.instance = s.instance or instance
        t = raw.tokens
        if t.request_ids:
            ids = list(t.token_ids)
            if len(t.num_logprobs) or len(t.num_prompt_logprobs):
                self._deltas_with_logprobs(t, ids)
            else:  # (usually: no request of this message asked for log-probabilities)
                pos = 0
                for rid, n in zip(t.request_ids, t.num_tokens, strict=True):
                    end = pos + n
                    if (s := streams.get(rid)) is not None:
                        s.push(ids[pos:end])
                    pos = end
        for f in raw.finished:
            if (s := streams.pop(f.request_id, None)) is not None:
                s.end(Finished.from_pb(f))
        for e in raw.errors:
            # A refused submit names its tag (= its request id); a refused abort (the request
            # finished meanwhile) needs nothing.
            if e.client_tag and (s := streams.pop(e.client_tag, None)) is not None:
                s.fail(error_for(e.code, e.message, s.request_id))

    def _deltas_with_logprobs(self, t: rpb.SessionResponse.TokenDeltas, ids: list[int]) -> None:
        """Token deltas with log-probability columns: each request's rows (num_logprobs[i] of
        `logprobs`) and its prompt's (num_prompt_logprobs[i], with its first tokens) go with
        its tokens."""
        rows, prompt = logprob_rows(t.logprobs), logprob_rows(t.prompt_logprobs)
        n_rows = list(t.num_logprobs) or [0] * len(t.request_ids)
        n_prompt = list(t.num_prompt_logprobs) or [0] * len(t.request_ids)
        pos = i = j = 0
        for rid, n, m, k in zip(t.request_ids, t.num_tokens, n_rows, n_prompt, strict=True):
            if (s := self.streams.get(rid)) is not None:
                s.push(ids[pos : pos + n], rows[i : i + m], prompt[j : j + k] if k else None)
            pos, i, j = pos + n, i + m, j + k

    def close(self) -> None:
        """Drop the stream (the daemon aborts its non-detachable requests)."""
        self._closing = True
        self._session.cancel()
        self._reader.cancel()
        self._writer.cancel()


class RequestStream:
    """One request's outputs, from its session (or, after a break, from a stream of its own):
    `await next_batch()` gives every token that arrived since the last call (waiting for one),
    None once it finished; raises the request's error (a refusal, a break it cannot survive).
    Then `finished`, `tokens`, `resumes` (Resume calls that succeeded). For a request that
    asked (options `logprobs` / `prompt_logprobs`), as kvsched.client.resumable's stream:
    `logprobs`, one row per token of `tokens` (rank 0: not known), and `prompt_logprobs`, the
    prompt's rows once they came."""

    def __init__(
        self,
        prompt: Sequence[int],
        options: dict[str, Any],
        metadata: tuple[tuple[str, str], ...],
        place: Callable[[RequestStream], SessionLink],
        rotation: Callable[[], list[AsyncClient]],
        retry_for_s: float,
    ) -> None:
        self.prompt = list(prompt)
        self.options = dict(options)
        self.request_id: str = self.options.get("request_id") or uuid.uuid4().hex
        self.options["request_id"] = self.request_id
        self.detachable = bool(self.options.get("detachable"))
        self.metadata = metadata
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self._asked = "logprobs" in self.options or "prompt_logprobs" in self.options
        self.finished: Finished | None = None
        self.instance = ""
        self.accepted = False
        self.resumes = 0
        self.link: SessionLink | None = None
        self.follower: ResumableStream | None = None
        self._place = place
        self._rotation = rotation
        self._retry_for_s = retry_for_s
        self._deadline = time.monotonic() + retry_for_s
        self._task: asyncio.Task[None] | None = None  # a retry or a follower after a break
        self._placed = False
        self._taken = 0
        self._ended = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._end_waiters: list[asyncio.Future[None]] = []
        self._aborted = False

    # -- the reader's side
    async def next_batch(self) -> list[int] | None:
        if not self._placed:
            self._placed = True
            self._put_on(self._place(self))
        while self._taken == len(self.tokens) and not self._ended:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        self._waiter = None
        if self._taken < len(self.tokens):
            batch = self.tokens[self._taken :]
            self._taken = len(self.tokens)
            return batch
        if self._error is not None:
            raise self._error
        return None

    async def wait_ended(self, timeout: float) -> None:
        """Until the request ended (finished or failed), at most `timeout` seconds."""
        if self._ended:
            return
        fut = asyncio.get_running_loop().create_future()
        self._end_waiters.append(fut)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(fut, timeout)

    async def abort(self, stop: bool = False) -> None:
        """End the request wherever it is (`stop`: it finishes with reason stop); one that
        ended already, or was never sent, needs nothing."""
        if self._aborted or self._ended or not self._placed:
            return
        self._aborted = True
        if self.link is not None:
            self.link.abort(self.request_id, stop)
        elif self.follower is not None and self.follower.attempts:
            client = self.follower.client
            with contextlib.suppress(KvschedClientError):
                await client.abort(self.request_id, timeout=5.0, metadata=self.metadata, stop=stop)
        # else: between a break and its retry, which sees `_aborted`

    # -- the session's side
    def push(
        self,
        batch: list[int],
        rows: list[TokenLogprob] | None = None,
        prompt_rows: list[TokenLogprob] | None = None,
    ) -> None:
        """Tokens that arrived, with their log-probability rows and the prompt's (only for a
        request that asked; a batch that came without rows gets unknown ones, rank 0)."""
        if self._asked:
            rows = rows if "logprobs" in self.options else []
            if rows is None or len(rows) != len(batch):
                rows = ((rows or []) + [_UNKNOWN] * len(batch))[: len(batch)]
            self.logprobs.extend(rows)
            if self.prompt_logprobs is None and prompt_rows is not None:
                self.prompt_logprobs = prompt_rows
        self.tokens.extend(batch)
        self._wake()

    def end(self, finished: Finished | None) -> None:
        self.finished = finished
        if finished is None:
            self._error = KvschedClientError("the request's stream ended unfinished")
        self._close()

    def fail(self, exc: Exception) -> None:
        self._error = exc
        self._close()

    def _close(self) -> None:
        self._ended = True
        self.link = None
        self._wake()
        for f in self._end_waiters:
            if not f.done():
                f.set_result(None)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def broke(self, link: SessionLink, why: KvschedClientError) -> None:
        """Its session ended before its `finished` (see the module docstring)."""
        if self._ended or self.link is not link:
            return
        self.link = None
        loop = asyncio.get_running_loop()
        retryable = isinstance(why, Unavailable | Cancelled) and not isinstance(why, _Closing)
        if self._aborted:  # its reader is gone: end it where it may still run, best effort
            if self.detachable and retryable:
                self._task = loop.create_task(self._abort_anywhere())
            self.fail(Cancelled("aborted", request_id=self.request_id))
        elif not retryable or (self.accepted and not self.detachable):
            self.fail(why)
        elif self.detachable:
            self._task = loop.create_task(self._follow())
        elif time.monotonic() >= self._deadline:
            self.fail(why)
        else:
            self._task = loop.create_task(self._submit_again())

    def _put_on(self, link: SessionLink) -> None:
        """`link` carries it now. A detachable request not accepted within ATTEMPT_TIMEOUT_S
        (a paused or hung daemon whose connection still stands: keepalive would take longer
        to break it) leaves that session and is followed alone through the next daemon."""
        self.link = link
        if self.detachable:
            loop = asyncio.get_running_loop()
            loop.call_later(ATTEMPT_TIMEOUT_S, self._no_answer, link)

    def _no_answer(self, link: SessionLink) -> None:
        if self.link is link and not self.accepted and not self._ended and not self._aborted:
            link.detach(self)
            self.link = None
            self._task = asyncio.get_running_loop().create_task(self._follow())

    async def _submit_again(self) -> None:
        await asyncio.sleep(_BACKOFF_S)
        if self._aborted:
            self.fail(Cancelled("aborted", request_id=self.request_id))
        elif not self._ended:
            self._put_on(self._place(self))

    async def _follow(self) -> None:
        """A detachable request whose session broke: Resume it alone (submitted again when no
        daemon accepted it), through the next address first."""
        left = self._deadline - time.monotonic()
        rs = ResumableStream(
            self._rotation(),
            self.prompt,
            self.options,  # type: ignore[arg-type]
            retry_for_s=self._retry_for_s if self.accepted else max(0.0, left),
            backoff_s=_BACKOFF_S,
            metadata=self.metadata,
        )
        rs.tokens = list(self.tokens)
        rs.logprobs = list(self.logprobs)
        rs.prompt_logprobs = self.prompt_logprobs
        rs.accepted = self.accepted
        rs.broken_at.append(time.monotonic())
        self.follower = rs
        try:
            async for batch in rs:
                have = len(self.logprobs)
                self.push(batch, rs.logprobs[have : have + len(batch)], rs.prompt_logprobs)
            self.resumes = rs.resumes
            self.end(rs.finished)
        except KvschedClientError as exc:
            self.resumes = rs.resumes
            self.fail(exc)

    async def _abort_anywhere(self) -> None:
        """Abort through the first daemon that answers (any daemon relays it to the owner)."""
        for client in self._rotation():
            try:
                await client.abort(self.request_id, timeout=5.0, metadata=self.metadata)
            except Unavailable:
                continue
            except KvschedClientError:
                pass
            return

    def cancel(self) -> None:
        """At shutdown: stop following it."""
        if self._task is not None:
            self._task.cancel()


class _Closing(Cancelled):
    """The front end closed the session (shutting down): nothing to retry."""
