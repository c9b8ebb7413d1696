"""Every request field the client cannot send (out of its protobuf range, or of the wrong type)
is an InvalidArgument (a KvschedClientError) naming the field, raised before any call, from the
blocking and the asyncio client alike (no daemon needed: nothing is sent)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvsched.client import AsyncClient, Client, InvalidArgument, KvschedClientError
from kvsched.client.types import build_request

BAD = [
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"min_tokens": -(2**40)}, "min_tokens"),
    ({"top_k": 2**40}, "top_k"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"priority": 2**31}, "priority"),
    ({"ttft_deadline_ms": -1}, "ttft_deadline_ms"),
    ({"temperature": "hot"}, "temperature"),
    ({"stop_token_ids": [1, 2**31]}, "stop_token_ids[1]"),
]


@pytest.mark.parametrize(("options", "field"), BAD)
def test_out_of_range_field_is_invalid_argument_naming_it(options: dict, field: str) -> None:
    with Client("127.0.0.1:1") as client, pytest.raises(InvalidArgument) as e:
        client.generate([1, 2, 3], **options)
    assert isinstance(e.value, KvschedClientError)
    assert e.value.message.startswith(field)


def test_out_of_range_prompt_token_is_named_by_position() -> None:
    with Client("127.0.0.1:1") as client, pytest.raises(InvalidArgument) as e:
        client.generate([1, 2, 10**12])
    assert e.value.message.startswith("prompt[2]=1000000000000")


def test_aio_client_raises_the_same() -> None:
    async def go() -> None:
        async with AsyncClient("127.0.0.1:1") as client:
            with pytest.raises(InvalidArgument) as e:
                await client.generate([1, 2, 3], max_tokens=10**12)
            assert e.value.message.startswith("max_tokens")

    asyncio.run(go())


def test_build_submit_is_the_nested_submit_byte_for_byte() -> None:
    """`build_submit` builds the request inside the SessionRequest (no copy of the prompt):
    the same message a nested `Submit(request=build_request(...))` is; a bad option still
    raises InvalidArgument naming the field."""
    from kvsched.client.types import build_submit, rpb

    prompt = list(range(7, 5000))
    opts: Any = {"max_tokens": 5, "temperature": 0.5, "request_id": "r1", "stop_token_ids": [2]}
    nested = rpb.SessionRequest(
        submit=rpb.SessionRequest.Submit(request=build_request(prompt, opts), client_tag="t")
    )
    assert build_submit(prompt, opts, "t").SerializeToString() == nested.SerializeToString()
    with pytest.raises(InvalidArgument, match="max_tokens"):
        build_submit(prompt, {"max_tokens": 10**12}, "t")  # type: ignore[typeddict-item]
