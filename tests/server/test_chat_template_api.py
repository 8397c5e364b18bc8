"""vLLM's chat-template controls through the real server and the official client: ``continue_final_message`` (the
answer continues the last assistant message; the same prompt and greedy text as /v1/completions on the template's
own rendering), ``chat_template_kwargs`` (variables the template reads), and the fields other servers take that
would change the answer here and are refused with a 400 naming them."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from tests.server.live import LiveServer, serving

GREETING = "You are talking to a lighthouse keeper. "


@pytest.fixture(scope="module")
def model(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoint whose template also writes a ``greeting`` variable first, when it is given."""
    out = tmp_path_factory.mktemp("template") / "demo"
    shutil.copytree(demo_model_dir, out)
    template = out / "chat_template.jinja"
    template.write_text("{%- if greeting is defined -%}{{- greeting -}}{%- endif -%}\n" + template.read_text())
    return out


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[LiveServer]:
    yield from serving(model)


def _chat(server: LiveServer, messages: list[dict[str, Any]], **extra: Any) -> tuple[str, int]:
    out = server.client().chat.completions.create(model="demo", messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                                  temperature=0.0, extra_body=extra or None)
    assert out.usage is not None
    return out.choices[0].message.content or "", out.usage.prompt_tokens


def _completion(server: LiveServer, prompt: str) -> tuple[str, int]:
    out = server.client().completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=0.0)
    assert out.usage is not None
    return out.choices[0].text, out.usage.prompt_tokens


def test_continue_final_message_answers_from_inside_the_last_turn(server: LiveServer, model: Path) -> None:
    messages = [{"role": "user", "content": "Write a greeting for a letter."},
                {"role": "assistant", "content": "Dear friend, I hope"}]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                           continue_final_message=True)
    assert prompt.endswith("I hope")  # the turn is left open
    continued = _chat(server, messages, add_generation_prompt=False, continue_final_message=True)
    assert continued == _completion(server, prompt)
    new_turn = _chat(server, messages)  # the default: the assistant's turn closed, a new one opened
    assert new_turn[1] > continued[1]


def test_chat_template_kwargs_reach_the_template(server: LiveServer, model: Path) -> None:
    messages = [{"role": "user", "content": "Where are you?"}]
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, greeting=GREETING)
    assert prompt.startswith(GREETING)
    greeted = _chat(server, messages, chat_template_kwargs={"greeting": GREETING})
    assert greeted == _completion(server, prompt)
    assert greeted[1] > _chat(server, messages)[1]


@pytest.mark.parametrize(("extra", "param"), [
    ({"continue_final_message": True}, "continue_final_message"),  # with the default generation prompt
    ({"continue_final_message": True, "add_generation_prompt": False, "last": "user"}, "continue_final_message"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"echo": True}, "echo"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: it could change nothing
])
def test_what_it_cannot_honour_is_a_400_naming_it(server: LiveServer, extra: dict[str, Any], param: str) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    if extra.pop("last", None) != "user":
        messages.append({"role": "assistant", "content": "Hi"})
    with pytest.raises(openai.BadRequestError) as info:
        _chat(server, messages, **extra)
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]


def test_their_defaults_are_accepted(server: LiveServer) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    defaults = {"skip_special_tokens": True, "include_stop_str_in_output": False, "echo": False,
                "modalities": ["text"], "add_generation_prompt": True, "continue_final_message": False,
                "chat_template_kwargs": {}}
    assert _chat(server, messages, **defaults) == _chat(server, messages)


@pytest.mark.parametrize("field", [{"skip_special_tokens": False}, {"include_stop_str_in_output": True}])
def test_completions_refuse_the_same_detokenizing_switches(server: LiveServer, field: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model="demo", prompt="Hello", max_tokens=4, extra_body=field)
    assert info.value.body["param"] == next(iter(field)), info.value.body  # type: ignore[index]
