"""Text in and out of token ids, with the model's own tokenizer (transformers' AutoTokenizer,
from the model directory): prompts, chat templates, incremental detokenization (tokenizers'
DecodeStream: a multi-byte character or a merge split across tokens is emitted once whole, as
vLLM's fast detokenizer does) and stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvsched.http.errors import invalid


class TextModel:
    """The tokenizer of the served model. Needs a fast tokenizer (tokenizer.json)."""

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoTokenizer

        self.hf: Any = AutoTokenizer.from_pretrained(model_dir)
        self.backend: Any = getattr(self.hf, "backend_tokenizer", None)
        if self.backend is None:
            raise ValueError(f"{model_dir}: needs a fast tokenizer (tokenizer.json)")
        self.vocab_size = len(self.hf)
        self.eos_token_id: int | None = self.hf.eos_token_id

    def encode_prompt(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
        """One prompt: text (special tokens added, as the model's tokenizer adds them) or ids."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.hf(prompt).input_ids)
        ids = [int(t) for t in prompt]  # type: ignore[arg-type]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise invalid(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", "prompt"
            )
        return ids

    def encode_chat(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The chat template of the model's tokenizer config, tokenized (no special tokens
        added beyond what the template writes, as vLLM does); `tools` are passed to the
        template as vLLM passes them (a template that ignores them renders none)."""
        if getattr(self.hf, "chat_template", None) is None:
            raise invalid("this model's tokenizer has no chat template; use /v1/completions")
        try:
            text = self.hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools
            )
        except Exception as exc:  # jinja2's errors: the template refused these messages
            raise invalid(f"chat template: {exc}", "messages") from None
        return list(self.hf(text, add_special_tokens=False).input_ids)

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        """`ids` with the tokenizer's special tokens added (bos), as encoding with them would."""
        return list(self.hf.build_inputs_with_special_tokens(ids))

    def detokenizer(
        self, skip_special_tokens: bool = True, prompt: Sequence[int] = ()
    ) -> Detokenizer:
        return Detokenizer(self.backend, skip_special_tokens, prompt)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out: str = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return out


class Detokenizer:
    """Output token ids -> text, incrementally, exactly as vLLM's FastIncrementalDetokenizer:
    a DecodeStream primed with the prompt's ids, `push(ids)` returns the new text (possibly ""
    while a multi-byte character is incomplete). What the stream still holds when the request
    ends (an incomplete character and the text decoded with it) is dropped, as vLLM drops it:
    a text never ends in U+FFFD that no character completed. Otherwise the concatenation of
    everything returned equals decoding the whole sequence (tests/http/test_text.py)."""

    def __init__(self, backend: Any, skip_special_tokens: bool, prompt: Sequence[int] = ()) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=list(prompt), skip_special_tokens=skip_special_tokens)

    def push(self, ids: Sequence[int]) -> str:
        out = []
        for t in ids:
            piece = self._step(int(t))
            if piece:
                out.append(piece)
        return "".join(out)

    def _step(self, t: int) -> str | None:
        try:
            piece: str | None = self._stream.step(self._backend, t)
        except Exception as exc:
            # A byte sequence that decodes non-monotonically breaks DecodeStream's state; vLLM
            # starts a fresh stream from this token (vllm-project/vllm#17448), so do we.
            if not str(exc).startswith("Invalid prefix encountered"):
                raise
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self._skip)
            piece = self._stream.step(self._backend, t)
        return piece


class StopStrings:
    """Text as it grows, cut before the first stop string. `feed(new)` returns the text that is
    safe to send now: a tail that could still become the start of a stop string is held back
    until the next feed or `flush()` (so a stop string is never partly streamed)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # everything accepted so far (cut at the stop string once hit)
        self._sent = 0
        self.hit: str | None = None  # the stop string that ended the text

    def feed(self, new: str) -> str:
        if self.hit is not None or not new:
            return ""
        start = max(0, len(self.text) - self._hold)  # a stop string may straddle the feeds
        self.text += new
        cut = self._find(start)
        if cut is not None:
            self.text = self.text[:cut]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._hold)

    def _find(self, start: int) -> int | None:
        best: int | None = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best):
                best, hit = i, s
        if best is not None:
            self.hit = hit
        return best

    def _release(self, upto: int) -> str:
        upto = max(upto, self._sent)
        out = self.text[self._sent : upto]
        self._sent = upto
        return out

    def flush(self) -> str:
        """The held-back tail, at the end of the request."""
        return self._release(len(self.text))
