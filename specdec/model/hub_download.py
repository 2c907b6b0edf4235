"""A commit's files from the hub into the Hugging Face cache, laid out as huggingface_hub lays
them (so that transformers, vLLM and huggingface_hub find them, and this finds theirs):
``blobs/<etag>`` (an LFS file's sha256, else git's blob sha1: the ETag the hub sends),
``snapshots/<commit>/<file>`` a relative link to its blob, ``trees/<commit>.json`` the commit's
listing in huggingface_hub's format (version 1), the blob written under huggingface_hub's lock
(``.locks/<repo folder>/<etag>.lock``, flock) so that the two never write one blob at once.

The bytes stream straight into ``blobs/<etag>.incomplete`` through large ``readinto`` buffers,
hashed as they arrive (in a thread for a large file: hashlib lets go of the GIL) against the
listing's sha256 (LFS) or git blob sha1, and sized against it. A transfer the network cuts
resumes with a ``Range`` request from the byte reached, up to 5 times without progress; a
process that dies leaves the ``.incomplete`` blob, which the next download resumes (resumed
bytes that do not hash right: the whole file again). A tqdm bar counts the bytes.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import queue
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from specdec.model.hub_http import ConnectError, HubClient, Reply, Unusual, next_link

TREE_FORMAT_VERSION = 1  # huggingface_hub's _tree_cache.TREE_CACHE_FORMAT_VERSION
# NOTE: a readinto and a write each. SmolLM2 Q4_1 (94 MiB) from the loopback stand-in hub, hashed
# alongside (2-vCPU Xeon VM, Linux 6.18, ext4): 0.10-0.12 s in pieces of 256 KiB to 1 MiB, 8 in
# flight (4 MiB); 0.17 s in 128 KiB ones (Python's work per piece); 0.33 s in 2 MiB and 4 MiB
# ones (writes of 2 MiB and up fill large page-cache folios: see DOWNLOAD_CHUNK_BYTES in hub.py)
CHUNK_BYTES = 512 << 10
BUFFERS = 8  # in flight between the socket and the hashing thread
THREADED_HASH_BYTES = 8 << 20  # smaller files hash inline
RETRIES = 5  # a cut transfer resumed this many times in a row without a byte more
MAX_WORKERS = 8  # files at once (huggingface_hub's snapshot_download default)
CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by huggingface_hub.\n"
    "# For information about cache directory tags, see:\n"
    "#\thttps://bford.info/cachedir/\n"
)
_XET_HASH = re.compile(r"[0-9a-fA-F]{64}")
_BLOB_ID = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # git's blob sha1, an LFS file's sha256


class CorruptDownload(OSError):
    """A downloaded file's size or hash is not the one the hub lists."""


class UnsafeListing(ValueError):
    """The hub listed a file whose name leaves the snapshot folder, or whose blob id is not a
    hash (a path in the cache would come from it)."""


def check_entry(name: str, entry: TreeEntry) -> None:
    """Raise ``UnsafeListing`` unless ``name`` is a plain relative path and the blob id a hash."""
    if (
        not name
        or name.startswith("/")
        or "\\" in name
        or "\0" in name
        or any(part in ("", ".", "..") for part in name.split("/"))
    ):
        raise UnsafeListing(f"the hub listed a file name outside the repository: {name[:80]!r}")
    if not _BLOB_ID.fullmatch(entry.etag):
        raise UnsafeListing(f"the hub listed {name[:80]!r} with a blob id that is not a hash")


@dataclass(frozen=True)
class TreeEntry:
    """A file as the hub's tree listing gives it (huggingface_hub's TreeCacheEntry)."""

    size: int
    blob_id: str  # git's blob sha1 (of the LFS pointer, for an LFS file)
    lfs_sha256: str | None = None
    lfs_size: int | None = None
    xet_hash: str | None = None

    @property
    def etag(self) -> str:
        """The hub's ETag for the file: the name of its blob in the cache."""
        return self.lfs_sha256 or self.blob_id

    @property
    def nbytes(self) -> int:
        return self.lfs_size if self.lfs_size is not None else self.size

    def to_json(self) -> dict:
        info: dict = {"size": self.size, "blob_id": self.blob_id}
        if self.lfs_sha256 is not None:
            info.update(lfs_sha256=self.lfs_sha256, lfs_size=self.lfs_size)
        if self.xet_hash is not None:
            info["xet_hash"] = self.xet_hash
        return info

    @classmethod
    def from_json(cls, info: dict) -> TreeEntry:
        return cls(int(info["size"]), str(info["blob_id"]), info.get("lfs_sha256"),
                   info.get("lfs_size"), info.get("xet_hash"))  # fmt: skip

    @classmethod
    def from_api(cls, item: dict) -> TreeEntry:
        lfs = item.get("lfs")
        return cls(
            size=int(item["size"]), blob_id=str(item["oid"]),
            lfs_sha256=lfs["oid"] if lfs else None, lfs_size=int(lfs["size"]) if lfs else None,
            xet_hash=item.get("xetHash"),
        )  # fmt: skip


# ---- the listing -----------------------------------------------------------------------------
def list_tree(client: HubClient, repo: str, commit: str) -> dict[str, TreeEntry]:
    """The files of ``repo`` at ``commit`` (every page of the hub's recursive tree listing)."""
    data, headers = client.get_json(
        f"/api/models/{repo}/tree/{quote(commit, safe='')}",
        {"recursive": "true", "expand": "false"},
    )
    entries: dict[str, TreeEntry] = {}
    while True:
        if not isinstance(data, list):
            raise Unusual("the hub's tree listing is not a list")
        try:
            for item in data:
                if item.get("type") == "file":
                    entries[item["path"]] = TreeEntry.from_api(item)
        except (KeyError, TypeError, ValueError) as e:
            raise Unusual(f"a tree entry this does not read ({e!r})") from e
        url = next_link(headers)
        if url is None:
            return entries
        data, headers = client.get_json_url(url)


def _tree_path(storage: Path, commit: str) -> Path:
    return storage / "trees" / f"{commit}.json"


def read_tree(storage: Path, commit: str) -> dict[str, TreeEntry] | None:
    """The listing kept in the cache for ``commit`` (None: none, or not huggingface_hub's
    format version 1)."""
    try:
        with open(_tree_path(storage, commit), encoding="utf-8") as f:
            kept = json.load(f)
        if kept.get("format_version") != TREE_FORMAT_VERSION:
            return None
        return {name: TreeEntry.from_json(info) for name, info in kept["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_tree(storage: Path, commit: str, entries: dict[str, TreeEntry]) -> None:
    """Keep the listing as huggingface_hub's snapshot_download does (sorted, ``indent=1``,
    written whole; none when a Xet hash is not one); best effort."""
    xet = [e.xet_hash for e in entries.values() if e.xet_hash is not None]
    if not all(_XET_HASH.fullmatch(h) for h in xet):
        return
    data = {
        "format_version": TREE_FORMAT_VERSION,
        "files": {name: entries[name].to_json() for name in sorted(entries)},
    }
    path = _tree_path(storage, commit)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass


# ---- the files -------------------------------------------------------------------------------
def fetch_files(
    client: HubClient,
    storage: Path,
    repo: str,
    commit: str,
    names: list[str],
    entries: dict[str, TreeEntry],
) -> None:
    """Download ``names`` of ``repo`` at ``commit`` into the cache folder ``storage``
    (``models--org--name``), those not there yet, several at a time, under one progress bar."""
    if os.name != "posix":  # NOTE: flock, pread, pwrite
        raise Unusual("not a POSIX system")
    snapshot = storage / "snapshots" / commit
    missing = [n for n in names if n not in entries]
    if missing:
        raise Unusual(f"the tree listing lacks {', '.join(missing[:4])}")
    for name in names:
        check_entry(name, entries[name])
    todo = [n for n in names if not (snapshot / n).is_file()]
    if not todo:
        return
    _tag(storage.parent)
    desc = todo[0] if len(todo) == 1 else f"{repo} ({len(todo)} files)"
    with _Progress(sum(entries[n].nbytes for n in todo), desc) as progress:

        def one(name: str) -> None:
            url = f"{client.endpoint}/{repo}/resolve/{quote(commit, safe='')}/{quote(name)}"
            _fetch_file(client, url, storage, snapshot, name, commit, entries[name], progress)

        if len(todo) == 1:
            one(todo[0])
            return
        with ThreadPoolExecutor(min(MAX_WORKERS, len(todo))) as pool:
            futures = [pool.submit(one, name) for name in todo]
            try:
                for done in futures:
                    done.result()
            except BaseException:
                pool.shutdown(cancel_futures=True)  # NOTE: the files not started yet
                raise


def _tag(cache: Path) -> None:
    """``CACHEDIR.TAG`` in the cache folder, as huggingface_hub writes it (backup tools skip)."""
    tag = cache / "CACHEDIR.TAG"
    if not tag.exists():
        with suppress(OSError):
            cache.mkdir(parents=True, exist_ok=True)
            tag.write_text(CACHEDIR_TAG)


def _fetch_file(
    client: HubClient,
    url: str,
    storage: Path,
    snapshot: Path,
    name: str,
    commit: str,
    entry: TreeEntry,
    progress: _Progress,
) -> None:
    blob = storage / "blobs" / entry.etag
    lock = storage.parent / ".locks" / storage.name / f"{entry.etag}.lock"
    blob.parent.mkdir(parents=True, exist_ok=True)
    with _locked(lock):
        if blob.is_file():  # NOTE: the same bytes under another name or commit
            progress.update(entry.nbytes)
        else:
            _download_blob(client, url, blob, name, commit, entry, progress)
        _link(blob, snapshot / name)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """huggingface_hub's per-blob lock (filelock's: flock on the file, left in place)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # NOTE: releases the lock


def _link(blob: Path, pointer: Path) -> None:
    """``pointer`` a relative link to ``blob`` (a copy where links cannot be made)."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    with suppress(FileNotFoundError):
        pointer.unlink()
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), pointer)
    except FileExistsError:
        if os.path.realpath(pointer) != os.path.realpath(blob):
            raise
    except OSError:
        shutil.copyfile(blob, pointer)


def _download_blob(
    client: HubClient,
    url: str,
    blob: Path,
    name: str,
    commit: str,
    entry: TreeEntry,
    progress: _Progress,
) -> None:
    """``blob`` (file ``name``) from ``url``, through ``blob.incomplete`` (resumed when there
    is one)."""
    part = blob.with_name(blob.name + ".incomplete")
    for attempt in range(2):
        fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o666)
        digest, got = _Digest(entry), None
        try:
            start = min(os.fstat(fd).st_size, entry.nbytes)
            if os.fstat(fd).st_size > start:
                # NOTE: only when needed: ext4 (auto_da_alloc) flushes a file truncated to 0 when
                # it is closed, ~35 ms for 94 MiB
                os.ftruncate(fd, start)
            digest.hash_file(fd, start)
            progress.update(start)
            _transfer(client, url, fd, start, commit, entry, digest, progress)
            got = digest.hexdigest()
        finally:
            digest.close()
            if got is None and os.fstat(fd).st_size == 0:  # NOTE: nothing to resume
                part.unlink(missing_ok=True)
            os.close(fd)
        if got == digest.want:
            os.replace(part, blob)
            return
        part.unlink()
        progress.update(-entry.nbytes)
        if start == 0 or attempt == 1:  # NOTE: resumed bytes that did not match: once more whole
            raise CorruptDownload(
                f"{name}: the bytes downloaded hash to {got}, the hub lists {digest.want}"
            )


def _transfer(
    client: HubClient,
    url: str,
    fd: int,
    pos: int,
    commit: str,
    entry: TreeEntry,
    digest: _Digest,
    progress: _Progress,
) -> None:
    """Bytes ``pos`` on of the file into ``fd``: a cut transfer resumes with a Range request."""
    size, tries = entry.nbytes, 0
    while pos < size:
        before = pos
        try:
            reply = _request(client, url, pos, commit, entry)
        except ConnectError as e:
            error: ConnectError | None = e
        else:
            if reply.response.status == 200 and pos:  # NOTE: the Range was not honoured
                digest.reset()
                progress.update(-pos)
                os.ftruncate(fd, 0)
                pos = before = 0
            pos, error = _stream(reply, fd, pos, size, digest, progress)
        if error is None:
            reply.release()
            break
        tries = 0 if pos > before else tries + 1
        if tries >= RETRIES:
            raise error
        time.sleep(min(1.0, 0.05 * 2**tries))
    digest.finish()
    if os.fstat(fd).st_size != size:
        raise CorruptDownload(f"{url}: {os.fstat(fd).st_size} bytes written, the hub lists {size}")


def _request(client: HubClient, url: str, pos: int, commit: str, entry: TreeEntry) -> Reply:
    """GET the file (from byte ``pos``), checked against the listing: the commit and ETag the
    hub names (before any redirect off its origins), the size, the range."""
    reply = client.open("GET", url, {"Range": f"bytes={pos}-"} if pos else None)
    meta, response = reply.hub_headers, reply.response
    etag = (meta.get("X-Linked-Etag") or meta.get("ETag") or "").removeprefix("W/").strip('"')
    size = _int(meta.get("X-Linked-Size"))
    if size is None and meta is response.headers:  # NOTE: no redirect: the answer's own length
        total = (response.getheader("Content-Range") or "").rpartition("/")[2]
        size = _int(total if response.status == 206 else response.getheader("Content-Length"))
    size = entry.nbytes if size is None else size
    problem = None
    if meta.get("X-Repo-Commit") != commit or etag != entry.etag or size != entry.nbytes:
        problem = (f"the hub names commit {meta.get('X-Repo-Commit')}, blob {etag}, {size} "
                   f"bytes; its listing {commit}, {entry.etag}, {entry.nbytes}")  # fmt: skip
    elif (response.getheader("Content-Encoding") or "identity").lower() != "identity":
        problem = f"a body sent {response.getheader('Content-Encoding')}"
    elif response.status == 206 and not _range_from(response, pos, entry.nbytes):
        problem = f"a range other than bytes {pos}-: {response.getheader('Content-Range')}"
    elif response.status not in (200, 206):
        problem = f"HTTP {response.status}"
    if problem:
        reply.discard()
        raise Unusual(f"{url}: {problem}")
    return reply


def _int(value: str | None) -> int | None:
    return int(value) if value and value.strip().isdigit() else None


def _range_from(response: http.client.HTTPResponse, pos: int, size: int) -> bool:
    got = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", response.getheader("Content-Range") or "")
    return bool(got) and int(got[1]) == pos and int(got[2]) == size - 1


def _stream(
    reply: Reply, fd: int, pos: int, size: int, digest: _Digest, progress: _Progress
) -> tuple[int, ConnectError | None]:
    """Read the body into the file from ``pos``: the position reached, and what cut the
    transfer (None: nothing; else the connection is closed, ``digest`` has every byte written)."""
    response = reply.response
    while pos < size:
        buf = digest.buffer()
        try:
            n = response.readinto(buf[: min(len(buf), size - pos)])
        except (OSError, http.client.HTTPException) as e:
            n, cause = 0, f"{type(e).__name__}: {e}"
        else:
            cause = "the connection closed"
        if n == 0:
            digest.give_back(buf)
            reply.discard()
            return pos, ConnectError(f"{reply.url}: the transfer stopped at byte {pos} ({cause})")
        view = buf[:n]
        written = 0
        while written < n:
            written += os.pwrite(fd, view[written:], pos + written)
        digest.update(buf, n)
        pos += n
        progress.update(n)
    return pos, None


class _Digest:
    """The file's hash as the listing gives it: an LFS file's sha256, else git's blob sha1
    (``blob <size>\\0`` and the bytes). A large file is hashed in a thread as buffers arrive."""

    def __init__(self, entry: TreeEntry) -> None:
        self.entry = entry
        self.want = entry.lfs_sha256 or entry.blob_id
        self._threaded = entry.nbytes >= THREADED_HASH_BYTES
        self._free: queue.Queue[memoryview] = queue.Queue()
        self._buffers = 0  # NOTE: made as needed, up to BUFFERS (1 when hashed inline)
        self._work: queue.Queue[tuple[memoryview, int] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.reset()

    def reset(self) -> None:
        """Start over (the bytes go again from the first)."""
        self.finish()
        if self.entry.lfs_sha256:
            self._hash = hashlib.sha256()
        else:
            self._hash = hashlib.sha1(b"blob %d\0" % self.entry.size)
        if self._threaded:
            self._thread = threading.Thread(target=self._run, name="hub-hash", daemon=True)
            self._thread.start()

    def hash_file(self, fd: int, length: int) -> None:
        """Hash the first ``length`` bytes already in ``fd`` (a resumed download's)."""
        done = 0
        while done < length:
            data = os.pread(fd, min(CHUNK_BYTES * 8, length - done), done)
            if not data:
                break
            self._hash.update(data)
            done += len(data)

    def buffer(self) -> memoryview:
        if self._error is not None:
            raise self._error
        if self._free.empty() and self._buffers < (BUFFERS if self._threaded else 1):
            self._buffers += 1
            return memoryview(bytearray(min(CHUNK_BYTES, max(self.entry.nbytes, 1))))
        return self._free.get()

    def give_back(self, buf: memoryview) -> None:
        self._free.put(buf)

    def update(self, buf: memoryview, n: int) -> None:
        if self._threaded:
            self._work.put((buf, n))
        else:
            self._hash.update(buf[:n])
            self._free.put(buf)

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            buf, n = item
            try:
                self._hash.update(buf[:n])
            except BaseException as e:  # noqa: BLE001 - handed to the reading thread
                self._error = e
            self._free.put(buf)

    def finish(self) -> None:
        """Wait for the bytes handed over to be hashed."""
        self.close()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        if self._thread is not None:
            self._work.put(None)
            self._thread.join()
            self._thread = None

    def hexdigest(self) -> str:
        self.finish()
        return self._hash.hexdigest()


class _Progress:
    """A tqdm bar of the bytes, shown as huggingface_hub shows its own: not when
    ``HF_HUB_DISABLE_PROGRESS_BARS`` is set, always when ``TQDM_POSITION=-1``, else on a
    terminal (tqdm's ``disable=None``)."""

    def __init__(self, total: int, desc: str) -> None:
        from tqdm import tqdm

        value = (os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") or "").strip().lower()
        disable: bool | None = value in ("1", "true", "yes", "on") or None
        if disable is None and os.environ.get("TQDM_POSITION") == "-1":
            disable = False
        if len(desc) > 40:
            desc = f"(…){desc[-40:]}"
        self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                        disable=disable)  # fmt: skip
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        if n:
            with self._lock:
                self.bar.update(n)

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()
