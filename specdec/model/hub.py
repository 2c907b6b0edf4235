"""Models by Hugging Face hub id, as vLLM users (``Qwen/Qwen3-0.6B``) and llama.cpp users
(``-hf ggml-org/Qwen3-0.6B-GGUF[:Q4_K_M]``) type them.

An id names a repository. A repository of GGUF files gives one file: the one whose name holds
the quantization after ``:`` (case-insensitive), else the first of ``PREFERRED_QUANTS`` it has.
Any other repository gives a folder of its configuration, tokenizer and safetensors. The local
Hugging Face cache is read first (``HF_HUB_CACHE``; ``HF_HUB_OFFLINE=1`` reads nothing else);
what it lacks is downloaded into it, once.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from specdec.errors import ModelNotFoundError

# "org/name" or "org/name:QUANT", as the hub spells repository ids
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(:[\w.-]+)?$")
# llama.cpp's -hf default is Q4_K_M; then the formats the native kernels keep as they are
PREFERRED_QUANTS = ("Q4_K_M", "Q4_0", "Q8_0", "Q4_1", "Q5_K_M", "Q6_K", "F16", "BF16")
# a folder model: what loading reads (configuration, tokenizer, chat template, weights)
FOLDER_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]


def is_hub_id(model: str) -> bool:
    """``model`` reads as a hub id and not as a path on this machine."""
    return bool(HUB_ID.match(model)) and not Path(model).expanduser().exists()


def hub_model_path(model: str) -> Path:
    """The local path of hub id ``model`` (``org/name[:QUANT]``), from the cache or downloaded."""
    repo, _, quant = model.partition(":")
    cached = _cached_snapshot(repo)
    if cached is not None:
        found = _pick(cached, quant, model)
        if found is not None:
            return found
    if _offline():
        raise ModelNotFoundError(
            f"model '{model}' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: "
            f"download it where there is a network (hf download {repo}) or pass a local path"
        )
    return _download(repo, quant, model)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _cached_snapshot(repo: str) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        return None


def _pick(folder: Path, quant: str, model: str) -> Path | None:
    """The GGUF file (or the folder itself) a downloaded repository ``folder`` gives for
    ``quant``; None when the files for it are not all there yet."""
    names = [p.name for p in folder.iterdir()]
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    if ggufs:
        name = _choose_gguf(ggufs, quant, model)
        return folder / name if (folder / name).is_file() else None
    if quant:
        raise _no_gguf(model, quant)
    if (folder / "config.json").is_file() and any(n.endswith(".safetensors") for n in names):
        return folder
    return None


def _no_gguf(model: str, quant: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model '{model}': the repository holds no GGUF files to pick {quant} from"
    )


def _choose_gguf(ggufs: list[str], quant: str, model: str) -> str:
    whole = [n for n in ggufs if not re.search(r"-\d{5}-of-\d{5}\.gguf$", n)]
    wanted = [quant] if quant else list(PREFERRED_QUANTS)
    for q in wanted:
        hits = [n for n in whole if q.lower() in n.lower()]
        if hits:
            return min(hits, key=len)  # NOTE: "Q4_0" before "Q4_0_4_4" and the like
    if not quant and whole:
        return whole[0]
    shown = ", ".join(ggufs[:8]) + (" ..." if len(ggufs) > 8 else "")
    raise ModelNotFoundError(
        f"model '{model}': no single-file GGUF for {quant or 'any quantization'} in the "
        f"repository ({shown})"
    )


def _download(repo: str, quant: str, model: str) -> Path:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        names = HfApi().list_repo_files(repo)
        ggufs = [n for n in names if n.lower().endswith(".gguf")]
        if ggufs:
            return Path(hf_hub_download(repo, _choose_gguf(sorted(ggufs), quant, model)))
        if quant:
            raise _no_gguf(model, quant)
        if "config.json" not in names:
            raise ModelNotFoundError(
                f"model '{model}': the repository has no config.json or GGUF file"
            )
        return Path(snapshot_download(repo, allow_patterns=FOLDER_PATTERNS))
    except ModelNotFoundError:
        raise
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"no model '{repo}' on the Hugging Face hub") from None
    except GatedRepoError:
        raise ModelNotFoundError(
            f"model '{repo}' is gated on the Hugging Face hub: accept its terms and log in "
            "(hf auth login), or pass a local path"
        ) from None
    except Exception as e:  # noqa: BLE001 - the network's errors (httpx's, the hub's, the OS's)
        raise ModelNotFoundError(
            f"model '{model}' is not in the local Hugging Face cache and the hub cannot be "
            f"reached ({type(e).__name__}): pass a local path, or download it first"
        ) from None
