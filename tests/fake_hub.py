"""A stand-in Hugging Face hub on loopback: just the requests ``huggingface_hub`` makes to find
and download a model's files, so the hub tests run without a network.

- ``GET /api/models/{repo}/revision/{rev}``: the commit a branch, tag or commit names (``sha``)
  and its files (``siblings``);
- ``GET /api/models/{repo}/tree/{rev}?recursive=...``: the files, with sizes (one page);
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag``, ``X-Linked-Size``,
  ``Content-Length``, and the bytes (``Range: bytes=N-`` gives a 206 with the rest).

Errors as the hub sends them: 404 with ``X-Error-Code: RepoNotFound`` / ``RevisionNotFound`` /
``EntryNotFound``; a gated repository answers 401 (no ``Authorization``) or 403 (another token)
with ``X-Error-Code: GatedRepo``. ``cut_once`` names files whose first GET sends half the bytes
and then drops the connection. Every request is recorded (method, path, headers).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

CHUNK = 1 << 20


@dataclass
class Blob:
    """A file's bytes: in memory, or a file on disk (the real model, read in chunks)."""

    data: bytes | Path

    @property
    def size(self) -> int:
        return len(self.data) if isinstance(self.data, bytes) else self.data.stat().st_size

    def read(self, start: int, end: int) -> bytes:
        if isinstance(self.data, bytes):
            return self.data[start:end]
        with self.data.open("rb") as f:
            f.seek(start)
            return f.read(end - start)

    @property
    def etag(self) -> str:
        if not hasattr(self, "_etag"):
            h = hashlib.sha256()
            for start in range(0, self.size, 64 * CHUNK):
                h.update(self.read(start, min(self.size, start + 64 * CHUNK)))
            self._etag = h.hexdigest()
        return self._etag


@dataclass
class Repo:
    """Commits (sha -> files) and the branches that name them; ``gated``: a token is needed."""

    commits: dict[str, dict[str, Blob]]
    branches: dict[str, str]
    gated: bool = False

    def commit(self, rev: str) -> str | None:
        return rev if rev in self.commits else self.branches.get(rev)


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class FakeHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    token: str = "hf_test_token"
    requests: list[Request] = field(default_factory=list)
    cut_once: set[str] = field(default_factory=set)
    url: str = ""

    def add(
        self, repo: str, files: dict[str, bytes | Path], branch: str = "main", gated: bool = False
    ) -> str:
        """Add a commit of ``files`` to ``repo`` under ``branch``; returns its sha."""
        blobs = {name: Blob(data) for name, data in files.items()}
        sha = hashlib.sha1(f"{repo}@{branch}:{sorted(files)}".encode()).hexdigest()
        entry = self.repos.setdefault(repo, Repo({}, {}, gated))
        entry.commits[sha] = blobs
        entry.branches[branch] = sha
        return sha

    def gets(self, name: str) -> list[Request]:
        """The GET requests for file ``name``."""
        return [r for r in self.requests if r.method == "GET" and r.path.endswith("/" + name)]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            headers = {k.title(): v for k, v in self.headers.items()}  # NOTE: one spelling
            hub.requests.append(Request(self.command, self.path, headers))
            parts = [unquote(p) for p in urlsplit(self.path).path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) in (4, 6):
                repo_id = "/".join(parts[2:4])
                what, rev = (parts[4], parts[5]) if len(parts) == 6 else ("revision", "main")
                repo = self._repo(repo_id)
                sha = repo and self._commit(repo, rev)
                if sha and what == "revision":
                    files = repo.commits[sha]
                    self._json({"id": repo_id, "sha": sha, "private": False,
                                "gated": "auto" if repo.gated else False,
                                "siblings": [{"rfilename": n} for n in files]})  # fmt: skip
                elif sha and what == "tree":
                    self._json([{"type": "file", "path": n, "size": b.size, "oid": b.etag[:40]}
                                for n, b in repo.commits[sha].items()])  # fmt: skip
                elif sha:
                    self._error(404, "EntryNotFound")
            elif len(parts) >= 5 and parts[2] == "resolve":
                repo = self._repo("/".join(parts[:2]))
                sha = repo and self._commit(repo, parts[3])
                if sha:
                    self._file(repo, sha, "/".join(parts[4:]), body)
            else:
                self._error(404, "RepoNotFound")

        def _repo(self, repo_id: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            if repo.gated:
                auth = self.headers.get("Authorization")
                if auth is None:
                    self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted.")
                    return None
                if auth != f"Bearer {hub.token}":
                    self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted.")
                    return None
            return repo

        def _commit(self, repo: Repo, rev: str) -> str | None:
            sha = repo.commit(rev)
            if sha is None:
                self._error(404, "RevisionNotFound", "Invalid rev id")
            return sha

        def _file(self, repo: Repo, sha: str, name: str, body: bool) -> None:
            blob = repo.commits[sha].get(name)
            if blob is None:
                return self._error(404, "EntryNotFound", "Entry not found", sha)
            size, start = blob.size, 0
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes=") and rng.endswith("-"):
                start = int(rng[len("bytes=") : -1])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", sha)
            self.send_header("ETag", f'"{blob.etag}"')
            self.send_header("X-Linked-Size", str(size))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(size - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            self.end_headers()
            if not body:
                return
            end = size
            if name in hub.cut_once:  # NOTE: half the bytes, then the connection drops
                hub.cut_once.discard(name)
                end = start + (size - start) // 2
                self.close_connection = True
            for pos in range(start, end, CHUNK):
                self.wfile.write(blob.read(pos, min(end, pos + CHUNK)))
            self.wfile.flush()

        def _json(self, value) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def _error(self, status: int, code: str, message: str = "", sha: str | None = None) -> None:
            data = json.dumps({"error": message or code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message or code)
            if sha:
                self.send_header("X-Repo-Commit", sha)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

    return Handler


class HubServer:
    """``FakeHub`` served on 127.0.0.1 at a free port, from a thread (``with`` it)."""

    def __init__(self, hub: FakeHub) -> None:
        self.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
        self.server.daemon_threads = True
        hub.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self.hub

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
