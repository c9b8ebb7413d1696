"""`tool_choice: "auto"`: the model's text parsed into tool calls by vLLM's own tool parser
(`--enable-auto-tool-choice --tool-call-parser NAME`, vLLM's flags and names, e.g. "hermes"
for ChatML models that write `<tool_call>{...}</tool_call>`). The parsers live in vLLM
(`vllm.tool_parsers`), so this needs vLLM installed where `kvsched http` runs; without the flags
an "auto" request is a 400, as on vLLM's server."""

from __future__ import annotations

from typing import Any


class AutoToolParser:
    """One vLLM tool parser class, instantiated per request (parsers keep per-request state)."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        try:
            from vllm.tool_parsers import ToolParserManager
        except ImportError:
            raise ValueError(
                f"--tool-call-parser {name}: vLLM's tool parsers are not installed here "
                "(pip install vllm, or leave auto tool choice off)"
            ) from None
        try:
            self._cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise ValueError(f"--tool-call-parser {name!r}: vLLM has no such tool parser") from None
        self._tokenizer = tokenizer

    def _request(self, body: dict[str, Any]) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest.model_validate(body)

    def skip_special_tokens(self, body: dict[str, Any]) -> bool:
        """The request's skip_special_tokens after the parser's adjust_request (vLLM's hermes
        parser turns it off, so its tags survive detokenization)."""
        parser = self._cls(self._tokenizer, None)
        adjusted = parser.adjust_request(self._request(body))
        return bool(adjusted.skip_special_tokens)

    def parse(self, text: str, body: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished text, as vLLM's server extracts them."""
        from kvsched.http.structured import tool_call

        request = self._request(body)
        parser = self._cls(self._tokenizer, request.tools)
        info = parser.extract_tool_calls(text, request=request)
        if not info.tools_called:
            return text, []
        calls = [tool_call(tc.function.name, tc.function.arguments) for tc in info.tool_calls]
        content = info.content if info.content and info.content.strip() else None
        return content, calls
