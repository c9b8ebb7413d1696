"""The engine protocol's messages as kvsched's, both ways.

    to_request(GenerateRequest)  the gateway's request (token ids, vLLM-style sampling with
                                 proto3 zero defaults) as kvsched's GenerateRequest; a field
                                 kvsched cannot honour is refused by name (INVALID_ARGUMENT),
                                 never dropped silently
    complete(Finished)           kvsched's one Finished as the protocol's GenerateComplete

The gateway templates, tokenizes, detokenizes and matches stop strings on the text itself
(`stop`, `include_stop_str_in_output`, `skip_special_tokens`, `spaces_between_special_tokens`
are its own business and pass unread); the engine stops at EOS, `stop_token_ids` and
`max_tokens`, and samples.
"""

from __future__ import annotations

from typing import Any

from kvsched.core import InvalidRequest
from kvsched.v1 import common_pb2 as kcommon
from kvsched.v1 import request_service_pb2 as kpb

_INT32_MAX = (1 << 31) - 1
FINISH_REASONS = {
    kcommon.FINISH_REASON_STOP: "stop",
    kcommon.FINISH_REASON_LENGTH: "length",
    kcommon.FINISH_REASON_ABORT: "abort",
    kcommon.FINISH_REASON_ERROR: "error",
}


def _refuse(field: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"sampling_params.{field}: {why}" if field else why)


def _check_unsupported(req: Any) -> None:
    """INVALID_ARGUMENT naming the first field set that kvsched does not serve."""
    if req.WhichOneof("input") != "tokenized":
        raise InvalidRequest(
            "GenerateRequest.text: kvsched takes token ids only (send `tokenized.input_ids`)"
        )
    for name in ("mm_inputs", "media_refs", "kv_transfer_params"):
        if req.HasField(name):
            raise InvalidRequest(f"GenerateRequest.{name}: not supported by kvsched's gateway port")
    if len(req.extra_mm_inputs):
        raise InvalidRequest("GenerateRequest.extra_mm_inputs: not supported by kvsched")
    if req.HasField("kv_transfer_params_json"):
        raise InvalidRequest(
            "GenerateRequest.kv_transfer_params_json: kvsched moves KV itself (its P/D roles)"
        )
    sp = req.sampling_params
    if sp.n > 1:
        raise _refuse("n", f"n = {sp.n}: kvsched serves one sample per request; send n = 1")
    for name in ("min_p", "frequency_penalty", "presence_penalty"):
        if getattr(sp, name) != 0.0:
            raise _refuse(name, f"{getattr(sp, name):g} is not supported by kvsched (only 0)")
    if sp.repetition_penalty not in (0.0, 1.0):
        raise _refuse("repetition_penalty", f"{sp.repetition_penalty:g} is not supported (only 1)")
    for name in ("logprobs", "prompt_logprobs", "truncate_prompt_tokens"):
        if sp.HasField(name):
            raise _refuse(name, "not supported by kvsched; leave it unset")
    if len(sp.logit_bias):
        raise _refuse("logit_bias", "not supported by kvsched; leave it empty")
    constraint = sp.WhichOneof("constraint")
    if constraint:
        raise _refuse(constraint, "structured output is not supported by kvsched yet")


def to_request(req: Any, model: str, max_model_len: int) -> kpb.GenerateRequest:
    """The gateway's GenerateRequest as kvsched's, for `model` (the one this daemon serves to
    the gateway). An absent max_tokens is the room left in the model's context, as vLLM's."""
    _check_unsupported(req)
    sp = req.sampling_params
    ids = req.tokenized.input_ids
    if ids and max(ids) > _INT32_MAX:
        raise InvalidRequest("tokenized.input_ids: a token id is above 2^31 - 1")
    out = kpb.GenerateRequest(request_id=req.request_id, model=model)
    out.prompt_token_ids.extend(ids)
    s = out.sampling
    s.temperature = sp.temperature if sp.HasField("temperature") else 1.0
    if sp.top_p != 0.0:  # proto3's zero: unset
        s.top_p = sp.top_p
    s.top_k = min(sp.top_k, _INT32_MAX)
    if sp.HasField("max_tokens"):
        if sp.max_tokens > _INT32_MAX:
            raise _refuse("max_tokens", f"{sp.max_tokens} is above 2^31 - 1")
        s.max_tokens = sp.max_tokens
    else:
        s.max_tokens = max(1, max_model_len - len(ids))
    s.min_tokens = min(sp.min_tokens, _INT32_MAX)
    if sp.HasField("seed"):
        if sp.seed < 0:
            raise _refuse("seed", f"{sp.seed} is negative; kvsched takes seeds >= 0")
        s.seed = sp.seed
    s.stop_token_ids.extend(t for t in sp.stop_token_ids if t <= _INT32_MAX)
    s.ignore_eos = sp.ignore_eos
    return out


def complete(
    pb: Any,
    finished: kpb.Finished,
    output_ids: list[int],
    last_token: int | None,
    stops: Any,
    stop_str: str | None = None,
    num_output: int | None = None,
) -> Any:
    """kvsched's Finished as the protocol's GenerateComplete (`pb` is vllm_engine_pb2).
    `output_ids`: every output token (not streaming) or none (streaming: the chunks had them).
    A STOP on one of the request's `stops` (its stop_token_ids) names that token
    (`matched_token_id`); a stop at EOS names none, as vLLM's servicer. `stop_str`: the stop
    string the request ended at (stops.py), with `num_output` its tokens up to the match."""
    usage = finished.usage
    reason = "stop" if stop_str is not None else FINISH_REASONS.get(finished.reason, "error")
    msg = pb.GenerateComplete(
        output_ids=output_ids,
        finish_reason=reason,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.output_tokens if num_output is None else num_output,
        cached_tokens=usage.cached_tokens,
    )
    if stop_str is not None:
        msg.matched_stop_str = stop_str
    elif finished.reason == kcommon.FINISH_REASON_STOP and last_token in stops:
        msg.matched_token_id = last_token
    return msg
