"""A checkpoint's tokenizer: text <-> token ids (tokenizer.json, the `tokenizers` library), chat
messages -> prompt (the chat template of tokenizer_config.json, rendered with jinja2 as transformers'
apply_chat_template does), and an incremental detokenizer for streaming.

Routers tokenize themselves and send token ids; this is for people talking to a worker directly.
"""
from __future__ import annotations

import datetime
import json
import pathlib

from engine.errors import ConfigError, InvalidArgument


class Tokenizer:
    def __init__(self, backend, chat_template: str | None = None, special_tokens: dict[str, str] | None = None):
        """backend: a tokenizers.Tokenizer; chat_template: jinja2 source; special_tokens: bos_token,
        eos_token, ... as the template sees them."""
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(chat_template) if chat_template else None

    @classmethod
    def from_dir(cls, path: str | pathlib.Path) -> "Tokenizer | None":
        """The tokenizer of a checkpoint directory, or None when it has no tokenizer.json."""
        from tokenizers import Tokenizer as Backend

        path = pathlib.Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        try:
            backend = Backend.from_file(str(path / "tokenizer.json"))
            config = json.loads((path / "tokenizer_config.json").read_text()) \
                if (path / "tokenizer_config.json").is_file() else {}
        except Exception as e:  # tokenizers raises its own Exception type for a malformed file
            raise ConfigError(f"{path}: tokenizer.json or tokenizer_config.json cannot be read: {e}") from e
        template = config.get("chat_template")
        if isinstance(template, list):  # transformers' named templates: [{"name": ..., "template": ...}]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        special = {k: _token_text(config[k]) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                   if config.get(k)}
        return cls(backend, template, special)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens adds what the tokenizer adds around a text (a BOS
        for sentencepiece vocabularies). Special tokens written in the text are matched whole."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for chat messages ([{"role": ..., "content": ...}, ...]). kwargs reach the
        template as variables (e.g. tools). InvalidArgument for messages the template refuses."""
        if self._template is None:
            raise InvalidArgument("this model has no chat template: send text or token ids")
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise InvalidArgument("chat messages must be a list of {role, content} objects")
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **kwargs)
        except TemplateError as e:
            raise InvalidArgument(f"the chat template refused the messages: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of the chat prompt. The template writes the special tokens it wants (a BOS among
        them), so none are added (as transformers' apply_chat_template(tokenize=True))."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Decodes a stream of token ids into text pieces that hold whole characters only.

    A byte-level token can end inside a multi-byte UTF-8 character, and a sentencepiece token's
    leading space depends on what came before, so each token's text is the difference between
    decoding a short window of tokens with and without it. The window starts at the last token that
    was emitted before the previous piece (prefix) and the piece is held back while the decoded text
    ends in U+FFFD (an incomplete character); flush() returns what is still held at the end."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens [prefix, read) are emitted; [read, len) are held back

    def step(self, token_id: int) -> str:
        """The text that token_id completes ("" while a character is still incomplete)."""
        self._ids.append(int(token_id))
        before = self._tokenizer.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix:], self._skip)
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        if self._prefix > 0:  # keep only the window
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return text[len(before):]

    def flush(self) -> str:
        """What is held back (an incomplete character decodes to U+FFFD)."""
        before = self._tokenizer.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tokenizer.decode(self._ids[self._prefix:], self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(before):]


def _token_text(token) -> str:
    return token.get("content", "") if isinstance(token, dict) else str(token)


def _compile(source: str):
    """The template compiled as transformers compiles chat templates: a sandbox, trim_blocks and
    lstrip_blocks, loop controls, raise_exception(), strftime_now() and a tojson that keeps non-ASCII
    characters."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ConfigError(f"the chat template does not compile: {e}") from e
