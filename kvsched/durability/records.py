"""The journal's subjects and records (their format is documented in journal.proto).

Pure functions: no I/O. A request id becomes one subject token in unpadded base64url, so any
id (dots, spaces, wildcards) is safe in a subject.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

from kvsched.v1 import journal_pb2, request_service_pb2

STREAM = "KVSCHED_JOURNAL"
PREFIX = "kvsched.journal"
REQ = f"{PREFIX}.req"
TOK = f"{PREFIX}.tok"

ACCEPTED = journal_pb2.JournalRecord.KIND_ACCEPTED
FINISHED = journal_pb2.JournalRecord.KIND_FINISHED


def id_token(req_id: str) -> str:
    """A request id as one subject token."""
    return base64.urlsafe_b64encode(req_id.encode()).rstrip(b"=").decode()


def id_from_token(token: str) -> str:
    return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()


def req_subject(daemon_id: str, req_id: str) -> str:
    return f"{REQ}.{daemon_id}.{id_token(req_id)}"


def tok_subject(daemon_id: str, req_id: str) -> str:
    return f"{TOK}.{daemon_id}.{id_token(req_id)}"


def accepted_record(
    pb: request_service_pb2.GenerateRequest,
    req_id: str,
    daemon_id: str,
    instance: str,
    principal: str,
    client_tag: str,
) -> bytes:
    rec = journal_pb2.JournalRecord(
        kind=ACCEPTED,
        request_id=req_id,
        daemon_id=daemon_id,
        instance=instance,
        principal=principal,
        client_tag=client_tag,
    )
    rec.request.CopyFrom(pb)
    rec.request.request_id = req_id
    return rec.SerializeToString()


def finished_record(
    req_id: str,
    daemon_id: str,
    principal: str,
    tokens: list[int],
    finished: request_service_pb2.Finished,
) -> bytes:
    rec = journal_pb2.JournalRecord(
        kind=FINISHED, request_id=req_id, daemon_id=daemon_id, principal=principal
    )
    rec.output_token_ids.extend(tokens)
    rec.finished.CopyFrom(finished)
    return rec.SerializeToString()


def delta(start: int, tokens: list[int]) -> bytes:
    return journal_pb2.TokenDelta(start=start, token_ids=tokens).SerializeToString()


def parse_record(data: bytes) -> journal_pb2.JournalRecord:
    rec = journal_pb2.JournalRecord()
    rec.ParseFromString(data)
    return rec


def apply_delta(tokens: list[int], data: bytes) -> None:
    """Apply one TokenDelta to the tokens known so far (in place). A delta past their end is
    a gap (records lost while NATS was unreachable): ignored, a later full delta repairs it."""
    d = journal_pb2.TokenDelta()
    d.ParseFromString(data)
    start = d.start
    if start > len(tokens):
        return
    del tokens[start:]
    tokens.extend(d.token_ids)


@dataclass
class Unfinished:
    """A request the journal holds as accepted and not finished: what recovery replays."""

    record: journal_pb2.JournalRecord
    tokens: list[int] = field(default_factory=list)
