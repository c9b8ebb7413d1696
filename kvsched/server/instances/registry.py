"""The instance registry: owns the daemon's engines (one per instance) and the routing.

Workers attach here (one Hello per rank); an instance's engine exists from its configuration or
from its first rank's Hello (`auto_instances`) and starts when its last rank registers. The
layers above ask the registry where a request goes (`route`, `route_decode`, `route_moved`);
they never hold a list of engines of their own.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kvsched import codec
from kvsched.core import (
    InvalidRequest,
    KvschedError,
    ProtocolError,
    Request,
    RequestNotFound,
    Role,
    Router,
    StorageIndex,
    Unavailable,
)
from kvsched.core.router import lora_eligible
from kvsched.server.instances.engine import InstanceEngine, RankConn
from kvsched.server.instances.events import EngineListener
from kvsched.server.instances.models import (
    Limits,
    check_lora_known,
    check_loras,
    fitting,
    limits_of,
    resolve_lora,
    resolve_model,
)
from kvsched.server.telemetry.values import InstanceFacts
from kvsched.v1 import worker_service_pb2

if TYPE_CHECKING:
    from kvsched.server.config.settings import ServerConfig
    from kvsched.server.telemetry.hooks import Telemetry

log = logging.getLogger("kvsched.daemon")

MAX_GPU_BLOCKS = 1 << 22  # 4M blocks; a pool this big takes ~1 s and ~1 GB to set up
MAX_HOST_BLOCKS = 1 << 24  # host memory is larger; the pool's cost per block is the same


class InstanceRegistry:
    def __init__(self, config: ServerConfig, telemetry: Telemetry) -> None:
        self.config = config
        self.telemetry = telemetry
        self.engines: dict[str, InstanceEngine] = {}
        self.router = Router(
            ttft_target_ms=config.routing_ttft_target_ms, overload=config.routing_overload
        )
        self._empty_since: dict[str, float] = {}  # instance -> since when it has no worker
        self.paused = False  # AdminService Pause without an instance id (shown by GetStatus)
        self._listener: EngineListener[InstanceEngine] | None = None
        # A cluster's Hello gate (kvsched.cluster.node.ClusterNode.admit_worker; None: alone):
        # awaited before a worker attaches; returns None (attach here) or the serialized
        # ConnectResponse that redirects the worker to its instance's owner.
        self.worker_gate: Callable[[Any], Awaitable[bytes | None]] | None = None
        # The cluster's fencing epoch of an instance this daemon attaches (None: unfenced).
        self.fencing_epoch: Callable[[str], int] | None = None
        # A cluster's peers' models, the limits of their live instances and their models
        # (kvsched.cluster.routing.ClusterRouter; None: alone).
        self.peer_models: Callable[[], set[str]] | None = None
        self.peer_limits: Callable[[], list[Limits]] | None = None
        self.peer_ready_models: Callable[[], set[str]] | None = None
        # The shared storage tier (docs/STORAGE.md): ONE index for all this daemon's
        # schedulers (the store is shared); its kind is what a Hello must list to use it.
        self.storage_url: str = config.storage
        self.storage_kind = config.storage.partition("://")[0] if config.storage else ""
        self.storage_index = StorageIndex() if config.storage else None

    def open(self, listener: EngineListener[InstanceEngine]) -> None:
        """Create the configured instances' engines, reporting to `listener`. Called once, by
        the composition root, before any worker attaches."""
        self._listener = listener
        for iid, icfg in self.config.instances.items():
            self.engines[iid] = self._engine(iid, icfg.engine, icfg.world_size)

    def _engine(self, instance_id: str, engine_config: Any, world_size: int) -> InstanceEngine:
        assert self._listener is not None, "InstanceRegistry.open() was not called"
        eng = InstanceEngine(
            self._listener,
            self.telemetry,
            instance_id,
            engine_config,
            world_size,
            load_seconds=self.router.load_seconds,
        )
        eng.kv_events = bool(self.config.cluster)  # a cluster publishes them (kvsched.cluster)
        eng.storage_index, eng.storage_kind = self.storage_index, self.storage_kind
        return eng

    # ---- workers ----------------------------------------------------------------------------
    def attach_worker(self, hello: Any) -> tuple[InstanceEngine, RankConn]:
        """Register a worker rank from its Hello; raises ProtocolError for a bad one."""
        if hello.protocol_version != codec.PROTOCOL_VERSION:
            raise ProtocolError(
                f"worker speaks protocol version {hello.protocol_version}; this daemon speaks "
                f"{codec.PROTOCOL_VERSION}"
            )
        if not hello.instance_id:
            raise ProtocolError("Hello.instance_id must not be empty")
        for name, value, hi in (
            ("num_gpu_blocks", hello.num_gpu_blocks, MAX_GPU_BLOCKS),
            ("block_size", hello.block_size, 4096),
            ("num_slots", hello.num_slots, (1 << 32) - 1),  # min()ed with max_num_seqs
        ):
            if not 1 <= value <= hi:
                raise ProtocolError(f"Hello.{name} = {value} is out of range [1, {hi}]")
        if hello.num_host_blocks > MAX_HOST_BLOCKS:  # 0: no host tier
            raise ProtocolError(
                f"Hello.num_host_blocks = {hello.num_host_blocks} is out of range "
                f"[0, {MAX_HOST_BLOCKS}]"
            )
        if not 0 <= hello.rank < max(1, hello.world_size) <= 64:
            raise ProtocolError(
                f"Hello.rank = {hello.rank} is outside world size {hello.world_size} (ranks 0..world_size-1), "
                "world_size at most 64"
            )
        eng = self.engines.get(hello.instance_id)
        if eng is None:
            if not self.config.auto_instances:
                raise ProtocolError(
                    f"unknown instance {hello.instance_id!r}; configured: {sorted(self.engines)}"
                )
            engine_config = copy.deepcopy(self.config.engine)
            eng = self._engine(hello.instance_id, engine_config, max(1, hello.world_size))
            self.engines[hello.instance_id] = eng
        conn = RankConn(
            rank=hello.rank,
            num_gpu_blocks=hello.num_gpu_blocks,
            num_host_blocks=hello.num_host_blocks,
            block_size=hello.block_size,
            num_slots=hello.num_slots,
            address=hello.worker_address,
            model=hello.model,
            max_model_len=hello.max_model_len,
            vocab_size=hello.vocab_size,
            storage_backends=tuple(hello.storage_backends),
            lora_adapters=check_loras(hello.lora_adapters, hello.max_loras, hello.model),
            max_loras=hello.max_loras,
            max_cpu_loras=hello.max_cpu_loras,
        )
        was_ready = eng.ready
        if not eng.ranks:  # the first rank names the model and its limits (the others agree)
            eng.limits = limits_of(
                hello.model,
                hello.max_model_len,
                hello.vocab_size,
                self.config.model,
                eng.engine_config.scheduler.max_model_len,
                hello_structured_outputs=hello.structured_outputs,
                hello_max_logprobs=hello.max_logprobs,
                loras=conn.lora_adapters,
                hello_multimodal=hello.multimodal,
            )
            if eng.cost_seed is None:  # never ran here: priced like its model's instances
                eng.cost_seed = self._sibling_cost(eng)
        if not eng.ranks and self.fencing_epoch is not None:  # its ranks share the epoch
            eng.fencing_epoch = self.fencing_epoch(hello.instance_id)
        try:
            eng.attach(conn, max(1, hello.world_size))
        except Exception:
            if not eng.ranks and not eng.ready and hello.instance_id not in self.config.instances:
                del self.engines[hello.instance_id]  # refused before it ever existed
            raise
        if eng.ready and not was_ready:
            self.announce_peers()  # prefill workers push KV to the receivers listed
        return eng, conn

    def _sibling_cost(self, eng: InstanceEngine) -> tuple[float, ...] | None:
        """The step-cost fit of a ready instance here with `eng`'s model and role (the first
        in id order that has learned one), for an instance that never ran here: its workers
        just moved here (a takeover, a redirect) and its first steps would otherwise be priced
        at the config's default GPU while the router spreads work over it."""
        model = eng.limits.model if eng.limits is not None else ""
        for iid in sorted(self.engines):
            other = self.engines[iid]
            if other is eng or other.role != eng.role or other.limits is None:
                continue
            if other.limits.model == model and (fit := other.learned_cost()) is not None:
                return fit
        return None

    def welcome(self, eng: InstanceEngine, conn: RankConn) -> bytes:
        cfg = eng.engine_config
        msg = worker_service_pb2.ConnectResponse(
            welcome=worker_service_pb2.Welcome(
                protocol_version=codec.PROTOCOL_VERSION,
                instance_id=eng.instance_id,
                block_size=conn.block_size,
                num_speculative_tokens=cfg.speculative.num_speculative_tokens,
                max_model_len=(
                    eng.limits.max_model_len if eng.limits else cfg.scheduler.max_model_len
                ),
                role=codec.role_to_proto(eng.role),
                heartbeat_interval_ns=int(self.config.heartbeat_interval_s * 1e9),
                answers_reports=True,
                fencing_epoch=eng.fencing_epoch,
                silence_timeout_ns=int(
                    self.config.silence_timeout_intervals * self.config.heartbeat_interval_s * 1e9
                ),
                # The store, to a worker that can reach its kind ("" = none: no storage tasks).
                storage_url=(
                    self.storage_url if self.storage_kind in conn.storage_backends else ""
                ),
            )
        )
        return msg.SerializeToString()

    def peers_message(self) -> bytes | None:
        """Where every connected rank's KV receiver is (None: nowhere yet), serialized."""
        peers = [p for e in self.engines.values() for p in e.peers()]
        if not peers:
            return None
        return worker_service_pb2.ConnectResponse(
            peers=worker_service_pb2.Peers(
                peers=[
                    worker_service_pb2.Peers.Peer(instance_id=i, rank=r, address=a)
                    for i, r, a in peers
                ]
            )
        ).SerializeToString()

    def announce_peers(self) -> None:
        """Tell every connected worker where the KV receivers are."""
        msg = self.peers_message()
        if msg is None:
            return
        for e in self.engines.values():
            for conn in e.ranks.values():
                conn.queue.put_nowait(msg)

    def take_out_silent(self, now: float) -> None:
        """Take out instances with a rank silent for more than heartbeat_timeout_s."""
        timeout = self.config.heartbeat_timeout_s
        for eng in list(self.engines.values()):
            silent = [c for c in eng.ranks.values() if now - c.last_seen > timeout]
            if silent:
                eng.take_out(
                    f"rank {silent[0].rank} silent for more than {timeout:g} s",
                    # UNAVAILABLE, as for a dropped stream: a worker that was merely stalled
                    # (SIGSTOP, a long GC) reconnects instead of giving up for good.
                    Unavailable("heartbeat timeout: no message within heartbeat_timeout_s"),
                    worker_fault=False,  # a pause or a partition as often as a death
                )

    def forget_lost(self, now: float) -> None:
        """Drop auto-created instances that have had no worker for forget_lost_instance_s
        (0: never): `kvsched status` shows them as lost until then. Configured ones stay."""
        after = self.config.forget_lost_instance_s
        for iid, eng in list(self.engines.items()):
            if eng.ranks or eng.ready or iid in self.config.instances:
                self._empty_since.pop(iid, None)
                continue
            since = self._empty_since.setdefault(iid, now)
            if after > 0 and now - since >= after:
                del self.engines[iid]
                del self._empty_since[iid]
                eng.close()
                log.info("instance %s forgotten: no worker for %g s", iid, after)

    def send_heartbeats(self, now: float) -> None:
        """A Heartbeat to every worker rank the daemon has sent nothing for the welcome's
        heartbeat interval. Called by the watchdog, never per step: what a rank was sent is
        read off its instance's Tasks count (every Tasks sent has the next seq), so the step
        path keeps no clock of its own. Other messages (welcome, peers) are rare and at most
        make a heartbeat early."""
        interval = self.config.heartbeat_interval_s
        beat: bytes | None = None
        for eng in self.engines.values():
            mark = eng.last_tasks_seq
            for conn in eng.ranks.values():
                if conn.hb_mark != mark:
                    conn.hb_mark, conn.hb_since = mark, now
                elif now - conn.hb_since >= interval and not conn.closed:
                    if beat is None:
                        beat = worker_service_pb2.ConnectResponse(
                            heartbeat=worker_service_pb2.Heartbeat(time_ns=time.time_ns())
                        ).SerializeToString()
                    conn.queue.put_nowait(beat)
                    conn.hb_since = now

    # ---- routing ----------------------------------------------------------------------------
    def model_for(self, requested: str) -> str:
        """The model a request naming `requested` runs on (see server/instances/models.py): NOT_FOUND
        naming the known models for an unknown one."""
        ready = {
            _limits(e, self.config.model).model
            for e in self.engines.values()
            if e.queueing and not e.is_decode
        }
        if self.peer_ready_models is not None:
            ready |= self.peer_ready_models()
        return resolve_model(requested, self.config.model, self.models(), ready)

    def model_and_lora(self, requested: str, lora_name: str) -> tuple[str, str]:
        """The model and LoRA adapter of a request naming model `requested` and `lora_name`:
        `requested` may name an adapter (its base model then runs it, as vLLM's server
        takes `model`). NOT_FOUND naming an adapter no instance of the model announced."""
        limits = self._all_limits()
        models = self.models()  # (a model's own name is never read as an adapter's)
        adapters = {n: lim.model for lim in limits for n, _ in lim.loras if n not in models}
        lora = resolve_lora(requested, lora_name, adapters)
        # An announced adapter's name runs on its base model (resolve_lora took it as the
        # adapter); any other name is a model's (an unknown one: NOT_FOUND, whatever lora_name).
        model = self.model_for(adapters.get(requested, requested))
        check_lora_known(lora, model, limits)
        return model, lora

    def _all_limits(self) -> list[Limits]:
        """The limits of every instance here that said Hello, and of its peers' (cluster)."""
        got = [e.limits for e in self.engines.values() if e.limits is not None]
        if self.peer_limits is not None:
            got += self.peer_limits()
        return got

    def adapter_table(self) -> dict[str, tuple[str, str, int]]:
        """Per LoRA adapter announced here (or by a peer): (its base model, its path, ready
        instances that can load it)."""
        out: dict[str, tuple[str, str, int]] = {}
        rows: list[tuple[Limits, bool]] = [
            (e.limits, e.queueing) for e in self.engines.values() if e.limits is not None
        ]
        if self.peer_limits is not None:
            rows += [(lim, True) for lim in self.peer_limits()]
        for lim, ready in rows:
            for name, path in lim.loras:
                _, _, n = out.get(name, (lim.model, path, 0))
                out[name] = (lim.model, path, n + int(ready))
        return out

    def models(self) -> set[str]:
        """Every model an instance of this daemon (or of a peer, in a cluster) serves or
        served, ready or not."""
        got = {e.limits.model for e in self.engines.values() if e.limits is not None}
        if self.peer_models is not None:
            got |= self.peer_models()
        return got

    def instance_facts(self) -> dict[str, InstanceFacts]:
        """Every known instance's published facts, connected or not (a scrape reads these)."""
        return {iid: eng.facts() for iid, eng in list(self.engines.items())}

    def model_table(self) -> dict[str, tuple[int, int, int]]:
        """Per model served: (the largest max_model_len of its ready instances, its vocab
        size, its ready instances), over this daemon's instances and its peers' (cluster)."""
        rows: list[tuple[Limits, bool]] = [
            (e.limits, e.queueing) for e in self.engines.values() if e.limits is not None
        ]
        if self.peer_limits is not None:
            rows += [(lim, True) for lim in self.peer_limits()]
        out: dict[str, tuple[int, int, int]] = {}
        for lim, ready in rows:
            mml, vocab, n = out.get(lim.model, (0, 0, 0))
            if ready:
                mml, n = max(mml, lim.max_model_len), n + 1
            out[lim.model] = (mml, vocab or lim.vocab_size, n)
        return out

    def largest_max_model_len(self) -> int:
        """The largest prompt + output any instance here could hold (the daemon's limit when no
        worker announced one yet)."""
        got = [e.limits.max_model_len for e in self.engines.values() if e.limits is not None]
        return max(got, default=self.config.engine.scheduler.max_model_len)

    def candidates(
        self, req: Request, model: str, engines: list[InstanceEngine]
    ) -> list[InstanceEngine]:
        """`engines` (ready ones) that serve `model` and whose limits `req` fits; raises
        InvalidRequest naming the limit when the model's instances can never run it."""
        pairs = [(e, _limits(e, self.config.model)) for e in engines]
        try:
            return fitting(req, model, pairs)
        except InvalidRequest:
            # Fields out of range are named first, in the core's order, as an instance that
            # fits would name them; the limit only when the request is otherwise valid.
            best = max(
                (p for p in pairs if p[1].model == model),
                key=lambda p: (p[1].max_model_len, p[1].vocab_size),
            )[0]
            best.validate(req)
            raise

    def route(self, req: Request, model: str = "") -> InstanceEngine:
        """The instance a new request goes to; Unavailable when none takes new requests. A
        paused instance queues it (the router prefers one that is not paused). A sample of a
        group whose prompt an instance computes now goes there (`group_engine`)."""
        ready = [e for e in self.engines.values() if e.queueing and not e.is_decode]
        if not ready:
            raise Unavailable(self.no_instance_reason())
        model = model or self.model_for("")
        if (grouped := self.group_engine(req, model)) is not None:
            return grouped  # a sample waits where its group's prompt is computed (groups.py)
        return _route(self.router, self.candidates(req, model, ready), req)

    def group_engine(self, req: Request, model: str = "") -> InstanceEngine | None:
        """The instance where a request of req's sample group computes the prompt now (its
        members belong there: they take the prompt's blocks from its cache), or None."""
        group = req.sample_group
        if not group:
            return None
        for e in self.engines.values():
            same_model = not model or _limits(e, self.config.model).model == model
            if e.queueing and e.leads_group(group) and same_model:
                return e
        return None

    def no_instance_reason(self) -> str:
        """Why no instance here takes a request (what the caller can do about it)."""
        if any(e.ranks for e in self.engines.values()):
            return "no instance is ready: its workers are still starting, or all are draining"
        return "no instance is ready: no worker connected (start one with `kvsched worker`)"

    def route_decode(self, req: Request | None = None, model: str = "") -> InstanceEngine:
        """The decode instance a prefill instance's request will be handed off to: one of
        `model` (any model when ""); for a LoRA request, one whose workers announced its
        adapter, of the best adapter-affinity tier (the adapter in use there > a free adapter
        slot > neither), then the least loaded."""
        decodes = [e for e in self.engines.values() if e.is_decode and e.accepting]
        if model:
            decodes = [e for e in decodes if _limits(e, self.config.model).model == model]
        lora = "" if req is None else req.lora_name
        if lora:
            decodes = [e for e in decodes if _limits(e, self.config.model).has_lora(lora)]
        if not decodes:
            has = f" of model {model!r}" if model else ""
            has += f" with LoRA adapter {lora!r}" if lora else ""
            raise Unavailable(f"prefill instance has no ready decode instance{has} to hand off to")
        if lora and req is not None and len(decodes) > 1:
            tier = lora_eligible([e.lora_affinity(req) for e in decodes])
            decodes = [e for e, best in zip(decodes, tier.tolist(), strict=True) if best]
        return _route_decode(self.router, decodes)

    def route_moved(self, req: Request, model: str = "") -> InstanceEngine | None:
        """The mixed instance of `model` a lost instance's request is recomputed on (None:
        none now)."""
        ready = [e for e in self.engines.values() if e.queueing and e.role == Role.MIXED]
        want = model
        if not want:
            try:
                want = self.model_for("")
            except KvschedError:
                want = self.config.model
        ready = [e for e in ready if _limits(e, self.config.model).model == want]
        if req.lora_name:
            ready = [e for e in ready if _limits(e, self.config.model).has_lora(req.lora_name)]
        if req.mm_ranges:  # never onto a worker that runs no multimodal items
            ready = [e for e in ready if _limits(e, self.config.model).multimodal]
        return _route(self.router, ready, req) if ready else None

    # ---- admin ------------------------------------------------------------------------------
    def select(self, instance_id: str) -> list[InstanceEngine]:
        if not instance_id:
            return list(self.engines.values())
        eng = self.engines.get(instance_id)
        if eng is None:
            raise RequestNotFound(f"no instance {instance_id!r}; known: {sorted(self.engines)}")
        return [eng]


def _limits(eng: InstanceEngine, configured_model: str) -> Limits:
    lim: Limits | None = eng.limits
    if lim is None:  # an instance started without a Hello's limits (never: attach sets them)
        lim = Limits(configured_model, eng.engine_config.scheduler.max_model_len)
    return lim


def _route(router: Router, engines: list[InstanceEngine], req: Request) -> InstanceEngine:
    """The engine `router` places a new request on, among `engines` (ready, taking requests)."""
    if len(engines) == 1:
        return engines[0]
    return engines[router.pick(engines, req, [e.load for e in engines])]


def _route_decode(router: Router, engines: list[InstanceEngine]) -> InstanceEngine:
    """The decode engine `router` reserves a hand-off on, among ready, accepting `engines`."""
    idx = router.pick_decode(engines, [e.load for e in engines])
    return engines[idx or 0]
