"""The tokenizer files a gateway asks for (`GetTokenizer`) when the tokenizer path the daemon
announces does not exist on the gateway's host: the files of the tokenizer directory given to
`kvsched serve --tokenizer DIR` (the names smg's own servicers send) as one zip archive, with
its SHA-256, built once off the event loop and kept."""

from __future__ import annotations

import asyncio
import hashlib
import io
import zipfile
from pathlib import Path

# smg-grpc-servicer's list (its tokenizer_bundle.TOKENIZER_FILES and globs): what the gateway's
# tokenizer loader reads.
FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "tiktoken.model",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
GLOBS = ("*.tiktoken", "*.jinja", "*.model")
CHUNK_BYTES = 64 * 1024


def build_zip(directory: Path) -> tuple[bytes, str]:
    """The directory's tokenizer files as a zip archive (deterministic: sorted names, fixed
    timestamps) and its SHA-256 hex digest. FileNotFoundError when it holds none."""
    names = {n for n in FILES if (directory / n).is_file()}
    for pattern in GLOBS:
        names |= {p.name for p in directory.glob(pattern) if p.is_file()}
    if not names:
        raise FileNotFoundError(f"no tokenizer files in {directory}")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(names):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, (directory / name).read_bytes())
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


class TokenizerBundle:
    """One directory's archive, built at the first request and kept."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)
        self._built: asyncio.Future[tuple[bytes, str]] | None = None

    async def archive(self) -> tuple[bytes, str]:
        if self._built is None or (self._built.done() and self._built.exception() is not None):
            self._built = asyncio.ensure_future(asyncio.to_thread(build_zip, self.directory))
        return await asyncio.shield(self._built)


def chunks(data: bytes, sha256: str) -> list[tuple[bytes, str]]:
    """(bytes, sha256) pieces of at most CHUNK_BYTES, the digest on the last one only."""
    out = []
    for start in range(0, len(data), CHUNK_BYTES):
        end = min(start + CHUNK_BYTES, len(data))
        out.append((data[start:end], sha256 if end == len(data) else ""))
    return out
