"""Grammar engines for structured output, measured on the default model's tokenizer.

For each engine that imports (llguidance, xgrammar, outlines-core), on SmolLM2's tokenizer
(49,152 tokens):

1. vocabulary preprocessing: what must happen once per tokenizer before any grammar compiles
   (llguidance: LLTokenizer; xgrammar: TokenizerInfo + GrammarCompiler; outlines-core: the
   Vocabulary from the byte-level tokens);
2. compile time of a typical JSON schema (a cold compile, and the median over the schemas);
3. mask time per token with 32 concurrent requests: 32 matchers walk valid instances of the
   schemas (their canonical tokenization) in lock step; each step fills the [32, V/32] int32
   bitmask (batched where the engine offers it) and accepts one token each; a request that
   reaches its end is replaced by a new one (new matcher time included), so 32 stay active.

All three use the same JSON layout (", " and ": " separators, no free whitespace), the one the
server asks for. Run it in an environment that has the engines (xgrammar needs torch):

    python benchmarks/grammar_engines.py [--tokenizer DIR] [--engines llguidance xgrammar outlines]

One JSON line per engine goes to benchmarks/results/grammar_engines.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import time

import numpy as np

from results_log import append_results

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "grammar_engines.jsonl"

# A typical schema: a nested object, an enum, an array, bounded numbers, a bounded string.
TYPICAL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role", "tags", "address", "score"],
    "additionalProperties": False,
}
TYPICAL_INSTANCE = {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry"],
                    "address": {"city": "London", "zip": "10001"}, "score": 0.75}

OTHERS = [
    ({"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
      "required": ["city", "unit"], "additionalProperties": False},
     {"city": "Paris", "unit": "c"}),
    ({"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
        "required": ["sku", "qty"], "additionalProperties": False}}, "total": {"type": "number"}},
      "required": ["items", "total"], "additionalProperties": False},
     {"items": [{"sku": "A-1", "qty": 2}, {"sku": "B-7", "qty": 1}], "total": 31.5}),
    ({"type": "array", "items": {"type": "integer", "minimum": -100, "maximum": 100}, "minItems": 1, "maxItems": 10},
     [3, -7, 42, 0, 99]),
    ({"type": "object", "properties": {"ok": {"type": "boolean"}, "reason": {"type": ["string", "null"]}},
      "required": ["ok", "reason"], "additionalProperties": False},
     {"ok": False, "reason": None}),
    # free text: inside the string most of the vocabulary is allowed at each step
    ({"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                       "text": {"type": "string", "maxLength": 300}},
      "required": ["title", "text"], "additionalProperties": False},
     {"title": "A walk", "text": "The quick brown fox jumps over the lazy dog while the cat watches from the "
                                 "window, thinking about dinner and the weather in Paris and Rome."}),
]
CASES = [(TYPICAL, TYPICAL_INSTANCE), *OTHERS]
SEPARATORS = (", ", ": ")


def dump(value) -> str:
    return json.dumps(value, separators=SEPARATORS, ensure_ascii=False)


def load_tokenizer(path: str | None):
    if path is None:
        from jaxserve.models.loader import load_tokenizer as jl, resolve_model

        return jl(resolve_model(None))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------------------- engines
class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab_size: int, eos: int, threads: int):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.ll, self.np = llguidance, llguidance.numpy
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema):
        opts = {"whitespace_flexible": False, "item_separator": SEPARATORS[0], "key_separator": SEPARATORS[1]}
        g = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=opts)
        m = self.ll.LLMatcher(self.tok, g, log_level=0)
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers, rows, bitmask):
        self.np.fill_next_token_bitmask_par(self.executor, list(zip(matchers, rows)), bitmask)

    def accept(self, m, tok) -> bool:
        return m.consume_token(tok)


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab_size: int, eos: int, threads: int):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers, rows, bitmask):
        import torch

        t = torch.from_numpy(bitmask)
        self.batch.batch_fill_next_token_bitmask(matchers, t, rows)

    def accept(self, m, tok) -> bool:
        return m.accept_token(tok)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: token characters -> bytes."""
    from jaxserve.models.gguf_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


class Outlines:
    name = "outlines-core"

    def __init__(self, hf, vocab_size: int, eos: int, threads: int):
        import outlines_core

        self.oc = outlines_core
        dec = _byte_decoder()
        special = set(hf.all_special_ids)
        vocab: dict[bytes, list[int]] = {}
        for tid, tok in enumerate(hf.convert_ids_to_tokens(list(range(len(hf))))):
            if tid in special or tok is None:
                continue
            vocab.setdefault(bytes(dec[c] for c in tok), []).append(tid)
        self.vocab = outlines_core.Vocabulary(eos, vocab)
        self.words = (vocab_size + 31) // 32

    def compile(self, schema):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern=r"[ ]?")
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, matchers, rows, bitmask):
        for m, r in zip(matchers, rows):
            row = bitmask[r]
            m.write_mask_into(row.ctypes.data, row.size, 4)

    def accept(self, m, tok) -> bool:
        m.advance(tok)
        return True


ENGINES = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines": Outlines}


# ---------------------------------------------------------------------------- measurement
def measure(cls, hf, args) -> dict:
    V = args.vocab_size or len(hf)
    eos = hf.eos_token_id
    t0 = time.perf_counter()
    eng = cls(hf, V, eos, args.threads)
    prep = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = [eng.compile(CASES[0][0])]
    cold = time.perf_counter() - t0
    times = []
    for schema, _ in CASES[1:]:
        t0 = time.perf_counter()
        compiled.append(eng.compile(schema))
        times.append(time.perf_counter() - t0)
    # the typical schema again, for a warm figure (engines with caches answer from them)
    t0 = time.perf_counter()
    eng.compile({**TYPICAL, "title": "again"})
    warm = time.perf_counter() - t0
    seqs = [hf.encode(dump(inst), add_special_tokens=False) + [eos] for _, inst in CASES]
    B, W = args.batch, (V + 31) // 32
    bitmask = np.full((B, W), -1, np.int32)
    step_times = []
    for _ in range(args.repeats):
        ms = [eng.matcher(compiled[i % len(CASES)]) for i in range(B)]
        toks = [seqs[i % len(CASES)] for i in range(B)]
        # offset the requests so that they are at different places of their documents
        pos = [(i * 3) % max(1, len(toks[i]) // 2) for i in range(B)]
        for i in range(B):
            for t in toks[i][: pos[i]]:
                assert eng.accept(ms[i], t)
        rows = list(range(B))
        for _ in range(args.steps):
            t0 = time.perf_counter()
            eng.fill(ms, rows, bitmask)
            for i in rows:
                tok = toks[i][pos[i]]
                allowed = (bitmask[i, tok >> 5] >> (tok & 31)) & 1
                assert allowed, f"{eng.name}: token {tok} of case {i % len(CASES)} masked at {pos[i]}"
                if tok != eos:
                    assert eng.accept(ms[i], tok)
                pos[i] += 1
            step_times.append(time.perf_counter() - t0)
            for i in rows:  # a finished request is replaced by a new one: 32 stay active
                if pos[i] == len(toks[i]):
                    ms[i], pos[i] = eng.matcher(compiled[i % len(CASES)]), 0
    step = statistics.median(step_times)
    return {
        "engine": eng.name,
        "vocab_size": V,
        "vocab_preprocess_s": round(prep, 4),
        "compile_typical_cold_s": round(cold, 4),
        "compile_median_s": round(statistics.median(times), 4),
        "compile_typical_again_s": round(warm, 4),
        "batch": B,
        "steps": len(step_times),
        "mask_step_ms_median": round(step * 1e3, 3),
        "mask_per_token_us": round(step / B * 1e6, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: the bundled model's)")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200, help="steps per repeat, 32 requests active in each")
    ap.add_argument("--threads", type=int, default=2, help="mask threads for engines that batch")
    ap.add_argument("--vocab-size", type=int, default=None, help="bitmask width in tokens (default: tokenizer)")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    hf = load_tokenizer(args.tokenizer)
    for name in args.engines:
        try:
            row = measure(ENGINES[name], hf, args)
        except ImportError as e:
            print(json.dumps({"engine": name, "skipped": str(e)}))
            continue
        row.update(date=datetime.date.today().isoformat(), cpus=os.cpu_count(),
                   load=round(os.getloadavg()[0], 2))
        print(json.dumps(row))
        if not args.no_save:
            append_results(RESULTS, row)


if __name__ == "__main__":
    main()
