"""The checkpoint's tokenizer files as one zip, for the gateway's GetTokenizer.

smg fetches it when it cannot load the tokenizer from a path of its own: it concatenates the chunks'
`data`, checks the SHA-256 hex digest that the last chunk carries (every other chunk's is empty), and
unpacks the archive (at most 50 entries) as a tokenizer directory. The archive is built once, off the
event loop, and served from memory: the files are the model's, fixed while the worker runs."""
from __future__ import annotations

import asyncio
import hashlib
import io
import pathlib
import zipfile
from typing import Iterator

from worker.gateway_pb import cpb

CHUNK_BYTES = 64 << 10  # per GetTokenizerChunk (what smg's client expects)
# Files that make a directory a tokenizer (any one of them).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
# Everything smg's tokenizer loader reads besides: special tokens, chat template, the model's configs.
COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json", "merges.txt", "added_tokens.json",
                   "chat_template.json", "chat_template.jinja", "config.json", "generation_config.json")
PATTERNS = ("*.tiktoken", "*.jinja")


def tokenizer_files(directory: pathlib.Path) -> list[pathlib.Path]:
    """The tokenizer files of a directory, sorted by name; empty when it holds no vocabulary file."""
    found = {p.name: p for p in (directory / n for n in VOCABULARY_FILES + COMPANION_FILES) if p.is_file()}
    for pattern in PATTERNS:
        found.update({p.name: p for p in directory.glob(pattern) if p.is_file()})
    if not any(name in found for name in VOCABULARY_FILES) and not any(n.endswith(".tiktoken") for n in found):
        return []
    return [found[name] for name in sorted(found)]


def build(directory: pathlib.Path) -> tuple[bytes, str]:
    """(zip bytes, their SHA-256 hex digest). Raises FileNotFoundError when there is no tokenizer."""
    files = tokenizer_files(directory)
    if not files:
        raise FileNotFoundError(f"{directory} holds no tokenizer ({' / '.join(VOCABULARY_FILES)})")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for path in files:
            zf.write(path, path.name)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def chunks(data: bytes, sha256: str) -> Iterator[cpb.GetTokenizerChunk]:
    view = memoryview(data)
    for start in range(0, len(data), CHUNK_BYTES):
        end = min(start + CHUNK_BYTES, len(data))
        yield cpb.GetTokenizerChunk(data=bytes(view[start:end]), sha256=sha256 if end == len(data) else "")


class TokenizerBundle:
    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        self._archive: tuple[bytes, str] | None = None
        self._lock = asyncio.Lock()

    @property
    def available(self) -> bool:
        return bool(self._archive) or bool(tokenizer_files(self.directory))

    async def archive(self) -> tuple[bytes, str]:
        async with self._lock:  # concurrent first calls share one build
            if self._archive is None:
                self._archive = await asyncio.to_thread(build, self.directory)
            return self._archive
