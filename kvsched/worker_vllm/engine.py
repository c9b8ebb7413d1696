"""The worker engine over vLLM's executor, and the factory `kvsched worker --executor vllm` uses.

`VllmEngine` is the reference `WorkerEngine` (same slot rules, stop checks and reports) that
also tells its `VllmExecutor` when a request is placed (with vLLM's sampling parameters, made
as vLLM's input processor makes them) and when it is dropped (finished, aborted, or preempted).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from kvsched.core.protocol import Placement, SamplingParams, StepReport, Tasks
from kvsched.worker_stub.engine import KvSender, WorkerEngine
from kvsched.worker_stub.factories import EngineFactory, EngineSettings
from kvsched.worker_vllm import spec_decode
from kvsched.worker_vllm.runner import EngineFacts, VllmExecutor, VllmModel
from kvsched.worker_vllm.structured import vllm_params

log = logging.getLogger(__name__)


def vllm_sampling(
    sampling: SamplingParams, num_output: int, facts: EngineFacts
) -> tuple[Any, SamplingParams]:
    """vLLM's SamplingParams for a placement, pre-processed as vLLM's input processor does
    (generation config EOS ids, the tokenizer's EOS), and kvsched's with the stop token ids that
    follow from it. min_tokens counts from the placement: the runner counts outputs since then.
    An absent seed is unseeded; seed 0 is a seed, as in vLLM."""
    from vllm import SamplingParams as VSamplingParams

    params = VSamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,
        seed=sampling.seed,
        max_tokens=max(1, sampling.max_tokens - num_output),
        min_tokens=max(0, sampling.min_tokens - num_output),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        logit_bias=dict(sampling.logit_bias) or None,
        min_p=sampling.min_p,
        logprobs=sampling.logprobs,
        # (a re-placement after outputs recomputes prompt + outputs: its prompt's rows are known)
        prompt_logprobs=sampling.prompt_logprobs if num_output == 0 else None,
        detokenize=False,
        structured_outputs=vllm_params(sampling.structured) if sampling.structured else None,
    )
    params.update_from_generation_config(facts.generation_config, facts.eos_token_id)
    stop_ids = list(params.stop_token_ids or [])
    return params, replace(sampling, stop_token_ids=stop_ids)


class VllmEngine(WorkerEngine):
    """WorkerEngine whose executor is a `VllmExecutor`."""

    executor: VllmExecutor

    def __init__(self, executor: VllmExecutor, block_size: int, num_slots: int, **kw: Any):
        facts = executor.model.facts
        eos = facts.eos_token_id if facts.eos_token_id is not None else -1
        super().__init__(executor, block_size, num_slots, eos, facts.max_model_len, **kw)
        self._preempting: set[int] = set()

    def apply(self, tasks: Tasks) -> None:
        self._preempting = set(tasks.preempts)
        try:
            super().apply(tasks)
        finally:
            self._preempting = set()

    def _place(self, p: Placement) -> None:
        try:
            params, sampling = vllm_sampling(
                p.sampling, p.num_output_tokens, self.executor.model.facts
            )
        except Exception:  # a constraint xgrammar cannot take (vLLM's VLLMValidationError)
            log.warning("request %s refused by the worker", p.req_id, exc_info=True)
            params, sampling = None, p.sampling
        super()._place(replace(p, sampling=sampling))
        if params is None:
            self._failed[p.handle] = None
            self._free(p.handle)
            return
        self.executor.place(
            p.req_id, p.num_prefill_tokens, params, p.num_output_tokens, p.lora_name
        )

    def step(self) -> StepReport | None:
        """A step, after failing the requests whose grammar cannot be used (vLLM's scheduler
        waits for each compile before it schedules the request, and fails it on an error)."""
        if self.executor.grammars:
            failed = set(self.executor.grammar_failures())
            for handle, s in list(self._held.items()):
                if s.req_id in failed:
                    self._failed[handle] = None
                    self._free(handle)
        return super().step()

    def _free(self, handle: int) -> None:
        req_id = self._held[handle].req_id
        super()._free(handle)
        self.executor.release(req_id, preempted=handle in self._preempting)


def vllm_engine_factory(model: VllmModel, num_slots: int) -> EngineFactory:
    """Engines over one VllmModel (built before the worker connects: its facts go in Hello)."""
    facts = model.facts

    def build(settings: EngineSettings, kv_sender: KvSender) -> WorkerEngine:
        if settings.block_size != facts.block_size:
            raise ValueError(
                f"the daemon fixed block_size {settings.block_size}, vLLM's attention backend "
                f"here uses {facts.block_size}: configure the daemon with block_size "
                f"{facts.block_size} (or leave it to the worker)"
            )
        k = settings.num_speculative_tokens
        if k > facts.num_speculative_tokens:
            raise ValueError(
                f"the daemon asks for {k} speculative tokens, this vLLM runner verifies at most "
                f"{facts.num_speculative_tokens}: start the worker with --num-speculative-tokens "
                f"{k} (or configure the daemon with fewer)"
            )
        executor = VllmExecutor(model)
        engine = VllmEngine(
            executor,
            facts.block_size,
            num_slots,
            kv_sender=kv_sender,
            num_speculative_tokens=k,
            # with a draft model the engine only reserves the draft positions (spec_decode.py)
            draft=spec_decode.reserve if facts.draft_model and k else None,
        )
        if settings.max_model_len:
            engine.max_model_len = min(engine.max_model_len, settings.max_model_len)
        return engine

    return build
