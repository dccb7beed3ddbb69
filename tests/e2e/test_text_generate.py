"""Generate with a text or chat prompt, over real gRPC: the default model (SmolLM2-135M-Instruct, fp32 on
CPU) answers chat and text prompts with text pieces that concatenate to transformers' decode of the
generated ids; a character split across byte tokens comes out whole (or flushed with the last token);
a worker without a tokenizer (or chat template) refuses text with FAILED_PRECONDITION and allocates
nothing; Info reports the tokenizer. The oracle for prompts and text is transformers' tokenizer loaded
from the same checkpoint directory; generated ids are checked against Generate with token ids."""
from __future__ import annotations

import shutil

import grpc
import pytest

from conftest import start_server
from engine.checkpoint import write_checkpoint
from metrale.worker.v1 import worker_pb2 as pb

pytestmark = pytest.mark.timeout(300)

FRANCE = "What is the capital of France?"
# The default model answers this greedily with 水, whose three UTF-8 bytes are byte-level tokens of their own.
WATER = "Write the Chinese word for water."


@pytest.fixture(scope="module")
def real(default_model):
    srv = start_server(default_model, dtype="float32")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf_tokenizer(default_model):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(default_model)


def chat(*turns: tuple[str, str], add_generation_prompt: bool | None = None) -> pb.Chat:
    msg = pb.Chat(messages=[pb.ChatMessage(role=r, content=c) for r, c in turns])
    if add_generation_prompt is not None:
        msg.add_generation_prompt = add_generation_prompt
    return msg


def generate(srv, max_new_tokens: int = 32, **prompt) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens), **prompt)
    return list(srv.stub().Generate(request, timeout=120))


def ids_of(responses) -> list[int]:
    return [r.token.token_id for r in responses]


def text_of(responses) -> str:
    return "".join(r.text for r in responses)


def refusal(srv, **prompt) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        generate(srv, **prompt)
    return err.value


def usage(srv) -> tuple[int, int, int]:
    info = srv.stub().Info(pb.InfoRequest())
    return info.free_slots, info.free_blocks, info.live_sequences


def test_chat_prompt_streams_text_that_decodes_its_tokens(real, hf_tokenizer):
    messages = [{"role": "user", "content": FRANCE}]
    out = generate(real, chat=chat(("user", FRANCE)))
    prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert out[0].token.seq_len == len(prompt) + 1
    assert ids_of(out) == ids_of(generate(real, prompt_token_ids=prompt))  # the same prompt, as token ids
    assert out[-1].token.finish_reason == pb.FINISH_REASON_EOS and out[-1].text == ""  # EOS is special: no text
    text = text_of(out)
    assert text == hf_tokenizer.decode(ids_of(out), skip_special_tokens=True)
    assert "Paris" in text
    assert all(r.text for r in out[:-1])  # ASCII answer: every token but EOS has its piece at once


def test_chat_without_generation_prompt_renders_the_messages_alone(real, hf_tokenizer):
    turns = [("user", FRANCE), ("assistant", "The capital")]
    messages = [{"role": r, "content": c} for r, c in turns]
    alone = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)["input_ids"]
    with_prompt = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert len(alone) < len(with_prompt)
    assert generate(real, 1, chat=chat(*turns, add_generation_prompt=False))[0].token.seq_len == len(alone) + 1
    assert generate(real, 1, chat=chat(*turns))[0].token.seq_len == len(with_prompt) + 1  # unset: true


def test_text_prompt_streams_text(real, hf_tokenizer):
    text = "The capital of France is"
    out = generate(real, 12, text=text)
    assert ids_of(out) == ids_of(generate(real, 12, prompt_token_ids=hf_tokenizer(text)["input_ids"]))
    assert text_of(out) == hf_tokenizer.decode(ids_of(out), skip_special_tokens=True)
    assert "Paris" in text_of(out)


def test_token_id_prompts_get_no_text(real, hf_tokenizer):
    out = generate(real, 4, prompt_token_ids=hf_tokenizer("The capital of France is")["input_ids"])
    assert len(out) == 4 and all(r.text == "" for r in out)


def test_character_split_across_tokens_comes_out_whole(real, hf_tokenizer):
    out = generate(real, 40, chat=chat(("user", WATER)))
    ids = ids_of(out)
    split = [i for i, t in enumerate(ids) if "\ufffd" in hf_tokenizer.decode([t])]
    assert split, f"no token ends inside a character: the test checks nothing ({hf_tokenizer.decode(ids)!r})"
    assert text_of(out) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert "水" in text_of(out)
    assert any(out[i].text == "" for i in split)  # held back while the character is incomplete ...
    assert any("水" in r.text for r in out)  # ... and sent whole
    assert all("\ufffd" not in r.text for r in out)

    # Cut after the character's first byte token: the last token's text flushes what was held back.
    cut = split[0] + 1
    short = generate(real, cut, chat=chat(("user", WATER)))
    assert ids_of(short) == ids[:cut] and short[-1].token.finish_reason == pb.FINISH_REASON_LENGTH
    assert short[-1].text.endswith("\ufffd")
    assert text_of(short) == hf_tokenizer.decode(ids[:cut], skip_special_tokens=True)


def test_bad_text_prompts_are_invalid_arguments_and_allocate_nothing(real):
    before = usage(real)
    both = refusal(real, prompt_token_ids=[1, 2], text="hello")
    assert both.code() == grpc.StatusCode.INVALID_ARGUMENT and "one prompt" in both.details()
    empty = refusal(real, chat=pb.Chat())
    assert empty.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat.messages is empty" in empty.details()
    blank = refusal(real, text="")  # no tokens: the engine's empty-prompt refusal
    assert blank.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert usage(real) == before


def test_info_reports_the_tokenizer(real, hf_tokenizer):
    info = real.stub().Info(pb.InfoRequest())
    assert info.has_tokenizer and info.chat_template == hf_tokenizer.chat_template


def test_text_to_a_worker_without_a_tokenizer_fails_precondition_and_leaks_nothing(server):
    """The tiny random checkpoint has no tokenizer.json."""
    assert not (server.engine.model_path / "tokenizer.json").exists()
    info = server.stub().Info(pb.InfoRequest())
    assert not info.has_tokenizer and info.chat_template == ""
    before = usage(server)
    for prompt in (dict(text="hello"), dict(chat=chat(("user", "hello")))):
        err = refusal(server, **prompt)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        message = err.details()
        assert "no tokenizer" in message and "prompt_token_ids" in message and "\n" not in message
        assert str(server.engine.model_path) not in message and "Traceback" not in message
    err = refusal(server, prompt_token_ids=[1, 2, 3], stop=["w"])  # stop strings need the tokenizer too
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("stop needs the checkpoint's tokenizer")
    assert usage(server) == before
    assert len(generate(server, 3, prompt_token_ids=[1, 2, 3])) == 3  # token ids are served as before


def test_tokenizer_without_chat_template(default_model, tmp_path, hf_tokenizer):
    """A random-weight checkpoint with the default model's tokenizer.json alone (no tokenizer_config.json):
    text works (the pieces of a random answer concatenate to its decode), chat is refused."""
    path = write_checkpoint(tmp_path / "m", shape="tiny", vocab_size=hf_tokenizer.vocab_size, seed=4)
    shutil.copy(default_model / "tokenizer.json", path / "tokenizer.json")
    srv = start_server(path)
    try:
        info = srv.stub().Info(pb.InfoRequest())
        assert info.has_tokenizer and info.chat_template == ""
        out = generate(srv, 48, text="Hello 水")
        assert text_of(out) == hf_tokenizer.decode(ids_of(out), skip_special_tokens=True)
        err = refusal(srv, chat=chat(("user", "hello")))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "chat template" in err.details()
        assert srv.stub().Info(pb.InfoRequest()).live_sequences == 0
    finally:
        srv.stop()


def test_stop_strings_end_the_stream_at_the_token_that_completes_one(real, hf_tokenizer):
    """Generate's `stop`: the stream ends with the token whose text completes a stop string
    (FINISH_REASON_STOP_STRING); the streamed text stops before the string (vLLM's default); nothing stays
    allocated; an empty one is refused (and without a tokenizer, any: the test above)."""
    full = generate(real, chat=chat(("user", FRANCE)))
    text = text_of(full)
    assert "Paris" in text
    k = next(k for k in range(1, len(full) + 1) if "Paris" in hf_tokenizer.decode(ids_of(full[:k])))
    before = usage(real)
    out = generate(real, chat=chat(("user", FRANCE)), stop=["no such words", "Paris"])
    assert ids_of(out) == ids_of(full[:k])
    assert out[-1].token.finish_reason == pb.FINISH_REASON_STOP_STRING
    assert [r.token.finish_reason for r in out[:-1]] == [pb.FINISH_REASON_NONE] * (k - 1)
    decoded = hf_tokenizer.decode(ids_of(out), skip_special_tokens=True)
    assert decoded.endswith("Paris") and text_of(out) == decoded[:decoded.index("Paris")]
    assert usage(real) == before
    # Token ids in, the same stop on the model's text.
    prompt = hf_tokenizer.apply_chat_template([{"role": "user", "content": FRANCE}], add_generation_prompt=True,
                                              tokenize=True)["input_ids"]
    by_ids = generate(real, prompt_token_ids=prompt, stop=["Paris"])
    assert ids_of(by_ids) == ids_of(out) and by_ids[-1].token.finish_reason == pb.FINISH_REASON_STOP_STRING
    assert refusal(real, text="x", stop=[""]).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert usage(real) == before


def test_structured_output_on_generate(real, hf_tokenizer):
    """Generate's constraint: a JSON schema, and a regular expression; the same greedy tokens the gateway service's
    Generate gives with that constraint (tests/e2e/test_structured_output.py holds those against transformers);
    an uncompilable one is INVALID_ARGUMENT naming Generate's field; nothing stays allocated."""
    pytest.importorskip("xgrammar")
    import json
    import re

    from worker.gateway_pb import vpb, vpb_grpc

    gateway = vpb_grpc.VllmEngineStub(grpc.insecure_channel(real.address))
    prompt = hf_tokenizer.apply_chat_template([{"role": "user", "content": "Give me a JSON object with a cat's name."}],
                                              add_generation_prompt=True, tokenize=True)["input_ids"]
    before = usage(real)
    schema = {"type": "object", "properties": {"name": {"type": "string", "enum": ["Tom", "Kitty", "Felix"]}},
              "required": ["name"], "additionalProperties": False}
    cases = (("json_schema", json.dumps(schema), lambda t: json.loads(t)["name"] in ("Tom", "Kitty", "Felix")),
             ("regex", r'\{"name": "[A-Z][a-z]{1,8}"\}', lambda t: re.fullmatch(r'\{"name": "[A-Z][a-z]{1,8}"\}', t)))
    for field, value, check in cases:
        out = generate(real, 48, prompt_token_ids=prompt, **{field: value})
        assert out[-1].token.finish_reason == pb.FINISH_REASON_EOS, field
        text = hf_tokenizer.decode(ids_of(out), skip_special_tokens=True)
        assert check(text), (field, text)
        via_gateway = list(gateway.Generate(vpb.GenerateRequest(
            request_id=f"sg-{field}", tokenized=vpb.TokenizedInput(input_ids=prompt),
            sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=48, **{field: value})), timeout=120))
        assert list(via_gateway[-1].complete.output_ids) == ids_of(out), field
    err = refusal(real, prompt_token_ids=prompt, regex="(unclosed")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("regex cannot be compiled")
    assert usage(real) == before
