"""Models by Hugging Face hub id, as vLLM users (``Qwen/Qwen3-0.6B``) and llama.cpp users
(``-hf ggml-org/Qwen3-0.6B-GGUF[:Q4_K_M]``) type them, through ``huggingface_hub``.

An id names a repository. A repository of GGUF files gives one file: ``--hf-file``'s, else the
one whose name holds the quantization after ``:`` (case-insensitive), else the first of
``PREFERRED_QUANTS`` it has; a split model (``-00001-of-0000N.gguf``) gives all its parts. A repository with ``config.json`` and safetensors gives a folder of
its configuration, tokenizer and weights; a drafter head (EAGLE, Medusa) the folder of its
configuration and weights. Files land in the Hugging Face cache layout (``HF_HUB_CACHE``, or
vLLM's ``--download-dir``), shared with transformers and vLLM. The cache is read first: a model
whose files are all there loads without a single request (``HF_HUB_OFFLINE=1``: nothing else
is read). A download lists the commit and fetches its files on the standard library
(model/hub_http.py, model/hub_download.py: the cache's blobs, links, refs and listing as
huggingface_hub writes them, a tqdm bar, a transfer cut by the network resumed with a ``Range``
request, every file checked against the sha256 or git sha1 the hub lists);
``huggingface_hub``'s ``snapshot_download`` downloads where that path meets something it does not
handle (a proxy, an OAuth or OIDC login, an answer without the hub's metadata).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import quote

from specdec.errors import ModelNotFoundError
from specdec.model.gguf_file import split_parts

# "org/name" or "org/name:QUANT", as the hub spells repository ids
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(:[\w.-]+)?$")
# llama.cpp's -hf default is Q4_K_M; then the formats the native kernels keep as they are
PREFERRED_QUANTS = ("Q4_K_M", "Q4_0", "Q8_0", "Q4_1", "Q5_K_M", "Q6_K", "F16", "BF16")
# a folder model: what loading reads (configuration, tokenizer, chat template, weights)
FOLDER_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt"]
# a drafter head (EAGLE, EAGLE-3, Medusa): its configuration and weights
HEAD_PATTERNS = ["*.json", "*.safetensors", "*.bin", "*.pt", "*.pth"]
# a tokenizer (--tokenizer): tokenizer.json, its configuration and chat template
TOKENIZER_PATTERNS = ["tokenizer*", "special_tokens_map.json", "chat_template*", "*.jinja"]
# NOTE: (the fallback, huggingface_hub's download) it writes into the cache DOWNLOAD_CHUNK_SIZE
# (10 MiB) at a time.
# On a 2-vCPU Xeon VM (Linux 6.18, ext4) 10 MiB writes to a fresh file cost ~0.27 s of kernel
# time per 94 MiB (large page-cache folios), 64 KiB writes ~0.025 s: SmolLM2 Q4_1 (94 MiB) from
# the loopback stand-in hub downloads in 0.14-0.15 s instead of 0.24-0.52 s
# (benchmarks/hub_load.py). Smaller pieces cost nothing measurable on a real network.
DOWNLOAD_CHUNK_BYTES = 64 << 10
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)
_FIRST_PART = re.compile(r"-00001-of-\d{5}\.gguf$", re.IGNORECASE)
_QUANT_TAG = re.compile(r"(?i)I?Q\d\w*|B?F16|F32")
_COMMIT = re.compile(r"[0-9a-f]{40}")

Kind = Literal["model", "head", "tokenizer"]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HubOptions:
    """Where a hub id's files come from: ``revision`` (a branch, tag or commit; vLLM's
    ``--revision``), ``download_dir`` (a cache folder instead of the Hugging Face cache; vLLM's
    ``--download-dir``), ``token`` (``HF_TOKEN`` or the stored login when None; True: the stored
    login; vLLM's ``--hf-token``) and ``filename`` (the repository's file to load, llama.cpp's
    ``--hf-file``)."""

    revision: str | None = None
    download_dir: str | None = None
    token: str | bool | None = None
    filename: str | None = None

    def __repr__(self) -> str:  # NOTE: never print the token
        token = None if self.token is None else "***"
        return (
            f"HubOptions(revision={self.revision!r}, download_dir={self.download_dir!r}, "
            f"token={token}, filename={self.filename!r})"
        )


def is_hub_id(model: str) -> bool:
    """``model`` reads as a hub id and not as a path on this machine."""
    return bool(HUB_ID.match(model)) and not Path(model).expanduser().exists()


def hub_model_path(model: str, options: HubOptions | None = None, kind: Kind = "model") -> Path:
    """The local path of hub id ``model`` (``org/name[:QUANT]``): a GGUF file or a folder, from
    the cache, else downloaded into it. ``kind`` "head": a drafter head's folder; "tokenizer":
    a folder of the repository's tokenizer files only."""
    options = options or HubOptions()
    repo, _, quant = model.partition(":")
    found = _from_cache(repo, quant, model, options, kind)
    if found is not None:
        return found
    if offline():
        where = f" at revision {options.revision}" if options.revision else ""
        raise ModelNotFoundError(
            f"model '{model}'{where} is not in the local Hugging Face cache ({cache_dir(options)}) "
            f"and HF_HUB_OFFLINE is set: download it where there is a network (hf download "
            f"{repo}) or pass a local path"
        )
    return _download(repo, quant, model, options, kind)


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (read now, not when huggingface_hub was imported)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in ("1", "true", "yes", "on")


def cache_dir(options: HubOptions) -> str:
    """``download_dir``, else huggingface_hub's cache folder as the environment names it now
    (``HF_HUB_CACHE``, ``HF_HOME``/hub, ``XDG_CACHE_HOME``/huggingface/hub)."""
    if options.download_dir:
        return str(Path(options.download_dir).expanduser())
    env = os.environ
    folder = (
        env.get("HF_HUB_CACHE")
        or env.get("HUGGINGFACE_HUB_CACHE")
        or os.path.join(hf_home(), "hub")
    )
    return os.path.expandvars(os.path.expanduser(folder))


def hf_home() -> str:
    """huggingface_hub's home folder as the environment names it now (``HF_HOME``, else
    ``XDG_CACHE_HOME``/huggingface, else ~/.cache/huggingface)."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
    )
    return os.path.expandvars(os.path.expanduser(home))


def _endpoint() -> str | None:
    return (os.environ.get("HF_ENDPOINT") or "").rstrip("/") or None


# ---- the cache -------------------------------------------------------------------------------
def _from_cache(repo: str, quant: str, model: str, options: HubOptions, kind: Kind) -> Path | None:
    """The model's path when every file it needs is cached; no request is made."""
    cache = cache_dir(options)
    storage = _storage(cache, repo)
    commit = _cached_commit(storage, options.revision or "main")
    if commit is None:  # NOTE: nothing of this revision cached: huggingface_hub not imported yet
        return None
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    # NOTE: the whole listing, kept by snapshot_download: the same choice as online
    names = _cached_listing(storage, commit, repo, cache)
    complete = names is not None
    if names is None:
        # a cache filled file by file (hf_hub_download, `hf download repo file`): what is there
        names = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
    try:
        files, target = _choose(names, quant, model, options, kind)
    except ModelNotFoundError:
        if complete:
            raise  # NOTE: the repository's listing says so: no need to ask the hub
        return None
    if all((snapshot / name).is_file() for name in files):
        return snapshot / target if target else snapshot
    return None


def _storage(cache: str, repo: str) -> Path:
    """A model repository's folder in the cache layout (``models--org--name``)."""
    return Path(cache) / ("models--" + repo.replace("/", "--"))


def _cached_commit(storage: Path, revision: str) -> str | None:
    """The commit ``revision`` names in the cache: itself when it is a commit hash, else the one
    its ``refs/`` file records (what ``HfApi.resolve_revision(local_files_only=True)`` reads)."""
    if _COMMIT.fullmatch(revision):
        return revision
    try:
        return (storage / "refs" / revision).read_text().strip() or None
    except (OSError, ValueError):
        return None


def _cached_listing(storage: Path, commit: str, repo: str, cache: str) -> list[str] | None:
    """The repository's files at ``commit`` as snapshot_download keeps them (None: not kept).
    Its file ``trees/<commit>.json`` in the format this huggingface_hub writes (version 1) is read
    here: ``get_cached_repo_tree`` imports all of huggingface_hub's API first (0.09 s on a 2-vCPU
    Xeon VM, where SmolLM2 loads in 0.2 s); any other format goes through it."""
    try:
        with open(storage / "trees" / f"{commit}.json", encoding="utf-8") as f:
            kept = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        kept = None
    if isinstance(kept, dict) and kept.get("format_version") == 1:
        files = kept.get("files")
        if isinstance(files, dict):
            return list(files)
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return [f.path for f in get_cached_repo_tree(repo, revision=commit, cache_dir=cache)]
    except (CachedRepoTreeNotFoundError, OSError, ValueError):
        return None


def _record_ref(storage: Path, revision: str, commit: str) -> None:
    """Record in ``refs/`` the commit a branch or tag named when it was listed, as huggingface_hub
    does (written whole, so that a reader never sees half of it); best effort."""
    if revision == commit:
        return
    ref = storage / "refs" / revision
    try:
        if ref.is_file() and ref.read_text() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f"{ref.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)
    except OSError:
        pass


# ---- what to load from a repository's listing ------------------------------------------------
def _choose(
    names: list[str], quant: str, model: str, options: HubOptions, kind: Kind
) -> tuple[list[str], str | None]:
    """(the files to download, the GGUF file to load or None for the folder)."""
    if kind == "head":
        return _head_files(names, model), None
    if kind == "tokenizer":
        if "tokenizer.json" not in names:
            raise ModelNotFoundError(
                f"tokenizer '{model}': the repository has no tokenizer.json{_listing(names)}"
            )
        return [n for n in names if any(fnmatch.fnmatch(n, p) for p in TOKENIZER_PATTERNS)], None
    if options.filename:
        if options.filename not in names:
            raise ModelNotFoundError(
                f"model '{model}': the repository has no file '{options.filename}' "
                f"(--hf-file){_listing(names)}"
            )
        return gguf_files(names, options.filename, model), options.filename
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    folder = "config.json" in names and any(n.endswith(".safetensors") for n in names)
    if quant or (ggufs and not folder):
        if not ggufs:
            raise ModelNotFoundError(
                f"model '{model}': the repository holds no GGUF files to pick {quant} from"
            )
        name = choose_gguf(ggufs, quant, model)
        return gguf_files(names, name, model), name
    if not folder:
        raise ModelNotFoundError(
            f"model '{model}': the repository has no GGUF file, nor config.json with "
            f"safetensors weights{_listing(names)}"
        )
    return [n for n in names if any(fnmatch.fnmatch(n, p) for p in FOLDER_PATTERNS)], None


def _head_files(names: list[str], model: str) -> list[str]:
    files = [n for n in names if any(fnmatch.fnmatch(n, p) for p in HEAD_PATTERNS)]
    if any(n.endswith(".safetensors") for n in files):  # NOTE: not the same weights twice
        files = [n for n in files if not n.endswith((".bin", ".pt", ".pth"))]
    if not any(not n.endswith(".json") for n in files):
        raise ModelNotFoundError(
            f"'{model}': the repository holds no head weights "
            f"(*.safetensors, *.bin, *.pt){_listing(names)}"
        )
    return files


def choose_gguf(ggufs: list[str], quant: str, model: str) -> str:
    """The GGUF file for ``quant`` (else the preferred one) among ``ggufs``: a single file, else
    the first part of a split one (``-00001-of-0000N.gguf``, as llama.cpp's ``-hf`` takes it)."""
    whole = [n for n in ggufs if not _SPLIT_GGUF.search(n)]
    firsts = [n for n in ggufs if _FIRST_PART.search(n)]
    wanted = [quant] if quant else list(PREFERRED_QUANTS)
    for q in wanted:
        for pool in (whole, firsts):
            hits = [n for n in pool if q.lower() in n.lower()]
            if hits:
                return min(hits, key=len)  # NOTE: "Q4_0" before "Q4_0_4_4" and the like
    if not quant and (whole or firsts):
        return (whole or firsts)[0]
    tags = quant_tags(whole + firsts)
    available = f"available: {', '.join(tags)}" if tags else f"files: {', '.join(ggufs[:8])}"
    raise ModelNotFoundError(
        f"model '{model}': no GGUF file for {quant or 'any quantization'} in the repository "
        f"({available})"
    )


def gguf_files(names: list[str], name: str, model: str) -> list[str]:
    """The files to download for GGUF ``name``: itself, or every part of its split model."""
    if not _FIRST_PART.search(name):
        return [name]
    folder = name.rpartition("/")[0]
    parts = [f"{folder}/{p.name}" if folder else p.name for p in split_parts(Path(name))]
    missing = [p for p in parts if p not in names]
    if missing:
        raise ModelNotFoundError(
            f"model '{model}': the split model {name} lacks parts in the repository "
            f"({', '.join(missing[:4])})"
        )
    return parts


def quant_tags(ggufs: list[str]) -> list[str]:
    """The quantizations the GGUF file names spell (``x-Q4_K_M.gguf``: Q4_K_M), else the names."""
    tags = []
    for name in ggufs:
        stem = _SPLIT_GGUF.sub(".gguf", Path(name).name)[: -len(".gguf")]
        tail = re.split(r"[-.]", stem)[-1]
        tags.append(tail.upper() if _QUANT_TAG.fullmatch(tail) else name)
    return sorted(set(tags), key=tags.index)


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
    return f" (files: {shown})" if names else " (no files)"


# ---- the network -----------------------------------------------------------------------------
def _download(repo: str, quant: str, model: str, options: HubOptions, kind: Kind) -> Path:
    """List the repository, choose its files, download them into the cache (a progress bar):
    on the standard library, else (what that path does not handle) through huggingface_hub."""
    from specdec.model.hub_http import Unusual

    try:
        return _fetch(repo, quant, model, options, kind)
    except Unusual as e:
        logger.info("%s: downloading through huggingface_hub (%s)", model, e)
    return _download_with_hf(repo, quant, model, options, kind)


def _fetch(repo: str, quant: str, model: str, options: HubOptions, kind: Kind) -> Path:
    """The download on the standard library: the commit and its files (model_info), the
    commit's listing (kept in the cache, as snapshot_download keeps it), the files chosen."""
    from specdec.model.hub_download import CorruptDownload, UnsafeListing, fetch_files
    from specdec.model.hub_http import (
        DEFAULT_ENDPOINT,
        ConnectError,
        HubClient,
        HubHTTPError,
        resolve_token,
    )

    token = resolve_token(options.token, hf_home())
    if options.token is True and token is None:
        raise ModelNotFoundError(
            f"model '{model}': --hf-token asks for the stored Hugging Face login and there is "
            "none: log in (hf auth login), or set HF_TOKEN"
        )
    cache = cache_dir(options)
    storage = _storage(cache, repo)
    client = HubClient(_endpoint() or DEFAULT_ENDPOINT, token, _timeout())
    revision = options.revision
    try:
        where = f"/revision/{quote(revision, safe='')}" if revision else ""
        info, _ = client.get_json(f"/api/models/{repo}{where}")
        sha = info.get("sha") if isinstance(info, dict) else None
        if not isinstance(sha, str) or not _COMMIT.fullmatch(sha):
            raise ModelNotFoundError(f"model '{model}': the hub named no commit of {repo}")
        names = _sibling_names(info)
        entries = None if names is not None else _listing_of(client, storage, repo, sha)
        files, target = _choose(list(entries) if names is None else names, quant, model,
                                options, kind)  # fmt: skip
        _record_ref(storage, revision or "main", sha)
        if entries is None:
            entries = _listing_of(client, storage, repo, sha)
        fetch_files(client, storage, repo, sha, files, entries)
    except (HubHTTPError, ConnectError) as e:
        raise ModelNotFoundError(_network_error(e, repo, model, options, bool(token))) from e
    except CorruptDownload as e:
        raise ModelNotFoundError(f"model '{model}': {e}; download it again") from e
    except UnsafeListing as e:
        raise ModelNotFoundError(f"model '{model}': {e}; nothing was written") from e
    except OSError as e:  # NOTE: the network's are ConnectError: this is the disk's
        raise ModelNotFoundError(
            f"model '{model}': writing into the cache {cache} failed: {e}"
        ) from e
    finally:
        client.close()
    snapshot = storage / "snapshots" / sha
    return snapshot / target if target else snapshot


def _sibling_names(info: dict) -> list[str] | None:
    """The files model_info lists (None: it leaves them out)."""
    siblings = info.get("siblings")
    if not isinstance(siblings, list):
        return None
    try:
        return [str(s["rfilename"]) for s in siblings]
    except (KeyError, TypeError):
        return None


def _listing_of(client, storage: Path, repo: str, commit: str) -> dict:
    """The commit's listing: the one kept in the cache, else the hub's (then kept)."""
    from specdec.model.hub_download import list_tree, read_tree, write_tree

    entries = read_tree(storage, commit)
    if entries is None:
        entries = list_tree(client, repo, commit)
        write_tree(storage, commit, entries)
    return entries


def _timeout() -> float:
    """huggingface_hub's HF_HUB_DOWNLOAD_TIMEOUT (seconds; 10)."""
    try:
        return float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT") or 10)
    except ValueError:
        return 10.0


def _download_with_hf(repo: str, quant: str, model: str, options: HubOptions, kind: Kind) -> Path:
    """The download through huggingface_hub (model_info, snapshot_download)."""
    from huggingface_hub.utils import get_session

    # NOTE: the HTTP client (its TLS context: loading the CA bundle releases the GIL) is built
    # in a thread while huggingface_hub's API modules are imported here
    threading.Thread(target=_quietly, args=(get_session,), daemon=True).start()
    from huggingface_hub import HfApi, ResolvedRevision, constants, snapshot_download
    from huggingface_hub.hf_api import RepoFile

    constants.DOWNLOAD_CHUNK_SIZE = min(constants.DOWNLOAD_CHUNK_SIZE, DOWNLOAD_CHUNK_BYTES)
    cache = cache_dir(options)
    api = HfApi(endpoint=_endpoint(), token=options.token)
    try:
        # NOTE: model_info fails at once when the hub is unreachable (resolve_revision would
        # fall back on a cached ref, and the downloads then retry for ~20 s). One request gives
        # the commit and its listing: the files come from that commit, its ref is recorded
        # for the cache's readers (and snapshot_download, handed it resolved, asks no more)
        info = api.model_info(repo, revision=options.revision)
        if info.sha is None:
            raise ModelNotFoundError(f"model '{model}': the hub named no commit of {repo}")
        if info.siblings is not None:
            names = [s.rfilename for s in info.siblings]
        else:  # NOTE: a hub that leaves the listing out of model_info
            tree = api.list_repo_tree(repo, recursive=True, revision=info.sha)
            names = [f.path for f in tree if isinstance(f, RepoFile)]
        files, target = _choose(names, quant, model, options, kind)
        _record_ref(_storage(cache, repo), options.revision or "main", info.sha)
        revision = ResolvedRevision(info.sha, options.revision, repo_id=repo)
        folder = snapshot_download(
            repo, revision=revision, cache_dir=cache, token=options.token, endpoint=_endpoint(),
            allow_patterns=files,
        )  # fmt: skip
    except ModelNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - the hub's, httpx's and the OS's errors, in one line
        raise ModelNotFoundError(_network_error(e, repo, model, options)) from e
    return Path(folder) / target if target else Path(folder)


def _quietly(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001, S110 - a warm-up: the request that needs it raises
        pass


def _network_error(
    e: Exception, repo: str, model: str, options: HubOptions, token_sent: bool | None = None
) -> str:
    """The one line for a failed request (``token_sent``: whether one went; None: guessed from
    ``--hf-token`` and HF_TOKEN)."""
    kind, status = _error_kind(e)
    token_given = (
        token_sent
        if token_sent is not None
        else bool(options.token)
        or bool(os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"))
    )
    if kind == "gated":
        if token_given:
            return (
                f"model '{repo}' is gated on the Hugging Face hub and the token has no access: "
                f"accept its terms on the model's page with that account"
            )
        return (
            f"model '{repo}' is gated on the Hugging Face hub: accept its terms on the model's "
            "page, then set HF_TOKEN (or pass --hf-token TOKEN) to a token of that account"
        )
    if kind == "repo":
        hint = "" if token_given else " (a private one needs HF_TOKEN or --hf-token)"
        return f"no model '{repo}' on the Hugging Face hub{hint}"
    if kind == "revision":
        return f"model '{repo}' has no revision '{options.revision}' on the Hugging Face hub"
    if kind == "status":
        return (
            f"model '{model}': the Hugging Face hub answered HTTP {status}; "
            "try again later, or pass a local path"
        )
    return (
        f"model '{model}' is not in the local Hugging Face cache and the hub cannot be reached "
        f"({_endpoint() or 'https://huggingface.co'}: {type(e).__name__}): check the network, "
        "or pass a local path"
    )


def _error_kind(e: Exception) -> tuple[str, int | None]:
    """What a failed request says, read as huggingface_hub's ``hf_raise_for_status`` reads it:
    "gated", "repo" (no such repository, or private), "revision", "status" (another HTTP
    error), else "unreachable"; and the HTTP status."""
    from specdec.model.hub_http import HubHTTPError

    if isinstance(e, HubHTTPError):
        if e.code == "GatedRepo":
            return "gated", e.status
        if e.code == "RepoNotFound" or (
            e.status == 401 and e.message != "Invalid credentials in Authorization header"
        ):
            return "repo", e.status
        if e.code == "RevisionNotFound":
            return "revision", e.status
        return "status", e.status
    errors = sys.modules.get("huggingface_hub.errors")  # NOTE: its errors only once it was used
    if errors is None:
        return "unreachable", None
    if isinstance(e, errors.GatedRepoError):
        return "gated", None
    if isinstance(e, errors.RepositoryNotFoundError):
        return "repo", None
    if isinstance(e, errors.RevisionNotFoundError):
        return "revision", None
    if isinstance(e, errors.HfHubHTTPError) and e.response is not None:
        return "status", e.response.status_code
    return "unreachable", None
