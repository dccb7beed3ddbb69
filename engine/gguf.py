"""A .gguf file (as llama.cpp writes them) -> a Hugging Face checkpoint directory in the cache.

The engine loads one layout only (config.json + *.safetensors, engine/loader.py). A GGUF given to
--model is converted once into that layout under CACHE_DIR/models/gguf/<stem>-<key>, where the key
covers the file's resolved path, size and mtime and the converter's version, so a changed file or a
changed converter converts again and an unchanged one starts in the time a safetensors load takes.
The directory holds config.json, generation_config.json, model.safetensors (or shards and an index)
and, when the GGUF's vocabulary is one engine/gguf_vocab.py builds, tokenizer.json and
tokenizer_config.json with the chat template.

Supported: the GGUF architectures llama (Llama, and Mistral, which llama.cpp writes as llama),
qwen2 and qwen3. Tensors of every type gguf's dequantizer reads (F32, F16, BF16, Q4_0/Q4_1/Q5_0/
Q5_1/Q8_0, the K-quants, the IQ quants) are dequantized with gguf.quants.dequantize. Everything
else is refused before anything is written, with one ConfigError line naming what is not supported.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pathlib
import shutil
import tempfile
import time

import numpy as np
import torch
from safetensors.torch import save_file

from engine import env
from engine.errors import ConfigError

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # part of the cache key: bump when the written checkpoint changes
# GGUF architecture -> (HF architecture class, config model_type).
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "qwen3": ("Qwen3ForCausalLM", "qwen3")}
# Quantized tensors of models up to this many parameters are stored dequantized in float32 (exactly
# the values the GGUF encodes); larger ones in bfloat16 (what a GPU serves; half the disk).
FP32_MAX_PARAMS = 1_000_000_000
SHARD_BYTES = 2 << 30

# GGUF tensor name (after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.").
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
ROPE_FREQS = "rope_freqs.weight"  # llama3-style rope scaling, written by llama.cpp as per-frequency factors


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".gguf")


def checkpoint_dir(path: str | os.PathLike) -> pathlib.Path:
    """The converted checkpoint of the GGUF at `path` (converted now if not cached yet)."""
    src = pathlib.Path(path).expanduser().resolve()
    if not src.is_file():
        raise ConfigError(f"{path}: no such GGUF file")
    st = src.stat()
    key = hashlib.sha256(f"{src}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}".encode()).hexdigest()[:16]
    out = env.CACHE_DIR / "models" / "gguf" / f"{src.stem}-{key}"
    if not (out / "config.json").is_file():
        convert(src, out)
    return out


def convert(src: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Writes the checkpoint of `src` to `out`, atomically: into a temporary sibling directory that is
    renamed to `out` when complete, so a failed or concurrent conversion never leaves a partial one."""
    from engine.gguf_vocab import tokenizer_files

    t0 = time.perf_counter()
    reader = _open(src)
    meta = _Metadata(reader, src)
    config = model_config(meta, reader)
    plan = _tensor_plan(reader, config, src)  # validates every tensor before anything is written
    tokenizer = tokenizer_files(meta, config)  # None: a vocabulary this converter does not build
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would keep other users of a shared cache out
        _write_weights(tmp, plan, config)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        eos = config["eos_token_id"]
        generation = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": eos, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        for name, content in (tokenizer or {}).items():
            (tmp / name).write_text(content)
        try:
            os.rename(tmp, out)
        except OSError:  # another process finished first: keep its copy
            if not (out / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s (%s, %d tensors) to %s in %.1fs%s", src, config["model_type"], len(plan), out,
             time.perf_counter() - t0, "" if tokenizer else " (no tokenizer: its vocabulary type is not supported)")
    return out


def _open(src: pathlib.Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(src)
    except Exception as e:  # the reader raises ValueError, struct/numpy errors... on a damaged file
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{src} is not a readable GGUF file (truncated or corrupt?): {detail}") from e


class _Metadata:
    """The GGUF's key/value metadata as Python values."""

    def __init__(self, reader, src: pathlib.Path):
        self.src = src
        self._fields = reader.fields

    def get(self, key: str, default=None):
        field = self._fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise ConfigError(f"{self.src}: metadata {key!r} cannot be read (corrupt file?): {e}") from e

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ConfigError(f"{self.src}: metadata {key!r} is missing")
        return value


def model_config(meta: _Metadata, reader) -> dict:
    """A Hugging Face config.json dict from the GGUF's metadata (and tensor shapes where the metadata
    leaves a value out)."""
    arch = meta.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{meta.src}: GGUF architecture {arch!r} is not supported; supported: "
                          f"{sorted(ARCHITECTURES)} (Mistral models are written as 'llama')")
    if meta.get(f"{arch}.expert_count"):
        raise ConfigError(f"{meta.src}: mixture-of-experts models ({arch} with {meta.get(f'{arch}.expert_count')} "
                          f"experts) are not supported")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ConfigError(f"{meta.src}: tensor 'token_embd.weight' is missing")
    hidden = int(meta.require(f"{arch}.embedding_length"))
    heads = _uniform(meta, f"{arch}.attention.head_count")
    kv_heads = _uniform(meta, f"{arch}.attention.head_count_kv", default=heads)
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                   or hidden // heads)
    value_dim = meta.get(f"{arch}.attention.value_length")
    if value_dim is not None and int(value_dim) != head_dim:
        raise ConfigError(f"{meta.src}: key and value head sizes differ ({head_dim} vs {value_dim}): not supported")
    vocab = int(tensors["token_embd.weight"].shape[1])  # GGUF shapes list the fastest dimension first
    eos = meta.get("tokenizer.ggml.eos_token_id")
    # Generation ends at any end-of-generation token llama.cpp knows: eos, end-of-turn, end-of-message.
    eog = [int(i) for i in (eos, meta.get("tokenizer.ggml.eot_token_id"), meta.get("tokenizer.ggml.eom_token_id"))
           if i is not None]
    eog = list(dict.fromkeys(eog))
    hf_class, model_type = ARCHITECTURES[arch]
    config = {
        "architectures": [hf_class],
        "model_type": model_type,
        "hidden_act": "silu",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 4096)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eog[0] if len(eog) == 1 else (eog or None),
        "torch_dtype": "float32",  # set by _tensor_plan from what is stored
        "gguf_source": {"file": meta.src.name, "architecture": arch, "name": meta.get("general.name"),
                        "converter_version": CONVERTER_VERSION},
    }
    if model_type in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None)
    scaling = _rope_scaling(meta, arch, tensors, config)
    if scaling:
        config["rope_scaling"] = scaling
    return config


def _uniform(meta: _Metadata, key: str, default=None) -> int:
    value = meta.get(key, default)
    if value is None:
        raise ConfigError(f"{meta.src}: metadata {key!r} is missing")
    if isinstance(value, list):  # per-layer counts: only a uniform model is supported
        if len(set(value)) != 1:
            raise ConfigError(f"{meta.src}: {key} differs between layers ({sorted(set(value))}): not supported")
        value = value[0]
    return int(value)


def _rope_scaling(meta: _Metadata, arch: str, tensors: dict, config: dict) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type") or "none"
    if ROPE_FREQS in tensors:
        return _llama3_scaling(tensors[ROPE_FREQS], config, meta.src)
    if kind == "none":
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind != "linear" or not factor:
        raise ConfigError(f"{meta.src}: rope scaling {kind!r} is not supported (supported: none, linear, "
                          f"llama3 as rope_freqs)")
    return {"rope_type": "linear", "factor": float(factor)}


def _llama3_scaling(tensor, config: dict, src: pathlib.Path) -> dict | None:
    """llama.cpp writes Llama 3.1's rope scaling as per-frequency divisors (rope_freqs): 1 for short
    wavelengths, `factor` for long ones and 1 / ((1 - s) / factor + s) between, with
    s = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
    The divisors fix only original_context / (high - low) and low / (high - low); with
    low_freq_factor = 1 (every Llama 3.x's) the parameters are unique. They are fitted from the
    divisors between the two ends (or, with fewer than two there, Llama 3's own high = 4 and
    original context 8192 are tried), and the divisors recomputed from them must match."""
    from gguf.quants import dequantize

    divisors = dequantize(tensor.data, tensor.tensor_type).astype(np.float64).reshape(-1)
    dim = config["head_dim"]
    if divisors.size != dim // 2:
        raise ConfigError(f"{src}: rope_freqs has {divisors.size} entries, expected {dim // 2}")
    wavelen = 2 * math.pi * config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor = float(divisors.max())
    if factor <= 1 + 1e-6:
        return None
    between = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if between.sum() >= 2:
        smooth = (factor / divisors[between] - 1) / (factor - 1)  # = slope / wavelength + intercept
        slope, intercept = np.polyfit(1 / wavelen[between], smooth, 1)
        high = 1 - 1 / intercept
        orig = slope * (high - 1)
    else:
        high, orig = 4.0, 8192.0
    high, orig = round(float(high), 4), int(round(orig))
    s = (orig / wavelen - 1.0) / (high - 1.0)
    expect = np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig, factor, 1 / ((1 - s) / factor + s)))
    if not np.allclose(expect, divisors, rtol=1e-3):
        raise ConfigError(f"{src}: rope_freqs does not match llama3 rope scaling: not supported")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
            "original_max_position_embeddings": orig}


def _tensor_plan(reader, config: dict, src: pathlib.Path) -> list[tuple[str, object, int]]:
    """[(HF name, GGUF tensor, rows per head for the q/k un-permutation or 0)], after checking every
    tensor's name and type. Sets config["torch_dtype"] to the dtype the weights are stored in."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import _type_traits

    readable = {Q.F32, Q.F16, Q.BF16} | set(_type_traits)
    plan, quantized, params = [], False, 0
    llama = config["model_type"] == "llama"  # llama.cpp permutes q/k rows of llama-arch models only
    for t in reader.tensors:
        if t.tensor_type not in readable:
            raise ConfigError(f"{src}: tensor {t.name!r} has quant type {t.tensor_type.name}, which gguf's "
                              f"dequantizer does not read: not supported")
        if t.name == ROPE_FREQS:
            continue
        hf = _hf_name(t.name)
        if hf is None:
            raise ConfigError(f"{src}: tensor {t.name!r} is not part of a {config['gguf_source']['architecture']} "
                              f"model this converter knows: not supported")
        heads = 0
        if llama and ".attn_q." in t.name:
            heads = config["num_attention_heads"]
        elif llama and ".attn_k." in t.name:
            heads = config["num_key_value_heads"]
        plan.append((hf, t, heads))
        quantized |= t.tensor_type not in (Q.F32, Q.F16, Q.BF16)
        params += int(np.prod([int(d) for d in t.shape]))
    embed = next(t for _, t, _ in plan if t.name == "token_embd.weight")
    if quantized:
        config["torch_dtype"] = "float32" if params <= FP32_MAX_PARAMS else "bfloat16"
    else:
        config["torch_dtype"] = {Q.F16: "float16", Q.BF16: "bfloat16"}.get(embed.tensor_type, "float32")
    return plan


def _hf_name(name: str) -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES \
            and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def dequantized(tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
    """The tensor as a torch tensor in HF layout ([out, in] for a linear weight) and `dtype`; q/k rows
    un-permuted when heads > 0. llama.cpp reorders each head's rows from HF's rotate-half RoPE layout
    (first half, second half) to interleaved pairs (convert_hf_to_gguf.py, LlamaModel.permute):
    w.reshape(heads, 2, dim // 2, ...).swapaxes(1, 2); this is its inverse."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize

    shape = [int(d) for d in reversed(tensor.shape)]
    if tensor.tensor_type == Q.BF16:  # kept exact: bf16 -> fp32 is lossless, and the reader gives raw bits
        bits = np.asarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
        w = torch.from_numpy(bits.view(np.float32).reshape(shape))
    else:
        w = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type)).reshape(shape))  # a writable copy
    if heads:
        rows = w.shape[0]
        w = w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    if tensor.tensor_type == Q.F16 and dtype == torch.float32:
        dtype = torch.float16  # lossless as stored
    return w.to(dtype).contiguous()


def _write_weights(out: pathlib.Path, plan: list, config: dict) -> None:
    """model.safetensors, or shards of at most SHARD_BYTES plus an index (bounded host memory)."""
    from gguf import GGMLQuantizationType as Q

    store = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[config["torch_dtype"]]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, names = 0, []
    files: list[str] = []

    def flush(last: bool) -> None:
        nonlocal size
        index = len(files) + 1
        fname = "model.safetensors" if last and not files else f"model-{index:05d}.safetensors"
        save_file(shards[0], str(out / fname), metadata={"format": "pt"})
        names.append((fname, list(shards[0])))
        files.append(fname)
        shards[0], size = {}, 0

    for hf, t, heads in plan:
        dtype = torch.float32 if t.tensor_type == Q.F32 else store  # norms and biases stay exact
        w = dequantized(t, heads, dtype)
        if shards[0] and size + w.nbytes > SHARD_BYTES:
            flush(last=False)
        shards[0][hf] = w
        size += w.nbytes
    flush(last=True)
    if len(files) > 1:
        weight_map = {n: f for f, ns in names for n in ns}
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
