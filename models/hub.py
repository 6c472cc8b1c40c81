"""Models named by their Hugging Face Hub repository (`Qwen/Qwen3-8B`, `bartowski/X-GGUF:Q4_K_M`).

`download(name, ...)` fetches the files a model needs, and only those, into the Hugging Face cache
through `huggingface_hub` (as vLLM does), and returns the local snapshot directory or, for a GGUF
repository, the chosen .gguf file. huggingface_hub reads its own environment: HF_TOKEN (gated and
private repositories), HF_HOME / HF_HUB_CACHE (where the cache lives), HF_HUB_OFFLINE (use the
cache only, never the network), HF_ENDPOINT. Every failure is a HubError naming the repository.
"""

from __future__ import annotations

import os
import pathlib
import re

# What a safetensors checkpoint needs: its configuration, the tokenizer's files, the weights and
# their index. Only files at the repository's top level are taken.
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                   "chat_template.jinja", "chat_template.json")
# The weights, chosen as the loader reads them (loader._weight_files): the index's shards when
# there is an index (not, say, a consolidated copy beside them), else model.safetensors, else
# every *.safetensors file.
INDEX = "model.safetensors.index.json"
# A repository name: `org/name` or a bare legacy name, letters, digits, '-', '_', '.'.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class HubError(ValueError):
    """A Hub model that cannot be had (missing, gated, private, offline, a file not there)."""


def split_name(name: str) -> tuple[str, str | None]:
    """(repo id, GGUF quant or None) of `org/name` or `org/name:QUANT`."""
    repo, sep, quant = name.partition(":")
    return repo, (quant or None) if sep else None


def is_repo_name(name: str) -> bool:
    """Whether `name` can only be a Hub repository (with an optional :QUANT), not a local path."""
    repo, quant = split_name(name)
    return (_REPO_ID.fullmatch(repo) is not None and ".." not in repo
            and not repo.endswith((".gguf", ".json")) and (quant is None or "/" not in quant))


def select_files(repo: str, files: list[str], *, gguf_file: str | None = None,
                 quant: str | None = None, config_only: bool = False,
                 shards: list[str] | None = None) -> list[str]:
    """The files of `repo` (its listing: `files`) that the model needs.

    A GGUF model (`gguf_file`, or `quant` matched against the .gguf names, case-insensitively)
    is that one file. Otherwise: the configuration, the tokenizer's files and the safetensors
    weights at the top level (`shards`: the files the index names, when the listing has one);
    only config.json with `config_only`."""
    top = [f for f in files if "/" not in f]
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if gguf_file is not None or quant is not None:
        if gguf_file is not None:
            if gguf_file not in files:
                raise HubError(f"{repo} has no file {gguf_file!r}; its GGUF files: "
                               f"{_listing(ggufs)}")
            return [gguf_file]
        chosen = [f for f in ggufs if _quant_of(f) == quant.lower()]
        if len(chosen) != 1:
            what = "no GGUF file" if not chosen else f"{len(chosen)} GGUF files"
            raise HubError(f"{repo} has {what} of quant {quant!r} (its GGUF files: "
                           f"{_listing(ggufs)}); name one with --gguf-file")
        return chosen
    if "config.json" not in top:
        hint = (f"; it holds GGUF files: pick one with {repo}:QUANT or --gguf-file NAME "
                f"({_listing(ggufs)})" if ggufs else f" (it holds: {_listing(files)})")
        raise HubError(f"{repo} has no config.json{hint}")
    if config_only:
        return ["config.json"]
    if INDEX in top:
        if shards is None:
            raise ValueError("the index's shards are needed to choose the weights")
        absent = sorted(set(shards) - set(files))
        if absent:
            raise HubError(f"{repo}: {INDEX} names files the repository lacks: {_listing(absent)}")
        weights = [INDEX, *sorted(set(shards))]
    elif "model.safetensors" in top:
        weights = ["model.safetensors"]
    else:
        weights = sorted(f for f in top if f.endswith(".safetensors"))
    if not weights:
        raise HubError(f"{repo} has no *.safetensors weights at its top level (it holds: "
                       f"{_listing(files)}); jaxserve reads safetensors or GGUF checkpoints")
    wanted = {*CONFIG_FILES, *TOKENIZER_FILES}
    return sorted(f for f in top if f in wanted) + weights


def _quant_of(filename: str) -> str:
    """The quant name in a GGUF file's name (`Qwen3-8B-Q4_K_M.gguf` -> q4_k_m), lower case."""
    stem = filename.rsplit("/", 1)[-1][: -len(".gguf")]
    return re.split(r"[-.]", stem)[-1].lower()


def _listing(files: list[str], limit: int = 12) -> str:
    shown = ", ".join(files[:limit])
    if len(files) > limit:
        shown += f", … ({len(files) - limit} more)"
    return shown or "nothing"


def download(name: str, *, revision: str | None = None,
             download_dir: str | os.PathLike | None = None, gguf_file: str | None = None,
             config_only: bool = False) -> pathlib.Path:
    """The local copy of the Hub model `name` (`org/name` or `org/name:QUANT`): its snapshot
    directory, or the .gguf file of a GGUF model. Downloads what is missing (with a progress
    bar) into `download_dir` (default: the Hugging Face cache, $HF_HOME/hub)."""
    import huggingface_hub
    from huggingface_hub import constants

    repo, quant = split_name(name)
    cache_dir = pathlib.Path(download_dir or constants.HF_HUB_CACHE).expanduser()
    if constants.HF_HUB_OFFLINE:
        files = _cached_files(repo, revision, cache_dir)
    else:
        files = _remote_files(repo, revision, cache_dir)
    shards = None
    if INDEX in files and not (config_only or gguf_file or quant):
        shards = _index_shards(repo, revision, cache_dir)
    needed = select_files(repo, files, gguf_file=gguf_file, quant=quant, config_only=config_only,
                          shards=shards)
    try:
        folder = pathlib.Path(huggingface_hub.snapshot_download(
            repo, revision=revision, cache_dir=cache_dir, allow_patterns=needed))
    except Exception as e:  # noqa: BLE001 - every failure of the library, named for the user
        raise _hub_error(repo, revision, e) from e
    if gguf_file is not None or quant is not None:
        return folder / needed[0]
    return folder


def _index_shards(repo: str, revision: str | None, cache_dir: pathlib.Path) -> list[str]:
    """The weight files the repository's safetensors index names (the index is fetched first)."""
    import json

    import huggingface_hub

    try:
        path = huggingface_hub.hf_hub_download(repo, INDEX, revision=revision, cache_dir=cache_dir)
        return sorted(set(json.loads(pathlib.Path(path).read_text())["weight_map"].values()))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise HubError(f"{repo}: {INDEX} is not a valid safetensors index ({e})") from e
    except Exception as e:  # noqa: BLE001
        raise _hub_error(repo, revision, e) from e


def _remote_files(repo: str, revision: str | None, cache_dir: pathlib.Path) -> list[str]:
    """The files of `repo` at `revision` on the Hub; when the Hub cannot be reached (no network,
    a time-out), those of its cached snapshot, as snapshot_download falls back to."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return HfApi().list_repo_files(repo, revision=revision)
    except HfHubHTTPError as e:  # the Hub answered: missing, gated, private, no such revision
        raise _hub_error(repo, revision, e) from e
    except Exception as e:  # noqa: BLE001 - unreachable
        try:
            return _cached_files(repo, revision, cache_dir, offline=False)
        except HubError:
            raise HubError(f"{repo}: the Hugging Face Hub cannot be reached ({type(e).__name__}: "
                           f"{e}) and the model is not in the cache ({cache_dir})") from e


def _cached_files(repo: str, revision: str | None, cache_dir: pathlib.Path, *,
                  offline: bool = True) -> list[str]:
    """The files of `repo` at `revision` in the Hub cache."""
    from huggingface_hub.file_download import repo_folder_name

    storage = cache_dir / repo_folder_name(repo_id=repo, repo_type="model")
    rev = revision or "main"
    commit = rev if _COMMIT.fullmatch(rev) else None
    if commit is None and (storage / "refs" / rev).is_file():
        commit = (storage / "refs" / rev).read_text().strip()
    snapshot = storage / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        if not offline:
            raise HubError(f"{repo} (revision {rev}) is not in the Hugging Face cache")
        raise HubError(f"{repo} (revision {rev}) is not in the Hugging Face cache ({cache_dir}) "
                       "and HF_HUB_OFFLINE is set: download it once with network access, or "
                       "unset HF_HUB_OFFLINE")
    return sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())


def _hub_error(repo: str, revision: str | None, e: Exception) -> HubError:
    from huggingface_hub import errors

    rev = f" (revision {revision})" if revision else ""
    if isinstance(e, errors.GatedRepoError):
        return HubError(f"{repo} is gated: accept its terms on https://huggingface.co/{repo} and "
                        "set HF_TOKEN to a token of that account")
    if isinstance(e, errors.RepositoryNotFoundError):
        return HubError(f"{repo} was not found on the Hugging Face Hub, nor as a local path (a "
                        "private repository needs HF_TOKEN)")
    if isinstance(e, errors.RevisionNotFoundError):
        return HubError(f"{repo} has no revision {revision!r}")
    if isinstance(e, errors.LocalEntryNotFoundError):
        return HubError(f"{repo}{rev}: files missing from the Hugging Face cache and the Hub "
                        f"cannot be reached ({e})")
    if isinstance(e, errors.EntryNotFoundError):
        return HubError(f"{repo}{rev}: a file is missing ({e})")
    return HubError(f"{repo}{rev}: the download failed: {type(e).__name__}: {e}")
