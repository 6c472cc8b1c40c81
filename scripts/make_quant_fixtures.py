"""Regenerate the quantized-checkpoint fixtures in tests/data/quant/ with the tools that write
such checkpoints (llm-compressor and compressed-tensors; torch on the CPU). The project's tests
read the files and need neither torch nor these tools.

A tiny random Llama (2 layers, hidden 64, MLP 128, vocab 128: every ASCII byte is a token) is
quantized by llm-compressor for each scheme below and saved as llm-compressor saves it
(`save_pretrained(save_compressed=True)`), data-free where the scheme allows (round to nearest
with the weights' own min/max; dynamic activation scales), with a few calibration sentences
(their ASCII bytes as token ids) where it needs data: GPTQ, and static activation scales.
Beside each checkpoint:
- reference.safetensors: every decoder Linear weight as compressed-tensors' own decompressor
  gives it back (transformers' loader with `CompressedTensorsConfig(run_compressed=False)`),
  float32, [out, in]; the tests compare jaxserve against a float model of these weights, so a
  misreading of the format shared by a writer and a reader in this project cannot pass.
- expected.safetensors: the token sequences the tests run, and transformers' float32 logits of
  the model with those decompressed weights (weight-only; activations unquantized).

    python3 -m venv /tmp/tools && /tmp/tools/bin/pip install torch==2.13.0  # the CPU build
    /tmp/tools/bin/pip install llmcompressor==0.14.0.1   # compressed-tensors 0.19.0
    /tmp/tools/bin/python scripts/make_quant_fixtures.py [--only NAME ...]

`--default-model DIR --source SRC [--scheme NAME]` instead quantizes the default model
(SmolLM2-135M-Instruct in float32; SRC is its HF directory as jaxserve converts it from the
GGUF: `python -c "from jaxserve.models.loader import resolve_model; print(resolve_model(None))"`
in the project's environment) with one scheme into DIR, with its reference.safetensors beside
it (groups of 64: its hidden size 576 takes 64, not the presets' 128): too large to commit;
`benchmarks/quant_parity.py` reads it.

`--awq` writes the AutoAWQ fixture (AutoAWQ 0.2.9 installed beside llm-compressor),
`--gptqmodel` the GPTQModel one (GPTQModel 7.7.0 in an environment of its own: it needs torch
2.14.1 and a newer transformers), and the actorder "group" fixture needs llm-compressor 0.8.1
(`--only w4a16-gptq-actorder`): tests/data/quant/README.md says why, and how each tool ran.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import tempfile

import numpy as np
import torch
from safetensors.numpy import save_file

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "quant"

TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False, rope_theta=10000.0, initializer_range=0.1,
            torch_dtype="float32")

CALIBRATION = [
    "The quick brown fox jumps over the lazy dog.",
    "Quantized weights keep four or eight bits of each value and a scale per group.",
    "A language model predicts the next token from the ones before it.",
    "Servers batch many requests into one step on the accelerator.",
    "Rain fell on the old stone bridge while the river rose.",
    "Numbers: 3.14159, 2.71828, 1.41421 and 42 are written here.",
    "print('hello, world')  # a line of Python",
    "She sold sea shells by the sea shore; the shells she sold were surely sea shells.",
]

# The sequences the tests run (token ids < 128), and the greedy continuation's prompt.
SEQUENCES = ["Quantization keeps the model small.", "jaxserve serves models"]


def _w(bits, strategy, group=None, symmetric=True, type_="int", actorder=None):
    args = dict(num_bits=bits, type=type_, symmetric=symmetric, strategy=strategy)
    if group is not None:
        args["group_size"] = group
    if actorder is not None:
        args["actorder"] = actorder
    return args


def _a(type_, strategy, dynamic):
    return dict(num_bits=8, type=type_, symmetric=True, strategy=strategy, dynamic=dynamic)


# name -> (weights, input activations or None, algorithm, format override or None)
SCHEMES: dict[str, tuple] = {
    # W4A16 (the Hub's most common vLLM format) with groups of 32 (the presets' 128 does not
    # divide this model's dims): pack-quantized, symmetric
    "w4a16": (_w(4, "group", 32), None, "rtn", None),
    # W4A16_ASYM: zero points, packed along the outputs
    "w4a16-asym": (_w(4, "group", 32, symmetric=False), None, "rtn", None),
    "w4a16-channel": (_w(4, "channel"), None, "rtn", None),
    # GPTQ (actorder "weight": columns visited in the Hessian's order, groups kept in order)
    "w4a16-gptq": (_w(4, "group", 32, actorder="weight"), None, "gptq", None),
    # actorder "group": inputs assigned to groups in the Hessian's order (weight_g_idx).
    # compressed-tensors 0.13 and later refuse it ("has been removed"), but checkpoints on the
    # Hub carry it: this one is written with llm-compressor 0.8.1 (compressed-tensors 0.12.2)
    "w4a16-gptq-actorder": (_w(4, "group", 32, actorder="group"), None, "gptq", None),
    # W8A16: 8-bit, per channel, pack-quantized (four values an int32)
    "w8a16": (_w(8, "channel"), None, "rtn", None),
    "w8a16-asym-group": (_w(8, "group", 32, symmetric=False), None, "rtn", None),
    # the same values one int8 each
    "w8a16-naive": (_w(8, "channel"), None, "rtn", "naive-quantized"),
    "w4a16-naive-asym": (_w(4, "group", 32, symmetric=False), None, "rtn", "naive-quantized"),
    # W8A8 int8: per-token dynamic activations (int-quantized), and static per-tensor ones
    "w8a8": (_w(8, "channel"), _a("int", "token", True), "rtn", None),
    "w8a8-static": (_w(8, "channel"), _a("int", "tensor", False), "rtn", None),
    # FP8 W8A8: FP8_DYNAMIC (per channel, per-token activations) and FP8 static (per tensor,
    # a calibrated input_scale)
    "fp8-dynamic": (_w(8, "channel", type_="float"), _a("float", "token", True), "rtn", None),
    "fp8-static": (_w(8, "tensor", type_="float"), _a("float", "tensor", False), "rtn", None),
}


def tokens(text: str) -> list[int]:
    return list(text.encode("ascii"))


def tiny_model(seed: int = 0, **config):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{k: v for k, v in {**TINY, **config}.items()
                         if k not in ("model_type", "torch_dtype")})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval()


def char_tokenizer():
    """One token a printable ASCII character (its code), <unk>=0, <s>=1, </s>=2: what
    llm-compressor's calibration asks for, and what `jaxserve serve` reads with the fixture."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(i): i for i in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return fast


def saved_tiny_model(tmp: pathlib.Path):
    """The tiny random model as llm-compressor takes it: loaded from a directory (it reads
    the config on disk)."""
    from transformers import AutoModelForCausalLM

    if not (tmp / "config.json").exists():
        tiny_model().save_pretrained(tmp)
        char_tokenizer().save_pretrained(tmp)
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def calibration_dataset(texts=CALIBRATION, tokenizer=None):
    from datasets import Dataset

    ids = [tokenizer(t)["input_ids"] for t in texts]
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})


def needs_data(weights, activations, algorithm) -> bool:
    return algorithm == "gptq" or (activations is not None and not activations["dynamic"])


def quantize(model, name: str, out: pathlib.Path, tokenizer=None) -> None:
    """Run llm-compressor's scheme `name` on `model` and save the compressed checkpoint."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    weights, activations, algorithm, fmt = SCHEMES[name]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                                input_activations=None if activations is None
                                else QuantizationArgs(**activations))
    groups = {"group_0": scheme}
    if algorithm == "gptq":
        recipe = GPTQModifier(config_groups=groups, ignore=["lm_head"], block_size=32,
                              dampening_frac=0.01)
    else:
        recipe = QuantizationModifier(config_groups=groups, ignore=["lm_head"])
    kwargs = {}
    if needs_data(weights, activations, algorithm):
        kwargs = dict(dataset=calibration_dataset(tokenizer=tokenizer), processor=tokenizer,
                      num_calibration_samples=len(CALIBRATION), max_seq_length=64)
    oneshot(model=model, recipe=recipe, **kwargs)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, save_compressed=True, quantization_format=fmt)


def decompressed(path: pathlib.Path):
    """The checkpoint at `path` decompressed to float32 weights by compressed-tensors: through
    transformers' loader (`CompressedTensorsConfig(run_compressed=False)`), or, where that
    loader fails (transformers 4.56 with compressed-tensors 0.12 on a CPU: "Tensor.item()
    cannot be called on meta tensors"), by `ModelCompressor.decompress` into a float model of
    the checkpoint's config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    try:
        return AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32,
            quantization_config=CompressedTensorsConfig(run_compressed=False))
    except RuntimeError as e:
        if "meta tensors" not in str(e):
            raise
    from compressed_tensors.compressors import ModelCompressor

    config = AutoConfig.from_pretrained(path)
    qc = config.quantization_config
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
    compressor = ModelCompressor.from_compression_config(qc)
    compressor.decompress(model_path=str(path), model=model)
    return model


def write_reference(path: pathlib.Path, seqs: list[list[int]] | None) -> None:
    """reference.safetensors: the decompressed Linear weights; then, for `seqs`,
    expected.safetensors (see `write_expected`)."""
    model = decompressed(path)
    state = {k: v.detach().to(torch.float32).numpy().copy() for k, v in model.state_dict().items()}
    linear = {k: v for k, v in state.items()
              if k.endswith("_proj.weight") and ".layers." in k}
    save_file(linear, str(path / "reference.safetensors"))
    if seqs is not None:
        write_expected(path, seqs)


def write_expected(path: pathlib.Path, seqs: list[list[int]], **config) -> None:
    """expected.safetensors: `seqs` and the float32 logits of the tiny model (transformers)
    with the checkpoint's float tensors and reference.safetensors' weights."""
    from safetensors import safe_open

    weights = {}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            if t.is_floating_point() and k.endswith("weight"):
                weights[k] = t
    with safe_open(str(path / "reference.safetensors"), "pt") as f:
        weights.update({k: f.get_tensor(k) for k in f.keys()})
    float_model = tiny_model(**config)
    missing, unexpected = float_model.load_state_dict(weights, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    expected = {}
    with torch.no_grad():
        for i, s in enumerate(seqs):
            expected[f"tokens_{i}"] = np.asarray(s, np.int32)
            logits = float_model(torch.tensor([s])).logits[0]
            expected[f"logits_{i}"] = logits.numpy().astype(np.float32)
    save_file(expected, str(path / "expected.safetensors"))


def make_tiny(names: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    base = pathlib.Path(tempfile.mkdtemp(prefix="tiny-llama-"))
    for name in names:
        model = saved_tiny_model(base)
        quantize(model, name, OUT / name, tokenizer=char_tokenizer())
        char_tokenizer().save_pretrained(OUT / name)
        for extra in ("recipe.yaml", "special_tokens_map.json"):
            (OUT / name / extra).unlink(missing_ok=True)
        write_reference(OUT / name, [tokens(s) for s in SEQUENCES])
        cfg = json.loads((OUT / name / "config.json").read_text())
        print(name, cfg["quantization_config"]["format"],
              sorted({k.split(".")[-1] for k in _tensor_names(OUT / name / "model.safetensors")}))


def _tensor_names(path: pathlib.Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "np") as f:
        return list(f.keys())


def make_awq(out: pathlib.Path, base: pathlib.Path) -> None:
    """AutoAWQ (0.2.9) on the CPU: its activation-aware scale search on the calibration
    sentences, then WQLinear_GEMM's packing, saved by `save_quantized`. The tiny model here has
    4 KV heads: AutoAWQ's clipping search takes output channels in batches of 64. The
    reference is AutoAWQ's own `dequantize_gemm` with the scales in float32."""
    from awq import AutoAWQForCausalLM
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors import safe_open

    if not (base / "config.json").exists():
        torch.manual_seed(0)
        from transformers import AutoModelForCausalLM, LlamaConfig

        cfg = LlamaConfig(**{k: v for k, v in TINY.items() if k not in ("model_type", "torch_dtype")})
        cfg.num_key_value_heads = 4
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(base)
        char_tokenizer().save_pretrained(base)
    model = AutoAWQForCausalLM.from_pretrained(str(base), device_map="cpu", dtype=torch.float32)
    model.quantize(char_tokenizer(), quant_config={"zero_point": True, "q_group_size": 32,
                                                   "w_bit": 4, "version": "GEMM"},
                   calib_data=CALIBRATION * 4, max_calib_samples=32, max_calib_seq_len=64)
    if out.exists():
        shutil.rmtree(out)
    model.save_quantized(str(out))
    char_tokenizer().save_pretrained(out)
    reference = {}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        for k in f.keys():
            if k.endswith(".qweight"):
                b = k.removesuffix(".qweight")
                w = dequantize_gemm(f.get_tensor(k), f.get_tensor(b + ".qzeros"),
                                    f.get_tensor(b + ".scales").float(), 4, 32)
                reference[b + ".weight"] = w.T.contiguous().numpy().astype(np.float32)
    save_file(reference, str(out / "reference.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    write_expected(out, [tokens(s) for s in SEQUENCES], num_key_value_heads=cfg["num_key_value_heads"])


def make_gptqmodel(out: pathlib.Path, base: pathlib.Path) -> None:
    """GPTQModel (7.7.0, in an environment of its own: it needs torch >= 2.14.1 and
    transformers >= 5.20) on the CPU: GPTQ with desc_act (act-order: `g_idx` assigns the
    inputs to groups in the Hessian's order), 4-bit symmetric, groups of 32, on the
    calibration sentences. On a 2-core host it needs GPTQMODEL_CPU_WORKERS=2 (set here): its
    default gives the CPU pool one worker and then asks two of it for the model loader
    ("Virtual pool 'model_loader:cpu' requests 2 workers but parent 'cpu' only has 1"). The
    reference is GPTQModel's own `dequantize_weight` (torch kernel) with float32 scales."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

    if not (base / "config.json").exists():
        tiny_model().save_pretrained(base)
        char_tokenizer().save_pretrained(base)
    model = GPTQModel.load(str(base), QuantizeConfig(bits=4, group_size=32, desc_act=True, sym=True),
                           device="cpu", dtype=torch.float32)
    tok = char_tokenizer()
    calib = [{"input_ids": tok(t)["input_ids"], "attention_mask": [1] * len(tok(t)["input_ids"])}
             for t in CALIBRATION]
    model.quantize(calib, batch_size=1)
    if out.exists():
        shutil.rmtree(out)
    model.save(str(out))
    for extra in ("quant_log.csv", "quantize_config.json"):
        (out / extra).unlink(missing_ok=True)
    char_tokenizer().save_pretrained(out)
    # its torch kernel takes float16 or bfloat16 only: float16 holds the stored scales exactly
    quantized = GPTQModel.load(str(out), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    reference = {}
    for name, module in quantized.model.named_modules():
        if hasattr(module, "dequantize_weight") and hasattr(module, "qweight"):
            module.scales = module.scales.float()
            w = module.dequantize_weight()  # [in, out]
            reference[name + ".weight"] = w.T.contiguous().numpy().astype(np.float32)
    save_file(reference, str(out / "reference.safetensors"))
    write_expected(out, [tokens(s) for s in SEQUENCES])


def make_default(out: pathlib.Path, scheme: str, source: pathlib.Path) -> None:
    """The default model (an HF directory converted from its GGUF: `source`) quantized with
    `scheme` into `out`, with the tokenizer and reference.safetensors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except AttributeError:  # transformers 4.x cannot read a tokenizer_config 5.x wrote
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_file(str(source / "tokenizer.json")))
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    weights, activations, algorithm, fmt = SCHEMES[scheme]
    if weights.get("group_size") == 32:  # SmolLM2's 576 takes groups of 64, not 128
        weights = dict(weights, group_size=64)
        SCHEMES[scheme] = (weights, activations, algorithm, fmt)
    quantize(model, scheme, out, tokenizer=tokenizer)
    for f in source.iterdir():  # the source's own tokenizer files
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    (out / "recipe.yaml").unlink(missing_ok=True)
    write_reference(out, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=list(SCHEMES), help="schemes to regenerate")
    ap.add_argument("--default-model", type=pathlib.Path, help="quantize the default model into DIR")
    ap.add_argument("--source", type=pathlib.Path, help="the default model's converted HF directory")
    ap.add_argument("--scheme", default="w4a16", choices=list(SCHEMES))
    ap.add_argument("--awq", action="store_true", help="write the AutoAWQ fixture (awq/)")
    ap.add_argument("--gptqmodel", action="store_true",
                    help="write the GPTQModel fixture (gptq-desc-act/)")
    ap.add_argument("--expected-only", action="store_true",
                    help="rewrite expected.safetensors of the fixtures from their files")
    args = ap.parse_args()
    for a in ("default_model", "source"):
        if getattr(args, a) is not None:
            setattr(args, a, getattr(args, a).resolve())
    os.chdir(tempfile.mkdtemp(prefix="quant-fixtures-"))  # llm-compressor logs into the cwd
    torch.set_num_threads(2)
    if args.gptqmodel:
        make_gptqmodel(OUT / "gptq-desc-act", pathlib.Path(tempfile.mkdtemp(prefix="tiny-llama-")))
        return
    if args.awq:
        make_awq(OUT / "awq", pathlib.Path(tempfile.mkdtemp(prefix="tiny-llama-kv4-")))
        return
    if args.expected_only:
        for name in args.only or list(SCHEMES):
            write_expected(OUT / name, [tokens(s) for s in SEQUENCES])
        return
    if args.default_model is not None:
        make_default(args.default_model, args.scheme, args.source)
        return
    make_tiny(args.only or list(SCHEMES))


if __name__ == "__main__":
    main()
