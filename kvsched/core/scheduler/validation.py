"""Checks a new request must pass before it is queued: every field in range, and a request the
instance could ever run (its prompt fits the KV pool, its multimodal items fit a step).

Pure functions of the request and the configuration; imported by admission only.
"""

from __future__ import annotations

import array
import json
import math
import re
from collections.abc import Container, Sequence

import numpy as np

from kvsched.core.config import EngineConfig, QueuePolicy
from kvsched.core.errors import InvalidRequest
from kvsched.core.protocol import STRUCTURED_KINDS
from kvsched.core.request import Request

_MAX_TOKEN_ID = (1 << 31) - 1


def token_ids_in_range(ids: Sequence[int]) -> bool:
    """Whether every id is an integer in [0, 2^31). Packed as unsigned 32-bit ints (the packing
    refuses a negative id, one from 2^32 and a non-integer), then the top bit checked: one C
    loop, ~4x cheaper than min() and max() over the list, on the path of every new request."""
    try:
        packed = array.array("I", ids)
    except (OverflowError, TypeError):
        return False
    if packed.itemsize != 4:  # a platform whose C unsigned int is not 32 bits
        return all(0 <= i <= _MAX_TOKEN_ID for i in packed)
    return not packed or int(np.frombuffer(packed, dtype=np.uint32).max()) <= _MAX_TOKEN_ID


def prompt_ids_in_range(req: Request) -> bool:
    """`token_ids_in_range` of req's prompt: from its packed prompt when it has one (int32
    ids, below 2^31 by their type: only the smallest is checked, one C loop), else the list."""
    arr = req.prompt_array
    if arr is None or arr.dtype != np.int32:
        return token_ids_in_range(req.prompt_token_ids)
    return not len(arr) or int(arr.min()) >= 0


def validate(req: Request, config: EngineConfig, live: Container[str], num_blocks: int) -> None:
    """Raise InvalidRequest naming the first field out of range. `live`: the request ids in
    use; `num_blocks`: the instance's KV pool."""
    sc, sp = config.scheduler, req.sampling
    rid = req.req_id
    if not rid:
        raise InvalidRequest("request_id must not be empty")
    if rid in live:
        raise InvalidRequest(f"request_id {rid!r} is already in use by a live request")
    n = len(req.prompt_token_ids)
    if n == 0:
        raise InvalidRequest(f"request {rid!r}: prompt_token_ids is empty")
    if sp.max_tokens < 1:
        raise InvalidRequest(f"request {rid!r}: max_tokens = {sp.max_tokens} must be >= 1")
    if sp.min_tokens < 0 or sp.min_tokens > sp.max_tokens:
        raise InvalidRequest(
            f"request {rid!r}: min_tokens = {sp.min_tokens} must be in [0, max_tokens]"
        )
    if sp.prompt_logprobs is not None and n > sc.max_num_batched_tokens:
        raise InvalidRequest(
            f"request {rid!r}: prompt_logprobs: a prompt of {n} tokens is computed in one step "
            f"for its log-probabilities, and a step holds max_num_batched_tokens "
            f"{sc.max_num_batched_tokens}"
        )
    if n + sp.max_tokens > sc.max_model_len:
        raise InvalidRequest(
            f"request {rid!r}: prompt ({n} tokens) + max_tokens ({sp.max_tokens}) = "
            f"{n + sp.max_tokens} exceeds max_model_len {sc.max_model_len}"
        )
    if not prompt_ids_in_range(req):
        raise InvalidRequest(f"request {rid!r}: token ids must be in [0, 2^31)")
    if req.priority < 0 and sc.policy == QueuePolicy.PRIORITY:
        raise InvalidRequest(f"request {rid!r}: priority = {req.priority} must be >= 0")
    if not 0 <= req.ttft_deadline_ms <= 3.6e6:
        raise InvalidRequest(
            f"request {rid!r}: ttft_deadline_ms = {req.ttft_deadline_ms:g} must be in "
            "[0, 3600000] (0: none)"
        )
    if len(req.tenant.encode()) > 128:
        raise InvalidRequest(f"request {rid!r}: tenant is longer than 128 bytes")
    if len(req.sample_group.encode()) > 128:
        raise InvalidRequest(f"request {rid!r}: sample_group is longer than 128 bytes")
    block_size = config.cache.block_size
    need_blocks = -(-(n + 1) // block_size)
    if need_blocks > num_blocks:
        raise InvalidRequest(
            f"request {rid!r}: a prompt of {n} tokens needs {need_blocks} KV blocks but the "
            f"instance has {num_blocks} ({num_blocks * block_size}"
            " tokens): shorten the prompt"
        )
    if not math.isfinite(sp.temperature) or not math.isfinite(sp.top_p):
        raise InvalidRequest(f"request {rid!r}: temperature and top_p must be finite numbers")
    if sp.temperature < 0 or not 0 < sp.top_p <= 1 or sp.top_k < 0:
        raise InvalidRequest(f"request {rid!r}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0")
    _validate_adjustments(req)
    _validate_structured(req)
    prev_end = 0
    for r in req.mm_ranges:
        if r.offset < prev_end:
            raise InvalidRequest(
                f"request {rid!r}: multimodal ranges must be sorted by offset and must not "
                f"overlap (a range starts at {r.offset}, before {prev_end})"
            )
        prev_end = r.offset + r.length
        if r.offset < 0 or r.length < 1 or r.offset + r.length > n or not r.content_hash:
            raise InvalidRequest(
                f"request {rid!r}: multimodal range (offset {r.offset}, length {r.length}) "
                f"must lie inside the prompt (0..{n}) and carry a content hash"
            )
        if _mm_never_fits(config, r.length):
            raise InvalidRequest(
                f"request {rid!r}: a multimodal item of {r.length} tokens can never fit "
                "the per-step token or encoder budget with chunked mm input disabled"
            )
        enc_cap = config.cache.encoder_cache_size
        if enc_cap and r.length > enc_cap:
            raise InvalidRequest(
                f"request {rid!r}: a multimodal item of {r.length} embeddings can never fit "
                f"the encoder cache ({enc_cap} embeddings: cache.encoder_cache_size)"
            )


def _validate_adjustments(req: Request) -> None:
    """The engine's sampling adjustments, in vLLM's ranges."""
    sp, rid = req.sampling, req.req_id
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(sp, name)
        if not (math.isfinite(v) and -2.0 <= v <= 2.0):
            raise InvalidRequest(f"request {rid!r}: {name} = {v:g} must be in [-2, 2]")
    if not (math.isfinite(sp.repetition_penalty) and sp.repetition_penalty > 0):
        raise InvalidRequest(
            f"request {rid!r}: repetition_penalty = {sp.repetition_penalty:g} must be > 0"
        )
    if not (math.isfinite(sp.min_p) and 0.0 <= sp.min_p <= 1.0):
        raise InvalidRequest(f"request {rid!r}: min_p = {sp.min_p:g} must be in [0, 1]")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(sp, name)
        if k is not None and k < 0:
            raise InvalidRequest(f"request {rid!r}: {name} = {k} must be >= 0")
    for token, bias in sp.logit_bias.items():
        if token < 0 or not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
            raise InvalidRequest(
                f"request {rid!r}: logit_bias[{token}] = {bias:g}: token ids must be >= 0 "
                "and biases in [-100, 100]"
            )


def _validate_structured(req: Request) -> None:
    """The constraint's syntax, as far as it can be checked without the worker's backend: a
    JSON schema that parses to an object (or a boolean schema), a regex Python compiles, a
    non-empty choice list or grammar. The worker's backend compiles it for good."""
    so, rid = req.sampling.structured, req.req_id
    if so is None:
        return
    name = f"structured_output.{so.kind}"
    if so.kind not in STRUCTURED_KINDS:
        raise InvalidRequest(f"request {rid!r}: {name}: unknown kind (one of {STRUCTURED_KINDS})")
    if so.kind == "json":
        try:
            schema = json.loads(so.spec)
        except ValueError as exc:
            raise InvalidRequest(
                f"request {rid!r}: {name}: the schema is not JSON ({exc})"
            ) from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequest(
                f"request {rid!r}: {name}: a JSON schema must be an object, not "
                f"{type(schema).__name__}"
            )
    elif so.kind == "regex":
        if not so.spec or "\x00" in so.spec:
            raise InvalidRequest(f"request {rid!r}: {name} is empty or contains a NUL character")
        try:
            re.compile(so.spec)
        except re.error as exc:
            raise InvalidRequest(f"request {rid!r}: {name} does not compile: {exc}") from None
    elif so.kind == "choice":
        if not so.choices:
            raise InvalidRequest(f"request {rid!r}: {name} needs at least one string")
    elif so.kind == "grammar" and not so.spec.strip():
        raise InvalidRequest(f"request {rid!r}: {name} is empty")


def _mm_never_fits(config: EngineConfig, length: int) -> bool:
    """A multimodal item that may not be split over steps but exceeds a step's budget."""
    sc = config.scheduler
    if not sc.disable_chunked_mm_input:
        return False
    enc = sc.max_num_encoder_tokens
    return length > sc.max_num_batched_tokens or bool(enc and length > enc)
