"""Weight loading (tokenos/model_loader): safetensors (single and sharded), GGUF files and names, and the
errors a user can cause."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.fixtures.checkpoints import save_tiny
from tests.fixtures.paged_runner import PagedRunner, assert_close_logits, hf_logits
from tokenos.model_loader.gguf_loader import hf_name, unpermute_qk
from tokenos.models import build_model, load_model_config


def test_sharded_checkpoint_loads_like_single(make_checkpoint, tmp_path):
    folder, reference = make_checkpoint("qwen2")
    sharded = str(tmp_path / "sharded")
    reference.save_pretrained(sharded, max_shard_size="200KB")
    with open(f"{sharded}/model.safetensors.index.json") as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    config = load_model_config(sharded, dtype="float32")
    model = build_model(config)
    runner = PagedRunner(model, block_size=16)
    prompt = list(range(3, 30))
    runner.step([(0, prompt)])
    assert_close_logits(runner.request_logits(0), hf_logits(reference, prompt))


def test_missing_weight_is_an_error(make_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = make_checkpoint("llama")
    tensors = load_file(f"{folder}/model.safetensors")
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="gate_up_proj|lacks"):
        build_model(load_model_config(folder))


def test_gguf_names_and_unpermute():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_gate.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight" and hf_name("rope_freqs.weight") is None
    n_head, rows, cols = 3, 3 * 8, 5
    w = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    # llama.cpp's convert_hf_to_gguf permute, which the loader must undo
    permuted = w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)
    np.testing.assert_array_equal(unpermute_qk(permuted, n_head), w)


def test_gguf_file_matches_gguf_reader(tmp_path):
    import gguf
    from gguf.quants import dequantize, quantize

    from tokenos.model_loader.gguf_file import GGUFFile

    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_float32("llama.rope.freq_base", 5e5)
    writer.add_token_list(["<s>", "a", "bc"] * 50)
    writer.add_array("tokenizer.ggml.token_type", [1, 2, 3])
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((6, 64)).astype(np.float32)
    writer.add_tensor("blk.0.attn_norm.weight", dense[0])
    writer.add_tensor("blk.0.attn_q.weight", quantize(dense, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, reference = GGUFFile(path), gguf.GGUFReader(path)
    assert ours.fields["llama.block_count"] == 2 and ours.fields["general.architecture"] == "llama"
    assert (
        ours.fields["llama.rope.freq_base"] == pytest.approx(5e5)
        and ours.fields["tokenizer.ggml.tokens"] is None
    )
    for mine, theirs in zip(ours.tensors, reference.tensors, strict=True):
        assert mine.name == theirs.name
        expected = dequantize(theirs.data, theirs.tensor_type).reshape(mine.shape)
        np.testing.assert_array_equal(ours.dequantize(mine), expected)
    np.testing.assert_allclose(ours.dequantize(ours.tensors[1]), dense, atol=0.05)


def test_qwen3_next_skips_multi_token_prediction_weights(tmp_path):
    """Released Qwen3-Next checkpoints carry ``mtp.*`` tensors the model does not run: skipped. A
    tensor no parameter claims anywhere else is still an error."""
    from tokenos.model_loader.loader import iter_checkpoint_weights, load_weights

    save_tiny("qwen3_next", str(tmp_path), perturbed=False)
    config = load_model_config(str(tmp_path), dtype="float32", max_model_len=64)
    model = build_model(config, load=False)
    extra = [("mtp.fc.weight", torch.zeros(4, 4)), ("mtp.layers.0.mlp.gate.weight", torch.zeros(2, 4))]
    load_weights(model, config, [*iter_checkpoint_weights(config), *extra])
    stray = ("model.extra.weight", torch.zeros(1))
    with pytest.raises(ValueError, match="no matching parameter"):
        load_weights(model, config, [*iter_checkpoint_weights(config), stray])


def test_gguf_rope_scaling_is_refused(tmp_path):
    """GGUF's rope scaling metadata is not read: such a file is refused, not run as default rope."""
    import gguf

    from tokenos.model_loader.gguf_loader import read_gguf_config

    path = str(tmp_path / "yarn.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("llama.rope.scaling.type", "yarn")
    writer.add_float32("llama.rope.scaling.factor", 4.0)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="llama.rope.scaling.type 'yarn' is not supported"):
        read_gguf_config(path)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", torch.int8])
def test_page_and_weight_dtypes_are_not_model_dtypes(dtype):
    """8-bit names are KV pages (--kv-cache-dtype) or weights (--quantization), never the compute dtype."""
    from tokenos.models.config import resolve_dtype

    with pytest.raises(ValueError, match="not a model dtype.*--kv-cache-dtype"):
        resolve_dtype(dtype)
    assert resolve_dtype("float16") == torch.float16 and resolve_dtype(torch.bfloat16) == torch.bfloat16
