"""The chat page at ``/``: three static files in the package, served with a strict CSP.

The page talks to this server's own ``/v1`` API only (streamed chat with
``return_token_provenance``); it has no build step and loads nothing from elsewhere. Model
output is inserted as text. An API key, when the server wants one, stays in the page's memory.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

# NOTE: no inline script or style and no other origin: injected markup could not run even if a
# reply were ever inserted as HTML. connect-src 'self': the page can only call this server.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-cache",
}
STATIC_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/app.css": ("app.css", "text/css; charset=utf-8"),
}


def read_static(name: str) -> bytes:
    """A static file's bytes (read once, when the app is built)."""
    return resources.files("specdec.entrypoints.openai").joinpath("static", name).read_bytes()


def add_chat_page(app: Any) -> None:
    """GET routes for the page and its script and style (no API key: the page asks for it)."""
    from fastapi.responses import Response

    def handler(body: bytes, media_type: str) -> Any:
        async def serve() -> Any:
            return Response(body, media_type=media_type, headers=SECURITY_HEADERS)

        return serve

    for path, (name, media_type) in STATIC_FILES.items():
        serve = handler(read_static(name), media_type)
        app.add_api_route(path, serve, methods=["GET"], include_in_schema=False)
