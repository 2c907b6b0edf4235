"""The chat page in a real headless Chromium (Debian's, driven by Playwright) against a real
``specdec serve smollm2-135m`` with n-gram speculation behind ``--api-key`` (issue 35).

Set SPECDEC_CHAT_SCREENSHOT=docs/chat_page.png to save a screenshot of the reply."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from playwright import sync_api as playwright  # pinned in requirements-test.txt

from tests.fixtures.server import serve

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
REPO = Path(__file__).resolve().parents[3]
KEY = "page-test-key"
SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'
# the model copies this back: its tokens come as accepted n-gram drafts, and the markup must stay text
ECHO = "Repeat exactly: <script>alert(1)</script> <img src=x onerror=alert(2)> the end. " * 2


@pytest.fixture(scope="module")
def served():
    # NOTE: ~15 s to start on a quiet machine; generous for a loaded CI runner
    with serve(
        "smollm2-135m", "--api-key", KEY, "--speculative-config", SPEC, "--max-model-len", "512",
        "--disable-log-stats", "--uvicorn-log-level", "warning",
        command=(sys.executable, "-m", "specdec", "serve"), timeout=180, grace=15,
    ) as srv:  # fmt: skip
        yield srv.url


def test_chat_page_streams_coloured_reply(served, tmp_path):
    assert Path(CHROMIUM).exists(), "chromium is missing: run scripts/setup.sh test"
    dialogs: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(served + "/")
        # the server wants a key: the page asks for it and chatting without it is refused
        page.wait_for_selector("#key_row:not([hidden])", timeout=10_000)
        page.fill("#max_tokens", "60")
        page.fill("#prompt", ECHO)
        page.click("#send")
        page.wait_for_selector("body[data-state=done]", timeout=30_000)
        assert "API key" in page.text_content("#error")
        assert page.locator("#log .msg").count() == 0
        # with the key: a streamed reply, coloured by provenance
        page.fill("#api_key", KEY)
        page.click("#send")
        page.wait_for_function("document.body.dataset.state === 'streaming'", timeout=5_000)
        page.wait_for_selector("body[data-state=done]", timeout=40_000)
        assert page.text_content("#error") == ""
        reply = page.text_content("#log .msg.assistant")
        assert reply
        num_drafts = page.locator("#log .msg.assistant span.draft").count()
        assert num_drafts > 0
        assert num_drafts == int(page.text_content("#draft_n_accepted"))
        assert page.text_content("#accepted") == str(num_drafts)
        assert page.text_content("#tps") not in ("-", "")
        assert page.text_content("#mal") not in ("-", "")
        # markup in the prompt and the reply stays text
        assert "<img src=x onerror=alert(2)>" in page.text_content("#log .msg.user")
        assert page.locator("#log script, #log img").count() == 0
        if "<script>" not in reply:
            print("note: the model did not echo the markup:", reply[:200])
        page.wait_for_timeout(300)
        assert dialogs == []
        shot = os.environ.get("SPECDEC_CHAT_SCREENSHOT")
        page.screenshot(path=shot or str(tmp_path / "chat.png"), full_page=True)
        browser.close()
