"""Empty or malformed prompts and conversations get a clear ValueError (never a TypeError), with
nothing queued; LLM.chat takes vLLM's keyword arguments."""

from __future__ import annotations

import pytest

from specdec import LLM, SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), max_model_len=64)


@pytest.mark.parametrize(
    ("prompts", "needle"),
    [
        ({"prompt_token_ids": []}, "prompts[0]: prompt_token_ids is empty"),
        ({"prompt_token_ids": None}, "prompt_token_ids must be a list of token ids, not NoneType"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids must be a list of token ids, not str"),
        ({"prompt_token_ids": [1, "a"]}, "prompt token ids must be integers; item 1 is str"),
        ({"prompt": None}, "prompts[0]: prompt must be a string, not NoneType"),
        ({"foo": 1}, "a prompt dict needs 'prompt' (text) or 'prompt_token_ids'"),
        ({"prompt": ""}, "prompts[0]: prompt is empty"),
        ("", "prompts[0]: prompt is empty"),
        ([[]], "prompts[0]: prompt is empty"),
        ([[1, 2], []], "prompts[1]: prompt is empty"),
        ([1, -1], "prompts[0]: prompt token ids must be in [0, "),
        (["a", 5], "prompts[1]: prompt must be a string or a list of token ids, not int"),
        (None, "prompts must be a string, a list of token ids, a prompt dict or a list"),
        (123, "prompts must be a string, a list of token ids, a prompt dict or a list"),
    ],
)
def test_bad_prompts_are_clear_value_errors(llm, prompts, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        llm.generate(prompts, SP)
    assert needle in str(info.value)
    assert not isinstance(info.value, TypeError)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests


def test_good_prompt_shapes(llm) -> None:
    ids = llm.get_tokenizer().encode("hello there")
    outs = llm.generate(
        ["hello there", ids, tuple(ids), {"prompt": "hello there"}, {"prompt_token_ids": ids}], SP
    )
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert llm.generate([], SP) == []


def test_bad_requests_to_the_engine(llm) -> None:
    for prompt, needle in ((None, "not NoneType"), ([], "prompt is empty"), ([0.5], "item 0")):
        with pytest.raises(ValueError, match=needle):
            llm.engine.add_request(prompt, SP)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "messages must be a non-empty list"),
        (None, "messages must be a non-empty list"),
        ("hi", "messages must be a non-empty list"),
        ([[]], "messages[0]: a conversation must be a non-empty list"),
        ([["hi"]], "messages[0]: message 0 must be a dict, not str"),
    ],
)
def test_bad_conversations(llm, messages, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        llm.chat(messages, SP)
    assert needle in str(info.value)


def test_chat_takes_vllms_keyword_arguments(llm) -> None:
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text",
             "text": "colour."}]}]  # fmt: skip
    joined = [{"role": "user", "content": "Name a colour."}]
    want = tok.apply_chat_template(joined, add_generation_prompt=True, tokenize=True)
    assert llm.chat(msgs, SP)[0].prompt_token_ids == want
    template = (
        "{% for m in messages %}[{{ m['role'] }}|{{ m['content'] }}|{{ flavour }}]{% endfor %}"
    )
    out = llm.chat(
        joined, SP, chat_template=template, chat_template_kwargs={"flavour": "x"},
        add_generation_prompt=False,
    )[0]  # fmt: skip
    assert out.prompt_token_ids == tok.encode("[user|Name a colour.|x]", add_special_tokens=False)
    assert out.prompt == "[user|Name a colour.|x]"  # the rendered conversation, as vLLM's
    assert llm.llm_engine is llm.engine
    cont = [*joined, {"role": "assistant", "content": "Blue is"}]
    ids = llm.chat(cont, SP, continue_final_message=True, add_generation_prompt=False)[0]
    rendered = tok.decode(ids.prompt_token_ids, skip_special_tokens=False)
    assert rendered.endswith("<|im_start|>assistant\nBlue is")
    with pytest.raises(ValueError, match="exclude each other"):
        llm.chat(cont, SP, continue_final_message=True)


def test_vllms_prompt_types(llm) -> None:
    """``from specdec import TokensPrompt, TextPrompt`` as ``from vllm.inputs import ...``."""
    from specdec import TextPrompt, TokensPrompt

    ids = llm.get_tokenizer().encode("the cat sat")
    want = [o.outputs[0].token_ids for o in llm.generate(["the cat sat"], SP, use_tqdm=False)]
    got = llm.generate(
        [TextPrompt(prompt="the cat sat"), TokensPrompt(prompt_token_ids=ids)], SP, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in got] == want * 2


def test_served_model_name_is_taken_as_vllm_takes_it(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), max_model_len=64, served_model_name="tiny")
    assert llm.served_model_names == ["tiny"]
    assert LLM(str(tiny_llama), max_model_len=64).served_model_names == [str(tiny_llama)]
    with pytest.raises(ValueError, match="served_model_name"):
        LLM(str(tiny_llama), served_model_name=[])
