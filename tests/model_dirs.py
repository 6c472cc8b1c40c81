"""Tiny servable model directories for engine and server tests: a random architecture fixture
(tests/data/arch/<name>) with a word-level tokenizer over its 128-token vocabulary ("w3" …
"w127", plus <unk>=0, <s>=1, </s>=2) and a plain chat template, so that the real engine loads
and compiles it in seconds. `write_reasoning_model_dir` makes a reasoning model (below)."""

from __future__ import annotations

import itertools
import json
import pathlib
import shutil

DATA = pathlib.Path(__file__).parent / "data" / "arch"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def word_tokenizer(vocab_size: int = 128):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_model_dir(dst: pathlib.Path, fixture: str = "llama", *,
                    generation_config: dict | None = None) -> pathlib.Path:
    """A model directory in `dst` from the fixture, with a tokenizer; `generation_config`
    replaces the fixture's generation_config.json."""
    dst.mkdir(parents=True, exist_ok=True)
    src = DATA / fixture
    for name in ("model.safetensors", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    # Without model_type: transformers would load the family's own tokenizer class (e.g.
    # Qwen2's BPE) over the word-level tokenizer; the engine reads `architectures`.
    config = json.loads((src / "config.json").read_text())
    config.pop("model_type", None)
    (dst / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation_config))
    word_tokenizer(json.loads((src / "config.json").read_text())["vocab_size"]).save_pretrained(dst)
    return dst


# ---------------------------------------------------------------------------- a reasoning model
# A tiny reasoning model whose greedy output is known: its weights make a lookup table (the
# layers' output projections are zero, so the residual stream is the last token's embedding, and
# the untied LM head scores token j by the embeddings of the tokens that lead to it), so greedy
# decoding follows REASONING_CHAINS whatever came before the last token. Its tokenizer is
# byte-level (llguidance reads it: structured output works) over whole words: " w10" ... " w125"
# are ids 10..125, a few other pieces are 3..9, and `<think>` / `</think>` are 126 / 127, added
# tokens that are not special (as in Qwen3's and DeepSeek-R1's tokenizers: they survive
# skip_special_tokens).
THINK, END_THINK = 126, 127
TOOL_CALLS = {  # hermes tool calls, one token each
    8: '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    9: '<tool_call>{"name": "get_time", "arguments": {"city": "Tokyo"}}</tool_call>',
}
PIECES = {3: "\n", 4: "\n\n", 5: '"', 6: "</th", 7: "ink>", **TOOL_CALLS}
REASONING_CHAINS = [  # token -> the next one, greedily
    # Qwen3's generation prompt ends with " w10": reasoning (with a tool call in it), </think>,
    # then the answer (another tool call) and EOS
    [10, 20, 8, 21, END_THINK, 4, 30, 9, 2],
    [3, 50, 51, END_THINK],  # R1's generation prompt ends with "<think>\n"
    [55, 56, 6, 7, 57, 2],  # " w55" continued: "</think>" written in two ordinary tokens
]
# Qwen3's template in miniature: the generation prompt is " w10"; with enable_thinking false it
# closes reasoning in the prompt ("<think>\n\n</think>\n\n"), as Qwen3's does; an assistant turn
# after the last user turn shows its reasoning_content (Qwen3's keeps the current turn's only).
QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 > ns.last_user and m.reasoning_content -%}"
    "{{ '<think> ' + m.reasoning_content + '</think>' }}{%- endif -%}"
    "{{ ' ' + m['content'] }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ ' w10' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{ '<think>\n\n</think>\n\n' }}{%- endif -%}"
    "{%- endif -%}")
# DeepSeek-R1's: the generation prompt opens reasoning (" w10<think>\n").
R1_TEMPLATE = ("{%- for m in messages -%}{{ ' ' + m['content'] }}{%- endfor -%}"
               "{%- if add_generation_prompt -%}{{ ' w10<think>\n' }}{%- endif -%}")


def reasoning_tokenizer(template: str = QWEN3_TEMPLATE):
    """The reasoning model's tokenizer (see above), with `template` as its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"Ġw{i}": i for i in range(10, THINK)}}
    for i, text in PIECES.items():
        vocab["".join(t for t, _ in byte_level.pre_tokenize_str(text))] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "merged_with_next"),
                                                 byte_level])  # " w10" -> "Ġw10"
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.add_tokens([AddedToken("<think>", special=False, normalized=False),
                     AddedToken("</think>", special=False, normalized=False)])
    assert fast.convert_tokens_to_ids(["<think>", "</think>"]) == [THINK, END_THINK]
    assert len(fast) == 128
    fast.chat_template = template
    return fast


def make_lookup_table(dst: pathlib.Path, chains: list[tuple[list[int], float]],
                      zeroed: tuple[str, ...] = ("o_proj.weight", "down_proj.weight")) -> None:
    """Rewrite dst's model.safetensors into the lookup table: the tensors whose names end with
    `zeroed` (every layer's output projections) set to zero, so that the residual stream is the
    last token's embedding; random embeddings; the final norm's weight one; an untied LM head
    scoring token `nxt` by `weight` times the embedding of each token that leads to it in
    `chains` [(token chain, weight)], so greedy decoding follows the heaviest link out of a
    token whatever came before it."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    tensors = load_file(dst / "model.safetensors")
    vocab, hidden = tensors["model.embed_tokens.weight"].shape
    embed = np.random.default_rng(0).standard_normal((vocab, hidden)).astype(np.float32)
    head = np.zeros_like(embed)
    for chain, weight in chains:
        for token, nxt in itertools.pairwise(chain):
            head[nxt] += weight * embed[token]
    for name, t in tensors.items():
        if name.endswith(zeroed):
            tensors[name] = np.zeros_like(t)  # every layer adds nothing to the residual stream
        elif name == "model.norm.weight":
            tensors[name] = np.ones_like(t)
    tensors.update({"model.embed_tokens.weight": embed, "lm_head.weight": head})
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))


def write_reasoning_model_dir(dst: pathlib.Path, style: str = "qwen3") -> pathlib.Path:
    """The reasoning model's directory: `style` "qwen3" (enable_thinking false closes reasoning
    in the prompt) or "deepseek_r1" (the prompt opens it), from the qwen3 fixture's shapes."""
    write_model_dir(dst, "qwen3")
    make_lookup_table(dst, [(chain, 0.25) for chain in REASONING_CHAINS])
    template = {"qwen3": QWEN3_TEMPLATE, "deepseek_r1": R1_TEMPLATE}[style]
    reasoning_tokenizer(template).save_pretrained(dst)
    return dst
