"""A GGUF's tokenizer metadata -> tokenizer.json (the `tokenizers` library) and tokenizer_config.json.

A GGUF stores its vocabulary under llama.cpp's keys: tokenizer.ggml.model (the algorithm),
.tokens, .token_type, .merges or .scores, .pre (which pre-tokenizer the vocabulary was trained
with), the special token ids and tokenizer.chat_template. Built here:

- "gpt2" (byte-level BPE: Llama 3, Qwen2/3, SmolLM, ...): the merges as the file lists them, and
  the pre-tokenizer splits llama.cpp applies for the file's `pre` type (src/llama-vocab.cpp,
  llm_tokenizer_bpe), written as tokenizers' Split pre-tokenizers before the byte-level mapping.
- "llama" (sentencepiece BPE with byte fallback: Llama 2, Mistral): merges recovered from the token
  scores (a pair merges into a token when both halves are tokens; higher-scoring results first),
  a "▁" prefix on the first word and byte-fallback decoding.

Tokens the file marks CONTROL become special tokens and USER_DEFINED ones plain added tokens, so
both are matched whole in text (llama.cpp's parse_special). Any other vocabulary type returns None:
the model still serves token ids, without text.
"""
from __future__ import annotations

import functools
import json
import logging

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes llama.cpp splits text with, in order (each splits the pieces the
# one before left), and whether it matches a whole word in the vocabulary before merging (ignore_merges).
# A missing or "default" type gets GPT-2's split, as transformers does.
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{k: ((_GPT2,), False) for k in ("default", "gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling")},
    **{k: ((r"\p{N}", _GPT2), False) for k in ("smollm", "starcoder", "refact", "command-r", "codeshell",
                                               "exaone", "minerva")},
    **{k: ((_LLAMA3,), True) for k in ("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3",
                                       "pixtral", "lfm2")},
    **{k: ((_QWEN2,), False) for k in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan")},
    "tekken": ((_TEKKEN,), False),
    **{k: ((_GPT4O,), False) for k in ("gpt-4o", "llama4", "minimax-m2")},
}


def tokenizer_files(meta, config: dict) -> dict[str, str] | None:
    """{"tokenizer.json": ..., "tokenizer_config.json": ...}, or None (with a warning) for a
    vocabulary this module does not build. meta: engine.gguf._Metadata."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        log.warning("%s has no vocabulary: serving token ids only", meta.src)
        return None
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if kind == "gpt2" and pre in PRE_TOKENIZERS:
        tokenizer = _byte_level(meta, tokens, *PRE_TOKENIZERS[pre])
        add_bos_default = False
    elif kind == "llama":
        tokenizer = _sentencepiece(meta, tokens)
        add_bos_default = True  # llama.cpp adds BOS to a sentencepiece vocabulary unless told otherwise
    else:
        log.warning("%s: tokenizer %r (pre-tokenizer %r) is not supported: serving token ids only", meta.src, kind,
                    pre)
        return None
    specials = _add_special_tokens(tokenizer, meta, tokens)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if add_bos and bos is not None:
        from tokenizers import processors

        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": add_bos,
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    return {"tokenizer.json": tokenizer.to_str(), "tokenizer_config.json": json.dumps(tokenizer_config, indent=2)}


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the spelling of byte-level vocabularies)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level(meta, tokens: list[str], splits: tuple[str, ...], ignore_merges: bool):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # Special tokens may be stored in plain text ("<|im_start|>" is already in the alphabet; others not).
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    model = models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
                       fuse_unk=False, ignore_merges=ignore_merges)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece(meta, tokens: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    listed = meta.get("tokenizer.ggml.merges")
    if listed:
        merges = [tuple(m.split(" ", 1)) for m in listed]
    else:
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=unk, fuse_unk=True,
                                     byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                       split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge; merges producing higher-scoring tokens rank
    first (sentencepiece BPE merges the best-scoring pair; llama.cpp's llm_tokenizer_spm does too)."""
    found = []
    for token, score in scores.items():
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special_tokens(tokenizer, meta, tokens: list[str]) -> dict[str, str]:
    """Adds CONTROL tokens (and the bos/eos/unk/pad tokens) as special tokens and USER_DEFINED ones as
    plain added tokens; returns tokenizer_config's bos_token/eos_token/... entries."""
    from tokenizers import AddedToken

    types = meta.get("tokenizer.ggml.token_type") or []
    byte_level = meta.get("tokenizer.ggml.model") == "gpt2"
    alphabet = set(_byte_alphabet().values())
    named = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= int(i) < len(tokens):
            named[name] = tokens[int(i)]
    # In a byte-level vocabulary a CONTROL token spelled outside the byte alphabet is a llama.cpp
    # mislabel of a normal token; it is left as it is (as transformers' GGUF loader does).
    # Only tokens spelled as in the vocabulary: adding any other would grow it past the model's rows.
    vocab = tokenizer.get_vocab()
    special = [t for t, kind in zip(tokens, types) if kind == CONTROL and (not byte_level or set(t) <= alphabet)]
    special += [t for t in named.values() if t not in special and t in vocab]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = [t for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab]
    if user:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return named
