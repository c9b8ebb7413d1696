"""kvsched.client: a typed Python client for front ends, blocking (Client) and asyncio
(AsyncClient). Token ids in, token ids out: the front end tokenizes.

    from kvsched.client import Client

    with Client("127.0.0.1:50051", token="...") as client:
        stream = client.generate([101, 2023, 2003], max_tokens=16)
        for batch in stream:
            print(batch)
        print(stream.finished.reason, stream.finished.usage)

It speaks only the public API (kvsched.v1, the generated code of protos/kvsched/v1) and never
imports the daemon. Errors: kvsched.client.errors. Guide: docs/CLIENT.md.
"""

from kvsched.client.aio import AsyncClient, AsyncGenerateStream, AsyncSession
from kvsched.client.errors import (
    AlreadyLive,
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    KvschedClientError,
    NoAnswer,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvsched.client.sync import Client, GenerateStream, Session
from kvsched.client.types import (
    Accepted,
    Finished,
    ModelInfo,
    RequestOptions,
    SessionBatch,
    SessionError,
    Timings,
    TokenLogprob,
    Usage,
    logprob_rows,
)

__all__ = [
    "Accepted",
    "AlreadyLive",
    "AsyncClient",
    "AsyncGenerateStream",
    "AsyncSession",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "Finished",
    "GenerateStream",
    "InvalidArgument",
    "KvschedClientError",
    "ModelInfo",
    "NoAnswer",
    "NotFound",
    "PermissionDenied",
    "RequestOptions",
    "ResourceExhausted",
    "Session",
    "SessionBatch",
    "SessionError",
    "Timings",
    "TokenLogprob",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "logprob_rows",
]
