"""Models by Hugging Face hub id (model/hub.py), read from a local Hugging Face cache built here
(offline: no network in tests), and the errors for names that are neither."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdec import LLM, SamplingParams
from specdec.model.registry import ModelNotFoundError, resolve_model_path


def _cache_repo(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """A repository's snapshot in the Hugging Face cache layout (refs/main -> snapshots/REV)."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(snap.name)
    for name, src in files.items():  # NOTE: links, as the cache's snapshots hold them
        (snap / name).symlink_to(src)
    return snap


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    return cache


def test_a_folder_model_by_hub_id(tiny_llama, hf_cache) -> None:
    snap = _cache_repo(hf_cache, "acme/tiny-llama", {p.name: p for p in tiny_llama.iterdir()})
    assert resolve_model_path("acme/tiny-llama") == snap
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    by_id = LLM("acme/tiny-llama", max_model_len=64).generate(["the cat"], sp, use_tqdm=False)
    local = LLM(str(tiny_llama), max_model_len=64).generate(["the cat"], sp, use_tqdm=False)
    assert by_id[0].outputs[0].token_ids == local[0].outputs[0].token_ids


def test_a_gguf_repository_gives_the_file_of_the_asked_quantization(hf_cache) -> None:
    from specdec.model.registry import _smollm2_path

    gguf = _smollm2_path()
    snap = _cache_repo(
        hf_cache,
        "acme/SmolLM2-GGUF",
        {"SmolLM2-Q4_1.gguf": gguf, "SmolLM2-Q8_0.gguf": gguf, "README.md": gguf},
    )
    assert resolve_model_path("acme/SmolLM2-GGUF:q8_0") == snap / "SmolLM2-Q8_0.gguf"
    # no quantization asked: the first preferred one the repository has
    assert resolve_model_path("acme/SmolLM2-GGUF") == snap / "SmolLM2-Q8_0.gguf"
    with pytest.raises(ModelNotFoundError, match="no single-file GGUF for Q6_K"):
        resolve_model_path("acme/SmolLM2-GGUF:Q6_K")


def test_names_that_are_nothing_get_a_specific_error(hf_cache) -> None:
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model_path("acme/not-cached")
    with pytest.raises(ModelNotFoundError, match="no such file or folder: './models/x.gguf'"):
        resolve_model_path("./models/x.gguf")
    with pytest.raises(ModelNotFoundError, match="unknown model 'nosuch'.*hub id"):
        resolve_model_path("nosuch")
