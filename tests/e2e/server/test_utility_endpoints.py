"""The endpoints clients call besides completions: /v1/models/{id} (the openai client's
models.retrieve), /tokenize and /detokenize (vLLM's shapes, llama.cpp's content field),
/version and /ping."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.fixtures.server import API_KEY, _client, _start


@pytest.fixture(scope="module")
def srv(tiny_llama):
    server = _start(str(tiny_llama), api_key=API_KEY)
    yield server
    server.stop()


def _post(srv, path: str, body: dict, key: str = API_KEY) -> httpx.Response:
    return httpx.post(
        f"{srv.url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def test_models_retrieve(srv) -> None:
    client = _client(srv, API_KEY)
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4-secret-name")
    assert "gpt-4-secret-name" not in str(e.value.body)


def test_tokenize_and_detokenize_round_trip(srv) -> None:
    tok = srv.server.config.app.state.llm.engine.tokenizer
    r = _post(srv, "/tokenize", {"model": "tiny", "prompt": "the cat sat"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("the cat sat") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == srv.server.config.app.state.llm.engine.max_model_len
    r = _post(srv, "/tokenize", {"content": "the cat sat", "return_token_strs": True})
    assert r.json()["tokens"] == body["tokens"]
    assert "".join(r.json()["token_strs"]) == tok.decode(body["tokens"], False)
    back = _post(srv, "/detokenize", {"tokens": body["tokens"]}).json()
    assert back["prompt"] == back["content"] == "the cat sat"
    chat = [{"role": "user", "content": "hi"}]
    r = _post(srv, "/tokenize", {"messages": chat})
    want = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert r.json()["tokens"] == want


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "messages": []}, None),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ],
)
def test_bad_bodies_are_4xx(srv, path: str, body: dict, param: str | None) -> None:
    r = _post(srv, path, body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert "\n" not in err["message"]
    if param is not None:
        assert err["param"] == param


def test_version_ping_and_the_api_key(srv) -> None:
    import specdec

    assert httpx.get(f"{srv.url}/version").json() == {"version": specdec.__version__}
    assert httpx.get(f"{srv.url}/ping").status_code == 200
    assert httpx.post(f"{srv.url}/ping", json={}).status_code == 200
    assert _post(srv, "/tokenize", {"prompt": "a"}, key="wrong").status_code == 401
