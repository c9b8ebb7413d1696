"""The records kvsched.client hands out (plain dataclasses, no protobuf in sight) and the one
place that turns a call's keyword arguments into a GenerateRequest."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypedDict

from kvsched.client.errors import InvalidArgument, KvschedClientError, error_for
from kvsched.v1 import common_pb2
from kvsched.v1 import request_service_pb2 as rpb

REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


class RequestOptions(TypedDict, total=False):
    """What a request may set besides its prompt (see GenerateRequest and SamplingParams in
    request_service.proto / common.proto). Absent keys take the daemon's defaults."""

    request_id: str  # empty or absent: the daemon assigns one
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Mapping[int, float]  # token id -> added to its logit
    min_p: float
    # A grammar the output follows, one kind as vLLM's StructuredOutputsParams: {"json": schema
    # (a dict or its JSON text)}, {"json_object": True}, {"regex": str}, {"choice": [str]},
    # {"grammar": str}
    structured_output: Mapping[str, object]
    logprobs: int  # each output token's log-probability and this many top alternatives
    prompt_logprobs: int  # the same for the prompt's tokens (after the first)
    priority: int
    lora_name: str
    cache_salt: str
    model: str
    detachable: bool
    ttft_deadline_ms: int  # time to first token asked for, ms after arrival; 0: none
    tenant: str  # who the request is served for (fair shares between tenants)
    sample_group: str  # samples of one prompt, computed once (GenerateRequest.sample_group)


_SAMPLING = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "logprobs",
    "prompt_logprobs",
)
_REQUEST = (
    "request_id",
    "priority",
    "lora_name",
    "cache_salt",
    "model",
    "detachable",
    "ttft_deadline_ms",
    "tenant",
    "sample_group",
)


def build_submit(
    prompt: Sequence[int], options: RequestOptions, client_tag: str
) -> rpb.SessionRequest:
    """A Session submit of `prompt`, its request built in place: nesting a built
    GenerateRequest (`Submit(request=...)`) copies it, ~10 ms for a 87k-token prompt."""
    msg = rpb.SessionRequest()
    msg.submit.client_tag = client_tag
    build_request(prompt, options, into=msg.submit.request)
    return msg


def build_request(
    prompt: Sequence[int], options: RequestOptions, into: rpb.GenerateRequest | None = None
) -> rpb.GenerateRequest:
    """A GenerateRequest from a prompt and RequestOptions (built in `into`, an empty message,
    when given). A value the message cannot carry (of the wrong type, or outside its field's
    range: max_tokens=10**12) raises InvalidArgument naming the field; the daemon checks the
    rest and answers InvalidArgument naming the field."""
    extra = {"stop_token_ids", "logit_bias", "structured_output"}
    unknown = set(options) - set(_SAMPLING) - set(_REQUEST) - extra
    if unknown:
        raise TypeError(f"unknown request option(s): {', '.join(sorted(unknown))}")
    msg = rpb.GenerateRequest() if into is None else into
    sampling = msg.sampling
    for key in _SAMPLING:
        if key in options:
            _put(sampling, key, options[key])  # type: ignore[literal-required]
    _put_list(sampling.stop_token_ids, "stop_token_ids", options.get("stop_token_ids", ()))
    for token, bias in (options.get("logit_bias") or {}).items():
        try:
            sampling.logit_bias[token] = bias
        except (ValueError, TypeError) as exc:
            raise InvalidArgument(
                f"logit_bias[{token!r}]={bias!r} cannot be sent: {_why(exc)}"
            ) from None
    if options.get("structured_output"):
        _put_structured(sampling.structured_output, options["structured_output"])
    for key in _REQUEST:
        if key in options:
            _put(msg, key, options[key])  # type: ignore[literal-required]
    _put_list(msg.prompt_token_ids, "prompt", prompt)
    return msg


_STRUCTURED_FIELDS = {"json": "json_schema", "regex": "regex", "grammar": "grammar"}


def _put_structured(pb: common_pb2.StructuredOutput, so: Mapping[str, object]) -> None:
    """SamplingParams.structured_output from a {kind: value} mapping (one kind)."""
    kinds = [k for k, v in so.items() if v is not None]
    if len(kinds) != 1:
        raise InvalidArgument(
            f"structured_output: give exactly one of json, json_object, regex, choice, grammar "
            f"(got {sorted(kinds)})"
        )
    kind, value = kinds[0], so[kinds[0]]
    if kind == "json_object":
        pb.json_object = True
    elif kind == "choice":
        if isinstance(value, str | bytes) or not all(isinstance(c, str) for c in value):  # type: ignore[attr-defined]
            raise InvalidArgument("structured_output.choice must be a list of strings")
        pb.choice.choices.extend(value)  # type: ignore[arg-type]
    elif kind in _STRUCTURED_FIELDS:
        text = value if isinstance(value, str) or kind != "json" else json.dumps(value)
        if not isinstance(text, str):
            raise InvalidArgument(f"structured_output.{kind} must be a string")
        setattr(pb, _STRUCTURED_FIELDS[kind], text)
    else:
        raise InvalidArgument(f"structured_output: unknown kind {kind!r}")


_INT32 = (-(1 << 31), (1 << 31) - 1)


def _put(msg: object, key: str, value: object) -> None:
    try:
        setattr(msg, key, value)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"{key}={value!r} cannot be sent: {_why(exc)}") from None


def _put_list(field: object, key: str, values: Sequence[int]) -> None:
    try:
        field.extend(values)  # type: ignore[attr-defined]
    except (ValueError, TypeError) as exc:
        lo, hi = _INT32
        bad = next(
            (
                (i, v)
                for i, v in enumerate(values)
                if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi
            ),
            None,
        )
        where = f"{key}[{bad[0]}]={bad[1]!r}" if bad is not None else key
        raise InvalidArgument(
            f"{where} cannot be sent: {_why(exc)} (token ids are int32)"
        ) from None


def _why(exc: Exception) -> str:
    text = str(exc).strip() or type(exc).__name__
    return "out of range for its field" if "out of range" in text.lower() else text


class TokenLogprob(NamedTuple):
    """One token's log-probability (natural log) and rank (1 = most likely; 0 = not known: a
    token recovered without it), and the top alternatives, most likely first."""

    logprob: float
    rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


def logprob_rows(pb: common_pb2.TokenLogprobs) -> list[TokenLogprob]:
    """The rows of a TokenLogprobs message."""
    out, k = [], 0
    ids, lps = pb.top_token_ids, pb.top_logprobs
    for lp, rank, n in zip(pb.logprobs, pb.ranks, pb.num_top, strict=True):
        out.append(TokenLogprob(lp, rank, list(ids[k : k + n]), list(lps[k : k + n])))
        k += n
    return out


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class Timings:
    """Measured by the daemon, in seconds from the request's arrival."""

    queue_s: float
    ttft_s: float
    e2e_s: float


@dataclass(frozen=True)
class Finished:
    """The end of a request, exactly one per accepted request. `reason` is "stop", "length",
    "abort" or "error"; `message` says why for abort and error."""

    request_id: str
    reason: str
    usage: Usage
    timings: Timings
    message: str = ""

    @classmethod
    def from_pb(cls, f: rpb.Finished) -> Finished:
        u, t = f.usage, f.timings
        return cls(
            f.request_id,
            REASONS.get(f.reason, "error"),
            Usage(u.prompt_tokens, u.output_tokens, u.cached_tokens),
            Timings(t.queue_s, t.ttft_s, t.e2e_s),
            f.message,
        )


@dataclass(frozen=True)
class Accepted:
    request_id: str
    client_tag: str
    instance: str


@dataclass(frozen=True)
class SessionError:
    """A submit refused (named by its client_tag) or an abort of an unknown request (named by
    its request_id) inside a Session; the session goes on."""

    client_tag: str
    request_id: str
    code: int
    message: str

    def exception(self) -> KvschedClientError:
        """The typed error this entry stands for (InvalidArgument, NotFound, ...)."""
        return error_for(self.code, self.message, self.request_id)


class SessionBatch:
    """One SessionResponse: what happened since the previous one. Apply in this order:
    `accepted`, then the tokens, then `finished`, then `errors` (a request may be accepted,
    produce tokens and finish in one batch). `raw` is the message itself, for callers that
    want its columns as they are."""

    __slots__ = ("raw",)

    def __init__(self, raw: rpb.SessionResponse) -> None:
        self.raw = raw

    @property
    def accepted(self) -> list[Accepted]:
        a = self.raw.accepted
        return [
            Accepted(*row) for row in zip(a.request_ids, a.client_tags, a.instances, strict=True)
        ]

    def token_counts(self) -> Iterator[tuple[str, int]]:
        """(request id, number of new tokens), without copying the tokens."""
        t = self.raw.tokens
        return zip(t.request_ids, t.num_tokens, strict=True)

    @property
    def tokens(self) -> dict[str, list[int]]:
        """The new tokens of each request that produced some."""
        t = self.raw.tokens
        out: dict[str, list[int]] = {}
        pos = 0
        ids = t.token_ids
        for rid, n in zip(t.request_ids, t.num_tokens, strict=True):
            out[rid] = list(ids[pos : pos + n])
            pos += n
        return out

    @property
    def logprobs(self) -> dict[str, tuple[list[TokenLogprob], list[TokenLogprob]]]:
        """Request id -> (the rows of its new tokens, its prompt's rows: with its first tokens
        only, else empty), for the requests of this batch that asked for log-probabilities."""
        t = self.raw.tokens
        if not len(t.num_logprobs) and not len(t.num_prompt_logprobs):
            return {}
        rows, prompt = logprob_rows(t.logprobs), logprob_rows(t.prompt_logprobs)
        n_rows = list(t.num_logprobs) or [0] * len(t.request_ids)
        n_prompt = list(t.num_prompt_logprobs) or [0] * len(t.request_ids)
        out, i, j = {}, 0, 0
        for rid, n, m in zip(t.request_ids, n_rows, n_prompt, strict=True):
            if n or m:
                out[rid] = (rows[i : i + n], prompt[j : j + m])
            i, j = i + n, j + m
        return out

    @property
    def finished(self) -> list[Finished]:
        return [Finished.from_pb(f) for f in self.raw.finished]

    @property
    def errors(self) -> list[SessionError]:
        return [
            SessionError(e.client_tag, e.request_id, e.code, e.message) for e in self.raw.errors
        ]

    def __repr__(self) -> str:
        return (
            f"SessionBatch(accepted={self.accepted}, tokens={self.tokens}, "
            f"finished={self.finished}, errors={self.errors})"
        )


@dataclass(frozen=True)
class ModelInfo:
    """One model the daemon serves (RequestService.ListModels): what GenerateRequest.model
    names, the longest prompt + output its ready instances hold, its vocabulary size (0: not
    announced) and how many of its instances are ready now; for a LoRA adapter, its base
    model (`parent`) and path (`root`)."""

    name: str
    max_model_len: int
    vocab_size: int
    ready_instances: int
    parent: str = ""  # a LoRA adapter's base model ("" for a base model)
    root: str = ""  # a LoRA adapter's path as its workers announced it

    @classmethod
    def from_pb(cls, m: rpb.ListModelsResponse.Model) -> ModelInfo:
        return cls(m.name, m.max_model_len, m.vocab_size, m.ready_instances, m.parent, m.root)


def session_abort(request_id: str, stop: bool = False) -> rpb.SessionRequest.Abort:
    """A Session abort: reason STOP when the client ended the request at a stop condition of
    its own (it then finishes with reason stop), else ABORT."""
    reason = common_pb2.FINISH_REASON_STOP if stop else common_pb2.FINISH_REASON_UNSPECIFIED
    return rpb.SessionRequest.Abort(request_id=request_id, reason=reason)
