"""The Hugging Face hub's few requests on the standard library (``http.client``), for model/hub.py's
downloads: its JSON API (the commit a revision names, the repository's listing) and a file's
bytes, following redirects as huggingface_hub does: the token goes to the hub's origins only,
never on to the CDN that ``resolve`` redirects an LFS file to, and a file's metadata (its
commit, ETag and size) is read from the last answer on the hub's side of the redirects.
Connections are kept alive, one per origin and thread.

What this does not handle raises ``Unusual``, and huggingface_hub does the download instead: a
proxy configured for the hub, a response compressed or without the hub's metadata, a login
that huggingface_hub refreshes (OAuth) or exchanges (OIDC).
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import sys
import threading
import urllib.request
from dataclasses import dataclass
from email.message import Message
from pathlib import Path
from urllib.parse import urlencode, urljoin, urlsplit

DEFAULT_ENDPOINT = "https://huggingface.co"
# the origins besides HF_ENDPOINT's that the token may go to (huggingface_hub's _HUB_ORIGINS)
HUB_ORIGINS = ("https://huggingface.co", "https://hub-ci.huggingface.co", "https://hf.co")
MAX_REDIRECTS = 20  # huggingface_hub's bound
DEFAULT_TIMEOUT_S = 10.0  # huggingface_hub's HF_HUB_DOWNLOAD_TIMEOUT and HF_HUB_ETAG_TIMEOUT
_REDIRECTS = (301, 302, 303, 307, 308)
_PORTS = {"http": 80, "https": 443}
_TLS: list[ssl.SSLContext] = []  # NOTE: one per process (loading the CA bundle takes ~20 ms)
_TLS_LOCK = threading.Lock()

Origin = tuple[str, str, int]


class HubHTTPError(Exception):
    """The hub answered an error: ``code`` is its ``X-Error-Code`` (RepoNotFound, GatedRepo,
    RevisionNotFound, EntryNotFound), ``message`` its ``X-Error-Message``."""

    def __init__(self, status: int, code: str | None, message: str | None, url: str) -> None:
        super().__init__(f"HTTP {status} ({code or 'no error code'}) for {url}: {message or ''}")
        self.status, self.code, self.message, self.url = status, code, message, url


class ConnectError(OSError):
    """The hub, or the CDN it redirected to, could not be reached or stopped answering."""


class Unusual(Exception):
    """A setting or an answer this client does not handle: huggingface_hub takes over."""


def origin(url: str) -> Origin:
    """(scheme, host, port) of ``url``, the port filled in: what the token is scoped to."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or _PORTS.get(scheme, 0)


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _clean(token: str | None) -> str | None:
    return (token or "").replace("\r", "").replace("\n", "").strip() or None


def resolve_token(token: str | bool | None, hf_home: str) -> str | None:
    """The token to send, picked as huggingface_hub's ``get_token_to_send`` does: ``token`` itself;
    none for False, or for None under ``HF_HUB_DISABLE_IMPLICIT_TOKEN``; else ``HF_TOKEN``
    (``HUGGING_FACE_HUB_TOKEN``), else the stored login (``HF_TOKEN_PATH``, else the file
    ``token`` in huggingface_hub's home folder ``hf_home``). Raises ``Unusual`` for the logins
    huggingface_hub refreshes or exchanges first."""
    if isinstance(token, str):
        return token
    if token is False or (token is None and _true(os.environ.get("HF_HUB_DISABLE_IMPLICIT_TOKEN"))):
        return None
    if os.environ.get("HF_OIDC_RESOURCE"):
        raise Unusual("an OIDC login (HF_OIDC_RESOURCE)")
    found = _clean(os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"))
    if found is not None:
        return found
    path = Path(os.path.expandvars(os.path.expanduser(
        os.environ.get("HF_TOKEN_PATH") or os.path.join(hf_home, "token")
    )))  # fmt: skip
    try:
        found = _clean(path.read_text())
        stored = (path.parent / "stored_tokens").read_text() if found else ""
    except FileNotFoundError:
        stored = ""
    except (OSError, ValueError) as e:
        raise Unusual(f"the stored login could not be read ({e})") from e
    if "refresh_token" in stored:  # NOTE: an OAuth login: huggingface_hub refreshes it
        raise Unusual("an OAuth login")
    return found


def proxied(url: str) -> bool:
    """A proxy is configured for ``url`` (``HTTPS_PROXY`` and the like, not bypassed by
    ``NO_PROXY``): huggingface_hub's HTTP client goes through it, this one does not."""
    proxies = urllib.request.getproxies()
    parts = urlsplit(url)
    if not (proxies.get(parts.scheme.lower()) or proxies.get("all")):
        return False
    return not urllib.request.proxy_bypass(parts.hostname or "")


def _tls() -> ssl.SSLContext:
    """The TLS context: ``SSL_CERT_FILE``/``SSL_CERT_DIR`` when set, else certifi's CA bundle (as
    huggingface_hub's client), else the system's."""
    with _TLS_LOCK:
        if not _TLS:
            cafile = None
            if not (os.environ.get("SSL_CERT_FILE") or os.environ.get("SSL_CERT_DIR")):
                try:
                    import certifi

                    cafile = certifi.where()
                except ImportError:
                    pass
            _TLS.append(ssl.create_default_context(cafile=cafile))
        return _TLS[0]


def next_link(headers: Message) -> str | None:
    """The ``rel="next"`` address of a ``Link`` header (the hub's pages of a listing)."""
    for part in (headers.get("Link") or "").split(","):
        address, _, params = part.partition(";")
        if 'rel="next"' in params.replace(" ", "") and address.strip().startswith("<"):
            return address.strip()[1:-1]
    return None


@dataclass
class Reply:
    """An answer under 300, its body unread: ``hub_headers`` are those of the last answer on the
    hub's side of the redirects (a file's metadata), ``url`` the address that answered."""

    client: HubClient
    origin: Origin
    conn: http.client.HTTPConnection
    response: http.client.HTTPResponse
    url: str
    hub_headers: Message

    def release(self) -> None:
        """The body was read whole: the connection serves the next request."""
        self.client._release(self.origin, self.conn, self.response)

    def discard(self) -> None:
        """The body is not read to its end: the connection closes."""
        self.conn.close()


class HubClient:
    """Requests to ``endpoint`` (and wherever it redirects), with ``token``."""

    def __init__(self, endpoint: str, token: str | None, timeout: float = DEFAULT_TIMEOUT_S):
        self.endpoint = endpoint.rstrip("/")
        self.timeout = timeout
        self._token = token
        self._hub = {origin(self.endpoint), *(origin(u) for u in HUB_ORIGINS)}
        self._idle: dict[Origin, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        # NOTE: the package's version read, not imported (specdec/__init__ names the layers above)
        version = getattr(sys.modules.get("specdec"), "__version__", "unknown")
        self._agent = f"specdec/{version}; python/{sys.version.split()[0]}"

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.close()

    def get_json(self, path: str, params: dict[str, str] | None = None) -> tuple[object, Message]:
        """GET ``path`` of the endpoint: (its JSON, its headers)."""
        query = f"?{urlencode(params)}" if params else ""
        return self.get_json_url(f"{self.endpoint}{path}{query}")

    def get_json_url(self, url: str) -> tuple[object, Message]:
        reply = self.open("GET", url)
        try:
            data = reply.response.read()
        except (OSError, http.client.HTTPException) as e:
            reply.discard()
            raise ConnectError(f"{url}: {e}") from e
        reply.release()
        try:
            return json.loads(data), reply.response.headers
        except ValueError as e:
            raise Unusual(f"{url} answered something other than JSON") from e

    def open(self, method: str, url: str, headers: dict[str, str] | None = None) -> Reply:
        """``method`` on ``url``, redirects followed (the token dropped once one leaves the hub's
        origins, as huggingface_hub does); raises HubHTTPError for an error status."""
        on_hub = True
        for _ in range(MAX_REDIRECTS + 1):
            here = origin(url)
            sent = dict(headers or {})
            if on_hub and self._token:
                sent["Authorization"] = f"Bearer {self._token}"
            conn, response = self._send(method, url, sent)
            if on_hub:
                hub_headers = response.headers
            location = response.getheader("Location")
            if response.status in _REDIRECTS and location:
                self._drain(here, conn, response)
                target = urljoin(url, location)
                on_hub = on_hub and (origin(target) == here or origin(target) in self._hub)
                url = target
                continue
            if response.status >= 300:
                self._drain(here, conn, response)
                raise HubHTTPError(response.status, response.getheader("X-Error-Code"),
                                   response.getheader("X-Error-Message"), url)  # fmt: skip
            return Reply(self, here, conn, response, url, hub_headers)
        raise Unusual(f"more than {MAX_REDIRECTS} redirects from {url}")

    def _send(
        self, method: str, url: str, headers: dict[str, str]
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        here = origin(url)
        parts = urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        # NOTE: identity: the sizes are the files' (huggingface_hub asks the same)
        sent = {"User-Agent": self._agent, "Accept-Encoding": "identity", **headers}
        for attempt in range(2):
            conn, reused = self._take(here, url)
            try:
                conn.request(method, target, headers=sent)
                return conn, conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as e:
                conn.close()
                if reused and attempt == 0:  # NOTE: a kept-alive connection the server closed
                    continue
                raise ConnectError(f"{url}: {e}") from e
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                raise ConnectError(f"{url}: {e}") from e
        raise AssertionError("unreachable")

    def _take(self, here: Origin, url: str) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            idle = self._idle.get(here)
            if idle:
                return idle.pop(), True
        if proxied(url):
            raise Unusual(f"a proxy is configured for {here[1]}")
        scheme, host, port = here
        if scheme == "https":
            conn = http.client.HTTPSConnection(host, port, timeout=self.timeout, context=_tls())
        elif scheme == "http":
            conn = http.client.HTTPConnection(host, port, timeout=self.timeout)
        else:
            raise Unusual(f"an address that is not http(s): {url}")
        return conn, False

    def _drain(self, here: Origin, conn: http.client.HTTPConnection, response) -> None:
        try:
            response.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            return
        self._release(here, conn, response)

    def _release(self, here: Origin, conn: http.client.HTTPConnection, response) -> None:
        if response.will_close or not response.isclosed():
            conn.close()
            return
        with self._lock:
            self._idle.setdefault(here, []).append(conn)
