"""`vllm.grpc.engine.VllmEngine` (smg-grpc-proto's engine protocol) on the daemon's port: a
gateway (smg) in front of kvsched sees one engine serving one model.

    HealthCheck     healthy while the daemon takes requests and an instance of the model is
                    ready (the gateway registers the engine that answers healthy)
    GetModelInfo    the served model (the daemon's `model`, or the only one served), its context
                    length and vocabulary; the tokenizer directory given with --tokenizer
    GetTokenizer    that directory's tokenizer files as a zip plus its SHA-256 (tokenizer.py)
    GetServerInfo   requests in flight, uptime, slots, block size
    GetLoads        the instances' published facts summed into one load (kvsched routes among
                    its instances, and across a cluster, itself)
    Generate        through RequestService's own Generate (the Acceptor, the request table,
                    auth's principal, the call's trace context): token-id chunks, then one
                    complete; not streaming, one complete with every output id
    Abort           by request id, as RequestService's Abort: the request finishes ABORT and
                    its Generate stream ends with a complete (finish_reason "abort")
    SubscribeKvEvents  UNIMPLEMENTED on purpose: kvsched places requests by its own KV index

Requests keep the gateway's ids: a Resume or an Abort names them as the gateway does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, cast

import grpc

from kvsched.core import FinishReason, KvschedError, RequestNotFound
from kvsched.server.gateway.proto import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc
from kvsched.server.gateway.stops import StopStrings
from kvsched.server.gateway.tokenizer import TokenizerBundle, chunks
from kvsched.server.gateway.translate import complete, to_request
from kvsched.server.requests.frontend import RequestServicer, principal
from kvsched.v1 import common_pb2 as kcommon

pb = vllm_engine_pb2


class EngineServicer(vllm_engine_pb2_grpc.VllmEngineServicer):  # type: ignore[misc]
    """The engine protocol over RequestService's parts (`front`)."""

    def __init__(self, front: RequestServicer, tokenizer: str) -> None:
        self.front = front
        self.requests = front.requests
        self.registry = front.requests.registry
        self.tokenizer = tokenizer
        self.bundle = TokenizerBundle(tokenizer) if tokenizer else None
        self.stops = StopStrings(tokenizer)
        self.started = time.monotonic()

    def _model(self) -> tuple[str, int, int]:
        """(name, max_model_len, vocab_size) of the model the gateway is served; the typed
        error of `model_for` when there is none to name."""
        name = self.registry.model_for("")
        mml, vocab, _ = self.registry.model_table().get(name, (0, 0, 0))
        return name, mml or self.registry.largest_max_model_len(), vocab

    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if self.requests.draining:
            return pb.HealthCheckResponse(healthy=False, message="kvsched is draining")
        try:
            name, _, _ = self._model()
        except KvschedError as exc:
            return pb.HealthCheckResponse(healthy=False, message=str(exc))
        ready = self.registry.model_table().get(name, (0, 0, 0))[2]
        if not ready:
            return pb.HealthCheckResponse(healthy=False, message=f"no instance of {name} ready")
        return pb.HealthCheckResponse(healthy=True, message=f"{ready} instance(s) of {name}")

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        name, mml, vocab = self._model()
        return pb.GetModelInfoResponse(
            model_path=self.tokenizer or name,
            is_generation=True,
            max_context_length=mml,
            max_req_input_len=mml,
            vocab_size=vocab,
            served_model_name=name,
            tokenizer_path=self.tokenizer,
        )

    async def GetServerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        snaps = [s for e in self.registry.engines.values() if (s := e.snapshot()) is not None]
        blocks = [e.block_size for e in self.registry.engines.values() if e.block_size]
        return pb.GetServerInfoResponse(
            active_requests=len(self.requests.tracked),
            is_paused=bool(snaps) and all(s.paused for s in snaps),
            last_receive_timestamp=time.time(),
            uptime_seconds=time.monotonic() - self.started,
            server_type="kvsched",
            data_parallel_size=1,
            block_size=blocks[0] if blocks else 0,
            max_num_seqs=sum(s.num_slots for s in snaps),
        )

    async def GetLoads(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """One load for the whole daemon (dp rank 0): its instances' published facts summed."""
        running = waiting = slots = blocks = used = tokens = 0
        hits = queries = 0
        for eng in self.registry.engines.values():
            s = eng.snapshot()
            if s is None:
                continue
            running, waiting, slots = (
                running + s.num_running,
                waiting + s.num_waiting,
                slots + s.num_slots,
            )
            blocks += s.num_gpu_blocks
            used += s.num_gpu_blocks - s.num_free_blocks
            tokens += s.num_gpu_blocks * eng.block_size
            hits, queries = hits + s.prefix_cache_hit_tokens, queries + s.prefix_cache_query_tokens
        usage = used / blocks if blocks else 0.0
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_total_reqs=running + waiting,
            num_used_tokens=round(usage * tokens),
            max_total_num_tokens=tokens,
            token_usage=usage,
            utilization=usage,
            cache_hit_rate=hits / queries if queries else 0.0,
            max_running_requests=slots,
        )
        return pb.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version="kvsched",
            dp_rank_count=1,
            loads=[load],
        )

    async def GetTokenizer(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        if self.bundle is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "kvsched has no tokenizer directory: start `kvsched serve --tokenizer DIR`, or "
                "give the gateway the tokenizer (smg --tokenizer-path DIR)",
            )
            return
        try:
            data, digest = await self.bundle.archive()
        except OSError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"--tokenizer: {exc}")
            return
        for piece, sha in chunks(data, digest):
            yield common_pb2.GetTokenizerChunk(data=piece, sha256=sha)

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        name, mml, _ = self._model()
        kreq = to_request(request, name, mml)
        stream = request.stream
        stops = set(kreq.sampling.stop_token_ids)
        sp = request.sampling_params
        matcher = self.stops.matcher(list(sp.stop), sp.skip_special_tokens)
        prompt_n = len(kreq.prompt_token_ids)
        out: list[int] = []  # every output id so far (up to a matched stop string)
        last: int | None = None
        matched: str | None = None
        inner = cast(AsyncGenerator[Any, None], self.front.Generate(kreq, context))
        async with aclosing(inner) as msgs:
            async for msg in msgs:
                kind = msg.WhichOneof("kind")
                if kind == "tokens":
                    ids = list(msg.tokens.token_ids)
                    if not ids or matched is not None:  # past a stop string: not output
                        continue
                    base = len(out)
                    out.extend(ids)
                    if matcher is not None and (hit := matcher.match(out, base)) is not None:
                        n, matched = hit
                        del out[n:]
                        ids = ids[: n - base]
                        self._stop_at(kreq.request_id, matched)
                    last = out[-1]
                    if stream:
                        yield pb.GenerateResponse(
                            chunk=pb.GenerateStreamChunk(
                                token_ids=ids, prompt_tokens=prompt_n, completion_tokens=len(ids)
                            )
                        )
                elif kind == "finished":
                    fin = msg.finished
                    if fin.reason == kcommon.FINISH_REASON_ERROR:
                        await context.abort(
                            grpc.StatusCode.INTERNAL,
                            f"request {kreq.request_id!r} failed: {fin.message or 'engine error'}",
                        )
                        return
                    upto = None if matched is None else len(out)
                    done = complete(pb, fin, [] if stream else out, last, stops, matched, upto)
                    yield pb.GenerateResponse(complete=done)
                    return

    def _stop_at(self, req_id: str, stop: str) -> None:
        """End a request whose text reached one of its stop strings: finished STOP, now."""
        tr = self.requests.tracked.get(req_id)
        if tr is not None and not tr.finished:
            self.requests.abort_tracked(tr, f"stop string {stop!r} matched", FinishReason.STOP)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Abort each id this caller submitted; ids that are not live are skipped (the request
        may have just finished), as vLLM's engine does."""
        owner = principal(context) or None
        cluster = self.requests.cluster
        for rid in request.request_ids:
            try:
                self.requests.abort(rid, owner=owner)
            except RequestNotFound:
                if cluster is not None:
                    await cluster.abort_elsewhere(rid, owner)
        return pb.AbortResponse()

    async def SubscribeKvEvents(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "kvsched routes requests across its instances (and its cluster) by its own KV "
            "index: give the gateway one kvsched address per cluster, or poll GetLoads",
        )
        yield  # an async generator, as the protocol's stream


def add_to_server(front: RequestServicer, tokenizer: str, server: grpc.aio.Server) -> str:
    """Serve the engine protocol on `server`; returns its service name (for reflection)."""
    from kvsched.server.gateway.proto import SERVICE_NAME

    vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(EngineServicer(front, tokenizer), server)
    return str(SERVICE_NAME)
