"""Orbax conversion and restore, the tokenizer, the registry, and what a bad checkpoint reports."""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model_testing import LLAMA3_SCALING, dense_logits, tiny_config
from models import MODEL_REGISTRY, CheckpointError, Llama, load_model, load_tokenizer
from models.checkpoint import checkpoint_kind
from scripts.convert_checkpoint import convert, main

PROMPT = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 12)), jnp.int32)


def params(model):
    return nnx.to_pure_dict(nnx.state(model))


def write_tokenizer(directory):
    """A word-level tokenizer.json whose post-processor adds BOS (as Llama 3's does), and an
    instruct-style generation_config.json listing a second eos id."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "paged": 4, "world": 5, "<eot>": 6}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>", "<eot>"])
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A",
                                                                  special_tokens=[("<s>", 1)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 6]}))


def test_convert_then_restore_gives_identical_logits(save_hf, tmp_path, capsys):
    hf_dir, _ = save_hf(tiny_config(tie_word_embeddings=True, rope_scaling=LLAMA3_SCALING))
    write_tokenizer(hf_dir)
    out = tmp_path / "orbax"
    stats = main([str(hf_dir), str(out)])
    printed = capsys.readouterr().out
    assert f"{stats['bytes'] / 2**20:.1f} MiB" in printed and str(out) in printed
    assert checkpoint_kind(out) == "orbax" and checkpoint_kind(hf_dir) == "hf"
    original, restored = load_model(hf_dir), load_model(out)
    assert restored.config == original.config
    assert stats["params"] == sum(x.size for x in jax.tree.leaves(params(original)))
    jax.tree.map(np.testing.assert_array_equal, params(restored), params(original))
    np.testing.assert_array_equal(dense_logits(restored, PROMPT), dense_logits(original, PROMPT))
    tokenizer = load_tokenizer(out)  # copied from the source directory
    assert tokenizer.eos_token_ids == (2, 6) and tokenizer.bos_token_id == 1
    assert tokenizer.encode("hello paged world") == [1, 3, 4, 5]
    assert tokenizer.decode([1, 3, 4, 5, 6]) == "hello paged world"


def test_convert_to_bfloat16_and_cast_on_restore(save_hf, tmp_path):
    hf_dir, _ = save_hf(tiny_config())
    convert(hf_dir, tmp_path / "bf16", dtype="bfloat16")
    as_bf16 = load_model(hf_dir, dtype="bfloat16")
    restored = load_model(tmp_path / "bf16")
    assert restored.config.dtype == "bfloat16" and restored.layers.w_up[...].dtype == jnp.bfloat16
    jax.tree.map(np.testing.assert_array_equal, params(restored), params(as_bf16))
    widened = load_model(tmp_path / "bf16", dtype="float32")
    assert widened.embed[...].dtype == jnp.float32
    jax.tree.map(np.testing.assert_array_equal, params(widened),
                 jax.tree.map(lambda x: x.astype(jnp.float32), params(as_bf16)))


def test_registry_and_tokenizer_absent(save_hf):
    hf_dir, _ = save_hf(tiny_config())
    assert MODEL_REGISTRY["llama"].model_cls is Llama
    assert isinstance(load_model(hf_dir), Llama)
    assert load_tokenizer(hf_dir) is None


def edit_config(directory, **changes):
    file = directory / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def test_missing_config(save_hf):
    hf_dir, _ = save_hf(tiny_config())
    (hf_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(f"{hf_dir / 'config.json'}: missing")):
        load_model(hf_dir)


def test_missing_shard(save_hf):
    hf_dir, _ = save_hf(tiny_config(), max_shard_size="20KB")
    shard = sorted(hf_dir.glob("model-*.safetensors"))[1]
    shard.unlink()
    message = f"{shard}: shard named by {hf_dir / 'model.safetensors.index.json'} is missing"
    with pytest.raises(FileNotFoundError, match=re.escape(message)):
        load_model(hf_dir)


def test_tensor_shape_mismatch(save_hf):
    hf_dir, _ = save_hf(tiny_config())  # intermediate_size 128
    edit_config(hf_dir, intermediate_size=96)
    message = (r"model.safetensors: tensor 'model.layers.0.mlp.down_proj.weight' has shape "
               r"\(64, 128\), expected \(64, 96\)")
    with pytest.raises(CheckpointError, match=message):
        load_model(hf_dir)


def test_missing_and_unexpected_tensors(save_hf):
    hf_dir, _ = save_hf(tiny_config(tie_word_embeddings=True))
    edit_config(hf_dir, tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match="1 tensors missing .* first 'lm_head.weight'"):
        load_model(hf_dir)
    edit_config(hf_dir, tie_word_embeddings=True, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match="unexpected tensor 'model.layers.1.input_layernorm.weight'"):
        load_model(hf_dir)


@pytest.mark.parametrize("changes, message", [
    (dict(model_type="gemma4"), "unsupported model_type 'gemma4'"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     "unsupported rope_scaling type 'yarn'"),
])
def test_unsupported_config(save_hf, changes, message):
    hf_dir, _ = save_hf(tiny_config())
    edit_config(hf_dir, **changes)
    with pytest.raises(CheckpointError, match=re.escape(f"{hf_dir / 'config.json'}: {message}")):
        load_model(hf_dir)


def test_neither_kind(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf_config()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=re.escape(f"{tmp_path}: neither an HF checkpoint")):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        load_model(tmp_path / "absent")
