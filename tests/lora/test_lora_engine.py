"""Multi-LoRA in the engine: the max_loras cap per step (everyone still finishes), prefix-cache isolation
between adapters (and between old and new weights under one name), the bounded table of loaded adapters,
and a clear refusal of every adapter or request that cannot be served."""

from __future__ import annotations

import json
import os
import shutil

import pytest

import tokenos.lora.manager as manager_module
from tests.fixtures.checkpoints import LLM_SHAPE, save_tiny
from tests.fixtures.llm import DENSE, hf_generate_greedy, make_llm
from tests.fixtures.lora import ATTENTION, MLP, save_adapter
from tokenos import SamplingParams
from tokenos.bench.recording import record_schedules
from tokenos.core.messages import EngineCoreRequest, EngineSamplingParams
from tokenos.lora import LoRARequest

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    base_folder = str(root / "base")
    base = save_tiny("llama", base_folder, **LLM_SHAPE)
    refs = {
        f"a{i}": save_adapter(
            base_folder, str(root / f"a{i}"), r=4 * (i + 1), targets=ATTENTION + MLP, seed=i
        )
        for i in range(4)
    }
    loras = {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(refs)}
    return root, base_folder, base, refs, loras


def _greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_at_most_max_loras_adapters_per_step_and_all_finish(setup):
    root, base_folder, base, refs, loras = setup
    llm = make_llm(base_folder, enable_lora=True, max_loras=2)
    recorded = record_schedules(llm)
    prompts = DENSE.prompts(16, 4, 20, seed=11)
    names = [None if i % 5 == 4 else f"a{i % 4}" for i in range(len(prompts))]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        _greedy(),
        use_tqdm=False,
        lora_request=[loras[n] if n else None for n in names],
    )
    key_of = {info["name"]: info["key"] for info in llm.list_loras()}
    running: dict[str, str | None] = {}
    for out in recorded:
        for new in out.scheduled_new_reqs:
            running[new.req_id] = new.adapter_id
        step = {running[r] for r in out.num_scheduled_tokens} - {None}
        assert len(step) <= 2, step
    assert {running[str(i)] for i in range(len(prompts))} - {None} == set(key_of.values())
    for out, prompt, name in zip(outputs, prompts, names, strict=True):
        ref = base if name is None else refs[name]
        assert out.outputs[0].token_ids == hf_generate_greedy(ref, prompt, 6)[0]


def test_prefix_cache_never_crosses_adapters(setup, tmp_path):
    root, base_folder, base, refs, loras = setup
    llm = make_llm(base_folder, enable_lora=True, max_loras=2, block_size=8)
    prompt = {"prompt_token_ids": DENSE.prompts(1, 40, 40, seed=13)[0]}

    def cached(lora: LoRARequest | None) -> int:
        return llm.generate(prompt, _greedy(2), use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(None) == 0
    assert cached(loras["a0"]) == 0  # the base model's blocks are not a0's
    assert cached(loras["a1"]) == 0
    assert cached(loras["a0"]) == 32  # a0 hits its own blocks (all whole blocks but the last token's)
    assert cached(None) > 0
    # new weights under the same name are another adapter: no hit on the old weights' blocks
    moved = str(tmp_path / "a0-new")
    save_adapter(base_folder, moved, r=4, targets=ATTENTION + MLP, seed=99)
    assert llm.remove_lora("a0")
    new = LoRARequest("a0", 1, moved)
    assert cached(new) == 0
    assert cached(new) > 0


def test_idle_adapters_beyond_max_cpu_loras_are_evicted_and_reloaded(setup):
    root, base_folder, base, refs, loras = setup
    llm = make_llm(base_folder, enable_lora=True, max_loras=1, max_cpu_loras=2)
    prompt = DENSE.prompts(1, 10, 10, seed=17)[0]
    for name in ("a0", "a1", "a2", "a3"):
        llm.add_lora(loras[name])
    manager = llm.engine.loras
    assert len(manager.loaded) == 2  # the two most recent; a0 and a1 left memory
    out = llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False, lora_request=loras["a0"])
    assert out[0].outputs[0].token_ids == hf_generate_greedy(refs["a0"], prompt, 6)[0]
    assert len(manager.loaded) == 2 and manager.registered["a0"].key in manager.loaded


def _evicted_adapter(setup, tmp_path):
    """An engine holding adapter "changing" (a copy of a0) registered but evicted by a1, and the call
    that writes new weights into its folder."""
    root, base_folder, base, refs, loras = setup
    folder = str(tmp_path / "changing")
    shutil.copytree(loras["a0"].lora_path, folder)
    llm = make_llm(base_folder, enable_lora=True, max_loras=1, max_cpu_loras=1)
    changing = LoRARequest("changing", 9, folder)
    llm.add_lora(changing)
    llm.add_lora(loras["a1"])  # evicts "changing" (idle)
    return llm, changing, lambda: save_adapter(base_folder, folder, r=4, targets=ATTENTION, seed=5)


def test_an_adapter_changed_on_disk_is_refused_until_reloaded(setup, tmp_path):
    llm, changing, change = _evicted_adapter(setup, tmp_path)
    change()
    with pytest.raises(ValueError, match="changed on disk"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(), use_tqdm=False, lora_request=changing)
    # the engine goes on serving everyone else
    assert llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(), use_tqdm=False)[0].outputs[0].token_ids


def test_waiting_requests_hold_no_weights_so_the_table_stays_bounded(setup):
    """Requests for more adapters than max_loras + max_cpu_loras all queued at once: never more than that
    many adapters are loaded, and everyone gets their adapter's tokens."""
    root, base_folder, base, refs, loras = setup
    llm = make_llm(base_folder, enable_lora=True, max_loras=1, max_cpu_loras=1)
    manager = llm.engine.loras
    for name in loras:
        llm.add_lora(loras[name])
    loaded: list[int] = []
    set_step = manager.set_step
    manager.set_step = lambda *a: set_step(*a) or loaded.append(len(manager.loaded))
    prompts = DENSE.prompts(8, 4, 16, seed=21)
    names = [f"a{i % 4}" for i in range(len(prompts))]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        _greedy(),
        use_tqdm=False,
        lora_request=[loras[n] for n in names],
    )
    assert loaded and max(loaded) <= 2, loaded
    for out, prompt, name in zip(outputs, prompts, names, strict=True):
        assert out.outputs[0].token_ids == hf_generate_greedy(refs[name], prompt, 6)[0]
    llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(), use_tqdm=False)  # tells the worker who finished
    assert not manager.active and not manager.refs


def test_an_adapter_that_changes_while_its_request_waits_fails_that_request_alone(
    setup, tmp_path, monkeypatch
):
    """Its files change after the request was accepted but before it runs: loading them then is refused,
    that request ends with the reason, and the rest of the batch is served."""
    root, base_folder, base, refs, loras = setup
    llm, changing, change = _evicted_adapter(setup, tmp_path)
    accepted_hash = manager_module.content_hash(changing.lora_path)
    change()
    monkeypatch.setattr(manager_module, "content_hash", lambda path: accepted_hash)  # as checked on arrival
    prompts = DENSE.prompts(2, 5, 9, seed=23)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        _greedy(),
        use_tqdm=False,
        lora_request=[loras["a1"], changing],
    )
    assert outputs[0].error is None
    assert outputs[0].outputs[0].token_ids == hf_generate_greedy(refs["a1"], prompts[0], 6)[0]
    assert outputs[1].error is not None and "changed on disk" in outputs[1].error
    assert not llm.engine.has_unfinished_requests() and llm.get_metrics()["kv_cache_usage"] == 0.0
    llm.generate({"prompt_token_ids": [5, 6, 7]}, _greedy(), use_tqdm=False)  # tells the worker who finished
    assert not llm.engine.loras.active and not llm.engine.loras.refs


def _rewrite_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def test_adapters_that_cannot_serve_are_refused_clearly(setup, tmp_path):
    root, base_folder, base, refs, loras = setup
    llm = make_llm(base_folder, enable_lora=True, max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 12, above max_lora_rank 8"):
        llm.add_lora(loras["a2"])
    other_base = str(tmp_path / "other")
    save_tiny("llama", other_base, **{**LLM_SHAPE, "hidden_size": 32, "head_dim": 8})
    wrong = str(tmp_path / "wrong")
    save_adapter(other_base, wrong, r=4)
    with pytest.raises(ValueError, match="does not fit this model"):
        llm.add_lora(LoRARequest("wrong", 5, wrong))
    head = str(tmp_path / "head")
    save_adapter(base_folder, head, r=4, targets=("lm_head",))  # tied: PEFT saves the embedding too
    with pytest.raises(ValueError, match="does not load base-model weights"):
        llm.add_lora(LoRARequest("head", 6, head))
    dora = str(tmp_path / "dora")
    shutil.copytree(loras["a0"].lora_path, dora)
    _rewrite_config(dora, use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        llm.add_lora(LoRARequest("dora", 7, dora))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.add_lora(LoRARequest("empty", 8, str(tmp_path)))
    llm.add_lora(loras["a0"])
    with pytest.raises(ValueError, match="already loaded from"):
        llm.add_lora(LoRARequest("a0", 1, loras["a1"].lora_path))
    assert [info["name"] for info in llm.list_loras()] == ["a0"]  # nothing half-loaded


def test_requests_for_adapters_the_engine_cannot_serve_are_refused(setup):
    root, base_folder, base, refs, loras = setup
    plain = make_llm(base_folder)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.generate({"prompt_token_ids": [5, 6]}, _greedy(), use_tqdm=False, lora_request=loras["a0"])
    llm = make_llm(base_folder, enable_lora=True)
    request = EngineCoreRequest(
        request_id="x", prompt_token_ids=[5, 6], sampling_params=EngineSamplingParams(), lora_name="nope"
    )
    with pytest.raises(ValueError, match="'nope' is not loaded"):
        llm.engine.add_request(request)
    assert not llm.engine.has_unfinished_requests()


def test_the_benchmarks_random_adapters_load_on_every_projection(setup, tmp_path):
    from tokenos.bench.lora import projection_shapes, write_random_adapter

    root, base_folder, base, refs, loras = setup
    llm = make_llm(base_folder, enable_lora=True, max_lora_rank=16)
    folder = write_random_adapter(llm.model_config, str(tmp_path / "random"), rank=16, seed=0)
    llm.add_lora(LoRARequest("random", 1, folder))
    layers = llm.model_config.num_hidden_layers
    # q/k/v land on qkv_proj and gate/up on gate_up_proj: 4 adapted linears per layer
    assert len(llm.engine.loras.loaded[llm.engine.loras.registered["random"].key]) == 4 * layers
    assert len(projection_shapes(llm.model_config)) == 7
