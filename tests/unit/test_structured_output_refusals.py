"""worker/structured_output.py's refusals, each one INVALID_ARGUMENT line naming the field: no xgrammar on the
worker, no tokenizer in the checkpoint, an empty choice list, and a constraint xgrammar cannot compile."""
from __future__ import annotations

import builtins
import json

import pytest

from engine.errors import InvalidArgument
from worker.structured_output import Grammars, choice_grammar


def test_without_xgrammar_the_refusal_says_what_to_install(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name == "xgrammar" or name.startswith("xgrammar."):
            raise ImportError("No module named 'xgrammar'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    with pytest.raises(InvalidArgument) as e:
        Grammars(tmp_path, 512, (2,)).compile("regex", "a+")
    assert "sampling_params.regex" in str(e.value) and "metrale-worker[structured]" in str(e.value)


def test_without_a_tokenizer_the_refusal_names_the_file(tmp_path):
    pytest.importorskip("xgrammar")
    with pytest.raises(InvalidArgument) as e:
        Grammars(tmp_path, 512, (2,)).compile("json_object", "")
    assert "sampling_params.json_object" in str(e.value) and "tokenizer.json" in str(e.value)


def test_choices_and_uncompilable_constraints(default_model):
    pytest.importorskip("xgrammar")
    grammars = Grammars(default_model, 49152, (2,))
    with pytest.raises(InvalidArgument, match="sampling_params.choice needs at least one choice"):
        grammars.compile("choice", "[]")
    with pytest.raises(InvalidArgument, match=r"sampling_params.json_schema cannot be compiled: Unsupported type"):
        grammars.compile("json_schema", json.dumps({"type": "nonsense"}))
    with pytest.raises(InvalidArgument, match=r"sampling_params.grammar cannot be compiled: .*not defined"):
        grammars.compile("grammar", "root ::= missing")
    assert grammars.compile("choice", json.dumps(['say "hi"', "back\\slash"])) is not None  # quotes escaped


def test_choice_grammar_escapes_quotes_and_backslashes():
    assert choice_grammar(['a"b', "c\\d", "e"]) == 'root ::= "a\\"b" | "c\\\\d" | "e"'
