"""Embeddings (--runner pooling) against sentence-transformers on PyTorch, for a host that has
torch, transformers and sentence-transformers (the GPU device check's machine has all three).

Builds tiny random decoders with transformers (a Qwen3 with last-token pooling and Normalize, a
Llama with mean pooling and no Normalize), wraps each in a SentenceTransformer and saves it:
the directory is then a real sentence-transformers checkpoint (modules.json, 1_Pooling/, the
base model's weights without `model.` prefix or lm_head), which jaxserve loads with
`runner="auto"`. The reference is the SentenceTransformer's own forward on each prompt's token
ids (float32); jaxserve embeds the same ids on this machine's default backend in float32 and
bfloat16. One JSON line per (model, dtype): the least cosine over the prompts, and the largest
difference between a batch and its prompts alone.

    python benchmarks/embedding_parity.py [--out DIR]   # min cosine: float32 0.9999, bf16 0.99
    python benchmarks/embedding_parity.py --rehearse    # no torch: the jaxserve half only

On the device machine (its python3 lacks llguidance and gguf: carry them, e.g. copied into an
ignored folder): `pip install --no-deps --no-build-isolation -e . && PYTHONPATH=<that folder>
python3 benchmarks/embedding_parity.py --out $OUT`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import numpy as np

from results_log import append_results

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VOCAB = 512
SHAPE = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=512)
CASES = [("qwen3", "lasttoken", True), ("llama", "mean", False)]
MIN_COSINE = {"float32": 0.9999, "bfloat16": 0.99}


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in (1, 7, 64, 200, 33, 128, 2, 255)]


def sentence_transformer_dir(family: str, pooling: str, normalize: bool, dst: pathlib.Path):
    """A random model saved as a sentence-transformers checkpoint; returns the model (eval)."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    from tests.model_dirs import word_tokenizer

    torch.manual_seed(0)
    config_class = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[family]
    causal = {"qwen3": transformers.Qwen3ForCausalLM,
              "llama": transformers.LlamaForCausalLM}[family]
    lm_dir = dst.parent / f"{dst.name}-lm"
    causal(config_class(**SHAPE, tie_word_embeddings=False)).float().save_pretrained(lm_dir)
    tok = word_tokenizer(VOCAB)
    tok.pad_token = "<unk>"
    tok.save_pretrained(lm_dir)
    modules = [models.Transformer(str(lm_dir)),
               models.Pooling(SHAPE["hidden_size"], pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    st = SentenceTransformer(modules=modules, device="cuda" if torch.cuda.is_available() else "cpu")
    st.save(str(dst))
    config = json.loads((dst / "config.json").read_text())
    config.pop("model_type", None)  # (the word-level tokenizer, as tests/model_dirs.py does)
    (dst / "config.json").write_text(json.dumps(config))
    return st.eval()


def reference(st, ids: list[list[int]]) -> np.ndarray:
    import torch

    out = []
    with torch.no_grad():
        for p in ids:
            t = torch.tensor([p], device=st.device)
            emb = st({"input_ids": t, "attention_mask": torch.ones_like(t)})["sentence_embedding"]
            out.append(emb[0].float().cpu().numpy())
    return np.asarray(out)


def jaxserve_embeddings(model_dir: pathlib.Path, dtype: str, ids: list[list[int]], runner: str):
    from jaxserve import LLM

    llm = LLM(str(model_dir), runner=runner, dtype=dtype, max_model_len=256, max_num_seqs=4,
              show_progress=False)
    together = np.asarray([o.outputs.embedding for o in llm.embed(ids)])
    alone = np.asarray([llm.embed([p])[0].outputs.embedding for p in ids])
    return together, float(np.abs(together - alone).max()), llm.engine.num_compiles_after_warmup


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--rehearse", action="store_true", help="no torch: jaxserve on a test fixture")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import jax

    ids, ok, lines = prompts(), True, []
    with tempfile.TemporaryDirectory() as tmp:
        for family, pooling, normalize in CASES:
            d = pathlib.Path(tmp) / family
            if args.rehearse:
                from tests.model_dirs import write_model_dir

                # the test fixture (128 ids), no sentence-transformers files: last token, normalized
                d, ref, runner = write_model_dir(d, family), None, "pooling"
                pooling, normalize = "lasttoken", True
                run_ids = [[t % 128 for t in p][:32] for p in ids]
            else:
                st = sentence_transformer_dir(family, pooling, normalize, d)
                ref, runner, run_ids = reference(st, ids), "auto", ids
            for dtype in ("float32", "bfloat16"):
                line = {"model": family, "pooling": pooling, "normalize": normalize, "dtype": dtype,
                        "backend": jax.default_backend()}
                try:
                    emb, batch_diff, recompiles = jaxserve_embeddings(d, dtype, run_ids, runner)
                    line.update(batch_vs_alone=batch_diff, recompiles=recompiles)
                    if ref is not None:
                        line["min_cosine"] = float(cosines(emb, ref).min())
                        line["ok"] = line["min_cosine"] >= MIN_COSINE[dtype] and recompiles == 0
                    else:
                        line["ok"] = bool(np.isfinite(emb).all()) and recompiles == 0
                except Exception as e:  # noqa: BLE001 - recorded, the other cases still run
                    line.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
                ok &= line["ok"]
                lines.append(line)
                print(json.dumps(line), flush=True)
    append_results(args.out / "embedding_parity.jsonl", lines)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
