"""The server's input guards without a server: bounded JSON, Host names, log escaping, and the
chat template sandbox's operator guards."""

from __future__ import annotations

import json
import time

import pytest
from jinja2.exceptions import SecurityError

from specdec.entrypoints.openai.chat_sandbox import render_guarded
from specdec.entrypoints.openai.protocol import RequestError
from specdec.entrypoints.openai.safety import (
    DEFAULT_JSON_LIMITS,
    JSONLimits,
    default_allowed_hosts,
    dropped_bytes,
    for_log,
    host_allowed,
    host_name,
    parse_json_body,
    unrepresentable,
)


def _refused(body: bytes | str, limits: JSONLimits = DEFAULT_JSON_LIMITS) -> RequestError:
    raw = body.encode() if isinstance(body, str) else body
    with pytest.raises(RequestError) as e:
        parse_json_body(raw, limits)
    assert e.value.status == 400
    return e.value


def test_parse_json_body_accepts_a_request() -> None:
    body = {
        "messages": [{"role": "user", "content": "héllo \U0001f600"}],
        "seed": 2**63,
        "top_p": 0.5,
    }
    assert parse_json_body(json.dumps(body).encode()) == body
    assert parse_json_body(json.dumps(body, ensure_ascii=False).encode("utf-16")) == body


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ("{not json", "invalid_json", None),
        ("[1]", "invalid_json", None),
        (b"\xff\xfe\xfd", "invalid_json", None),
        ('{"t": NaN}', "invalid_json", None),
        ('{"t": -Infinity}', "invalid_json", None),
        ('{"t": 1e400}', "invalid_json", None),
        ('{"t": ' + "1" * 5000 + "}", "invalid_json", None),
        ('{"a": ' + "[" * 5000 + "]" * 5000 + "}", "request_too_complex", None),
        # a deep path is shortened: its start and end (it is mostly the client's own keys)
        (
            '{"a": ' + "[" * 65 + "]" * 65 + "}",
            "request_too_complex",
            ("a" + "[0]" * 63)[:80] + "..." + ("a" + "[0]" * 63)[-30:],
        ),
        ('{"a": "\\ud800"}', "invalid_value", "a"),
        ('{"a": [{"b": "x\\udc00"}]}', "invalid_value", "a[0].b"),
        ('{"\\ud800": 1}', "invalid_value", None),
    ],
)
def test_parse_json_body_refuses(body: str | bytes, code: str, param: str | None) -> None:
    err = _refused(body)
    assert err.code == code and err.param == param, err.message


def test_parse_json_body_limits_name_the_path() -> None:
    small = JSONLimits(max_depth=4, max_containers=10, max_numbers=5, max_list_items=3,
                       max_object_keys=2, max_string_chars=4)  # fmt: skip
    assert _refused('{"a": [[[[1]]]]}', small).param == "a[0][0][0]"
    assert "limit is 10" in _refused('{"a": "' + "[" * 11 + '"}', small).message  # raw bytes
    assert "more than 5 numbers" in _refused('{"a": [1, 2, 3.5], "b": [4, 5, 6]}', small).message
    assert _refused('{"a": ["", "", "", ""]}', small).param == "a"
    assert _refused('{"a": {"x": 1, "y": 2, "z": 3}}', small).param == "a"
    assert _refused('{"a": ["12345"]}', small).param == "a[0]"


def test_parse_json_body_refuses_the_worst_bodies() -> None:
    """Bodies that took ~0.1-0.9 s to parse with the GIL held are refused (in a few ms; no
    wall-clock bound here: speed belongs to benchmarks, and CI machines are shared)."""
    worst = [
        b"[" + b",".join([b"[[[[[[[[]]]]]]]]"] * 230_000) + b"]",
        b'{"a": [' + b",".join([b"1"] * 1_500_000) + b"]}",
        b'{"a": [' + b",".join([b'{"a":1}'] * 500_000) + b"]}",
    ]
    for body in worst:
        _refused(body)


@pytest.mark.parametrize(
    ("header", "name"),
    [("example.com:8000", "example.com"), ("[::1]:80", "::1"), ("::1", "::1"), ("LocalHost", "localhost"), ("", "")],
)  # fmt: skip
def test_host_name(header: str, name: str) -> None:
    assert host_name(header) == name


def test_host_allowed() -> None:
    loop = default_allowed_hosts("127.0.0.1")
    assert loop is not None and "localhost" in loop and "::1" in loop
    assert host_allowed("127.0.0.1:8000", loop) and host_allowed("localhost.", loop)
    assert not host_allowed("evil.example", loop) and not host_allowed(None, loop)
    assert not host_allowed("localhost.evil.example", loop)
    assert (
        default_allowed_hosts("::1") is not None and default_allowed_hosts("127.0.0.2") is not None
    )
    assert default_allowed_hosts("0.0.0.0") is None and default_allowed_hosts("10.1.2.3") is None
    assert host_allowed("anything", None) and host_allowed("anything", ["*"])
    assert host_allowed("api.example.com", ["*.example.com"])
    assert not host_allowed("example.com.evil", ["*.example.com"])


def test_for_log_escapes_and_cuts() -> None:
    line = for_log("a\nb\r\x1b[31mc\u2028" + "x" * 500, limit=20)
    assert line.isprintable() and line.isascii() and "\n" not in line and line.endswith("...")
    assert "\\n" in line and len(line) < 60


@pytest.mark.parametrize(
    "template",
    [
        "{{ 9 ** (9 ** 7) }}",
        "{{ 2 ** 5000 }}",
        "{% set x = 2 ** 4000 %}{{ x * x }}",
        "{{ 'ab' * 10 ** 7 }}",
        "{{ [1] * 10 ** 7 }}",
        "{% set s = 'x' * 1000000 %}{{ s + s }}",
        "{{ '%099999d' % 1 }}",
        "{{ '%.*f' % (5, 1.0) }}",
    ],
)
def test_guards_refuse_blowups_at_once(template: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(SecurityError):
        render_guarded(template, {})
    assert time.perf_counter() - t0 < 0.5


def test_guards_leave_ordinary_templates_alone() -> None:
    template = (
        "{% for m in messages %}{{ '<|' + m.role + '|>' }}{{ m.content }}{% endfor %}"
        "{{ '-' * 3 }}{{ 2 ** 10 }}{{ '%5d' % 7 }}{{ (messages | length) * 2 }}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert (
        render_guarded(template, {"messages": messages}) == "<|user|>hi<|assistant|>yo---1024    74"
    )


# ---- text the tokenizer cannot represent ---------------------------------------------------------


def _byte_level(missing: bytes, unk: str | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from specdec.model.tokenizer import bytes_to_unicode

    chars = [c for b, c in bytes_to_unicode().items() if b not in missing]
    vocab = {c: i for i, c in enumerate(chars + ([unk] if unk else []))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    return tok


def test_dropped_bytes_are_the_byte_tokens_missing_without_an_unknown_token() -> None:
    tok = _byte_level(b"\x14\xf1")
    assert dropped_bytes(tok) == b"\x14\xf1"
    assert tok.encode("hi\x14there").tokens == list("hithere")  # what it would do: drop it
    assert dropped_bytes(_byte_level(b"")) == b""
    assert dropped_bytes(_byte_level(b"\x14", unk="<unk>")) == b""  # no silent drop


@pytest.mark.parametrize(
    ("text", "char"),
    [
        ("hi\x14there", "\x14"),
        ("plain text", None),
        ("é\x14", "\x14"),
        ("a\U00040000b", "\U00040000"),  # UTF-8 f1 80 80 80: its lead byte has no token
        ("\U0001f600 \u4e2d\x13", None),
        ("x" * 100_000 + "\x14", "\x14"),
    ],
)
def test_unrepresentable_finds_the_first_character_with_a_dropped_byte(text, char) -> None:
    assert unrepresentable(text, b"\x14\xf1") == char
    assert unrepresentable(text, b"") is None


def test_one_clients_slow_templates_leave_a_worker_for_the_others() -> None:
    """TemplateSandbox's lanes: three renders of one client that run to the time limit hold
    one of two workers; another client's template renders at once beside them."""
    import asyncio
    import time

    from specdec.entrypoints.openai.chat_sandbox import TemplateRenderError, TemplateSandbox

    slow = "{% for a in range(10000) %}{% for b in range(10000) %}{% for c in range(10000) %}"
    slow += "{% endfor %}{% endfor %}{% endfor %}"  # 10**12 steps: far past the limit

    async def run() -> tuple[float, list]:
        sandbox = TemplateSandbox(timeout_s=3.0)
        await sandbox.start()
        try:
            hostile = [asyncio.ensure_future(sandbox.render(slow, {}, lane="a")) for _ in range(3)]
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            text = await sandbox.render("{{ 1 + 1 }}", {}, lane="b")
            took = time.perf_counter() - t0
            assert text == "2"
            done = await asyncio.gather(*hostile, return_exceptions=True)
            return took, done
        finally:
            await sandbox.close()

    took, done = asyncio.run(run())
    assert took < 1.5, took  # a worker was free: no wait behind the 3 s renders
    assert all(isinstance(e, TemplateRenderError) for e in done), done  # each ran to the limit
