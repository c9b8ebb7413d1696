"""vLLM v1's own executor driven step by step: kvsched is its only scheduler.

`VllmModel` builds the executor as vLLM's EngineCore does (config, executor, KV cache sizing by
vLLM's own profiling or a fixed block count, warm-up) and records the engine's facts for the
worker's Hello. `VllmExecutor` implements the worker engine's `Executor` protocol: each step's
SeqWorks become one `SchedulerOutput`; the runner's sampled tokens come back.

How kvsched's decisions map onto vLLM's per-step structures:

    SeqWork, a chunk that does not end   -> NewRequestData under the request's alias id (see
      the prompt                             _ALIAS), unseeded: prompt_token_ids = the prompt
                                             as known so far, zeros past it (the runner reads
                                             only positions it computes), block_ids = kvsched's
                                             table (+1: vLLM's block 0 is its null block),
                                             num_computed_tokens = the chunk's start
    SeqWork, the prompt's last chunk (or -> NewRequestData under the request's id; a request
      the first decode of a full hit)        the runner still holds (preempted, now re-placed)
                                             is updated in place (its streaming-input path),
                                             keeping its seeded generator, as vLLM does
    SeqWork, a decode                    -> CachedRequestData: new blocks, computed tokens,
                                             output count
    ... of a request naming an adapter   -> its LoRARequest in NewRequestData.lora_request
                                             (alias too); vLLM activates and loads it (lora.py)
    ... with drafts (num_draft > 0)      -> the drafts as scheduled_spec_decode_tokens, never in
                                             the prompt (spec_decode.py); the accepted drafts
                                             and a bonus token come back (a draft model's too)
    finished / aborted handle            -> finished_req_ids (once; its alias too)
    preempted handle                     -> nothing: vLLM drops an unscheduled request from its
                                             batch and keeps its state for the re-placement

A non-final chunk leaves the runner a prompt longer than what it computed, so it discards that
step's sample as for its own chunked prefill. Nothing here checks stops: the worker
engine does (EOS, stop ids, max tokens), as for every executor.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from kvsched.worker_stub.executor import SeqWork, StepResult
from kvsched.worker_stub.lora import LoraSlots
from kvsched.worker_vllm import ahead, logprobs, spec_decode
from kvsched.worker_vllm import lora as vllm_lora
from kvsched.worker_vllm.build import build_executor, compiled, tokenizer_eos
from kvsched.worker_vllm.spin import nap_seconds, note_batch, quiet_executor, spin_batch
from kvsched.worker_vllm.structured import Grammars

log = logging.getLogger(__name__)

# Requests preempted here (their state kept for a re-placement) beyond this many: the oldest is
# finished in the runner (a preempted request the daemon later aborted is never re-placed).
_MAX_PARKED = 1024
# A chunk that does not end the prompt runs under the request's id + this, without a seed: the
# runner samples every request and discards a partial prefill's token, and on CPU it then fails
# to rewind a seeded request's generator ("CPU Generator does not use offset"). The KV lands in
# kvsched's blocks either way; the real id (and its generator) first runs the prompt's last chunk.
_ALIAS = "\x00chunk"


def _unseeded(params: Any) -> Any:
    if params.seed is None:
        return params
    copy = params.clone()
    copy.seed = None
    return copy


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the worker announces in its Hello."""

    num_blocks: int  # usable by kvsched (vLLM's null block excluded)
    block_size: int
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_token_id: int | None  # the tokenizer's (None without tokenizer files)
    generation_config: dict[str, Any]
    num_speculative_tokens: int = 0  # drafts per step the runner verifies (0: none)
    max_logprobs: int = 0  # log-probability alternatives per token (vLLM's max_logprobs)
    draft_model: str = ""  # the draft model's directory ("": the engine's ngram drafts)


@dataclass(slots=True)
class _Req:
    prompt: list[int]  # num_prefill tokens as known so far (zeros where not yet received)
    num_prefill: int
    params: Any  # vllm.SamplingParams
    lora: Any = None  # vLLM's LoRARequest of its adapter (None: the base model)
    num_blocks_known: int = 0  # blocks of its table the runner has
    num_out: int = 0  # tokens the runner sampled for it since it last (re)sent it
    synced: bool = False  # the runner holds its current prompt and table
    alias_live: bool = False  # the runner holds its prompt's first chunks under the alias id


class VllmModel:
    """vLLM's executor for one model in this process (its worker runs in a spawned child)."""

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        block_size: int = 0,
        max_model_len: int = 0,
        num_blocks: int = 0,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        seed: int = 0,
        num_host_blocks: int = 0,
        num_speculative_tokens: int = 0,
        extra: dict[str, Any] | None = None,
        lora: LoraSlots | None = None,
        draft_model: str = "",
    ) -> None:
        from vllm import envs
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform

        nap = nap_seconds()  # (bad values fail before the model loads)
        self.spin_batch = spin_batch() if nap > 0 else 0
        if current_platform.is_cpu():
            # vLLM CPU otherwise reserves 92 % of the machine's memory for KV and refuses to
            # start when less is free; 1 GiB holds ~4k blocks of a small model.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if not block_size:
            block_size = 32 if current_platform.is_cpu() else 16
        extra = dict(extra or {})
        if num_speculative_tokens:  # the runner's spec-decode path: kvsched proposes the drafts
            extra["speculative_config"] = spec_decode.vllm_config(
                num_speculative_tokens, draft_model
            )
        extra.update(vllm_lora.engine_args(lora or LoraSlots()))
        # Adapter name -> its LoRARequest, for each placement naming it (lora.py).
        self.lora_requests: dict[str, Any] = vllm_lora.lora_requests(lora or LoraSlots())
        args = EngineArgs(
            model=model,
            dtype=dtype,
            block_size=block_size,
            max_model_len=max_model_len or None,
            enforce_eager=not compiled(),
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_gpu_blocks_override=num_blocks + 1 if num_blocks else None,
            seed=seed,
            skip_tokenizer_init=True,  # the worker sees token ids only
            async_scheduling=False,  # one step at a time: kvsched's step loop
            **extra,
        )
        self.num_host_blocks = num_host_blocks  # the host KV tier (host.py), in block copies
        started = time.monotonic()
        self.config = config = args.create_engine_config()
        if getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", False):
            raise RuntimeError("VLLM_USE_V2_MODEL_RUNNER is set: this worker drives runner V1")
        self.executor = build_executor(config)
        quiet_executor(self.executor, nap, self.spin_batch)
        if self.lora_requests and current_platform.is_cpu():  # (vLLM's CPU kernels: lora.py)
            self.executor.collective_rpc(vllm_lora.mask_base_rows)
        mc, sc = config.model_config, config.scheduler_config
        self.facts = EngineFacts(
            num_blocks=int(config.cache_config.num_gpu_blocks or 0) - 1,
            block_size=int(config.cache_config.block_size),
            max_model_len=int(mc.max_model_len),
            vocab_size=int(mc.get_vocab_size()),
            max_num_seqs=int(sc.max_num_seqs),
            max_num_batched_tokens=int(sc.max_num_batched_tokens),
            eos_token_id=tokenizer_eos(model),
            generation_config=dict(mc.try_get_generation_config() or {}),
            num_speculative_tokens=num_speculative_tokens,
            max_logprobs=int(mc.get_vocab_size() if mc.max_logprobs < 0 else mc.max_logprobs),
            draft_model=draft_model if num_speculative_tokens else "",
        )
        log.info("vLLM engine ready in %.1f s: %s", time.monotonic() - started, self.facts)

    def shutdown(self) -> None:
        self.executor.shutdown()


class VllmExecutor:
    """The worker engine's Executor over a `VllmModel`. Not thread-safe (one step loop)."""

    name = "vllm"

    def __init__(self, model: VllmModel) -> None:
        self.model = model
        self._reqs: dict[str, _Req] = {}  # placed here now
        self._parked: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._finished: set[str] = set()  # to tell the runner in the next step
        self.grammars = Grammars(model.config)  # structured output (structured.py)
        self.num_steps = 0
        self.model_drafts = spec_decode.ModelDrafts()  # a draft model's proposals, if any
        # The step running ahead of the engine's (ahead.py), and when a step's tokens last came.
        self._ahead = ahead.enabled(model.facts.num_speculative_tokens)
        self._launched: ahead.Launched | None = None
        self._last_done = 0.0
        self._step_s = 0.0  # the runner's recent time per step (EWMA)
        self._defer_max_s = ahead.defer_max_s()
        self._ahead_rows = ahead.max_rows()

    # ---- what the engine tells it between steps ---------------------------------------------

    def place(
        self, req_id: str, num_prefill: int, params: Any, num_output: int = 0, lora_name: str = ""
    ) -> None:
        """A placement: the request runs here from its next SeqWork (with its LoRA adapter's
        LoRARequest; ValueError for one this worker did not announce). A request parked by a
        preemption is re-sent (its runner state, and generator, are kept); so is its grammar
        when it has one (`num_output`: its outputs so far)."""
        lora = None
        if lora_name:
            lora = self.model.lora_requests.get(lora_name)
            if lora is None:
                raise ValueError(f"placement of {req_id!r} names unknown adapter {lora_name!r}")
        self._parked.pop(req_id, None)
        self.model_drafts.drop(req_id)
        self._reqs[req_id] = _Req([0] * num_prefill, num_prefill, params, lora)
        if params.structured_outputs is not None:
            self.grammars.place(req_id, params, num_output)
        else:
            self.grammars.drop(req_id)

    def grammar_failures(self) -> list[str]:
        """Placed requests whose grammar could not be compiled or rejected a sampled token:
        the engine fails them (after any compile still running has finished)."""
        failed = self.grammars.take_failed([r for r in self._reqs if r in self.grammars])
        return failed + self.grammars.failed_now()

    def release(self, req_id: str, *, preempted: bool) -> None:
        """The engine dropped the request: finished, aborted or failed (the runner forgets
        it), or preempted (kept for its re-placement)."""
        r = self._reqs.pop(req_id, None)
        if r is None:
            return
        self.model_drafts.drop(req_id)
        if r.alias_live:
            self._finished.add(req_id + _ALIAS)
        if preempted:
            self._parked[req_id] = None
            while len(self._parked) > _MAX_PARKED:
                oldest = self._parked.popitem(last=False)[0]
                self._finished.add(oldest)
                self.grammars.drop(oldest)
        else:
            self._finished.add(req_id)
            self.grammars.drop(req_id)

    # ---- Executor ---------------------------------------------------------------------------

    def execute(self, work: list[SeqWork]) -> StepResult:
        """Run the step `work` (ahead.py: rows a step launched ahead already ran take its
        tokens; with one running ahead, the others are deferred into the step launched now)."""
        started = ahead.now()
        facts = self.model.facts
        total = sum(len(w.token_ids) for w in work)
        if total > facts.max_num_batched_tokens or len(work) > facts.max_num_seqs:
            raise RuntimeError(  # before any state changes: the session restarts clean
                f"a step of {total} tokens over {len(work)} requests exceeds the engine's "
                f"max_num_batched_tokens={facts.max_num_batched_tokens} / max_num_seqs="
                f"{facts.max_num_seqs}: start the worker with larger limits or the daemon "
                "with smaller ones"
            )
        if facts.num_speculative_tokens:  # (a vLLM bug: spec_decode.py)
            spec_decode.no_drafts_unless_greedy(work, self._reqs)
        reqs = self._reqs
        launched, self._launched = self._launched, None
        cover = [launched is not None and launched.covers(w, reqs[w.req_id]) for w in work]
        rest = [w for w, c in zip(work, cover, strict=True) if not c]
        free = (
            self._ahead
            and len(work) <= self._ahead_rows
            and all(ahead.runs_ahead(reqs[w.req_id].params) for w in rest)
        )
        deferred: set[int] = set()
        own = None
        if free and any(cover) and self._step_s < self._defer_max_s:
            # the covered rows' next decodes go out with the rest: those run a step later
            deferred = {j for j, c in enumerate(cover) if not c}
            nxt = [a for j, w in enumerate(work) if cover[j] and (a := self._advanced(w))]
            if nxt or rest:
                self._launched = self._send(nxt + rest, track=True)
        else:  # the rest as a step of its own, now (after the launched one, if any)
            if rest or self._finished:
                own = self._send(rest)
            if free and (nxt := [a for w in work if (a := self._advanced(w))]):
                self._launched = self._send(nxt, track=True)
        from_launched = launched.result() if launched is not None and any(cover) else None
        result = own.result() if own is not None else None
        if facts.draft_model and result is not None:  # the next step's drafts
            self.model_drafts.update(self.model.executor.take_draft_token_ids(), work)
        tokens: list[list[int]] = []
        results: list[Any] = []
        for j, w in enumerate(work):
            res = from_launched if cover[j] else result
            results.append(res)
            if not w.sample or res is None or j in deferred:
                tokens.append([])
                continue
            sampled = res.sampled_token_ids[res.req_id_to_index[w.req_id]]
            kept = [int(t) for t in sampled]  # with drafts: the accepted ones and a bonus token
            if w.num_draft:  # (a row without drafts was counted when sent)
                reqs[w.req_id].num_out += len(kept)
            if own is not None and own.grammar is not None and res is result:
                self.grammars.accept(w.req_id, kept)
            tokens.append(kept)
        self.num_steps += 1
        done = ahead.now()
        if deferred or (launched is not None and own is None):  # the runner's time between
            step_s = done - max(launched.sent_at if launched else started, self._last_done)
        else:
            step_s = done - started
        self._last_done = done
        self._step_s += 0.2 * (step_s - self._step_s)  # (EWMA: whether deferring is cheap)
        out = StepResult(tokens, step_s, deferred=sorted(deferred) or None)
        if launched is not None:
            out.num_ahead = sum(cover)
            out.num_wasted = len(launched.rows) - out.num_ahead
        if any(
            r is not None and (r.logprobs is not None or r.prompt_logprobs_dict) for r in results
        ):
            self._logprobs(work, tokens, results, out)  # only steps with requests that asked
        return out

    def _advanced(self, w: SeqWork) -> SeqWork | None:
        r = self._reqs.get(w.req_id)
        if r is None or not ahead.runs_ahead(r.params):
            return None
        facts = self.model.facts
        return ahead.advanced(w, r, facts.block_size, facts.max_model_len)

    def _send(self, work: list[SeqWork], track: bool = False) -> ahead.Launched:
        """Build the step's SchedulerOutput (advancing what the runner is told of each request)
        and put its forward pass and sampling on vLLM's queue, both at once. `track`: a step
        launched ahead, whose rows a later step may take (the others keep none)."""
        from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

        facts = self.model.facts
        new: list[Any] = []
        cached = CachedRequestData.make_empty()
        num_scheduled: dict[str, int] = {}
        drafts: dict[str, list[int]] = {}  # scheduled_spec_decode_tokens (spec_decode.py)
        sampling: list[tuple[str, list[int]]] = []  # (req_id, prompt) of the requests sampling
        rows: dict[str, ahead.Row] = {}
        for w in work:
            r = self._reqs[w.req_id]
            if track:
                rows[w.req_id] = ahead.row_of(w, r)
            n = len(w.token_ids)
            end = w.start + spec_decode.split(w, drafts, self.model_drafts)  # drafts: not in it
            if end > len(r.prompt):  # a decode past the prompt: the runner samples positions
                r.prompt.extend([0] * (end - len(r.prompt)))  # (only a full-hit placement)
            blocks = ([b + 1 for b in w.block_ids],)
            if not w.sample:  # a chunk that ends before the prompt does: under the alias
                r.prompt[w.start : end] = w.token_ids
                alias = w.req_id + _ALIAS
                new.append(self._new_data(alias, r, _unseeded(r.params), blocks, w.start))
                r.alias_live = True
                num_scheduled[alias] = n
                continue
            if not r.synced or w.start < r.num_prefill:
                r.prompt[w.start : end] = w.token_ids[: end - w.start]
                if r.alias_live:
                    self._finished.add(w.req_id + _ALIAS)
                    r.alias_live = False
                new.append(self._new_data(w.req_id, r, r.params, blocks, w.start))
                r.num_out = 0
                r.synced = True
            else:
                cached.req_ids.append(w.req_id)
                extra = w.block_ids[r.num_blocks_known :]
                cached.new_block_ids.append(([b + 1 for b in extra],) if extra else None)
                cached.num_computed_tokens.append(w.start)
                cached.num_output_tokens.append(r.num_out)
                cached.new_token_ids.append([])
            if not w.num_draft:  # one token comes back (with drafts: counted when they do)
                r.num_out += 1
            r.num_blocks_known = len(w.block_ids)
            num_scheduled[w.req_id] = n
            sampling.append((w.req_id, r.prompt))
        total = sum(num_scheduled.values())
        output = SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=drafts,
            scheduled_encoder_inputs={},
            finished_req_ids=self._finished,
            free_encoder_mm_hashes=[],
            num_spec_tokens_to_schedule=spec_decode.num_to_propose(facts),  # its proposer's
        )
        self._finished = set()
        executor = self.model.executor
        note_batch(len(num_scheduled), self.model.spin_batch)  # small steps may spin (spin.py)
        sent_at = ahead.now()
        if not total:
            executor.execute_model(output)  # (the finished requests reach the runner)
            return ahead.Launched(rows, None, None, sent_at)
        # Both calls go out at once: vLLM's worker takes sample_tokens right after the forward
        # pass (one shared-memory round trip a step less; the bitmask does not depend on the
        # forward pass, as in EngineCore.step).
        forward = executor.execute_model(output, non_block=True)
        grammar = self.grammars.bitmask(sampling, drafts)
        sampled = executor.sample_tokens(grammar, non_block=True)
        return ahead.Launched(rows, forward, sampled, sent_at, grammar)

    def _logprobs(
        self, work: list[SeqWork], tokens: list[list[int]], results: list[Any], out: StepResult
    ) -> None:
        """The step's log-probability rows (logprobs.py) into `out`, per SeqWork (`results`:
        the ModelRunnerOutput each row's tokens came from)."""
        out.logprobs = [[] for _ in work]
        out.prompt_logprobs = [None] * len(work)
        for j, w in enumerate(work):
            r = self._reqs.get(w.req_id)
            result = results[j]
            if not w.sample or r is None or result is None:
                continue
            k = r.params.logprobs
            if k is not None and result.logprobs is not None and tokens[j]:
                index = result.req_id_to_index[w.req_id]
                out.logprobs[j] = logprobs.sample_rows(result.logprobs, index, len(tokens[j]), k)
            got = (result.prompt_logprobs_dict or {}).get(w.req_id)
            if got is not None and r.params.prompt_logprobs is not None:
                out.prompt_logprobs[j] = logprobs.prompt_rows(got, r.params.prompt_logprobs)

    @staticmethod
    def _new_data(req_id: str, r: _Req, params: Any, blocks: Any, start: int) -> Any:
        from vllm.v1.core.sched.output import NewRequestData

        return NewRequestData(
            req_id=req_id,
            prompt_token_ids=list(r.prompt),
            mm_features=[],
            sampling_params=params,
            pooling_params=None,
            block_ids=blocks,
            num_computed_tokens=start,
            lora_request=r.lora,
        )

    # ---- the host KV tier: copies run inside vLLM's worker process (host.py) ------------------

    def swap_out(self, gpu_ids: list[int], host_ids: list[int]) -> None:
        from kvsched.worker_vllm import host

        self.model.executor.collective_rpc(host.swap_out, args=([g + 1 for g in gpu_ids], host_ids))

    def swap_in(self, host_ids: list[int], gpu_ids: list[int]) -> None:
        from kvsched.worker_vllm import host

        self.model.executor.collective_rpc(host.swap_in, args=(host_ids, [g + 1 for g in gpu_ids]))

    def drop_host(self) -> None:
        from kvsched.worker_vllm import host

        self.model.executor.collective_rpc(host.drop)

    # ---- block bytes: prefill/decode hand-off and the storage tier (kv_transfer.py) ----------

    def export_kv(self, block_ids: list[int]) -> bytes:
        return self._transfer().export_kv(block_ids)

    def import_kv(self, block_ids: list[int], data: bytes) -> None:
        self._transfer().import_kv(block_ids, data)

    def storage_read(self, block_ids: list[int]) -> list[bytes]:
        return self._transfer().storage_read(block_ids)

    def storage_write(self, gpu_ids: list[int], blobs: list[bytes | None]) -> None:
        self._transfer().storage_write(gpu_ids, blobs)

    def storage_write_host(self, host_ids: list[int], blobs: list[bytes | None]) -> None:
        self._transfer().storage_write_host(host_ids, blobs)

    def _transfer(self) -> Any:
        from kvsched.worker_vllm.kv_transfer import KvTransfer

        return KvTransfer(self.model.executor, bool(self.model.num_host_blocks))

    def reset(self) -> None:
        """Forget every request (a new session starts from an empty cache): the runner is told
        with the next step."""
        self._finished.update(self._reqs)
        self._finished.update(r + _ALIAS for r, s in self._reqs.items() if s.alias_live)
        self._finished.update(self._parked)
        self._launched = None  # (its answer is drained before the next call's: vLLM's order)
        self._reqs.clear()
        self._parked.clear()
        self.grammars.clear()
        self.model_drafts.clear()
        if self.model.num_host_blocks:
            self.drop_host()
