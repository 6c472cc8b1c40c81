"""Models named by their Hugging Face Hub repository (jaxserve/models/hub.py), without network:
the listing and the download are monkeypatched where the choice of files is checked, and a Hub
cache laid out by hand (models--ORG--NAME/snapshots/<commit>, refs/<branch>) is read with
HF_HUB_OFFLINE on (tests/conftest.py sets it for the whole suite) everywhere else."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

from jaxserve.models import hub, loader

MAIN = "a" * 40
V2 = "b" * 40


def hub_cache(root: pathlib.Path) -> pathlib.Path:
    """$HF_HOME with org/tiny in its hub cache: the llama fixture at main, qwen2 at tag v2."""
    from tests.model_dirs import write_model_dir

    storage = root / "hub" / "models--org--tiny"
    write_model_dir(storage / "snapshots" / MAIN, "llama")
    write_model_dir(storage / "snapshots" / V2, "qwen2")
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(MAIN)
    (storage / "refs" / "v2").write_text(V2)
    return root


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    from huggingface_hub import constants

    home = hub_cache(tmp_path / "hf")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    assert constants.is_offline_mode()
    return home


@pytest.mark.parametrize("name, repo", [
    ("Qwen/Qwen3-8B", True), ("gpt2", True), ("bartowski/X-GGUF:Q4_K_M", True),
    ("/no/such/dir", False), ("./model", False), ("a/b/c", False), ("model.gguf", False),
    ("../x", False), ("org/x:a/b", False),
])
def test_which_names_are_hub_names(name, repo):
    assert hub.is_repo_name(name) is repo


# ----------------------------------------------------------------------------- choosing files

REPO_FILES = [
    ".gitattributes", "README.md", "LICENSE", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "merges.txt",
    "vocab.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    "model.safetensors.index.json", "consolidated.safetensors", "pytorch_model.bin",
    "original/consolidated.00.pth",
    "onnx/model.safetensors", "onnx/config.json",
]
NEEDED = ["config.json", "generation_config.json", "merges.txt", "special_tokens_map.json",
          "tokenizer.json", "tokenizer_config.json", "vocab.json", "model.safetensors.index.json",
          "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
INDEX = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                        "b": "model-00002-of-00002.safetensors",
                                        "c": "model-00002-of-00002.safetensors"}}
GGUF_FILES = [".gitattributes", "README.md", "X-IQ4_XS.gguf", "X-Q4_K_M.gguf", "X-Q4_K_S.gguf",
              "X-Q8_0.gguf", "x-q5_k_m.gguf"]


@pytest.fixture
def online(monkeypatch, tmp_path):
    """The Hub, faked: `listing[repo]` lists a repository; snapshot_download records its
    arguments and returns a folder."""
    import huggingface_hub
    from huggingface_hub import HfApi, constants

    calls: list[dict] = []
    fetched: list[str] = []
    listing: dict[str, list[str] | Exception] = {}

    def list_repo_files(self, repo, *, revision=None, **kw):
        found = listing[repo]
        if isinstance(found, Exception):
            raise found
        return found

    def snapshot_download(repo, **kw):
        calls.append({"repo": repo, **kw})
        return str(tmp_path / "snapshot")

    def hf_hub_download(repo, filename, **kw):
        fetched.append(filename)
        (tmp_path / filename).write_text(json.dumps(INDEX))
        return str(tmp_path / filename)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(HfApi, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    return types.SimpleNamespace(calls=calls, listing=listing, fetched=fetched,
                                 folder=tmp_path / "snapshot")


def test_only_the_needed_files_are_downloaded(online, tmp_path):
    online.listing["org/m"] = REPO_FILES
    assert hub.download("org/m", revision="v1", download_dir=tmp_path / "dl") == online.folder
    [call] = online.calls
    assert call["allow_patterns"] == NEEDED  # the index's shards: no consolidated copy, no .bin
    assert online.fetched == ["model.safetensors.index.json"]
    assert call["revision"] == "v1" and pathlib.Path(call["cache_dir"]) == tmp_path / "dl"
    online.calls.clear()
    hub.download("org/m", config_only=True)  # shard-plan: the configuration alone
    assert online.calls[0]["allow_patterns"] == ["config.json"]


def test_a_gguf_repository_file_by_quant_or_name(online):
    online.listing["org/X-GGUF"] = GGUF_FILES
    assert hub.download("org/X-GGUF:Q4_K_M") == online.folder / "X-Q4_K_M.gguf"
    assert hub.download("org/X-GGUF:Q5_K_M") == online.folder / "x-q5_k_m.gguf"  # any case
    assert hub.download("org/X-GGUF", gguf_file="X-Q8_0.gguf") == online.folder / "X-Q8_0.gguf"
    assert [c["allow_patterns"] for c in online.calls] == [
        ["X-Q4_K_M.gguf"], ["x-q5_k_m.gguf"], ["X-Q8_0.gguf"]]
    with pytest.raises(hub.HubError, match=r"org/X-GGUF has no GGUF file of quant 'Q2_K'.*X-Q8_0"):
        hub.download("org/X-GGUF:Q2_K")
    with pytest.raises(hub.HubError, match="org/X-GGUF has no file 'nope.gguf'"):
        hub.download("org/X-GGUF", gguf_file="nope.gguf")
    with pytest.raises(hub.HubError, match=r"org/X-GGUF has no config.json; .*org/X-GGUF:QUANT"):
        hub.download("org/X-GGUF")
    assert len(online.calls) == 3  # nothing downloaded for the failures


def test_unsharded_weights(online):
    online.listing["org/one"] = ["config.json", "model.safetensors", "consolidated.safetensors"]
    online.listing["org/two"] = ["config.json", "weights.safetensors", "tokenizer.json"]
    hub.download("org/one")
    hub.download("org/two")
    assert [c["allow_patterns"] for c in online.calls] == [
        ["config.json", "model.safetensors"],
        ["config.json", "tokenizer.json", "weights.safetensors"]]
    assert online.fetched == []


def test_a_repository_without_safetensors_is_named(online):
    online.listing["org/old"] = ["config.json", "pytorch_model.bin", "tokenizer.json"]
    with pytest.raises(hub.HubError, match="org/old has no \\*.safetensors weights"):
        hub.download("org/old")


@pytest.mark.parametrize("error, message", [
    ("RepositoryNotFoundError", "org/gone was not found on the Hugging Face Hub.*HF_TOKEN"),
    ("GatedRepoError", "org/gone is gated: .*huggingface.co/org/gone.*HF_TOKEN"),
    ("RevisionNotFoundError", "org/gone has no revision 'v9'"),
])
def test_hub_errors_name_the_repository(online, error, message):
    from huggingface_hub import errors

    response = types.SimpleNamespace(headers={}, request=None)
    online.listing["org/gone"] = getattr(errors, error)("404", response=response)
    with pytest.raises(hub.HubError, match=message):
        hub.download("org/gone", revision="v9")


def test_an_unreachable_hub_falls_back_to_the_cache(online, tmp_path):
    home = hub_cache(tmp_path / "hf")
    online.listing["org/tiny"] = ConnectionError("no route to host")
    online.listing["org/absent"] = ConnectionError("no route to host")
    hub.download("org/tiny", download_dir=home / "hub")
    cached = sorted(p.name for p in (home / "hub/models--org--tiny/snapshots" / MAIN).iterdir())
    assert sorted(online.calls[0]["allow_patterns"]) == cached  # the listing: the cache's
    unreachable = (r"org/absent: the Hugging Face Hub cannot be reached \(ConnectionError: no "
                   r"route to host\) and the model is not in the cache")
    with pytest.raises(hub.HubError, match=unreachable):
        hub.download("org/absent", download_dir=home / "hub")


# ----------------------------------------------------------------------------- the cache, offline


def test_a_hub_name_resolves_to_its_cached_snapshot(hf_home):
    storage = hf_home / "hub" / "models--org--tiny" / "snapshots"
    assert loader.resolve_model("org/tiny") == (storage / MAIN).resolve()
    assert loader.resolve_model("org/tiny", revision="v2") == (storage / V2).resolve()
    assert loader.resolve_model("org/tiny", revision=V2) == (storage / V2).resolve()
    with pytest.raises(hub.HubError, match="org/tiny \\(revision v3\\) is not in the Hugging Face "
                                           "cache .*HF_HUB_OFFLINE"):
        loader.resolve_model("org/tiny", revision="v3")
    with pytest.raises(hub.HubError, match="org/absent \\(revision main\\) is not in the Hugging"):
        loader.resolve_model("org/absent")
    with pytest.raises(ValueError, match="applies to Hugging Face Hub names"):
        loader.resolve_model(storage / MAIN, revision="v2")


def test_shard_plan_reads_a_hub_models_config(hf_home):
    from jaxserve.tools.shard_plan import model_config

    name, config = model_config("org/tiny", revision="v2")
    assert name == "org/tiny" and config["architectures"] == ["Qwen2ForCausalLM"]


def test_llm_loads_a_hub_name(hf_home, compile_cache_dir):
    from jaxserve import LLM, SamplingParams

    llm = LLM("org/tiny", dtype="float32", max_num_seqs=8, token_buckets=(16,),
              request_buckets=(8,), compilation_cache_dir=compile_cache_dir, show_progress=False)
    out = llm.generate("w5 w6 w7", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


def test_generate_command_with_a_hub_name(tmp_path, compile_cache_dir):
    home = hub_cache(tmp_path / "hf")
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1",
               XLA_FLAGS=os.environ["XLA_FLAGS"] + " --xla_force_host_platform_device_count=1")
    env.pop("HF_HUB_CACHE", None)
    base = [sys.executable, "-m", "jaxserve.server.cli", "generate", "w5 w6 w7",
            "--max-tokens", "4", "--token-buckets", "16", "--request-buckets", "8",
            "--compilation-cache-dir", compile_cache_dir]
    res = subprocess.run([*base, "--model", "org/tiny", "--revision", "v2"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip()
    res = subprocess.run([*base, "--model", "org/absent"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "org/absent (revision main) is not in the Hugging Face cache" in res.stderr
    assert "Traceback" not in res.stderr


def test_serve_refuses_a_missing_hub_model_with_a_message(hf_home, capsys):
    from jaxserve.server.cli import main

    assert main(["serve", "org/absent", "--engine-core", "thread"]) == 2
    err = capsys.readouterr().err
    assert "org/absent" in err and "Traceback" not in err
