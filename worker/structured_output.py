"""Structured output for the gateway's Generate: JSON schemas, JSON objects, regular expressions, EBNF grammars,
choices and structural tags, through xgrammar (the grammar engine vLLM and SGLang use), as vLLM's xgrammar
backend compiles them.

A constrained choice's sequence is allocated with sampling.token_mask: before each token it samples the worker
sets that token's mask of allowed tokens (Engine.set_token_mask) from the grammar's state, and advances the
grammar by the token it drew (the EngineRunner does both around each step; such a sequence has one step in flight
at most). Once the grammar is complete only the model's EOS ids are allowed; a sequence that runs on past them
(ignore_eos) ends there. Compiling runs off the event loop; xgrammar caches compiled grammars.

xgrammar is an optional dependency (`pip install 'metrale-worker[structured]'`, in the test extras): without it,
or without the checkpoint's tokenizer, a constrained request is refused with INVALID_ARGUMENT saying so.
"""
from __future__ import annotations

import json
import pathlib
import re
import threading

import numpy as np

from engine.errors import InvalidArgument

_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")
KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "structural_tag")


def constraint_of(msg) -> tuple[str, str] | None:
    """The constraint a request sets in its `constraint` oneof (the gateway's SamplingParams, ModelWorker's
    GenerateRequest), as (kind, text): a choice's list as JSON, "" for json_object (false: none)."""
    kind = msg.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not msg.json_object):
        return None
    if kind == "choice":
        return kind, json.dumps(list(msg.choice.choices))
    return kind, "" if kind == "json_object" else getattr(msg, kind)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar of exactly one of `choices` (vLLM's choice_as_grammar)."""
    escaped = (re.sub(r'(["\\])', r"\\\1", c) for c in choices)
    return "root ::= " + " | ".join(f'"{c}"' for c in escaped)


class Grammars:
    """The checkpoint's grammar compiler: xgrammar over its tokenizer (tokenizer.json), made on first use."""

    def __init__(self, model_dir: str | pathlib.Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.model_dir = pathlib.Path(model_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler = None
        self._lock = threading.Lock()

    def compile(self, kind: str, value: str, field: str = ""):
        """The compiled grammar of a request's constraint (kind: one of KINDS; value: its text, for a choice the
        JSON list of choices). Blocking (call it off the event loop); InvalidArgument when it cannot be served,
        naming `field` (default: the gateway's sampling_params.<kind>)."""
        field = field or f"sampling_params.{kind}"
        compiler = self._compiler_or_refuse(field)
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(value, any_whitespace=True)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
            if kind == "regex":
                return compiler.compile_regex(value)
            if kind == "grammar":
                return compiler.compile_grammar(value)
            if kind == "choice":
                choices = json.loads(value)
                if not choices:
                    raise InvalidArgument(f"{field} needs at least one choice")
                return compiler.compile_grammar(choice_grammar(choices))
            return self._structural_tag(compiler, value)
        except InvalidArgument:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError for a schema or grammar it cannot compile
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = _XGRAMMAR_LOG_PREFIX.sub("", first)  # "[23:31:06] /project/cpp/...cc:5082: " before the reason
            raise InvalidArgument(f"{field} cannot be compiled: {first[:300]}") from None

    @staticmethod
    def _structural_tag(compiler, value: str):
        """vLLM's two structural-tag forms: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
        (xgrammar's StructuralTagItem list) or xgrammar's own structural-tag JSON."""
        import xgrammar

        tag = json.loads(value)
        if "structures" not in tag:
            return compiler.compile_structural_tag(value)
        items = [xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return compiler.compile_structural_tag(items, tag["triggers"])

    def _compiler_or_refuse(self, field: str):
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make_compiler(field)
            return self._compiler

    def _make_compiler(self, field: str):
        try:
            import xgrammar
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            raise InvalidArgument(f"{field} (structured output) needs xgrammar on the worker: install "
                                  f"'metrale-worker[structured]'") from None
        tokenizer_file = self.model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise InvalidArgument(f"{field} (structured output) needs the checkpoint's tokenizer ({tokenizer_file} "
                                  f"is missing)")
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                       stop_token_ids=self.eos_token_ids)
        return xgrammar.GrammarCompiler(info)


class Constraint:
    """One sequence's grammar state: the mask of its next token, advanced by each token it draws."""

    def __init__(self, compiled, vocab_size: int):
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # int32 [1, ceil(vocab / 32)]

    def mask(self) -> np.ndarray:
        """The allowed tokens of the next token (Engine.set_token_mask's layout); valid until accept()."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask[0].numpy()

    def accept(self, token_id: int) -> bool:
        """Advances the grammar by a drawn token; False if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and has taken its stop token: nothing may follow."""
        return self._matcher.is_terminated()
