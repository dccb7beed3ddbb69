"""GGUF checkpoints (engine/gguf.py, engine/gguf_vocab.py) on tiny files written here with gguf's own
GGUFWriter, laid out as llama.cpp's converter lays them out (llama-arch q/k rows permuted for its
RoPE, quantized tensors): served with --model file.gguf against transformers loading the same file,
a sentencepiece vocabulary against transformers' GGUF tokenizer, llama3 rope scaling, and bad files
(one line, exit 2, nothing left in the cache)."""
from __future__ import annotations

import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, generate_via_grpc, random_prompts, start_server
from engine import env
from engine.checkpoint import make_config, random_weights
from engine.config import ModelConfig
from engine.errors import ConfigError

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# (arch, overrides): tied and untied embeddings, GQA, q/k/v bias (qwen2) and q/k norm (qwen3).
TINY = {
    "llama": ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    # head_dim 128 (with hidden 64): transformers' GGUF loader reads no head_dim for qwen3 and takes
    # Qwen3Config's default, 128, as every Qwen3 has.
    "qwen3": ("qwen3", dict(head_dim=128)),
}
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _copy_llama_keys(reader: gguf.GGUFReader, w: gguf.GGUFWriter) -> None:
    for field in reader.fields.values():
        if field.name.startswith("llama."):
            w.add_key_value(field.name, field.contents(), field.types[0])


def gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{LAYER[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half row order -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def spm_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A sentencepiece-style vocabulary: unk/bos/eos, 256 byte tokens, then every prefix of "▁word"
    for a few words (each reachable by merging its last character), best-scoring first."""
    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    pieces = ["▁"] + list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,?!'")
    for word in ("the", "capital", "of", "France", "is", "Paris", "hello", "Hello", "world", "what", "What",
                 "model", "token", "tokens", "spaces", "two", "three", "in", "and", "a"):
        for k in range(2, len(word) + 2):
            pieces.append(("▁" + word)[:k])
        for k in range(2, len(word) + 1):
            pieces.append(word[:k])
    pieces = list(dict.fromkeys(p for p in pieces if p not in tokens))[:size - len(tokens)]
    tokens += pieces
    types += [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def write_gguf(path: pathlib.Path, name: str, quant=Q.Q8_0, tokenizer: bool = True) -> pathlib.Path:
    """A tiny random model of TINY[name] as a GGUF, with llama.cpp's tensor layout."""
    arch, overrides = TINY[name]
    raw = make_config(arch, "tiny", **overrides)
    cfg = ModelConfig.from_dict(raw)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(raw["max_position_embeddings"])
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_layers)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        tokens, scores, types = spm_vocab(cfg.vocab_size)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_chat_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    for hf, t in random_weights(cfg, seed=7, dtype=torch.float32).items():
        a = t.numpy()
        if arch == "llama" and ".q_proj." in hf:
            a = llama_cpp_permute(a, cfg.num_heads)
        elif arch == "llama" and ".k_proj." in hf:
            a = llama_cpp_permute(a, cfg.num_kv_heads)
        if a.ndim == 2 and quant not in (Q.F32, Q.F16):
            w.add_tensor(gguf_name(hf), gguf.quants.quantize(a, quant), raw_dtype=quant)
        elif a.ndim == 2 and quant == Q.F16:
            w.add_tensor(gguf_name(hf), a.astype(np.float16))
        else:
            w.add_tensor(gguf_name(hf), a.astype(np.float32))
    _finish(w)
    return path


@pytest.fixture()
def cache(tmp_path, monkeypatch) -> pathlib.Path:
    monkeypatch.setattr(env, "CACHE_DIR", tmp_path / "cache")
    return tmp_path / "cache"


def hf_greedy_gguf(path: pathlib.Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name,quant", [("llama", Q.Q8_0), ("qwen2", Q.Q4_0), ("qwen3", Q.F16)])
def test_gguf_model_answers_as_transformers_does(tmp_path, cache, name, quant):
    pytest.importorskip("transformers")
    path = write_gguf(tmp_path / f"{name}.gguf", name, quant, tokenizer=name == "llama")
    prompts = random_prompts([5, 11], 512, seed=3)
    srv = start_server(path, dtype="float32")
    try:
        got = generate_via_grpc(srv.stub(), prompts, 12)
    finally:
        srv.stop()
    for prompt, answer in zip(prompts, got):
        assert answer == hf_greedy_gguf(path, prompt, 12)
    (converted,) = (cache / "models" / "gguf").iterdir()
    assert (converted / "tokenizer.json").is_file() == (name == "llama")


def test_sentencepiece_vocabulary_matches_transformers_gguf_tokenizer(tmp_path, cache):
    transformers = pytest.importorskip("transformers")
    from engine.gguf import checkpoint_dir
    from engine.tokenizer import Tokenizer

    path = write_gguf(tmp_path / "spm.gguf", "llama", Q.F32)
    ours = Tokenizer.from_dir(checkpoint_dir(path))
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ("Hello world", "What is the capital of France? Paris.", "  two  spaces", "the tokens3 and",
                 "bytes: ü 日本 🙂", "</s> in text", "xyz QRS"):
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ids[0] == 1  # llama.cpp adds BOS to a sentencepiece vocabulary
        for skip in (True, False):
            assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
        if not text.startswith((" ", "</s>")):  # sentencepiece drops the first of leading spaces
            assert ours.decode(ids) == text
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n"


def test_llama3_rope_freqs_become_rope_scaling(tmp_path, cache):
    """llama.cpp stores Llama 3.1's rope scaling as rope_freqs factors (convert_hf_to_gguf.py,
    LlamaModel.generate_extra_tensors); the converter maps them back to rope_scaling."""
    from engine.gguf import checkpoint_dir

    theta, dim, factor, low, high, orig = 10000.0, 16, 8.0, 1.0, 4.0, 2048  # the tiny llama's theta and head_dim
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    factors = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            factors.append(1.0)
        elif wavelen > orig / low:
            factors.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    assert sum(1.0 < f < factor for f in factors) >= 2  # interior points: the fit is exercised
    path = write_gguf(tmp_path / "l3.gguf", "llama", Q.F32, tokenizer=False)
    reader = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "l3r.gguf"), "llama")
    _copy_llama_keys(reader, w)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    _finish(w)
    cfg = ModelConfig.from_dir(checkpoint_dir(tmp_path / "l3r.gguf"))
    assert cfg.rope.rope_type == "llama3" and cfg.rope.factor == pytest.approx(factor)
    assert cfg.rope.high_freq_factor == pytest.approx(high, rel=1e-3) and cfg.rope.low_freq_factor == low
    assert cfg.rope.original_max_position_embeddings == orig


def _unsupported_arch(path: pathlib.Path) -> pathlib.Path:
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    _finish(w)
    return path


def _unsupported_quant(path: pathlib.Path) -> pathlib.Path:
    """A valid llama GGUF whose down projections are Q8_1, which gguf's dequantizer does not read."""
    write_gguf(path.with_suffix(".src.gguf"), "llama", Q.F32, tokenizer=False)
    reader = gguf.GGUFReader(str(path.with_suffix(".src.gguf")))
    w = gguf.GGUFWriter(str(path), "llama")
    _copy_llama_keys(reader, w)
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    for t in reader.tensors:
        if t.name.endswith("ffn_down.weight"):
            rows, cols = t.data.shape
            w.add_tensor(t.name, np.zeros((rows, cols // block * size), dtype=np.uint8), raw_dtype=Q.Q8_1)
        else:
            w.add_tensor(t.name, np.array(t.data))
    _finish(w)
    return path


def _truncated(path: pathlib.Path) -> pathlib.Path:
    full = write_gguf(path.with_suffix(".full.gguf"), "llama", Q.Q8_0)
    data = full.read_bytes()
    path.write_bytes(data[:len(data) * 2 // 3])
    return path


@pytest.mark.parametrize("make,expect", [
    (_unsupported_arch, ["architecture 'gpt2' is not supported"]),
    (_unsupported_quant, ["'blk.0.ffn_down.weight'", "Q8_1"]),
    (_truncated, ["truncated or corrupt"]),
])
def test_bad_gguf_is_one_line_and_exit_2_with_nothing_cached(tmp_path, make, expect):
    path = make(tmp_path / "bad.gguf")
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-m", "worker", "serve", "--model", str(path), "--port", "0"], cwd=ROOT,
                          env={**os.environ, "METRALE_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("metrale-worker:")]
    assert len(lines) == 1 and proc.stderr.strip().splitlines()[-1] == lines[0], proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for part in expect:
        assert part in lines[0], lines[0]
    assert str(path) in lines[0] or path.name in lines[0]
    leftovers = list((cache / "models").rglob("*")) if (cache / "models").exists() else []
    assert not [p for p in leftovers if p.is_file()], leftovers


def test_a_conversion_that_fails_midway_leaves_nothing(tmp_path, cache, monkeypatch):
    from engine import gguf as engine_gguf

    path = write_gguf(tmp_path / "m.gguf", "qwen3", Q.F32, tokenizer=False)

    def fail(out, plan, config):
        (out / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(engine_gguf, "_write_weights", fail)
    with pytest.raises(OSError, match="disk full"):
        engine_gguf.checkpoint_dir(path)
    assert list((cache / "models" / "gguf").iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setattr(env, "CACHE_DIR", cache)
    converted = engine_gguf.checkpoint_dir(path)  # the next start converts it whole
    assert ModelConfig.from_dir(converted).architecture == "qwen3"
    assert engine_gguf.checkpoint_dir(path) == converted  # cached: converted once


def test_missing_gguf_file_is_a_config_error(tmp_path, cache):
    with pytest.raises(ConfigError, match="no such GGUF file"):
        ModelConfig.from_dir(tmp_path / "absent.gguf")
