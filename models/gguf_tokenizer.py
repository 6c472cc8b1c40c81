"""A Hugging Face tokenizer built from a GGUF file's `tokenizer.*` metadata.

The target is to tokenize exactly as transformers' own GGUF conversion does (that is what the
golden data used), so the backend `tokenizers.Tokenizer` comes from transformers' converter
(`transformers.integrations.gguf.gguf_tokenizer_mapping.convert_gguf_tokenizer`, torch-free).
Should that internal module move, byte-level BPE ("gpt2") files fall back to `_byte_level_backend`,
an equivalent rebuild that the tests compare against the converter.

The fast tokenizer is wrapped (`TokenizersBackend`, a.k.a. `PreTrainedTokenizerFast`) with the
file's bos/eos/unk/pad tokens, add_bos/add_eos flags and chat template, marks every CONTROL
token special, and is saved as tokenizer.json + tokenizer_config.json (+ chat_template.jinja,
special_tokens_map.json).
"""

from __future__ import annotations

import json
import logging
import pathlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import gguf
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
TOKEN_TYPE_USER_DEFINED = 4

# GGUF metadata key (after "tokenizer.") -> name in transformers' tokenizer dict
_TOKENIZER_KEYS = {
    "ggml.model": "tokenizer_type",
    "ggml.pre": "pre_tokenizer_type",
    "ggml.tokens": "tokens",
    "ggml.scores": "scores",
    "ggml.token_type": "token_type",
    "ggml.merges": "merges",
    "ggml.precompiled_charsmap": "precompiled_charsmap",
    "ggml.bos_token_id": "bos_token_id",
    "ggml.eos_token_id": "eos_token_id",
    "ggml.unknown_token_id": "unk_token_id",
    "ggml.padding_token_id": "pad_token_id",
    "ggml.add_space_prefix": "add_prefix_space",
}
_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unk_token_id",
    "pad_token": "pad_token_id",
}


def tokenizer_metadata(reader: gguf.GGUFReader) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(tokenizer_dict, tokenizer_config)` from a GGUF file, in transformers' naming."""
    from jaxserve.models.gguf_loader import metadata_value

    tok = {}
    for key, name in _TOKENIZER_KEYS.items():
        value = metadata_value(reader, f"tokenizer.{key}")
        if value is not None:
            tok[name] = value
    if "tokens" not in tok or "tokenizer_type" not in tok:
        raise ValueError(
            "GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)."
        )

    cfg: dict[str, Any] = {}
    for key, name in (
        ("chat_template", "chat_template"),
        ("ggml.add_bos_token", "add_bos_token"),
        ("ggml.add_eos_token", "add_eos_token"),
    ):
        value = metadata_value(reader, f"tokenizer.{key}")
        if value is not None:
            cfg[name] = value
    if (
        tok["tokenizer_type"] == "llama"
    ):  # llama.cpp adds BOS to sentencepiece vocabularies by default
        cfg.setdefault("add_bos_token", True)
    for name, id_key in _SPECIAL_IDS.items():
        token_id = tok.get(id_key)
        cfg[name] = tok["tokens"][token_id] if token_id is not None else None
    return tok, cfg


def _byte_level_backend(tok: dict[str, Any]) -> Tokenizer:
    """Byte-level BPE as transformers' GGUF converter builds it (GPT2Tokenizer + GGUF specials)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tok["tokens"])
    }
    merges = [tuple(m.split(" ")) for m in tok.get("merges", [])]
    backend = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    specials = ["<|endoftext|>"]  # GPT2Tokenizer's default bos/eos/unk, added before the file's own
    types = tok.get("token_type") or ()
    specials += [
        t for t, ty in zip(tok["tokens"], types) if ty == TOKEN_TYPE_CONTROL and set(t) <= alphabet
    ]
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(specials)]
    )
    user = [
        t for t, ty in zip(tok["tokens"], types) if ty == TOKEN_TYPE_USER_DEFINED and t in vocab
    ]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return backend


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def build_backend(architecture: str, tok: dict[str, Any]) -> Tokenizer:
    """The `tokenizers.Tokenizer` for a GGUF vocabulary (transformers' converter when available)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
    except ImportError:
        convert_gguf_tokenizer = None
    if convert_gguf_tokenizer is not None:
        try:
            backend, _ = convert_gguf_tokenizer(architecture, tok)
        except ValueError as e:
            raise ValueError(f"cannot build a tokenizer from this GGUF file: {e}") from e
        return backend
    if tok["tokenizer_type"] != "gpt2":
        raise ValueError(
            f"GGUF tokenizer type {tok['tokenizer_type']!r} needs transformers' GGUF tokenizer "
            "converter, which this transformers version lacks; only 'gpt2' (byte-level BPE) is "
            "built without it."
        )
    logger.warning("transformers' GGUF tokenizer converter is unavailable; using jaxserve's own")
    return _byte_level_backend(tok)


def build_tokenizer(
    reader: gguf.GGUFReader, model_max_length: int | None = None
) -> PreTrainedTokenizerFast:
    """The HF fast tokenizer a GGUF file describes (not saved)."""
    from transformers import PreTrainedTokenizerFast

    from jaxserve.models.gguf_loader import metadata_value

    tok, cfg = tokenizer_metadata(reader)
    backend = build_backend(metadata_value(reader, "general.architecture"), tok)
    types = tok.get("token_type") or ()
    control = [t for t, ty in zip(tok["tokens"], types) if ty == TOKEN_TYPE_CONTROL]
    named = {cfg[k] for k in _SPECIAL_IDS if cfg.get(k) is not None}
    vocab = backend.get_vocab(with_added_tokens=True)
    extra = [t for t in control if t not in named and t in vocab]
    kwargs: dict[str, Any] = dict(cfg)
    kwargs.update(
        extra_special_tokens=extra,
        clean_up_tokenization_spaces=False,
        add_bos_token=cfg.get("add_bos_token", False),
        add_eos_token=cfg.get("add_eos_token", False),
    )
    if model_max_length:
        kwargs["model_max_length"] = model_max_length
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


def save_tokenizer(reader: gguf.GGUFReader, out_dir: pathlib.Path, config: dict[str, Any]) -> None:
    """Write tokenizer.json, tokenizer_config.json (with chat_template), chat_template.jinja and
    special_tokens_map.json for a GGUF file into `out_dir`."""
    tokenizer = build_tokenizer(reader, config.get("max_position_embeddings"))
    tokenizer.save_pretrained(out_dir)
    path = out_dir / "tokenizer_config.json"
    tcfg = json.loads(path.read_text())
    # tools that predate chat_template.jinja read the template from here; same text either way
    if tokenizer.chat_template is not None:
        tcfg["chat_template"] = tokenizer.chat_template
    tcfg["add_bos_token"] = bool(tokenizer.add_bos_token)
    tcfg["add_eos_token"] = bool(tokenizer.add_eos_token)
    tcfg["clean_up_tokenization_spaces"] = False
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(tcfg, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
    special = {
        name: getattr(tokenizer, name)
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        if getattr(tokenizer, name, None) is not None
    }
    if tokenizer.extra_special_tokens:
        special["additional_special_tokens"] = [str(t) for t in tokenizer.extra_special_tokens]
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps(special, indent=2, ensure_ascii=False) + "\n"
    )
