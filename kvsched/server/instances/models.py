"""Models and their limits: which instances may run a request.

Each instance serves the model its workers' Hello names (empty: the daemon's configured
`model`) and holds the limits they announced: `max_model_len` (the smaller of the worker's and
the daemon's) and `vocab_size` (0: not announced, unchecked). A request names a model
(`GenerateRequest.model`; empty: the configured model when an instance serves it, else the only
model served) and runs only on an instance of that model whose limits it fits. When no
instance of the model could ever run it the request is refused at once (INVALID_ARGUMENT naming
the limit), never queued for a worker to crash on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvsched.core import InvalidRequest, ProtocolError, Request, RequestNotFound, Unavailable
from kvsched.core.request import prompt_max_id


@dataclass(frozen=True, slots=True)
class Limits:
    """What one instance's model can hold and accept (0: not announced)."""

    model: str
    max_model_len: int
    vocab_size: int = 0
    structured_outputs: bool = False  # Hello.structured_outputs: applies grammar constraints
    max_logprobs: int = 0  # log-probability alternatives per token its workers report
    # The LoRA adapters its workers can load, (name, path) pairs (Hello.lora_adapters).
    loras: tuple[tuple[str, str], ...] = ()
    multimodal: bool = True  # Hello.multimodal: runs a request's multimodal items (encoder)

    def has_lora(self, name: str) -> bool:
        return any(n == name for n, _ in self.loras)


class HasLimits(Protocol):
    @property
    def limits(self) -> Limits | None: ...


def limits_of(
    hello_model: str,
    hello_max_model_len: int,
    hello_vocab_size: int,
    configured_model: str,
    daemon_max_model_len: int,
    hello_structured_outputs: bool = False,
    hello_max_logprobs: int = 0,
    loras: tuple[tuple[str, str], ...] = (),
    hello_multimodal: bool = True,
) -> Limits:
    """An instance's limits from its first rank's Hello and the daemon's configuration."""
    mml = daemon_max_model_len
    if hello_max_model_len > 0:
        mml = min(mml, hello_max_model_len)
    return Limits(
        hello_model or configured_model,
        mml,
        hello_vocab_size,
        structured_outputs=hello_structured_outputs,
        max_logprobs=hello_max_logprobs,
        loras=loras,
        multimodal=hello_multimodal,
    )


def check_loras(adapters: Any, max_loras: int, model: str) -> tuple[tuple[str, str], ...]:
    """A Hello's LoRA adapters as (name, path) pairs; ProtocolError naming the field when a
    name is empty, repeated or the model's own, or when adapters come without max_loras."""
    got: list[tuple[str, str]] = []
    for a in adapters:
        if not a.name:
            raise ProtocolError("Hello.lora_adapters: an adapter's name is empty")
        if a.name == model or any(a.name == n for n, _ in got):
            raise ProtocolError(
                f"Hello.lora_adapters: adapter name {a.name!r} is repeated or names the model"
            )
        got.append((a.name, a.path))
    if got and not 1 <= max_loras <= 1 << 16:
        raise ProtocolError(
            f"Hello.max_loras = {max_loras} is out of range [1, 65536] for a worker that "
            "announces LoRA adapters"
        )
    return tuple(got)


def resolve_lora(requested_model: str, lora_name: str, adapters: Mapping[str, str]) -> str:
    """The LoRA adapter a request names: `lora_name`, or `requested_model` when that names an
    adapter (`adapters`: adapter name -> its base model), as vLLM's server takes `model`.
    InvalidRequest when both name different adapters."""
    if requested_model in adapters:
        if lora_name and lora_name != requested_model:
            raise InvalidRequest(
                f"GenerateRequest.model names LoRA adapter {requested_model!r} but lora_name "
                f"names {lora_name!r}: name one adapter"
            )
        return requested_model
    return lora_name


def check_lora_known(lora_name: str, model: str, limits: Iterable[Limits]) -> None:
    """RequestNotFound (NOT_FOUND, as vLLM answers an unknown model: 404) naming the adapter
    and the model's known adapters when no instance of `model` announced `lora_name`."""
    if not lora_name:
        return
    known: set[str] = set()
    for lim in limits:
        if lim.model == model:
            if lim.has_lora(lora_name):
                return
            known.update(n for n, _ in lim.loras)
    raise RequestNotFound(
        f"unknown LoRA adapter lora_name={lora_name!r} for model {model!r}; its workers "
        f"announce: {', '.join(map(repr, sorted(known))) or 'none'}"
    )


def misfit(req: Request, lim: Limits) -> str | None:
    """Why `req` can never run on an instance with limits `lim` (None: it fits). Names the
    limit and the value that broke it."""
    n = len(req.prompt_token_ids)
    sp = req.sampling
    if sp.structured is not None and not lim.structured_outputs:
        return (
            f"structured_output ({sp.structured.kind}): the workers of model {lim.model!r} "
            "cannot apply a structured-output constraint (it needs a vLLM worker, which "
            "announces structured_outputs in its Hello)"
        )
    if req.mm_ranges and not lim.multimodal:
        return (
            f"mm_ranges ({len(req.mm_ranges)} multimodal item(s)): the workers of model "
            f"{lim.model!r} run no encoder for them (the vLLM worker passes no multimodal "
            "inputs to vLLM's runner; the model executor's toy encoder and the sim do); send "
            "the prompt without items or to a model whose workers announce multimodal"
        )
    if n + sp.max_tokens > lim.max_model_len:
        return (
            f"prompt ({n} tokens) + max_tokens ({sp.max_tokens}) = {n + sp.max_tokens} exceeds "
            f"max_model_len {lim.max_model_len} of model {lim.model!r}"
        )
    vocab = lim.vocab_size
    if vocab > 0:
        bad = prompt_max_id(req)
        if bad >= vocab:
            return (
                f"prompt token id {bad} is outside the vocabulary of model {lim.model!r} "
                f"(vocab_size {vocab}: ids 0..{vocab - 1})"
            )
        bad_stop = [t for t in sp.stop_token_ids if t >= vocab]
        if bad_stop:
            return (
                f"sampling.stop_token_ids {bad_stop[:4]} outside the vocabulary of model "
                f"{lim.model!r} (vocab_size {vocab}: ids 0..{vocab - 1})"
            )
        bad_bias = sorted(t for t in sp.logit_bias if not 0 <= t < vocab)
        if bad_bias:
            return (
                f"sampling.logit_bias token ids {bad_bias[:4]} outside the vocabulary of model "
                f"{lim.model!r} (vocab_size {vocab}: ids 0..{vocab - 1})"
            )
    if sp.logprobs is not None or sp.prompt_logprobs is not None:
        return _logprobs_misfit(sp.logprobs, sp.prompt_logprobs, lim)
    return None


def _logprobs_misfit(logprobs: int | None, prompt_logprobs: int | None, lim: Limits) -> str | None:
    """Log-probabilities the instance's workers do not report (Hello.max_logprobs)."""
    for name, k in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if k is None:
            continue
        if lim.max_logprobs <= 0:
            return (
                f"{name}: the workers of model {lim.model!r} do not report log-probabilities "
                "(the sim and model executors; the vLLM worker does)"
            )
        if k > lim.max_logprobs:
            return f"{name} = {k} exceeds max_logprobs {lim.max_logprobs} of model {lim.model!r}"
    return None


def resolve_model(
    requested: str, configured: str, served: Iterable[str], ready: Iterable[str] = ()
) -> str:
    """The model a request runs on: `requested`, or for an empty one the configured model when
    an instance of it is ready, else the only model ready (else the only one served). NOT_FOUND
    naming the known models for an unknown one; INVALID_ARGUMENT when the request must choose
    among several."""
    known = sorted(set(served))
    if requested:
        if requested not in known:
            raise RequestNotFound(
                f"unknown model {requested!r}; served: {', '.join(map(repr, known)) or 'none yet'}"
            )
        return requested
    live = sorted(set(ready))
    if configured in live:
        return configured
    if len(live) == 1:
        return live[0]
    if not live:
        return known[0] if len(known) == 1 and configured not in known else configured
    raise InvalidRequest(
        f"GenerateRequest.model is empty and this daemon's model {configured!r} is not served; "
        f"name one of: {', '.join(map(repr, live))}"
    )


_C = TypeVar("_C")


def fitting(req: Request, model: str, candidates: Sequence[tuple[_C, Limits]]) -> list[_C]:
    """The candidates (ready instances, with their limits) of `model` that `req` fits.
    Unavailable when none of that model is ready; InvalidRequest naming the limit when the
    model's instances are ready but none could run it."""
    of_model = [(c, lim) for c, lim in candidates if lim.model == model]
    if not of_model:
        raise Unavailable(f"no instance of model {model!r} is ready now")
    if req.lora_name:  # only instances whose workers can load its adapter
        of_model = [(c, lim) for c, lim in of_model if lim.has_lora(req.lora_name)]
        if not of_model:
            raise Unavailable(
                f"no ready instance of model {model!r} has LoRA adapter {req.lora_name!r} now"
            )
    # Once per distinct limits (instances of a model mostly share theirs): misfit scans the prompt.
    ok = {lim: misfit(req, lim) is None for lim in {lim for _, lim in of_model}}
    fits = [c for c, lim in of_model if ok[lim]]
    if not fits:
        # The most permissive instance's reason: the limit no instance of the model passes.
        best = max(
            (lim for _, lim in of_model),
            key=lambda lim: (
                lim.multimodal,
                lim.structured_outputs,
                lim.max_model_len,
                lim.vocab_size,
                lim.max_logprobs,
            ),
        )
        raise InvalidRequest(f"request {req.req_id!r}: {misfit(req, best)}")
    return fits


def too_long(pb: Any, req_id: str, limit: int, default_max_tokens: int) -> InvalidRequest:
    """The refusal of a GenerateRequest `pb` whose prompt is longer than `limit` (the longest
    any instance holds), read off the message without making its prompt a Python list. The
    sampling fields the core checks before the length are named first, as it would."""
    sp = pb.sampling
    max_tokens = sp.max_tokens if sp.HasField("max_tokens") else default_max_tokens
    if max_tokens < 1:
        return InvalidRequest(f"request {req_id!r}: max_tokens = {max_tokens} must be >= 1")
    if not 0 <= sp.min_tokens <= max_tokens:
        return InvalidRequest(
            f"request {req_id!r}: min_tokens = {sp.min_tokens} must be in [0, max_tokens]"
        )
    return InvalidRequest(
        f"request {req_id!r}: prompt of {len(pb.prompt_token_ids)} tokens exceeds "
        f"max_model_len {limit} (the longest any instance here holds)"
    )
