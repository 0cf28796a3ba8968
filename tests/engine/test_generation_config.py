"""Request defaults from generation_config.json (vLLM's --generation-config auto / vllm / FOLDER and
--override-generation-config): read, overridden, and applied to the fields a request leaves unset."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.fixtures.fakes import FakeEngine
from tests.fixtures.servers import app_client
from tokenos.engine.args import EngineArgs
from tokenos.engine.generation_config import engine_generation_defaults, generation_defaults

QWEN3 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [1, 2]}


@pytest.fixture
def model_dir(tmp_path) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3))
    return str(tmp_path)


def test_read_ignored_overridden(model_dir, tmp_path_factory):
    assert generation_defaults(model_dir) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert generation_defaults(model_dir, "vllm") == {}
    assert generation_defaults(str(tmp_path_factory.mktemp("empty"))) == {}
    other = tmp_path_factory.mktemp("other")
    (other / "generation_config.json").write_text(
        json.dumps({"repetition_penalty": 1.1, "max_new_tokens": 64})
    )
    assert generation_defaults(model_dir, str(other)) == {"repetition_penalty": 1.1, "max_tokens": 64}
    assert generation_defaults(model_dir, override={"temperature": 1.0})["temperature"] == 1.0
    with pytest.raises(ValueError, match="override_generation_config"):
        generation_defaults(model_dir, override={"seed": 3})
    with pytest.raises(ValueError, match="auto"):
        generation_defaults(model_dir, "/no/such/folder")


def test_server_fills_only_unset_fields(model_dir):
    engine = FakeEngine()
    engine.engine_args = EngineArgs(override_generation_config={"max_new_tokens": 3})
    engine.model_config = SimpleNamespace(**vars(engine.model_config), model_dir=model_dir)
    engine.generation_defaults = engine_generation_defaults(engine)  # as AsyncLLM reads them
    client = app_client(engine)
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    params = engine.calls[-1]["params"]
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.95, 20, 3)
    client.post("/v1/chat/completions", json={**chat, "temperature": 0, "top_k": 5, "max_tokens": 2})
    params = engine.calls[-1]["params"]
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.0, 0.95, 5, 2)
    client.close()
