"""A client of RequestService written the way another language's client would be: plain grpcio
(grpc.aio) on the generated stubs, configured only with what docs/CLIENT.md "Writing a client
in another language" says. Nothing from `kvsched.client`.

    channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in addresses]
    s = PlainStream(request_id, prompt, max_tokens)
    await s.run([RequestServiceStub(c) for c in channels], first=0, t0=time.monotonic())
    s.tokens, s.finished, s.timeline

The rules (the page's, numbered as there):
1. one channel per daemon, with CHANNEL_OPTIONS;
2. the request carries a client-chosen id and `detachable`;
3. every Generate or Resume attempt waits at most FIRST_ANSWER_TIMEOUT_S for its first answer
   (`queued`, or an error status); one that gets none is cancelled and counts as UNAVAILABLE;
4. a stream that fails with UNAVAILABLE or CANCELLED, that ends without `finished`, or an
   attempt that failed so, is followed by Resume(request_id, every token held) at the next
   daemon of the list (round robin), after RETRY_BACKOFF_S, for up to RETRY_FOR_S; an
   UNAVAILABLE answer to a Resume ("retry", "changing owner") is such a failure too;
5. Resume answered NOT_FOUND while the request was never seen `queued`: it was not accepted,
   Generate it again (same id); Generate refused with INVALID_ARGUMENT and the trailer
   `kvsched-error: RequestAlreadyLive`: an earlier attempt was accepted after all, Resume it;
6. any other error ends the request (raised).

`timeline` records each step (seconds after `t0`, the daemon's index, what happened): the
benchmark prints those of the stalled streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import grpc

from kvsched.v1 import common_pb2, request_service_pb2_grpc
from kvsched.v1 import request_service_pb2 as rpb

# Rule 1, as gRPC core spells them (docs/CLIENT.md; the test checks the page lists exactly these).
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.http2.ping_timeout_ms", 2000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)
FIRST_ANSWER_TIMEOUT_S = 2.0  # rule 3
RETRY_BACKOFF_S = 0.1  # rule 4
RETRY_FOR_S = 60.0  # rule 4
RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
ALREADY_LIVE = ("kvsched-error", "RequestAlreadyLive")


class NoFirstAnswer(Exception):
    """An attempt that got no first answer in time (counts as UNAVAILABLE)."""


class Lost(Exception):
    """A request that cannot be followed any more (rule 6, or RETRY_FOR_S spent)."""


class PlainStream:
    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        first_answer_timeout_s: float | None = FIRST_ANSWER_TIMEOUT_S,
    ) -> None:
        self.request_id = request_id
        self.prompt = list(prompt)
        self.max_tokens = max_tokens
        self.first_answer_timeout_s = first_answer_timeout_s
        self.tokens: list[int] = []
        self.finished: rpb.Finished | None = None
        self.queued = False  # seen `queued` once: the request was accepted
        self.instance = ""  # its first `queued`'s instance
        self.daemon = -1  # index of the daemon whose stream delivered its first token
        self.timeline: list[tuple[float, int, str]] = []
        self.token_times: list[float] = []  # monotonic time of each batch
        self.t0 = 0.0

    def _note(self, daemon: int, what: str) -> None:
        self.timeline.append((round(time.monotonic() - self.t0, 3), daemon, what))

    async def run(
        self,
        stubs: Sequence[request_service_pb2_grpc.RequestServiceStub],
        first: int = 0,
        t0: float | None = None,
    ) -> list[int]:
        self.t0 = time.monotonic() if t0 is None else t0
        i = first
        resume = False  # the next attempt is a Resume (rule 4) rather than a Generate
        give_up: float | None = None  # set at the first failure of a break (rule 4)
        while True:
            try:
                call = self._attempt(stubs[i], resume)
                await self._read(call, i, resume)
                return self.tokens
            except (grpc.aio.AioRpcError, NoFirstAnswer) as exc:
                code = grpc.StatusCode.UNAVAILABLE
                if isinstance(exc, grpc.aio.AioRpcError):
                    code = exc.code()
                    what = f"{'Resume' if resume else 'Generate'} {code.name}: {exc.details()}"
                else:
                    what = f"{'Resume' if resume else 'Generate'}: no first answer"
                self._note(i, what)
                if isinstance(exc, grpc.aio.AioRpcError):
                    trailer = tuple(exc.trailing_metadata() or ())
                    live = code == grpc.StatusCode.INVALID_ARGUMENT and ALREADY_LIVE in trailer
                    if not resume and live:  # rule 5: an earlier attempt was accepted after all
                        resume = True
                        continue
                    if resume and code == grpc.StatusCode.NOT_FOUND and not self.queued:
                        resume = False  # rule 5: never accepted: submit again, same daemon
                        continue
                    if code not in RETRY_CODES:
                        raise Lost(f"{self.request_id}: {what}") from exc
                now = time.monotonic()
                give_up = give_up or now + RETRY_FOR_S
                if now >= give_up:
                    raise Lost(f"{self.request_id}: retried {RETRY_FOR_S:g} s: {what}") from exc
                resume = True  # rule 4 (a Generate that got no answer may have been accepted)
                i = (i + 1) % len(stubs)
                await asyncio.sleep(RETRY_BACKOFF_S)

    def _attempt(self, stub: Any, resume: bool) -> Any:
        if resume:
            msg = rpb.RequestServiceResumeRequest(request_id=self.request_id, token_ids=self.tokens)
            return stub.Resume(msg)
        return stub.Generate(
            rpb.GenerateRequest(
                request_id=self.request_id,
                prompt_token_ids=self.prompt,
                sampling=common_pb2.SamplingParams(max_tokens=self.max_tokens, ignore_eos=True),
                detachable=True,
            )
        )

    async def _read(self, call: Any, i: int, resume: bool) -> None:
        """One attempt: its first answer within the bound, then its stream to the end."""
        try:
            try:
                first = await asyncio.wait_for(call.read(), self.first_answer_timeout_s)
            except TimeoutError:
                raise NoFirstAnswer() from None
            self._note(i, "Resume answered" if resume else "Generate answered")
            got, noted = first, False
            while got is not grpc.aio.EOF:
                kind = got.WhichOneof("kind")
                if kind == "queued":
                    self.queued = True
                    self.instance = self.instance or got.queued.instance
                elif kind == "tokens" and got.tokens.token_ids:
                    if not noted:
                        noted = True
                        self._note(i, "first token")  # of this attempt
                    self.tokens.extend(got.tokens.token_ids)
                    self.token_times.append(time.monotonic())
                    if self.daemon < 0:
                        self.daemon = i
                elif kind == "finished":
                    self.finished = got.finished
                    self._note(i, "finished")
                    return
                got = await call.read()
            # Ended without `finished`: taken over by another Resume (rule 4).
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                details="stream ended without finished",
            )
        finally:
            call.cancel()
