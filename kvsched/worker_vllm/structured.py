"""Structured output under kvsched: the part of vLLM's scheduler that owns the grammars.

In vLLM v1 the engine core's scheduler holds a `StructuredOutputManager`: it compiles each
request's grammar asynchronously when the request arrives, builds the step's grammar bitmask
for the scheduled requests that sample (`get_grammar_bitmask`), hands it to the runner's
`sample_tokens(grammar_output)`, and advances each grammar's matcher by the accepted tokens
(`update_from_output`). kvsched is the scheduler here, so the worker plays that part with
vLLM's own manager and backend (xgrammar):

    place (new request)          -> vLLM Request + manager.grammar_init (compiles in a thread)
    each step                    -> manager.grammar_bitmask over this step's sampling requests,
                                    in the order of the SchedulerOutput -> GrammarOutput
    tokens sampled               -> manager.accept_tokens (a rejected token fails the request,
                                    as vLLM's FINISHED_ERROR)
    preempted, re-placed here    -> the matcher is kept (it saw exactly the outputs so far)
    placed anew with outputs     -> a fresh matcher replays the outputs (the prompt's last
      (another worker, a reset)     num_output tokens; the daemon sends the whole prompt of such
                                    a request, see core.kv_cache_manager.reads_prompt)
    compile failed               -> the request is failed (the daemon ends it with ERROR)

Once the grammar is complete its bitmask allows only the stop tokens (EOS), so the request
stops as vLLM's does.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


def vllm_params(so: Any) -> Any:
    """vLLM's StructuredOutputsParams for kvsched's `StructuredOutput`, validated (and a choice
    turned into its grammar) by vLLM's own xgrammar check. VLLMValidationError when xgrammar
    cannot take it."""
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    if so.kind == "choice":
        params = StructuredOutputsParams(choice=list(so.choices))
    elif so.kind == "json_object":
        params = StructuredOutputsParams(json_object=True)
    else:
        params = StructuredOutputsParams(**{so.kind: so.spec})
    params._backend = "xgrammar"

    class _Holder:  # what validate_xgrammar_grammar reads of a SamplingParams
        structured_outputs = params

    validate_xgrammar_grammar(_Holder)  # type: ignore[arg-type]
    return params


@dataclass(slots=True)
class _Grammar:
    req: Any  # vllm.v1.request.Request: what the manager reads (its grammar, sampling params)
    num_accepted: int = 0  # outputs the matcher has seen
    replay: int = 0  # outputs to feed it from the prompt's end before it first samples
    failed: bool = False


class Grammars:
    """The grammars of the requests placed on (or parked in) one VllmExecutor."""

    def __init__(self, vllm_config: Any) -> None:
        self._config = vllm_config
        self._manager: Any = None
        self._by_id: dict[str, _Grammar] = {}

    def _get_manager(self) -> Any:
        if self._manager is None:
            from vllm.v1.structured_output import StructuredOutputManager

            # The worker runs vLLM without its tokenizer (it sees token ids only); the grammar
            # backend needs it to map tokens to bytes: a config that loads it, for the manager.
            config = copy.copy(self._config)
            config.model_config = copy.copy(config.model_config)
            config.model_config.skip_tokenizer_init = False
            self._manager = StructuredOutputManager(config)
        return self._manager

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._by_id

    def place(self, req_id: str, params: Any, num_output: int) -> None:
        """A placement of a request with `params.structured_outputs`: keep the matcher of a
        request parked here that saw exactly `num_output` outputs, else compile anew."""
        g = self._by_id.get(req_id)
        if g is not None and g.num_accepted == num_output and not g.failed:
            g.req.sampling_params = params
            return
        from vllm.v1.request import Request

        req = Request(req_id, [], params, None)
        g = _Grammar(req, replay=num_output)
        self._by_id[req_id] = g
        try:
            self._get_manager().grammar_init(req)
        except Exception:
            log.warning("structured output of %s cannot be compiled", req_id, exc_info=True)
            g.failed = True

    def drop(self, req_id: str) -> None:
        self._by_id.pop(req_id, None)

    def clear(self) -> None:
        self._by_id.clear()

    def take_failed(self, req_ids: list[str]) -> list[str]:
        """Of `req_ids`, those whose grammar failed to compile (waiting for compiles still
        running: a request cannot sample before its grammar exists, vLLM's
        WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR); they are forgotten."""
        failed = []
        for req_id in req_ids:
            g = self._by_id.get(req_id)
            if g is None:
                continue
            so = g.req.structured_output_request
            if not g.failed and so is not None:
                fut = so._grammar
                if hasattr(fut, "result"):
                    try:
                        fut.result()
                    except Exception:
                        log.warning("grammar of %s failed to compile", req_id, exc_info=True)
                g.failed = isinstance(so.grammar, Exception) or so.grammar is None
            if g.failed:
                failed.append(req_id)
                del self._by_id[req_id]
        return failed

    def bitmask(self, sampling: list[tuple[str, list[int]]], drafts: dict[str, list[int]]) -> Any:
        """The GrammarOutput for this step's sampling requests (`(req_id, prompt)` in the
        SchedulerOutput's order; the prompt supplies the outputs to replay), or None."""
        ids = []
        for req_id, prompt in sampling:
            g = self._by_id.get(req_id)
            if g is None:
                continue
            if g.replay:
                self.accept(req_id, prompt[len(prompt) - g.replay :])
                g.replay = 0
            ids.append(req_id)
        if not ids:
            return None
        from vllm.v1.core.sched.output import GrammarOutput

        reqs = {req_id: self._by_id[req_id].req for req_id in ids}
        mask = self._get_manager().grammar_bitmask(reqs, ids, drafts)
        return GrammarOutput(ids, mask, [len(drafts.get(i, ())) for i in ids])

    def accept(self, req_id: str, tokens: list[int]) -> bool:
        """Advance the request's matcher by its accepted tokens; False when the grammar rejects
        them (vLLM then ends the request with an error)."""
        g = self._by_id.get(req_id)
        if g is None or not tokens:
            return True
        ok = bool(self._get_manager().accept_tokens(g.req, tokens))
        g.num_accepted += len(tokens)
        if not ok:
            g.failed = True
        return ok

    def failed_now(self) -> list[str]:
        """Requests whose grammar rejected a sampled token (forgotten)."""
        out = [r for r, g in self._by_id.items() if g.failed and g.num_accepted]
        for r in out:
            del self._by_id[r]
        return out

    def shutdown(self) -> None:
        if self._manager is not None:
            self._manager.clear_backend()
