"""Log-probabilities in the answers, shaped as vLLM's OpenAI server shapes them.

The engine computes the values (kvsched's vLLM worker takes them from vLLM's sampler: the
sampled token's log-probability and rank, then the top k); what is left here is what vLLM's
output processor and serving code do with them, read in vLLM 0.32's `v1/engine/logprobs.py`,
`logprobs.py`, `tokenizers/detokenizer_utils.py` and the completion / chat serving code:

- a position's entries are a dict from token id, the sampled (or prompt) token first, then the
  top k (a duplicate keeps its first place); each entry's text is that token decoded alone
  (`convert_ids_list_to_tokens`: a Metaspace tokenizer's stripped leading space restored), a
  text ending in U+FFFD re-decoded with up to 4 preceding tokens of the same sequence
  (`_correct_decoded_token`), "" when the character is still incomplete;
- completions: `text_offset`, `token_logprobs`, `tokens`, `top_logprobs` (the first k + 1
  entries, keyed by text); chat: `content` entries with `bytes` and the first `top_logprobs`
  entries; every value at least -9999.0 (OpenAI's stand-in for -inf);
- prompt log-probabilities: None for the first prompt token, then `{id: {logprob, rank,
  decoded_token}}`.

vLLM is not imported: the front end runs without it.
"""

from __future__ import annotations

import json
from typing import Any

from kvsched.client import TokenLogprob

MIN_LOGPROB = -9999.0
_CONTEXT = 4  # preceding tokens used to complete a character (UTF-8 has at most 4 bytes)

# One position: token id -> (logprob, rank, text), the sampled / prompt token first.
Entry = dict[int, tuple[float, int, str]]


def _marker(hf: Any) -> str | None:
    """The Metaspace replacement character of a SentencePiece-style tokenizer (None else)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except Exception:
        return None
    subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for sub in subs:
        if sub.get("type") == "Metaspace":
            return str(sub.get("replacement", "\u2581"))
    return None


class TokenTexts:
    """Entry texts for one tokenizer (transformers' tokenizer `hf`)."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        self.marker = _marker(hf)
        self._alone: dict[int, str] = {}

    def decode(self, ids: list[int]) -> str:
        return str(self.hf.decode(ids))

    def alone(self, tid: int) -> str:
        got = self._alone.get(tid)
        if got is None:
            got = self.decode([tid]) or ""
            if self.marker is not None:
                raw = self.hf.convert_ids_to_tokens([tid])[0] or ""
                n = len(raw) - len(raw.lstrip(self.marker))
                missing = n - (len(got) - len(got.lstrip(" ")))
                if n and missing > 0:
                    got = " " * missing + got
            if len(self._alone) < 65536:
                self._alone[tid] = got
        return got

    def texts(self, ids: list[int], context: list[int]) -> list[str]:
        """The texts of one position's entries `ids`, after the sequence's `context`."""
        out = [self.alone(t) for t in ids]
        return [
            self._complete(t, context) if s.endswith("\ufffd") else s
            for t, s in zip(ids, out, strict=True)
        ]

    def _complete(self, tid: int, context: list[int]) -> str:
        for n in range(1, min(len(context), _CONTEXT) + 1):
            ctx = context[-n:]
            full = self.decode([*ctx, tid])
            if full.endswith("\ufffd"):
                continue
            clean = len(ctx)
            for j in range(len(ctx) - 1, -1, -1):
                if self.decode([ctx[j]]).endswith("\ufffd"):
                    clean = j
                else:
                    break
            prefix = self.decode(ctx[:clean]) if clean else ""
            if full.startswith(prefix):
                return full[len(prefix) :]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


class Positions:
    """One sequence's positions (a request's output, or its prompt), built as rows arrive: the
    context of a position is the sequence's earlier tokens that have entries."""

    def __init__(self, texts: TokenTexts, k: int) -> None:
        self.texts = texts
        self.k = k
        self.context: list[int] = []
        self.entries: list[Entry | None] = []

    def add(self, token_ids: list[int], rows: list[TokenLogprob]) -> list[Entry | None]:
        out: list[Entry | None] = []
        for tid, row in zip(token_ids, rows, strict=True):
            if row.rank == 0:  # no values for this token
                out.append(None)
                continue
            k = self.k
            ids = [tid, *row.top_token_ids[:k]]
            lps = [row.logprob, *row.top_logprobs[:k]]
            ranks = [row.rank, *range(1, len(ids))]
            strs = self.texts.texts(ids, self.context[-_CONTEXT:])
            entry = {t: (lp, r, s) for t, lp, r, s in zip(ids, lps, ranks, strs, strict=True)}
            self.context.append(tid)
            out.append(entry)
        self.entries.extend(out)
        return out


def prompt_positions(
    texts: TokenTexts, k: int, prompt: list[int], rows: list[TokenLogprob]
) -> list[Entry | None]:
    """The prompt's positions: None for its first token, then one per row."""
    pos = Positions(texts, k)
    return [None, *pos.add(prompt[1 : 1 + len(rows)], rows)]


def prompt_logprobs_json(entries: list[Entry | None]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` field (-inf as -9999.0)."""
    return [
        None
        if e is None
        else {
            str(t): {"logprob": max(lp, MIN_LOGPROB), "rank": r, "decoded_token": s}
            for t, (lp, r, s) in e.items()
        }
        for e in entries
    ]


def completion_logprobs(
    texts: TokenTexts,
    token_ids: list[int],
    entries: list[Entry | None],
    k: int,
    offset: int = 0,
) -> dict[str, Any]:
    """A completion choice's `logprobs`; `offset`: the first token's text offset."""
    offsets: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    tops: list[dict[str, float] | None] = []
    for tid, e in zip(token_ids, entries, strict=True):
        if e is None:
            token = texts.decode([tid])
            token_logprobs.append(None)
            tops.append(None)
        else:
            lp, _, token = e[tid]
            token_logprobs.append(max(lp, MIN_LOGPROB))
            tops.append(
                {s: max(v, MIN_LOGPROB) for i, (v, _, s) in enumerate(e.values()) if k >= i}
            )
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def next_offset(logprobs: dict[str, Any], offset: int) -> int:
    """The text offset after a streamed chunk's tokens (vLLM advances by the tokens reported,
    not by the chunk's text)."""
    if logprobs["tokens"]:
        return int(logprobs["text_offset"][-1]) + len(logprobs["tokens"][-1])
    return offset


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": max(logprob, MIN_LOGPROB),
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def chat_logprobs(
    texts: TokenTexts, token_ids: list[int], entries: list[Entry | None], top: int
) -> dict[str, Any]:
    """A chat choice's `logprobs`: `content`, one entry per token with its `top` first
    entries (the sampled token first, as vLLM lists them)."""
    content = []
    for tid, e in zip(token_ids, entries, strict=True):
        if e is None or tid not in e:
            token = texts.decode([tid])
            content.append({**_chat_entry(token, MIN_LOGPROB), "top_logprobs": []})
            continue
        lp, _, token = e[tid]
        tops = [_chat_entry(s, v) for i, (v, _, s) in enumerate(e.values()) if i < top]
        content.append({**_chat_entry(token, lp), "top_logprobs": tops})
    return {"content": content}


class ChoiceExtras:
    """What one choice's answer carries besides its text, made only for a request that asked:
    log-probabilities (`k` alternatives per output token, `prompt_k` for the prompt's; chat
    shapes them as chat does), echo (`echo_text`, completions), token ids (`return_ids`:
    streamed too). `stream` is the Generation's ResumableStream (its `tokens`, `logprobs`,
    `prompt_logprobs`)."""

    def __init__(
        self,
        texts: TokenTexts,
        *,
        chat: bool,
        prompt: list[int],
        k: int | None,
        prompt_k: int | None,
        echo_text: str | None = None,
        return_ids: bool = False,
    ) -> None:
        self.texts, self.chat, self.prompt = texts, chat, prompt
        self.k, self.prompt_k = k, prompt_k
        self.echo_text, self.return_ids = echo_text, return_ids
        self._out = Positions(texts, k or 0)
        self._prompt: list[Entry | None] | None = None
        self.sent = 0  # output tokens streamed so far (their fields sent)
        self._offset = 0  # completions' text offset after what was streamed

    def _output(self, stream: Any, end: int) -> list[Entry | None]:
        """Entries of output tokens [0, end), built as far as needed."""
        have = len(self._out.entries)
        if end > have:
            rows = stream.logprobs[have:end]
            rows += [TokenLogprob(0.0, 0, [], [])] * (end - have - len(rows))
            self._out.add(stream.tokens[have:end], rows)
        return self._out.entries[:end]

    def _prompt_entries(self, stream: Any) -> list[Entry | None] | None:
        if self._prompt is None and self.prompt_k is not None:
            rows = stream.prompt_logprobs
            if rows is not None:
                self._prompt = prompt_positions(self.texts, self.prompt_k, self.prompt, rows)
        return self._prompt

    def _logprobs(
        self, stream: Any, ids: list[int], start: int, end: int, echo: bool
    ) -> dict[str, Any] | None:
        """The `logprobs` of output tokens [start, end) (after the prompt's, with echo)."""
        if self.k is None:
            return None
        entries = self._output(stream, end)[start:end]
        if self.chat:
            return chat_logprobs(self.texts, ids, entries, self.k)
        if echo:
            prompt = self._prompt_entries(stream) or [None] * len(self.prompt)
            ids, entries = [*self.prompt, *ids], [*prompt, *entries]
        got = completion_logprobs(self.texts, ids, entries, self.k, self._offset)
        return got

    def full(
        self, stream: Any, token_ids: list[int], choice: dict[str, Any], body: dict[str, Any]
    ) -> None:
        """A non-streamed answer's fields: `logprobs`, echo's text, `prompt_logprobs`."""
        echo = self.echo_text is not None
        if echo:
            choice["text"] = self.echo_text + choice["text"]
        got = self._logprobs(stream, token_ids, 0, len(token_ids), echo)
        if got is not None:
            choice["logprobs"] = got
        prompt = self._prompt_entries(stream)
        if prompt is not None:
            (body if self.chat else choice)["prompt_logprobs"] = prompt_logprobs_json(prompt)

    def piece(self, stream: Any, token_ids: list[int], end: int) -> tuple[str, dict[str, Any]]:
        """A streamed chunk's fields for the output tokens since the last one, up to `end`:
        (text to put before the piece, fields of its choice)."""
        start, first = self.sent, self.sent == 0
        ids = token_ids[start:end]
        fields: dict[str, Any] = {}
        echo = first and self.echo_text is not None
        got = self._logprobs(stream, ids, start, end, echo)
        if got is not None:
            fields["logprobs"] = got
            if not self.chat:
                self._offset = next_offset(got, self._offset)
        if self.return_ids:
            fields["token_ids"] = ids
            if first and not self.chat:
                fields["prompt_token_ids"] = self.prompt
        self.sent = max(start, end)
        return (self.echo_text or "") if echo else "", fields
