"""`kvsched generate`: one request from the shell, its output printed as it streams.

    kvsched generate --server 127.0.0.1:50051 "1 2 3" --max-tokens 8
    kvsched generate --tokenizer ./tiny-llama "Hello" --max-tokens 8

PROMPT is token ids (space or comma separated integers), or text when `--tokenizer DIR` names a
tokenizer (transformers' AutoTokenizer over local files: nothing is downloaded). Output: the
token ids as they come (or the decoded text, with a tokenizer), then one line with the finish
reason and usage. Exit 0 when the request finished (stop, length), 1 when it was refused or
ended in error, 2 for a prompt that is neither ids nor (without a tokenizer) allowed text.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

_IDS = re.compile(r"^\s*-?\d+(\s*[,\s]\s*-?\d+)*\s*$")


def parse_ids(text: str) -> list[int] | None:
    """`text` as token ids ('1 2 3', '1,2,3', '1, 2'), or None when it is not ids."""
    if not _IDS.match(text):
        return None
    return [int(t) for t in re.split(r"[,\s]+", text.strip()) if t]


def _tokenizer(path: str) -> Any:
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found"
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise RuntimeError("text prompts need transformers: pip install 'kvsched[text]'") from None

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def run_generate(args: argparse.Namespace) -> int:
    from kvsched.client import Client, KvschedClientError

    tok = None
    if args.tokenizer:
        try:
            tok = _tokenizer(args.tokenizer)
        except Exception as exc:  # a missing or unreadable directory: say which
            print(f"kvsched generate: cannot load tokenizer {args.tokenizer!r}: {exc}",
                  file=sys.stderr)  # fmt: skip
            return 2
        prompt = list(tok.encode(args.prompt))
    else:
        ids = parse_ids(args.prompt)
        if ids is None:
            print(
                "kvsched generate: PROMPT must be token ids (space or comma separated "
                "integers); to send text, give --tokenizer DIR",
                file=sys.stderr,
            )
            return 2
        prompt = ids
    options: dict[str, Any] = {"max_tokens": args.max_tokens}
    if args.temperature is not None:
        options["temperature"] = args.temperature
    if args.seed is not None:
        options["seed"] = args.seed
    if args.model:
        options["model"] = args.model
    out: list[int] = []
    shown = ""
    try:
        with Client(
            args.server,
            token=args.token,
            tls_ca=args.tls_ca,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            timeout=args.timeout,
        ) as client:
            stream = client.generate(prompt, **options)
            for batch in stream:
                out.extend(batch)
                if tok is None:
                    print(" ".join(map(str, batch)), end=" ", flush=True)
                else:
                    text = tok.decode(out, skip_special_tokens=True)
                    print(text[len(shown) :], end="", flush=True)
                    shown = text
            print()
            f = stream.finished
            assert f is not None
    except KvschedClientError as exc:
        print(f"kvsched generate: {args.server}: {exc.code.name}: {exc.message}",
              file=sys.stderr)  # fmt: skip
        return 1
    print(
        f"finished: {f.reason}{' (' + f.message + ')' if f.message else ''}; request "
        f"{f.request_id} on {stream.instance}; prompt {f.usage.prompt_tokens} tokens "
        f"({f.usage.cached_tokens} cached), output {f.usage.output_tokens}; "
        f"ttft {f.timings.ttft_s * 1000:.1f} ms, e2e {f.timings.e2e_s * 1000:.1f} ms"
    )
    return 0 if f.reason in ("stop", "length") else 1
