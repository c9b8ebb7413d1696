"""A request off the wire carries its prompt packed (Request.prompt_array, issue 37's send
cost): the block hashes, the token-id range check and the vocabulary check read the packed ids
and give exactly what they give from the list (a request built in the daemon, a copy placed
anew: no packed prompt)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvsched import codec
from kvsched.core import InvalidRequest, Request
from kvsched.core.block_hash import BlockHasher
from kvsched.core.request import packed_prompt, prompt_max_id
from kvsched.core.slots import set_output
from kvsched.server.instances.models import Limits, misfit
from kvsched.v1 import request_service_pb2 as rpb
from tests.core.factories import make_scheduler


def wire(ids: list[int], **fields: object) -> Request:
    """The core request the daemon makes of a GenerateRequest carrying `ids`."""
    pb = rpb.GenerateRequest(prompt_token_ids=ids, **fields)  # type: ignore[arg-type]
    pb.sampling.max_tokens = 4
    return codec.request_from_proto(pb, f"w{len(ids)}", 0.0)


def listed(req: Request) -> Request:
    """The same request with its prompt as a list only (no packed prompt)."""
    return Request(
        req.req_id,
        list(req.prompt_token_ids),
        req.sampling,
        lora_name=req.lora_name,
        cache_salt=req.cache_salt,
    )


def test_a_request_off_the_wire_holds_its_prompt_as_list_and_packed() -> None:
    ids = [0, 7, 2**31 - 1, 31999, 5]
    req = wire(ids)
    assert req.prompt_token_ids == ids
    assert all(type(t) is int for t in req.prompt_token_ids)
    assert req.prompt_array is not None and req.prompt_array.dtype == np.int32
    assert req.prompt_array.tolist() == ids
    assert packed_prompt(req, 1, 3) == np.array([7, 2**31 - 1], "<i8").tobytes()
    assert packed_prompt(listed(req), 1, 3) is None
    empty = wire([])
    assert empty.prompt_token_ids == [] and prompt_max_id(empty) == -1


@pytest.mark.parametrize("block_size", [16, 64])
def test_block_hashes_from_the_packed_prompt_are_the_lists(block_size: int) -> None:
    rng = random.Random(block_size)
    ids = [rng.randrange(0, 2**31) for _ in range(block_size * 9 + 5)]
    hasher = BlockHasher(block_size)
    packed, plain = wire(ids), listed(wire(ids))
    # In pieces (a router's look-up covers a few blocks, the scheduler the rest), then all.
    for n in (2, 5, 9):
        hasher.ensure_hashes(packed, n)
        hasher.ensure_hashes(plain, n)
        assert packed.block_hashes == plain.block_hashes
    assert len(packed.block_hashes) == 9
    # Output blocks after the prompt (one straddles the prompt's end) hash as before too.
    out = [rng.randrange(0, 2**31) for _ in range(block_size * 2)]
    set_output(packed, out)
    set_output(plain, out)
    hasher.ensure_hashes(packed, 11)
    hasher.ensure_hashes(plain, 11)
    assert packed.block_hashes == plain.block_hashes and len(packed.block_hashes) == 11
    # A prompt with extra keys (LoRA, salt) takes the per-block path: the same hashes.
    salted = wire(ids, lora_name="ad", cache_salt="s")
    other = listed(salted)
    hasher.ensure_hashes(salted, 9)
    hasher.ensure_hashes(other, 9)
    assert salted.block_hashes == other.block_hashes != packed.block_hashes[:9]


@pytest.mark.parametrize(
    ("ids", "ok"),
    [([0], True), ([2**31 - 1, 0, 7], True), ([-1], False), ([5, -(2**31)], False)],
)
def test_the_range_check_of_a_packed_prompt_gives_the_lists_verdict(
    ids: list[int], ok: bool
) -> None:
    for req in (wire(ids), listed(wire(ids))):
        s = make_scheduler()
        if ok:
            s.add_request(req)
            assert len(s.waiting) == 1
        else:
            with pytest.raises(InvalidRequest, match=r"token ids must be in \[0, 2\^31\)"):
                s.add_request(req)
            assert not s.requests


def test_the_vocabulary_check_names_the_largest_id_from_either_form() -> None:
    lim = Limits("m", 4096, vocab_size=1000)
    req = wire([3, 1500, 999, 1200])
    for r in (req, listed(req)):
        assert prompt_max_id(r) == 1500
        why = misfit(r, lim)
        assert why is not None and "prompt token id 1500 is outside the vocabulary" in why
    assert misfit(wire([0, 999]), lim) is None
    assert misfit(listed(wire([0, 999])), lim) is None
