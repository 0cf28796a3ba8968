"""GGUF files of every family llama.cpp defines and tokenos runs natively, written as llama.cpp's converter
writes them (`tests.fixtures.gguf_convert`) from a tiny random transformers model.

Per family: transformers' own GGUF reader, where it knows the architecture, reads the file back to the
model's tensors (so the file is what llama.cpp's converter would write, Gemma's ``1 + w`` norms and the
q/k permutation included); the config resolved from the GGUF equals the one resolved from the Hugging Face
folder; and `LLM` on the GGUF generates transformers' greedy tokens with logprobs within 1e-4 (float32).
Q8_0 and Q4_0 files keep their blocks packed and match transformers running the same dequantized weights.
Metadata that would change the model and that we do not read is refused.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.fixtures.checkpoints import GPT_OSS_YARN, LLM_SHAPE, TINY, hf_config, perturb
from tests.fixtures.gguf_convert import GGUF_ARCH, write_gguf
from tests.fixtures.llm import generate_greedy, hf_generate_greedy, make_llm, random_prompts
from tokenos.models import build_model, load_model_config

# family -> (transformers family, config overrides). llama.cpp fixes what its converter does not write:
# Gemma's softmax scale is head_dim ** -0.5 below 27B (so query_pre_attn_scalar = head_dim), Gemma 3 slides
# five layers in six, and its Qwen MoE layers are all sparse (no mlp_only_layers / decoder_sparse_step).
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "granite": ("granite", {}),
    "olmo2": ("olmo2", {}),
    "phi3": ("phi3", {"partial_rotary_factor": 0.5}),
    # The "128k" recipe: longrope factors (4 = half the rotary dims) as two tensors, prompts within the
    # original 64 positions.
    "phi3_longrope": (
        "phi3",
        {
            "partial_rotary_factor": 0.5,
            "max_position_embeddings": 256,
            "original_max_position_embeddings": 64,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.1, 1.3, 1.6],
                "long_factor": [1.5, 2.5, 4.0, 6.0],
            },
        },
    ),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}),
    "gemma3": (
        "gemma3_text",
        {"query_pre_attn_scalar": 16, "num_hidden_layers": 6, "sliding_window_pattern": 6},
    ),
    "qwen2moe": ("qwen2_moe", {"mlp_only_layers": []}),
    "qwen3moe": ("qwen3_moe", {"decoder_sparse_step": 1}),
    # llama.cpp fixes gpt-oss's SwiGLU clamp at 7 (the tiny fixture's 1.0 is not in any GGUF key).
    "gpt_oss": ("gpt_oss", {"swiglu_limit": 7.0}),
}
# The GGUF architectures transformers' GGUF loader reads (``GGUF_SUPPORTED_ARCHITECTURES``).
TRANSFORMERS_READS = ("llama", "phi3", "phi3_longrope", "gemma2", "gemma3", "qwen2moe", "qwen3moe")
# (family, block type): Q8_0 for every family, Q4_0 (int4) where q / k are permuted and for the experts.
QUANTIZED = [(f, "Q8_0") for f in FAMILIES] + [("llama", "Q4_0"), ("qwen3moe", "Q4_0"), ("gpt_oss", "MXFP4")]
MAX_TOKENS = 8
# The ModelConfig fields a GGUF must resolve exactly as the Hugging Face folder does.
CONFIG_FIELDS = (
    "architecture",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "attention_bias",
    "qk_norm",
    "sliding_window",
    "layer_sliding_windows",
)


def tiny_model(family: str, **extra) -> torch.nn.Module:
    hf_family, overrides = FAMILIES[family]
    from transformers import AutoModelForCausalLM

    config = hf_config(hf_family, base={**TINY, **LLM_SHAPE}, **{**overrides, **extra})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    perturb(model, 0.1)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, its HF folder, its F32 GGUF), built once per family."""
    cache: dict[str, tuple] = {}

    def get(family: str) -> tuple:
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            model = tiny_model(family)
            model.save_pretrained(str(folder / "hf"))
            cache[family] = (model, str(folder / "hf"), write_gguf(model, str(folder / "f32.gguf")))
        return cache[family]

    return get


def check_llm_parity(path: str, reference: torch.nn.Module, rel: float = 1e-4) -> None:
    """`LLM` on ``path``: transformers' greedy tokens exactly, each token's logprob within ``rel``."""
    prompts = random_prompts(4, 3, 30, seed=1, vocab=LLM_SHAPE["vocab_size"])
    llm = make_llm(path, max_model_len=64)
    for out, prompt in zip(generate_greedy(llm, prompts, MAX_TOKENS), prompts, strict=True):
        tokens, logprobs = hf_generate_greedy(reference, prompt, MAX_TOKENS)
        completion = out.outputs[0]
        assert completion.token_ids == tokens, f"prompt of {len(prompt)} tokens diverged"
        ours = [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]
        np.testing.assert_allclose(ours, logprobs, atol=rel, rtol=0)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f in TRANSFORMERS_READS])
def test_transformers_reads_our_gguf_back(checkpoints, family):
    """The fixture writes what llama.cpp's converter writes: transformers' GGUF tensor reading (its own
    name map, norm - 1, q/k reverse permute, expert stacking) gives back the model's tensors."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model, _, path = checkpoints(family)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    state = model.state_dict()
    assert set(state) - set(tensors) <= {"lm_head.weight"}  # a tied head is not in the file
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor, state[name], atol=1e-6, rtol=0, msg=name)


def assert_same_rope(ours: dict | None, theirs: dict | None) -> None:
    """The same scaling up to GGUF's float32 (longrope's factors, the attention factor the converter
    computed where transformers derives it) and the HF dict's extra partial_rotary_factor (Phi-3's, read
    from hf_config)."""
    from tokenos.layers.rotary import rope_attention_factor

    if ours is None or theirs is None:
        assert ours == theirs
        return
    assert rope_attention_factor(ours) == pytest.approx(rope_attention_factor(theirs), rel=1e-7)
    for key in set(ours) | set(theirs):
        if key not in ("attention_factor", "partial_rotary_factor"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-7), key


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_config_matches_hf_folder(checkpoints, family):
    _, folder, path = checkpoints(family)
    ours, theirs = load_model_config(path, dtype="float32"), load_model_config(folder, dtype="float32")
    for name in CONFIG_FIELDS:
        if name == "rope_scaling":
            assert_same_rope(ours.rope_scaling, theirs.rope_scaling)
        else:
            assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.quantization == "gguf" and ours.gguf_file


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_family_generates_like_transformers(checkpoints, family):
    model, _, path = checkpoints(family)
    check_llm_parity(path, model)


def test_llama_gguf_matches_transformers_loading_the_same_file(checkpoints):
    """transformers' own ``from_pretrained(gguf_file=...)`` (config from the metadata included: for llama
    it reads every key the fixture writes) generates what `LLM` does on the same file."""
    import os

    from transformers import AutoModelForCausalLM

    _, _, path = checkpoints("llama")
    folder, name = os.path.split(path)
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    check_llm_parity(path, reference)


def dequantized_reference(model: torch.nn.Module, qtype: str) -> torch.nn.Module:
    """`model` with every weight the fixture quantizes replaced by its dequantized blocks (rows quantize
    independently, so this commutes with the q/k permutation and the expert stacking). gpt-oss's expert
    weights are held ``[E, in, out]``: they quantize along ``in``, as the file's ``[E, out, in]`` rows."""
    import gguf
    from gguf.quants import dequantize, quantize

    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            experts = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
            transposed = experts and model.config.model_type == "gpt_oss"
            if kind == gguf.GGMLQuantizationType.MXFP4 and not experts:
                continue  # the fixture quantizes only the expert stacks to MXFP4
            w = p.detach().transpose(-1, -2).numpy() if transposed else p.detach().numpy()
            skip = name.endswith(("mlp.gate.weight", "mlp.router.weight", "bias", "sinks"))
            if skip or p.squeeze().dim() < 2 or w.shape[-1] % block:
                continue
            deq = torch.from_numpy(dequantize(quantize(np.ascontiguousarray(w), kind), kind).reshape(w.shape))
            p.copy_(deq.transpose(-1, -2) if transposed else deq)
    return reference


@pytest.mark.parametrize(("family", "qtype"), QUANTIZED)
def test_quantized_gguf_stays_packed_and_generates_like_transformers(checkpoints, tmp_path, family, qtype):
    model, _, _ = checkpoints(family)
    path = write_gguf(model, str(tmp_path / f"{qtype}.gguf"), qtype=qtype)
    ours = build_model(load_model_config(path, dtype="float32"))
    layer = ours.stack.layers[0]
    if qtype != "MXFP4":  # MXFP4 files quantize the experts only
        assert layer.self_attn.qkv_proj.quantized is not None and layer.self_attn.o_proj.quantized is not None
        assert ours.stack.embed.quantized is not None
    experts = getattr(layer.mlp, "experts", None)
    if family == "gpt_oss":  # its experts are dense once loaded (MXFP4 ones dequantized, like the release)
        assert not experts.quantized and not experts.mxfp4 and experts.gate_up_proj.dtype == torch.float32
    elif experts is not None:  # the [E, out, in] stacks too, one packed weight per expert and projection
        assert set(experts.quantized) == {"gate_up_proj", "down_proj"}
        assert experts.gate_up_proj.weight is None and experts.down_proj.weight is None
    check_llm_parity(path, dequantized_reference(model, qtype))


def test_gemma3_sliding_window_pattern_key(tmp_path):
    """Recent converters write Gemma 3's per-layer sliding flags: they win over llama.cpp's 5-in-6 default
    (here layers 0 and 2 slide, 1 and 3 do not)."""
    model = tiny_model("gemma3", num_hidden_layers=4, sliding_window_pattern=2)
    model.save_pretrained(str(tmp_path / "hf"))
    pattern = [t == "sliding_attention" for t in model.config.layer_types]
    path = write_gguf(model, str(tmp_path / "g3.gguf"), sliding_window_pattern=pattern)
    ours, theirs = load_model_config(path), load_model_config(str(tmp_path / "hf"))
    assert ours.layer_sliding_windows == theirs.layer_sliding_windows == (8, None, 8, None)
    check_llm_parity(path, model)


def _add_field(writer, key: str, value) -> None:
    """One scalar metadata field, typed as llama.cpp's converter writes it."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_string(key, value)


def _rewrite(tmp_path, family: str, **metadata) -> str:
    """The F32 GGUF of ``family`` with extra ``<arch>.<key>`` metadata (a float, an int or a string)."""
    import gguf

    model = tiny_model(family)
    path = write_gguf(model, str(tmp_path / "base.gguf"))
    arch = GGUF_ARCH[model.config.model_type]
    reader = gguf.GGUFReader(path)
    out = str(tmp_path / "extra.gguf")
    writer = gguf.GGUFWriter(out, arch)
    metadata = {f"{arch}.{key.replace('__', '.')}": value for key, value in metadata.items()}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in metadata:
            continue
        _add_field(writer, key, field.contents())
    for key, value in metadata.items():
        _add_field(writer, key, value)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize(
    ("family", "metadata", "message"),
    [
        ("llama", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ("llama", {"expert_count": 8}, "expert_count"),
        ("olmo2", {"logit_scale": 2.0}, "logit_scale"),
        ("qwen3moe", {"expert_gating_func": 2}, "expert_gating_func"),
        ("gemma3", {"rope__scaling__type": "yarn"}, "rope.scaling.type 'yarn'"),
        ("granite", {"rope__dimension_count": 8}, "rope.dimension_count"),
        ("phi3", {"attention__value_length": 32}, "value_length"),
    ],
)
def test_unread_model_metadata_is_refused(tmp_path, family, metadata, message):
    """Metadata that changes the model and that this family's loader does not read: refused by name,
    never run as the plain model."""
    path = _rewrite(tmp_path, family, **metadata)
    with pytest.raises(ValueError, match=message):
        load_model_config(path)


def test_every_gguf_family_is_a_llama_cpp_architecture_we_run_natively():
    """Each entry names an architecture llama.cpp defines (gguf's MODEL_ARCH_NAMES) and a native registry
    entry, and maps every per-layer tensor llama.cpp's table lists for it: the only ones left are
    Mixtral-style experts in a llama file (refused by their expert_count) and the rope tensors the config
    reads (Phi-3's longrope factors) or refuses (rope_freqs)."""
    import gguf

    from tokenos.model_loader.gguf_loader import _EXPERT_NAMES, _GLOBAL_NAMES, GGUF_FAMILIES
    from tokenos.models.registry import ARCHITECTURES

    arches = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
    assert set(GGUF_FAMILIES) >= set(GGUF_ARCH.values())
    for name, family in GGUF_FAMILIES.items():
        assert name in arches and family.architecture in ARCHITECTURES, name
        listed = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arches[name]]}
        layer = {n.removeprefix("blk.{bid}.") for n in listed if n.startswith("blk.")}
        unmapped = layer - set(family.layer_names) - set(_EXPERT_NAMES)
        assert unmapped <= ({"attn_rot_embd", "ffn_gate_inp"} if name == "llama" else set()), name
        rope = {"rope_freqs", "rope_factors_long", "rope_factors_short"}
        assert {n for n in listed if not n.startswith("blk.")} - set(_GLOBAL_NAMES) <= rope, name


def test_gpt_oss_yarn_reads_as_its_checkpoint_configures_it(tmp_path):
    model = tiny_model("gpt_oss", rope_parameters=GPT_OSS_YARN, max_position_embeddings=64)
    model.save_pretrained(str(tmp_path / "hf"))
    path = write_gguf(model, str(tmp_path / "yarn.gguf"))
    ours, theirs = load_model_config(path), load_model_config(str(tmp_path / "hf"))
    assert ours.rope_scaling["truncate"] is False and ours.rope_scaling["rope_type"] == "yarn"
    assert_same_rope(ours.rope_scaling, theirs.rope_scaling)
    check_llm_parity(path, model)


def _fuse_gate_up(src: str, out: str) -> str:
    """``src`` with each layer's gate and up expert stacks (weights and biases) written as one
    ``ffn_gate_up_exps`` (gate rows first), as converters with fused gate / up experts write it."""
    import gguf

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            _add_field(writer, key, field.contents())
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if ".ffn_up_exps." in t.name:
            continue
        data, name = np.array(t.data), t.name
        if ".ffn_gate_exps." in t.name:
            up = np.array(tensors[t.name.replace("ffn_gate_exps", "ffn_up_exps")].data)
            data, name = (
                np.concatenate((data, up), axis=1),
                t.name.replace("ffn_gate_exps", "ffn_gate_up_exps"),
            )
        writer.add_tensor(name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("qtype", [None, "MXFP4"])
def test_gpt_oss_fused_gate_up_experts(checkpoints, tmp_path, qtype):
    model, _, _ = checkpoints("gpt_oss")
    split = write_gguf(model, str(tmp_path / "split.gguf"), qtype=qtype)
    path = _fuse_gate_up(split, str(tmp_path / "fused.gguf"))
    check_llm_parity(path, model if qtype is None else dequantized_reference(model, qtype))


def test_mxfp4_blocks_relaid_losslessly():
    """ggml's MXFP4 rows re-laid as the checkpoint's blocks / scales dequantize (`dequantize_mxfp4`) to
    exactly what gguf's own dequantization gives, every code and exponent included."""
    import gguf
    from gguf.quants import dequantize

    from tokenos.layers.mxfp4 import dequantize_mxfp4
    from tokenos.model_loader.gguf_loader import _mxfp4_checkpoint_blocks

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (3, 5, 4 * 17), dtype=np.uint8)  # [E, rows, 4 blocks of 17 bytes]
    raw.reshape(3, 5, 4, 17)[..., 0] = rng.integers(100, 150, (3, 5, 4))  # exponents away from 0 / 255
    blocks, scales = _mxfp4_checkpoint_blocks(raw)
    assert blocks.shape == (3, 5, 4, 16) and scales.shape == (3, 5, 4)
    ours = dequantize_mxfp4(torch.from_numpy(blocks), torch.from_numpy(scales), torch.float32).numpy()
    theirs = dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(3, 5, 128)
    np.testing.assert_array_equal(ours, theirs)


def test_gpt_oss_mixed_mxfp4_experts_are_refused(tmp_path):
    """An MXFP4 down stack beside a float gate / up: the experts cannot dequantize as one; refused."""
    import gguf
    from gguf.quants import quantize

    model = tiny_model("gpt_oss")
    src = write_gguf(model, str(tmp_path / "f32.gguf"))
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(tmp_path / "mixed.gguf"), "gpt-oss")
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            _add_field(writer, key, field.contents())
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name.endswith("ffn_down_exps.weight"):
            writer.add_tensor(t.name, quantize(data, mxfp4), raw_dtype=mxfp4)
        else:
            writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="partly in MXFP4"):
        load_model_config(str(tmp_path / "mixed.gguf"))
