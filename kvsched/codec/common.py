"""Messages of `common.proto` both services share: finish reasons, instance roles, sampling
parameters, multimodal ranges. Ranges of values are not checked here: the request handler and
the scheduler do that."""

from __future__ import annotations

from collections.abc import Iterable

from kvsched.core import protocol as core
from kvsched.core.config import Role
from kvsched.core.logprobs import TokenLogprobs
from kvsched.v1 import common_pb2

FINISH_REASONS = frozenset(int(r) for r in core.FinishReason)
"""Every finish reason this version knows, as ints (the proto and core values are equal)."""
MAX_FINISH_REASON = max(FINISH_REASONS)


def finish_reason_to_proto(reason: core.FinishReason) -> common_pb2.FinishReason.ValueType:
    """The proto enum value of `reason` (the values are equal by design)."""
    return common_pb2.FinishReason.ValueType(int(reason))


def finish_reason_from_proto(value: int) -> core.FinishReason:
    """The core reason for a proto enum value; `ValueError` for a value this version lacks."""
    if value not in FINISH_REASONS:
        raise ValueError(f"unknown FinishReason {value}; this daemon knows 0-{MAX_FINISH_REASON}")
    return core.FinishReason(value)


_ROLE_TO_PROTO = {
    Role.MIXED: common_pb2.INSTANCE_ROLE_MIXED,
    Role.PREFILL: common_pb2.INSTANCE_ROLE_PREFILL,
    Role.DECODE: common_pb2.INSTANCE_ROLE_DECODE,
}
_ROLE_FROM_PROTO = {v: k for k, v in _ROLE_TO_PROTO.items()}


def role_to_proto(role: Role) -> common_pb2.InstanceRole.ValueType:
    return _ROLE_TO_PROTO[role]


def role_from_proto(value: int) -> Role:
    """The core role; `ValueError` for UNSPECIFIED or a value this version lacks."""
    role = _ROLE_FROM_PROTO.get(common_pb2.InstanceRole.ValueType(value))
    if role is None:
        raise ValueError(f"InstanceRole {value} is not one of {sorted(_ROLE_FROM_PROTO)}")
    return role


def sampling_to_proto(params: core.SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=None if params.repetition_penalty == 1.0 else params.repetition_penalty,
        logit_bias=params.logit_bias,
        min_p=params.min_p,
        structured_output=structured_to_proto(params.structured),
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
    )


def structured_to_proto(so: core.StructuredOutput | None) -> common_pb2.StructuredOutput | None:
    if so is None:
        return None
    if so.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if so.kind == "choice":
        return common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=so.choices))
    if so.kind == "json":
        return common_pb2.StructuredOutput(json_schema=so.spec)
    if so.kind == "regex":
        return common_pb2.StructuredOutput(regex=so.spec)
    return common_pb2.StructuredOutput(grammar=so.spec)


def structured_from_proto(pb: common_pb2.StructuredOutput) -> core.StructuredOutput | None:
    """The core constraint; None when no kind is set (a message from a client that set the
    field empty is unconstrained, as absent)."""
    kind = pb.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return core.StructuredOutput("json_object")
    if kind == "choice":
        return core.StructuredOutput("choice", choices=tuple(pb.choice.choices))
    return core.StructuredOutput("json" if kind == "json_schema" else kind, getattr(pb, kind))


def sampling_from_proto(
    pb: common_pb2.SamplingParams, default_max_tokens: int | None = None
) -> core.SamplingParams:
    """Core sampling params. Absent max_tokens takes `default_max_tokens` (else the core's
    default); absent top_p is 1.0."""
    params = core.SamplingParams(
        min_tokens=pb.min_tokens,
        temperature=pb.temperature,
        top_k=pb.top_k,
        seed=pb.seed if pb.HasField("seed") else None,
        stop_token_ids=pb.stop_token_ids[:],
        ignore_eos=pb.ignore_eos,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        logit_bias=dict(pb.logit_bias),
        min_p=pb.min_p,
    )
    if pb.HasField("repetition_penalty"):
        params.repetition_penalty = pb.repetition_penalty
    if pb.HasField("max_tokens"):
        params.max_tokens = pb.max_tokens
    elif default_max_tokens is not None:
        params.max_tokens = default_max_tokens
    if pb.HasField("top_p"):
        params.top_p = pb.top_p
    if pb.HasField("structured_output"):
        params.structured = structured_from_proto(pb.structured_output)
    if pb.HasField("logprobs"):
        params.logprobs = pb.logprobs
    if pb.HasField("prompt_logprobs"):
        params.prompt_logprobs = pb.prompt_logprobs
    return params


def logprobs_to_proto(lp: TokenLogprobs, out: common_pb2.TokenLogprobs) -> None:
    """Fill `out` (a message field) with `lp`'s columns."""
    out.logprobs.extend(lp.logprobs)
    out.ranks.extend(lp.ranks)
    out.num_top.extend(lp.num_top)
    out.top_token_ids.extend(lp.top_token_ids)
    out.top_logprobs.extend(lp.top_logprobs)


def logprobs_from_proto(pb: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(
        pb.logprobs[:], pb.ranks[:], pb.num_top[:], pb.top_token_ids[:], pb.top_logprobs[:]
    )


def mm_ranges_to_proto(ranges: Iterable[core.MultimodalRange]) -> list[common_pb2.MultimodalRange]:
    return [
        common_pb2.MultimodalRange(offset=r.offset, length=r.length, content_hash=r.content_hash)
        for r in ranges
    ]


def mm_ranges_from_proto(
    pbs: Iterable[common_pb2.MultimodalRange],
) -> list[core.MultimodalRange]:
    return [core.MultimodalRange(pb.offset, pb.length, pb.content_hash) for pb in pbs]
