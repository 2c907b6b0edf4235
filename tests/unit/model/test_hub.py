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
    # NOTE: a cache filled file by file holds no listing: the hub might have Q6_K
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache .*OFFLINE"):
        resolve_model_path("acme/SmolLM2-GGUF:Q6_K")


def test_names_that_are_nothing_get_a_specific_error(hf_cache) -> None:
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model_path("acme/not-cached")
    with pytest.raises(ModelNotFoundError, match="no such file or folder: './models/x.gguf'"):
        resolve_model_path("./models/x.gguf")
    with pytest.raises(ModelNotFoundError, match="unknown model 'nosuch'.*hub id"):
        resolve_model_path("nosuch")


# ---- through huggingface_hub, against a stand-in hub on loopback (tests/fixtures/fake_hub.py) ---
SMOL_Q4 = "SmolLM2-135M-Instruct-Q4_1.gguf"
SMOL_Q8 = "SmolLM2-135M-Instruct-Q8_0.gguf"  # NOTE: the same bytes, under another name
MULTI = {"m-Q4_K_M.gguf": b"Q4_K_M", "m-Q8_0.gguf": b"Q8_0", "m-Q4_0.gguf": b"Q4_0",
         "m-Q4_0_4_4.gguf": b"Q4_0_4_4", "README.md": b"# m"}  # fmt: skip


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A stand-in hub on 127.0.0.1 (a thread, a free port) holding: the real SmolLM2 GGUF under
    two quantization names, a repository of several small GGUF files (and a branch 'old'), and
    a gated one; HF_ENDPOINT points at it and HF_HOME is a fresh folder."""
    import huggingface_hub.constants as c

    from specdec.model.registry import _smollm2_path
    from tests.fixtures.fake_hub import FakeHub, HubServer

    hub = FakeHub()
    gguf = _smollm2_path()
    hub.add("acme/SmolLM2-GGUF", {SMOL_Q4: gguf, SMOL_Q8: gguf, "README.md": b"# SmolLM2"})
    hub.add("acme/Multi-GGUF", MULTI)
    hub.add("acme/Multi-GGUF", {"m-Q4_0.gguf": b"old Q4_0"}, branch="old")
    hub.add("acme/Gated-GGUF", {"g-Q4_0.gguf": b"gated"}, gated=True)
    home = tmp_path / "hf-home"
    with HubServer(hub):
        for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                     "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # fmt: skip
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(home))
        monkeypatch.setenv("SPECDEC_WEIGHT_CACHE", "off")
        # NOTE: what huggingface_hub read from the environment when it was imported
        template = hub.url + "/{repo_id}/resolve/{revision}/{filename}"
        for name, value in (("ENDPOINT", hub.url), ("HUGGINGFACE_CO_URL_TEMPLATE", template),
                            ("HF_HOME", str(home)),
                            ("HF_HUB_CACHE", str(home / "hub")), ("HF_HUB_OFFLINE", False),
                            ("DOWNLOAD_CHUNK_SIZE", c.DOWNLOAD_CHUNK_SIZE),
                            ("HF_TOKEN_PATH", str(home / "token")),
                            ("HF_STORED_TOKENS_PATH", str(home / "stored_tokens")),
                            ("AGENT_HARNESSES_PATH", str(home / ".agent_harnesses.json"))):  # fmt: skip
            monkeypatch.setattr(c, name, value)
        yield hub


def _file_requests(hub) -> list:
    return [r for r in hub.requests if "agent-harnesses" not in r.path]


def test_download_load_generate_then_the_cached_copy_makes_no_request(fake_hub, capsys) -> None:
    import time

    import huggingface_hub  # noqa: F401  NOTE: both paths below use it: not timed in either

    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    start = time.perf_counter()
    first = LLM("acme/SmolLM2-GGUF:Q4_1", max_model_len=128).generate(["Hi"], sp, use_tqdm=False)
    download_s = time.perf_counter() - start
    assert [r.method for r in fake_hub.gets(SMOL_Q4)] == ["GET"] and not fake_hub.gets(SMOL_Q8)
    before = len(fake_hub.requests)
    start = time.perf_counter()
    again = LLM("acme/SmolLM2-GGUF:Q4_1", max_model_len=128).generate(["Hi"], sp, use_tqdm=False)
    cached_s = time.perf_counter() - start
    assert len(fake_hub.requests) == before  # NOTE: not one request: the cache is read first
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids
    assert len(first[0].outputs[0].token_ids) == 4
    with capsys.disabled():
        print(f"\nSmolLM2 Q4_1 (94 MiB) from the stand-in hub: download + load + 4 tokens "
              f"{download_s:.2f} s; from the cache: {cached_s:.2f} s")  # fmt: skip


@pytest.mark.parametrize("cdn", [False, True], ids=["hub", "cdn"])
def test_an_interrupted_download_resumes_byte_identical(fake_hub, cdn) -> None:
    """The connection drops halfway (from the hub, or from the CDN it redirects to): the rest
    is asked for with a Range request (sent on through the redirect)."""
    import filecmp

    from specdec.model.registry import _smollm2_path

    fake_hub.cdn = cdn
    fake_hub.cut_once.add(SMOL_Q8)  # NOTE: half the file, then the connection drops
    path = resolve_model_path("acme/SmolLM2-GGUF:q8_0")
    gets = [r for r in fake_hub.gets(SMOL_Q8) if ("/cdn/" in r.path) == cdn]
    first, second = gets
    assert "Range" not in first.headers
    assert second.headers["Range"].startswith("bytes=") and second.headers["Range"] != "bytes=0-"
    assert path.name == SMOL_Q8 and filecmp.cmp(path, _smollm2_path(), shallow=False)
    assert not list(path.parents[2].glob("blobs/*.incomplete"))


def test_the_quantization_tag_picks_the_file_and_lists_the_others(
    fake_hub, monkeypatch, capsys
) -> None:
    from specdec.model.hub import HubOptions

    monkeypatch.setenv("TQDM_POSITION", "-1")  # NOTE: huggingface_hub's bars, even without a TTY
    q8 = resolve_model_path("acme/Multi-GGUF:q8_0")
    assert q8.name == "m-Q8_0.gguf" and q8.read_bytes() == b"Q8_0"
    assert "m-Q8_0.gguf: 100%" in capsys.readouterr().err  # NOTE: the bar of the bytes
    assert sorted(p.name for p in q8.parent.iterdir()) == ["m-Q8_0.gguf"]  # that file only
    # no tag: llama.cpp's default, Q4_K_M; Q4_0 is not Q4_0_4_4
    assert resolve_model_path("acme/Multi-GGUF").read_bytes() == b"Q4_K_M"
    assert resolve_model_path("acme/Multi-GGUF:Q4_0").read_bytes() == b"Q4_0"
    by_name = resolve_model_path("acme/Multi-GGUF", HubOptions(filename="m-Q4_0_4_4.gguf"))
    assert by_name.read_bytes() == b"Q4_0_4_4"
    before = len(fake_hub.requests)
    with pytest.raises(ModelNotFoundError, match=r"no GGUF file for Q6_K.*available: "
                       r"Q4_0, Q4_0_4_4, Q4_K_M, Q8_0"):  # fmt: skip
        resolve_model_path("acme/Multi-GGUF:Q6_K")
    assert len(fake_hub.requests) == before  # NOTE: the cached listing already says so
    with pytest.raises(ModelNotFoundError, match="no file 'nope.gguf' .--hf-file"):
        resolve_model_path("acme/Multi-GGUF", HubOptions(filename="nope.gguf"))


def test_revision_and_download_dir(fake_hub, tmp_path) -> None:
    from specdec.config import EngineArgs

    args = EngineArgs(model="acme/Multi-GGUF", revision="old", download_dir=str(tmp_path / "dl"))
    old = args.model_path()
    assert old.read_bytes() == b"old Q4_0"
    assert old.is_relative_to(tmp_path / "dl" / "models--acme--Multi-GGUF" / "snapshots")
    assert (tmp_path / "dl" / "models--acme--Multi-GGUF" / "refs" / "old").is_file()
    assert not (tmp_path / "hf-home" / "hub" / "models--acme--Multi-GGUF").exists()
    assert EngineArgs(model="acme/Multi-GGUF").model_path().read_bytes() == b"Q4_K_M"
    with pytest.raises(ModelNotFoundError, match="has no revision 'v9'"):
        EngineArgs(model="acme/Multi-GGUF", revision="v9").model_path()


def test_a_gated_repository_needs_a_token(fake_hub, monkeypatch, tmp_path) -> None:
    from specdec.config import EngineArgs

    with pytest.raises(ModelNotFoundError, match="gated on the Hugging Face hub: .*HF_TOKEN"):
        resolve_model_path("acme/Gated-GGUF")
    monkeypatch.setenv("HF_TOKEN", "hf_someone_else")
    with pytest.raises(ModelNotFoundError, match="gated .* the token has no access"):
        resolve_model_path("acme/Gated-GGUF")
    args = EngineArgs(model="acme/Gated-GGUF", hf_token=fake_hub.token)  # --hf-token wins
    assert args.model_path().read_bytes() == b"gated"
    assert fake_hub.gets("g-Q4_0.gguf")[0].headers["Authorization"] == f"Bearer {fake_hub.token}"
    monkeypatch.setenv("HF_TOKEN", fake_hub.token)
    args = EngineArgs(model="acme/Gated-GGUF", download_dir=str(tmp_path / "dl"))
    assert args.model_path().read_bytes() == b"gated"


def test_offline_not_found_and_network_down(fake_hub, monkeypatch) -> None:
    import socket

    with pytest.raises(ModelNotFoundError, match="^no model 'acme/nope' on the Hugging Face hub"):
        resolve_model_path("acme/nope")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = len(fake_hub.requests)
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache .* "
                       "HF_HUB_OFFLINE is set"):  # fmt: skip
        resolve_model_path("acme/Multi-GGUF:Q8_0")
    assert len(fake_hub.requests) == before
    monkeypatch.delenv("HF_HUB_OFFLINE")
    resolve_model_path("acme/Multi-GGUF:Q8_0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("acme/Multi-GGUF:Q8_0").read_bytes() == b"Q8_0"  # cached: fine
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as s:  # NOTE: a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ModelNotFoundError, match="the hub cannot be reached .*ConnectError"):
        resolve_model_path("acme/Multi-GGUF:Q4_0")


def test_folder_models_draft_models_and_heads_by_hub_id(
    fake_hub, tiny_llama, tiny_draft, tmp_path
) -> None:
    from tests.fixtures.heads import write_eagle

    head = write_eagle(tmp_path / "head", tiny_llama, "safeailab")
    for repo, folder in (("acme/tiny-llama", tiny_llama), ("acme/tiny-draft", tiny_draft),
                         ("acme/tiny-eagle", head)):  # fmt: skip
        fake_hub.add(repo, {p.name: p for p in folder.iterdir() if p.is_file()})
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(str(tiny_llama), max_model_len=64).generate(["the cat"], sp, use_tqdm=False)
    assert fake_hub.requests == []  # NOTE: a local path never touches the network
    for spec in ({"method": "draft_model", "model": "acme/tiny-draft", "num_speculative_tokens": 3},
                 {"method": "eagle", "model": "acme/tiny-eagle", "num_speculative_tokens": 2}):  # fmt: skip
        llm = LLM("acme/tiny-llama", max_model_len=64, speculative_config=spec)
        out = llm.generate(["the cat"], sp, use_tqdm=False)
        assert out[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
        assert llm.served_model_names == ["acme/tiny-llama"]
    assert sorted(r.path.rsplit("/", 1)[-1] for r in fake_hub.requests if r.method == "GET"
                  and "/resolve/" in r.path and "tiny-eagle" in r.path) == ["config.json", "pytorch_model.bin"]  # fmt: skip


def test_a_split_model_by_hub_id_downloads_every_part(fake_hub, tmp_path) -> None:
    """llama.cpp's -hf on a split model: the first part is loaded, every part downloaded; a
    whole file of the same quantization is preferred."""
    from specdec.model.registry import _smollm2_path
    from tests.fixtures.gguf_split import write_split_gguf

    parts = write_split_gguf(_smollm2_path(), tmp_path, "s-Q4_1", max_tensors=100)
    files = {p.name: p for p in parts} | {"s-Q8_0.gguf": b"Q8_0", "README.md": b"# s"}
    fake_hub.add("acme/Split-GGUF", files)
    fake_hub.add("acme/Broken-GGUF", {parts[0].name: parts[0], parts[2].name: parts[2]})
    path = resolve_model_path("acme/Split-GGUF:Q4_1")
    assert path.name == "s-Q4_1-00001-of-00003.gguf"
    assert sorted(p.name for p in path.parent.iterdir()) == [p.name for p in parts]
    assert not fake_hub.gets("s-Q8_0.gguf")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    by_id = LLM("acme/Split-GGUF:Q4_1", max_model_len=128).generate(["Hi"], sp, use_tqdm=False)
    whole = LLM(str(_smollm2_path()), max_model_len=128).generate(["Hi"], sp, use_tqdm=False)
    assert by_id[0].outputs[0].token_ids == whole[0].outputs[0].token_ids
    with pytest.raises(ModelNotFoundError, match="lacks parts in the repository .*00002-of"):
        resolve_model_path("acme/Broken-GGUF:Q4_1")


def test_a_tokenizer_by_hub_id_fetches_its_files_only(fake_hub, tiny_llama) -> None:
    from specdec.config import EngineArgs

    fake_hub.add("acme/tiny-tok", {p.name: p for p in tiny_llama.iterdir() if p.is_file()})
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM(str(tiny_llama), tokenizer="acme/tiny-tok", max_model_len=64)
    by_id = llm.generate(["the cat"], sp, use_tqdm=False)
    local = LLM(str(tiny_llama), max_model_len=64).generate(["the cat"], sp, use_tqdm=False)
    assert by_id[0].outputs[0].token_ids == local[0].outputs[0].token_ids
    fetched = {r.path.rsplit("/", 1)[-1] for r in fake_hub.requests if r.method == "GET"
               and "/resolve/" in r.path}  # fmt: skip
    assert "tokenizer.json" in fetched and not any(n.endswith(".safetensors") for n in fetched)
    assert Path(llm.llm_engine.config.tokenizer).name != "acme/tiny-tok"
    fake_hub.add("acme/no-tok", {"config.json": b"{}"})
    with pytest.raises(ModelNotFoundError, match=r"tokenizer \(--tokenizer\): .*no tokenizer.json"):
        EngineArgs(model=str(tiny_llama), tokenizer="acme/no-tok").create_engine_config()


def test_the_cli_takes_hub_ids_with_one_line_errors(fake_hub, tiny_llama, capsys) -> None:
    from specdec import cli

    fake_hub.add("acme/tiny-llama", {p.name: p for p in tiny_llama.iterdir() if p.is_file()})
    assert cli.main(["generate", "acme/tiny-llama", "the cat", "-n", "3", "--no-chat"]) == 0
    assert cli.main(["generate", "-hf", "acme/nope", "-p", "hi", "-n", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("specdec: error: no model 'acme/nope' on the Hugging Face hub")
    assert cli.main(["generate", str(tiny_llama), "hi", "--hf-file", "x.gguf"]) == 2
    assert "--hf-file" in capsys.readouterr().err


def test_serve_resolves_a_hub_id_before_loading(fake_hub, tiny_llama) -> None:
    from specdec import cli
    from specdec.entrypoints.openai.api_server import check_serve_args

    fake_hub.add("acme/tiny-llama", {p.name: p for p in tiny_llama.iterdir() if p.is_file()})
    args, _ = cli.build_parser().parse_known_args(
        ["serve", "acme/tiny-llama", "--revision", "main"]
    )
    _, config, _ = check_serve_args(args)
    assert (Path(config.model) / "model.safetensors").is_file() and args.model == "acme/tiny-llama"


def test_a_fresh_process_reads_the_environment(fake_hub, tiny_llama, tmp_path) -> None:
    """`specdec generate org/name`, HF_ENDPOINT and HF_HOME set before anything is imported:
    downloaded once, then offline from the cache with no request."""
    import os
    import subprocess
    import sys

    fake_hub.add("acme/tiny-llama", {p.name: p for p in tiny_llama.iterdir() if p.is_file()})
    env = {**os.environ, "HF_HOME": str(tmp_path / "fresh"), "SPECDEC_WEIGHT_CACHE": "off"}
    argv = [sys.executable, "-m", "specdec.cli", "generate", "acme/tiny-llama",
            "the cat", "-n", "3", "--no-chat", "--quiet"]  # fmt: skip
    for offline in ("0", "1"):
        before = len(_file_requests(fake_hub))
        run = subprocess.run(argv, env={**env, "HF_HUB_OFFLINE": offline}, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        assert (len(_file_requests(fake_hub)) > before) == (offline == "0")
    assert (tmp_path / "fresh" / "hub" / "models--acme--tiny-llama" / "refs" / "main").is_file()


def test_a_cached_model_is_found_without_huggingface_hubs_api(fake_hub) -> None:
    """A process that finds the model in the cache (its ref, the listing snapshot_download kept,
    the files) asks nothing and leaves huggingface_hub's API modules unimported (~0.09 s)."""
    import json
    import os
    import subprocess
    import sys

    path = resolve_model_path("acme/Multi-GGUF:Q8_0")
    code = (
        "import json, sys\n"
        "from specdec.model.hub import hub_model_path\n"
        "path = hub_model_path('acme/Multi-GGUF:Q8_0')\n"
        "print(json.dumps([str(path), sorted(m for m in sys.modules if m.startswith(('huggingface_hub', 'specdec.model.hub_')))]))"
    )  # fmt: skip
    before = len(fake_hub.requests)
    run = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    found, modules = json.loads(run.stdout.strip().splitlines()[-1])
    assert found == str(path) and len(fake_hub.requests) == before
    assert "huggingface_hub.hf_api" not in modules and "huggingface_hub.utils" not in modules
    assert "specdec.model.hub_http" not in modules  # NOTE: nor the download's own modules
    # the listing kept says Q6_K is not there: no request either, in this process
    with pytest.raises(ModelNotFoundError, match="no GGUF file for Q6_K"):
        resolve_model_path("acme/Multi-GGUF:Q6_K")
    assert len(fake_hub.requests) == before


def test_a_download_lists_the_commit_once(fake_hub) -> None:
    """model_info gives the commit and its files; its ref is recorded, its tree listed (every
    page) and kept for the cache, and each file fetched by one GET (no HEAD first: the listing
    names its blob, the GET's headers confirm it)."""
    import json

    fake_hub.page_size = 2
    path = resolve_model_path("acme/Multi-GGUF:Q8_0")
    commit = path.parent.name
    asked = [(r.method, r.path.split("?")[0]) for r in _file_requests(fake_hub)]
    assert asked == [
        ("GET", "/api/models/acme/Multi-GGUF"),
        *[("GET", f"/api/models/acme/Multi-GGUF/tree/{commit}")] * 3,
        ("GET", f"/acme/Multi-GGUF/resolve/{commit}/m-Q8_0.gguf"),
    ]
    assert (path.parents[2] / "refs" / "main").read_text() == commit
    kept = json.loads((path.parents[2] / "trees" / f"{commit}.json").read_text())
    assert kept["format_version"] == 1 and sorted(kept["files"]) == sorted(MULTI)


# ---- the download path on the standard library (model/hub_http.py, model/hub_download.py) ------
def _cache(tmp_path) -> Path:
    return tmp_path / "hf-home" / "hub"


def test_huggingface_hub_finds_our_downloads_and_we_find_its(fake_hub, tmp_path) -> None:
    """The cache is shared: a file this path downloaded is huggingface_hub's cached file (same
    blob name, link, ref and listing), and a blob huggingface_hub downloaded is not fetched again
    under another name or commit; the other way round too. LFS files come from the CDN."""
    from huggingface_hub import (
        hf_hub_download,
        scan_cache_dir,
        snapshot_download,
        try_to_load_from_cache,
    )
    from huggingface_hub.errors import LocalEntryNotFoundError

    from specdec.model.hub import HubOptions

    fake_hub.cdn = True
    cache = _cache(tmp_path)
    repo = "acme/SmolLM2-GGUF"
    ours = resolve_model_path(f"{repo}:Q4_1")
    assert try_to_load_from_cache(repo, SMOL_Q4, cache_dir=cache) == str(ours)
    assert hf_hub_download(repo, SMOL_Q4, cache_dir=cache, local_files_only=True) == str(ours)
    snapshot = snapshot_download(repo, cache_dir=cache, local_files_only=True,
                                 allow_patterns=[SMOL_Q4])  # fmt: skip
    assert Path(snapshot) == ours.parent.resolve()
    with pytest.raises(LocalEntryNotFoundError):  # NOTE: its listing (ours) says Q8_0 is missing
        snapshot_download(repo, cache_dir=cache, local_files_only=True)
    # huggingface_hub online, another file of the same bytes: its HEAD names our blob, no GET
    theirs = hf_hub_download(repo, SMOL_Q8, cache_dir=cache)
    assert Path(theirs).resolve() == ours.resolve() and not fake_hub.gets(SMOL_Q8)
    (info,) = scan_cache_dir(cache).repos
    (revision,) = info.revisions
    assert info.repo_id == repo and {f.file_name for f in revision.files} == {SMOL_Q4, SMOL_Q8}
    # the other way: what huggingface_hub downloaded is found, and its blob not fetched again
    m4 = hf_hub_download("acme/Multi-GGUF", "m-Q4_0.gguf", cache_dir=cache)
    before = len(fake_hub.requests)
    assert resolve_model_path("acme/Multi-GGUF:Q4_0") == Path(m4)
    assert len(fake_hub.requests) == before
    fake_hub.add("acme/Multi-GGUF", {**MULTI, "m-Q4_0-copy.gguf": b"Q4_0"})  # a new commit
    copy = resolve_model_path("acme/Multi-GGUF", HubOptions(filename="m-Q4_0-copy.gguf"))
    assert copy.resolve() == Path(m4).resolve() and copy.parent != Path(m4).parent
    assert not [r for r in fake_hub.requests[before:] if "/resolve/" in r.path]


def test_redirects_keep_the_token_on_the_hub_and_drop_it_for_the_cdn(fake_hub, monkeypatch) -> None:
    """A renamed repository's 307 (the hub's origin) keeps the Authorization header; the 302 of
    an LFS file to the CDN (another origin) drops it, as huggingface_hub does; the blob is named
    by the hub's X-Linked-Etag, not the CDN's ETag."""
    import hashlib

    fake_hub.cdn = True
    fake_hub.renamed["acme/Old-Gated"] = "acme/Gated-GGUF"
    monkeypatch.setenv("HF_TOKEN", fake_hub.token)
    path = resolve_model_path("acme/Old-Gated:Q4_0")
    assert path.read_bytes() == b"gated"
    assert path.resolve().name == hashlib.sha256(b"gated").hexdigest()
    bearer = f"Bearer {fake_hub.token}"
    cdn_host = fake_hub.cdn_url.removeprefix("http://")
    to_hub = [r for r in fake_hub.requests if r.headers["Host"] != cdn_host]
    to_cdn = [r for r in fake_hub.requests if r.headers["Host"] == cdn_host]
    assert all(r.headers.get("Authorization") == bearer for r in to_hub)
    assert len(to_cdn) == 1 and "Authorization" not in to_cdn[0].headers
    # model_info, the tree and the file under the old name, each sent on to the new one
    assert len([r for r in to_hub if "Old-Gated" in r.path]) == 3


def test_a_stored_login_is_the_token(fake_hub, tmp_path) -> None:
    (tmp_path / "hf-home").mkdir(exist_ok=True)
    (tmp_path / "hf-home" / "token").write_text(fake_hub.token + "\n")
    assert resolve_model_path("acme/Gated-GGUF").read_bytes() == b"gated"


def test_a_transfer_a_dead_process_left_resumes_and_bad_bytes_start_over(
    fake_hub, tmp_path
) -> None:
    """A ``blobs/<etag>.incomplete`` left behind is resumed with a Range request; resumed bytes
    that do not hash to the listed sha256 are dropped and the file fetched whole."""
    import hashlib
    import os

    data = os.urandom(3 << 20)
    sha = hashlib.sha256(data).hexdigest()
    for repo, partial, ranges in (("acme/Big-GGUF", data[:1234567], ["bytes=1234567-"]),
                                  ("acme/Bad-Big-GGUF", b"x" * 1000, ["bytes=1000-", None])):  # fmt: skip
        fake_hub.add(repo, {"b-Q4_0.gguf": data})
        blobs = _cache(tmp_path) / f"models--{repo.replace('/', '--')}" / "blobs"
        blobs.mkdir(parents=True)
        (blobs / f"{sha}.incomplete").write_bytes(partial)  # NOTE: as a killed download leaves it
        before = len(fake_hub.requests)
        path = resolve_model_path(f"{repo}:Q4_0")
        assert path.read_bytes() == data and path.resolve() == blobs / sha
        gets = [r for r in fake_hub.requests[before:] if r.path.endswith("/b-Q4_0.gguf")]
        assert [r.headers.get("Range") for r in gets] == ranges
        assert not list(blobs.glob("*.incomplete"))


def test_bytes_that_are_not_the_listed_ones_are_an_error(fake_hub, tmp_path) -> None:
    fake_hub.add("acme/Bad-GGUF", {"x-Q4_0.gguf": b"the real bytes"})
    (files,) = fake_hub.repos["acme/Bad-GGUF"].commits.values()
    files["x-Q4_0.gguf"].data = b"the fake bytes"  # NOTE: listed with the real bytes' sha256
    with pytest.raises(ModelNotFoundError, match="x-Q4_0.gguf: the bytes downloaded hash to "
                       ".*, the hub lists .*; download it again"):  # fmt: skip
        resolve_model_path("acme/Bad-GGUF:Q4_0")
    storage = _cache(tmp_path) / "models--acme--Bad-GGUF"
    assert not list(storage.glob("blobs/*")) and not list(storage.glob("snapshots/*/*"))


def test_an_answer_the_fast_path_does_not_read_goes_through_huggingface_hub(
    fake_hub, monkeypatch
) -> None:
    """The hub names a blob other than its listing's (here: the listing's LFS sha256 is wrong):
    huggingface_hub downloads (its HEAD first) and the file is there all the same."""
    from tests.fixtures import fake_hub as fixture

    entry = fixture.Blob.tree_entry

    def wrong(self, path):  # type: ignore[no-untyped-def]
        item = entry(self, path)
        if "lfs" in item:
            item["lfs"] = {**item["lfs"], "oid": "0" * 64}
        return item

    monkeypatch.setattr(fixture.Blob, "tree_entry", wrong)
    assert resolve_model_path("acme/Multi-GGUF:Q8_0").read_bytes() == b"Q8_0"
    assert [r.method for r in _file_requests(fake_hub) if "/resolve/" in r.path] == [
        "GET", "HEAD", "GET"]  # fmt: skip


def test_what_the_fast_path_leaves_to_huggingface_hub(monkeypatch, tmp_path) -> None:
    """The token as huggingface_hub picks it, and the settings that send the download through
    huggingface_hub: a proxy for the hub's address (not for one NO_PROXY names), an OAuth login
    it refreshes, an OIDC login it exchanges."""
    from specdec.model.hub_http import Unusual, proxied, resolve_token

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_OIDC_RESOURCE",
                 "HF_HUB_DISABLE_IMPLICIT_TOKEN", "HTTPS_PROXY", "https_proxy", "ALL_PROXY",
                 "all_proxy", "NO_PROXY", "no_proxy"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    home = str(tmp_path)
    assert resolve_token(None, home) is None and resolve_token("hf_x", home) == "hf_x"
    (tmp_path / "token").write_text("hf_stored\n")
    assert resolve_token(None, home) == resolve_token(True, home) == "hf_stored"
    assert resolve_token(False, home) is None
    monkeypatch.setenv("HF_TOKEN", "hf_env")
    assert resolve_token(None, home) == "hf_env"
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    assert resolve_token(None, home) is None and resolve_token(True, home) == "hf_env"
    monkeypatch.delenv("HF_TOKEN")
    (tmp_path / "stored_tokens").write_text("[x]\nhf_token = hf_stored\nrefresh_token = r\n")
    with pytest.raises(Unusual, match="OAuth"):
        resolve_token(True, home)
    monkeypatch.setenv("HF_OIDC_RESOURCE", "org/repo")
    with pytest.raises(Unusual, match="OIDC"):
        resolve_token(True, home)
    assert not proxied("https://huggingface.co/api/models/x")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert proxied("https://huggingface.co/api/models/x")
    assert not proxied("http://127.0.0.1:8000/api/models/x")  # NOTE: an https proxy only
    monkeypatch.setenv("NO_PROXY", "huggingface.co")
    assert not proxied("https://huggingface.co/api/models/x")


@pytest.mark.parametrize(
    "name, blob_id",
    [
        ("../../outside.gguf", "a" * 40),
        ("/etc/outside.gguf", "a" * 40),
        ("dir/./x.gguf", "a" * 40),
        ("dir\\..\\x.gguf", "a" * 40),
        ("model.gguf", "../../blob"),
    ],
)
def test_a_listing_that_would_leave_the_cache_is_refused(tmp_path, name, blob_id) -> None:
    """A file name or blob id from the hub becomes a path in the cache: one that leaves the
    snapshot folder (or is not a hash) is refused before any request or write."""
    from specdec.model.hub_download import TreeEntry, UnsafeListing, fetch_files

    storage = tmp_path / "models--acme--m"
    entries = {name: TreeEntry(size=4, blob_id=blob_id)}
    with pytest.raises(UnsafeListing, match="the hub listed"):
        fetch_files(None, storage, "acme/m", "c" * 40, [name], entries)  # type: ignore[arg-type]
    assert not tmp_path.joinpath("outside.gguf").exists() and not storage.exists()
