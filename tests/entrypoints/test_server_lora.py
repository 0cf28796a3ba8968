"""`tokenos serve --enable-lora --lora-modules`: adapters listed in /v1/models under their base, picked per
request by `model`, with completions equal to the offline engine's under the same adapter; runtime load
and unload over HTTP behind vLLM's environment guard, and clear errors for bad adapters."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.fixtures.checkpoints import save_served
from tests.fixtures.llm import make_llm
from tests.fixtures.lora import ATTENTION, MLP, save_adapter
from tests.fixtures.servers import Server, running_server
from tokenos import SamplingParams
from tokenos.lora import LoRARequest

pytest.importorskip("peft")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = ["the cat sat on the mat and", "one two three four"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("served-lora")
    base = save_served("llama", str(root / "base"))
    save_adapter(base, str(root / "a"), r=8, targets=ATTENTION + MLP, seed=1)
    save_adapter(base, str(root / "b"), r=16, targets=("q_proj", "v_proj", "down_proj"), seed=2)
    return {"base": base, "a": str(root / "a"), "b": str(root / "b")}


@pytest.fixture(scope="module")
def server(folders):
    flags = ("--enable-lora", "--max-loras", "2", "--lora-modules", f"a={folders['a']}")
    with running_server(folders["base"], *flags, env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as server:
        yield server


@pytest.fixture(scope="module")
def offline(folders):
    llm = make_llm(folders["base"], skip_tokenizer_init=False, enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)

    def texts(name: str | None) -> list[str]:
        lora = LoRARequest(name, 1 if name == "a" else 2, folders[name]) if name else None
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)]

    return {name: texts(name) for name in (None, "a", "b")}


def _complete(server: Server, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPTS, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def test_adapters_are_listed_under_their_base(server, folders):
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert set(cards) == {"tiny", "a"}
    assert cards["a"]["parent"] == "tiny" and cards["a"]["root"].endswith("/a")
    assert cards["tiny"]["parent"] is None


def test_each_model_name_serves_its_adapter_in_one_batch(server, offline):
    assert offline["a"] != offline[None]  # the adapter changes the text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # base and adapter requests in flight together
        futures = {name: pool.submit(_complete, server, name) for name in ("tiny", "a")}
        got = {name: [c["text"] for c in f.result().json()["choices"]] for name, f in futures.items()}
    assert got["tiny"] == offline[None]
    assert got["a"] == offline["a"]
    chat = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
    assert reply.status_code == 200 and reply.json()["model"] == "a"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics
    )


def test_load_and_unload_at_run_time(server, folders, offline):
    url = server.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": folders["b"]})
    assert r.status_code == 200, r.text
    assert "b" in {c["id"] for c in httpx.get(f"{url}/v1/models").json()["data"]}
    assert [c["text"] for c in _complete(server, "b").json()["choices"]] == offline["b"]
    again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": folders["b"]})
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
    missing = _complete(server, "b")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404


def test_bad_adapters_are_refused_and_the_server_goes_on(server, folders, tmp_path):
    url = server.url
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(tmp_path)})
    assert r.status_code == 400
    assert "adapter_config.json" in r.json()["error"]["message"]
    base = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": folders["a"]})
    assert base.status_code == 400
    assert _complete(server, "a").status_code == 200


def test_runtime_updates_are_off_unless_allowed(folders):
    with running_server(folders["base"], "--enable-lora", "--lora-modules", f"a={folders['a']}") as server:
        r = httpx.post(
            f"{server.url}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": folders["b"]}
        )
        assert r.status_code == 404
        assert _complete(server, "a").status_code == 200
