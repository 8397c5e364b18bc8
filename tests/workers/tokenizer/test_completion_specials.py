"""/v1/completions' ``add_special_tokens`` (vLLM's, default true): a text prompt gets the special tokens the
checkpoint's tokenizer adds of its own accord, as ``tokenizer(prompt)`` does (Gemma's ``<bos>``); false leaves
them out; token-id prompts are taken as sent. Checked on a copy of the demo checkpoint whose tokenizer adds a
``<|im_start|>`` before every text, through the real tokenizer worker."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from ipc.prompts import TokenizedRequest
from ipc.requests import GenerateRequest
from tests.server.live import data_url, png_bytes
from tests.workers.tokenizer.harness import MODEL, server_config
from workers.engine.prompt.chat_template import added_specials
from workers.tokenizer.worker import TokenizerWorker


@pytest.fixture(scope="module")
def bos_model(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("bos") / "demo-bos"
    shutil.copytree(demo_model_dir, model)
    spec = json.loads((model / "tokenizer.json").read_text())
    bos = next(t for t in spec["added_tokens"] if t["content"] == "<|im_start|>")
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [bos["id"]], "tokens": ["<|im_start|>"]}},
    }
    (model / "tokenizer.json").write_text(json.dumps(spec))
    return model


@pytest.fixture
def worker(bos_model: Path, launch_id: str) -> Iterator[TokenizerWorker]:
    w = TokenizerWorker(server_config(bos_model, launch_id), 0, logging.getLogger("test"))
    yield w
    w.close()


def prepared(worker: TokenizerWorker, endpoint: str = "completion", **body: object) -> TokenizedRequest:
    raw = json.dumps({"model": MODEL, **({"max_tokens": 2} if endpoint == "completion" else {}), **body}).encode()
    result = worker.handle(GenerateRequest("r", memoryview(raw), 0.0, endpoint))
    assert isinstance(result, tuple), result
    request = result[1]
    assert isinstance(request, TokenizedRequest)
    worker.prep.release(request.shm_names)  # an image's segment: no scheduler here to unlink it
    return request


def ids_of(worker: TokenizerWorker, **body: object) -> list[int]:
    return list(prepared(worker, **body).input_ids)


def test_text_prompts_get_the_tokenizers_specials_unless_asked_not_to(worker: TokenizerWorker, bos_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(bos_model)
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    text = "A page of text"
    assert added_specials(tok) == ([bos], [])
    assert ids_of(worker, prompt=text) == list(tok(text)["input_ids"]) == [bos, *tok(text, add_special_tokens=False)["input_ids"]]
    assert ids_of(worker, prompt=text, add_special_tokens=False) == list(tok(text, add_special_tokens=False)["input_ids"])
    assert ids_of(worker, prompt=[7, 8, 9]) == [7, 8, 9]  # token ids: as sent


def test_a_prompt_with_image_data_gets_them_too(worker: TokenizerWorker, bos_model: Path) -> None:
    """SGLang's image_data on /v1/completions: the specials lead the prompt and its image span moves past them;
    /generate's raw prompt gets none (its text is taken as sent)."""
    tok = AutoTokenizer.from_pretrained(bos_model)
    bos = tok.convert_tokens_to_ids("<|im_start|>")
    text = "<|vision_start|><|image_pad|><|vision_end|>Read it."
    image = data_url(png_bytes(64, 64, seed=3))
    plain = prepared(worker, prompt=text, image_data=image, add_special_tokens=False)
    served = prepared(worker, prompt=text, image_data=image)
    assert list(served.input_ids) == [bos, *plain.input_ids]
    assert [i.offset for i in served.items] == [i.offset + 1 for i in plain.items] and plain.items
    native = prepared(worker, "generate", text=text, image_data=image)
    assert native.input_ids == plain.input_ids


def test_a_tokenizer_that_adds_nothing_changes_nothing(demo_model_dir: Path) -> None:
    assert added_specials(AutoTokenizer.from_pretrained(demo_model_dir)) == ([], [])
