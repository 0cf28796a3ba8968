"""The transformers backend (`tokenos.models.transformers_backend`) against transformers itself, over the
engine's paged pool (`PagedRunner`): five families tokenos has no native code for and Llama forced onto
the backend, logits within float32 tolerance per position under chunked prefill, mixed batches and prefix
hits; and how `model_impl` picks (or refuses) an implementation."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from tests.fixtures.checkpoints import DENSE_FAMILIES, load_ours
from tests.fixtures.paged_runner import (
    PagedRunner,
    assert_bf16_close_to_float32,
    assert_close_logits,
    hf_logits,
)
from tokenos.config import CacheConfig
from tokenos.core.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from tokenos.models.transformers_backend import TransformersCausalLM

CASES = {
    "gpt_neox_partial_rotary_mha": "gpt_neox",
    "starcoder2_sliding_window": "starcoder2",
    "cohere_qk_norm_logit_scale": "cohere",
    "opt_prescaled_q_projected_embeddings": "opt",
    "gpt2_learned_positions": "gpt2",
    "llama_forced": "llama",  # has a native implementation: model_impl="transformers" forces the backend
}
PROMPT = [(i * 37 + 11) % 120 + 3 for i in range(45)]
TOLERANCE = 1e-5  # relative to the largest |logit|: float32 through the same weights


@pytest.fixture(params=list(CASES))
def case(request, make_checkpoint):
    folder, reference = make_checkpoint(CASES[request.param])
    model, config = load_ours(folder, model_impl="transformers")
    return model, config, reference


def test_chunked_prefill_then_decode_matches(case):
    model, _, reference = case
    assert isinstance(model, TransformersCausalLM)
    for block_size in (16, 32):
        runner = PagedRunner(model, block_size=block_size, seed=block_size)
        start = 0
        for size in (7, 13, 1, 9):  # odd chunks, one a single token
            runner.step([(0, PROMPT[start : start + size])])
            start += size
        for token in PROMPT[start:]:
            runner.step([(0, [token])])
        assert_close_logits(runner.request_logits(0), hf_logits(reference, PROMPT), rel=TOLERANCE)


def test_mixed_batch_matches(case):
    """Prefill chunks and decodes of four requests in one forward, in mixed order: the one flattened
    sequence transformers sees must not let requests attend to each other."""
    model, _, reference = case
    prompts = {r: [(t * (r + 2) + r) % 125 + 2 for t in PROMPT[: 20 + 7 * r]] for r in range(4)}
    schedule = {0: [5, 9, 1, 1, 1], 1: [12, 1, 1, 3, 1], 2: [1, 17, 2, 1, 1], 3: [26, 1, 1, 12, 1]}
    runner = PagedRunner(model, block_size=16, num_blocks=32, seed=3, max_model_len=64)
    done = dict.fromkeys(prompts, 0)
    for step in range(5):
        order = [3, 1, 0, 2] if step % 2 else [0, 2, 3, 1]
        work = []
        for r in order:
            work.append((r, prompts[r][done[r] : done[r] + schedule[r][step]]))
            done[r] += schedule[r][step]
        runner.step(work)
    for r, prompt in prompts.items():
        assert_close_logits(runner.request_logits(r), hf_logits(reference, prompt[: done[r]]), rel=TOLERANCE)


def test_prefix_hit_matches(case):
    """A second request adopts the first one's 32 cached tokens and computes only its own tail."""
    model, _, reference = case
    runner = PagedRunner(model, block_size=16, seed=5)
    runner.step([(0, PROMPT[:20])])
    runner.step([(0, PROMPT[20:40])])
    tail = [7, 9, 11, 13, 15]
    runner.adopt(1, 0, 32)
    runner.step([(1, tail[:3]), (0, PROMPT[40:41])])
    runner.step([(1, tail[3:])])
    want = hf_logits(reference, PROMPT[:32] + tail)[32:]
    assert_close_logits(runner.request_logits(1), want, rel=TOLERANCE)


def test_kv_cache_spec_one_per_layer_with_windows(case):
    model, config, _ = case
    specs = model.get_kv_cache_spec(CacheConfig(block_size=16))
    assert len(specs) == config.num_hidden_layers
    assert all(name.endswith(".paged_attn") for name in specs)
    for spec, window in zip(specs.values(), config.layer_sliding_windows, strict=True):
        assert spec.block_size == 16 and spec.dtype == "float32"
        assert type(spec) is (FullAttentionSpec if window is None else SlidingWindowSpec)
        assert getattr(spec, "sliding_window", None) == window


def test_gpt_neox_layers_take_the_modules_shape(make_checkpoint):
    """GPT-NeoX is multi-head whatever its config's stray num_key_value_heads says; Starcoder2 slides."""
    model, _ = load_ours(make_checkpoint("gpt_neox")[0])
    (spec, *_) = model.get_kv_cache_spec(CacheConfig(block_size=16)).values()
    assert (spec.num_kv_heads, spec.head_size) == (4, 16)
    model, config = load_ours(make_checkpoint("starcoder2")[0])
    assert config.layer_sliding_windows == (8, 8)


def test_forced_backend_matches_the_native_model(make_checkpoint):
    """Llama both ways on the same steps: the backend's logits are the native model's, and the same
    greedy tokens."""
    folder, _ = make_checkpoint("llama")
    native, _ = load_ours(folder)
    backend, config = load_ours(folder, model_impl="transformers")
    assert config.model_impl == "transformers" and not isinstance(native, TransformersCausalLM)
    logits = []
    for model in (native, backend):
        runner = PagedRunner(model, block_size=16)
        runner.step([(0, PROMPT[:30]), (1, PROMPT[5:17])])
        runner.step([(0, PROMPT[30:31]), (1, PROMPT[17:40])])
        logits.append(torch.cat([runner.request_logits(0), runner.request_logits(1)]))
    assert_close_logits(logits[1], logits[0], rel=TOLERANCE)
    assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))


@pytest.mark.parametrize("family", [f for f in DENSE_FAMILIES if f != "llama"])
def test_every_native_dense_family_forced_onto_the_backend_matches(make_checkpoint, family):
    """What the backend must get right beyond the cases above, each in some native family: Gemma 2's
    attention and final soft caps, Gemma 3's and Qwen2's per-layer windows, Granite's logit scaling,
    Phi-3's fused projections, the MoE blocks."""
    folder, reference = make_checkpoint(family)
    model, _ = load_ours(folder, model_impl="transformers")
    runner = PagedRunner(model, block_size=16)
    runner.step([(0, PROMPT[:20]), (1, PROMPT[3:12])])
    for token in PROMPT[20:30]:
        runner.step([(0, [token])])
    assert_close_logits(runner.request_logits(0), hf_logits(reference, PROMPT[:30]), rel=TOLERANCE)
    assert_close_logits(runner.request_logits(1), hf_logits(reference, PROMPT[3:12]), rel=TOLERANCE)


def test_bfloat16_close_to_float32(make_checkpoint):
    """bf16 weights and pages (the C decode / prefill kernels where the CPU has them) near float32."""
    folder, _ = make_checkpoint("gpt_neox")
    assert_bf16_close_to_float32(folder, PROMPT)


# ------------------------------------------------------------------ choosing the implementation


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_start_up_log_names_the_implementation(make_checkpoint):
    # tokenos's loggers do not propagate to the root (tokenos.logger), so listen on ours directly.
    records, logger = _Records(), logging.getLogger("tokenos.models")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        load_ours(make_checkpoint("gpt_neox")[0])
        load_ours(make_checkpoint("llama")[0])
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert records.lines == [
        "GPTNeoXForCausalLM: transformers implementation",
        "LlamaForCausalLM: tokenos implementation",
    ]


def test_auto_picks_native_where_it_exists_and_the_backend_elsewhere(make_checkpoint):
    from tokenos.models import load_model_config

    assert load_model_config(make_checkpoint("llama")[0]).model_impl == "tokenos"
    assert load_model_config(make_checkpoint("gpt_neox")[0]).model_impl == "transformers"
    assert load_model_config(make_checkpoint("llama")[0], model_impl="vllm").model_impl == "tokenos"


@pytest.mark.parametrize("model_impl", ["tokenos", "vllm"])
def test_native_only_refuses_an_architecture_without_native_code(make_checkpoint, model_impl):
    from tokenos.models import load_model_config

    with pytest.raises(ValueError, match="Unsupported architecture 'GPTNeoXForCausalLM'"):
        load_model_config(make_checkpoint("gpt_neox")[0], model_impl=model_impl)


def _config_folder(tmp_path, config) -> str:
    """A folder holding only ``config``'s config.json: resolution reads nothing else."""
    folder = str(tmp_path / config.model_type)
    config.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "config_class,fields,message",
    [
        # transformers' StableLm calls the registry but drops our keyword arguments on the way
        ("StableLmConfig", {}, "does not route its attention through the AttentionInterface"),
        ("BloomConfig", {"n_head": 4}, "does not route its attention through the AttentionInterface"),
        # recurrent layers: LFM2's short convolutions, GraniteMoeHybrid's Mamba2 (native code exists)
        ("Lfm2Config", {"layer_types": ["conv", "full_attention"]}, "conv layers"),
        ("GraniteMoeHybridConfig", {"layer_types": ["mamba", "attention"]}, "linear_attention layers"),
        ("DeepseekV3Config", {"num_attention_heads": 4, "kv_lora_rank": 16}, "multi-head latent attention"),
    ],
)
def test_refuses_what_the_backend_cannot_page(tmp_path, config_class, fields, message):
    import transformers

    from tokenos.models import load_model_config

    architecture = config_class.replace("Config", "ForCausalLM")
    config = getattr(transformers, config_class)(
        architectures=[architecture], hidden_size=64, num_hidden_layers=2, vocab_size=128, **fields
    )
    with pytest.raises(ValueError, match=message):
        load_model_config(_config_folder(tmp_path, config), model_impl="transformers")


def test_refuses_an_architecture_nobody_implements(tmp_path):
    from tokenos.models import load_model_config

    os.makedirs(tmp_path / "m")
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump({"architectures": ["NoSuchForCausalLM"], "hidden_size": 8}, f)
    with pytest.raises(ValueError, match="neither tokenos nor transformers implements it"):
        load_model_config(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="not a causal LM transformers"):
        load_model_config(str(tmp_path / "m"), model_impl="transformers")


def test_refuses_architectures_that_disagree_with_the_model_type(make_checkpoint):
    from tokenos.models import load_model_config

    folder, _ = make_checkpoint("llama")
    with open(f"{folder}/config.json") as f:
        raw = json.load(f)
    raw["architectures"] = ["GPT2LMHeadModel"]  # transformers would build a Llama from this config
    with open(f"{folder}/config.json", "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match="model_type 'llama' builds LlamaForCausalLM"):
        load_model_config(folder)


def test_refuses_quantization_and_gguf(make_checkpoint, tmp_path):
    from tokenos.models import build_model, load_model_config

    config = load_model_config(make_checkpoint("gpt_neox")[0], quantization="int8")
    with pytest.raises(ValueError, match="dense weights only"):
        build_model(config)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(ValueError, match="needs a Hugging Face folder"):
        load_model_config(str(gguf), model_impl="transformers")


def test_serve_flag_reaches_the_engine_args():
    from tokenos.engine.args import EngineArgs
    from tokenos.engine.flags import engine_kwargs
    from tokenos.entrypoints.openai.cli_args import parse_serve_args

    assert EngineArgs(
        **engine_kwargs(parse_serve_args(["m", "--model-impl", "transformers"]))
    ).model_impl == ("transformers")
    assert EngineArgs(**engine_kwargs(parse_serve_args(["m"]))).model_impl == "auto"
    with pytest.raises(SystemExit):
        parse_serve_args(["m", "--model-impl", "onnx"])  # not a choice: argparse names the choices


def test_refuses_a_logit_transform_it_does_not_repeat(make_checkpoint, monkeypatch):
    """Without Cohere's logit scale in compute_logits the start-up check sees the LM head's output
    transformed differently from transformers' forward, and refuses rather than serve wrong logits."""
    folder, _ = make_checkpoint("cohere")
    raw = TransformersCausalLM.compute_logits

    def unscaled(self, hidden):
        return self.hf.get_output_embeddings()(hidden).float()

    monkeypatch.setattr(TransformersCausalLM, "compute_logits", unscaled)
    with pytest.raises(ValueError, match="does not repeat"):
        load_ours(folder, model_impl="transformers")
    monkeypatch.setattr(TransformersCausalLM, "compute_logits", raw)
    assert isinstance(load_ours(folder, model_impl="transformers")[0], TransformersCausalLM)


def test_refuses_attention_with_its_own_parameters(tmp_path):
    """gpt-oss's attention sinks are a parameter of the attention module: the paged layer would drop
    them, so the backend refuses the model instead of serving it wrong."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, max_position_embeddings=256,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="sinks"):
        load_ours(str(tmp_path), model_impl="transformers")
