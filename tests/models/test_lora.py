"""LoRA adapters in the forward (models/lora.py): several adapters in one ragged batch, each token's
own, against the base model with each adapter folded into its weights, and against PEFT itself."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model_testing import (dense_logits, hf_logits, max_rel_err, merged_model, random_model, save_peft_adapter,
                           tiny_config)
from models import lora
from models.llama import forward
from paged_jax.attention import AttentionMetadata

BLOCK = 4


def _ragged_logits(model, prompts, slots, weights):
    """Every prompt in one ragged prefill step, each token with its prompt's adapter slot ->
    per prompt f32[len, vocab]."""
    tokens = np.concatenate(prompts)
    lens = [len(p) for p in prompts]
    start = np.concatenate([[0], np.cumsum(lens)])
    width = max(-(-n // BLOCK) for n in lens)
    tables = 1 + np.arange(len(prompts) * width).reshape(len(prompts), width)[:, ::-1]  # blocks out of order
    positions = np.concatenate([np.arange(n) for n in lens])
    rows = np.repeat(np.arange(len(prompts)), lens)
    md = AttentionMetadata(slot_mapping=jnp.asarray(tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK),
                           block_tables=jnp.asarray(tables, jnp.int32), seq_lens=jnp.asarray(lens, jnp.int32),
                           query_start_loc=jnp.asarray(start, jnp.int32))
    inputs = lora.LoRAInputs(weights, jnp.asarray(np.asarray(slots)[rows], jnp.int32))
    cache = model.init_cache(1 + tables.size, BLOCK)
    logits, _ = forward(*nnx.split(model), jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32),
                        cache, md, jnp.arange(len(tokens), dtype=jnp.int32), lora=inputs)
    return np.split(np.asarray(logits), start[1:-1])


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_each_token_takes_its_own_adapter(tmp_path, family):
    """Three prompts in one batch: no adapter, adapter 1 (rank 4, every projection) in slot 1 and
    adapter 2 (rank 8, rsLoRA, q/v only, one layer) in slot 0; each prompt's logits are the merged
    model's. Slots hold rank 8, so adapter 1's is padded."""
    extra = dict(model_type="gemma2", num_layers=3, head_dim=32, sliding_window=16, query_pre_attn_scalar=24,
                 attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=True) \
        if family == "gemma2" else dict(num_heads=8, num_kv_heads=2, head_dim=8)
    config = tiny_config(**extra)
    model = random_model(config, seed=1)
    one = save_peft_adapter(tmp_path / "one", config, rank=4, alpha=8, seed=2)
    two = save_peft_adapter(tmp_path / "two", config, rank=8, alpha=4, seed=3, rslora=True,
                            targets=("q_proj", "v_proj"), layers=[1])
    weights = lora.LoRAWeights.zeros(config, max_loras=2, max_rank=8)
    weights = lora.write_slot(weights, 1, *lora.load_peft(tmp_path / "one", config, 8))
    weights = lora.write_slot(weights, 0, *lora.load_peft(tmp_path / "two", config, 8))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, n) for n in (9, 13, 6)]
    got = _ragged_logits(model, prompts, [-1, 1, 0], weights)
    references = [model, merged_model(model, one, 8 / 4), merged_model(model, two, 4 / np.sqrt(8))]
    for prompt, logits, reference in zip(prompts, got, references):
        assert max_rel_err(logits, dense_logits(reference, jnp.asarray(prompt)[None])[0]) <= 1e-4
    # The adapters move the logits far beyond that tolerance: the test sees them.
    assert max_rel_err(got[1], dense_logits(model, jnp.asarray(prompts[1])[None])[0]) > 0.05
    assert max_rel_err(got[2], dense_logits(model, jnp.asarray(prompts[2])[None])[0]) > 0.01


@pytest.mark.parametrize("model_type, targets", [
    ("llama", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])])  # fused: one A, B's rows split
def test_matches_peft(save_hf, tmp_path, model_type, targets):
    """An adapter PEFT made and saved (random B, as after training) gives PEFT's logits."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from models.checkpoint import load_model

    config = tiny_config(num_heads=8, num_kv_heads=2, head_dim=8, model_type=model_type)
    directory, hf_model = save_hf(config)
    peft_model = peft.get_peft_model(hf_model, peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets))
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape))
    peft_model.save_pretrained(tmp_path / "adapter")
    model = load_model(directory, dtype="float32")
    weights = lora.write_slot(lora.LoRAWeights.zeros(config, 1, 4), 0, *lora.load_peft(tmp_path / "adapter", config, 4))
    prompt = np.random.default_rng(0).integers(0, 128, 24)
    got = _ragged_logits(model, [prompt], [0], weights)[0]
    expected = hf_logits(peft_model, prompt)
    assert max_rel_err(got, expected) <= 1e-4
    with peft_model.disable_adapter():  # the adapter moves the logits far beyond the tolerance
        assert max_rel_err(got, hf_logits(peft_model, prompt)) > 0.05


BAD = {
    "rank above max_lora_rank": (dict(rank=16, alpha=16), "has rank 16, more than max_lora_rank=8"),
    "DoRA": (dict(extra_config=dict(use_dora=True)), "DoRA (use_dora=True) is not supported"),
    "biases": (dict(extra_config=dict(bias="all")), "trained biases (bias='all')"),
    "modules_to_save": (dict(extra_config=dict(modules_to_save=["lm_head"])), "modules_to_save"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_refuses_what_it_cannot_serve(tmp_path, case):
    config = tiny_config()
    kwargs, message = BAD[case]
    save_peft_adapter(tmp_path / "a", config, **{**dict(rank=4, alpha=8), **kwargs})
    with pytest.raises(lora.LoRAError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lora.load_peft(tmp_path / "a", config, 8)


def test_refuses_foreign_tensors_and_shapes(tmp_path):
    from safetensors.numpy import load_file, save_file

    config = tiny_config()
    save_peft_adapter(tmp_path / "a", config, rank=4, alpha=8)
    file = tmp_path / "a" / "adapter_model.safetensors"
    tensors = load_file(str(file))
    save_file({**tensors, "base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 128), np.float32)},
              str(file))
    with pytest.raises(lora.LoRAError, match="tensor 'base_model.model.model.embed_tokens.lora_embedding_A' is "
                                             "not a LoRA A/B of a supported projection"):
        lora.load_peft(tmp_path / "a", config, 8)
    save_peft_adapter(tmp_path / "b", config, rank=4, alpha=8)  # for a model of another width
    with pytest.raises(lora.LoRAError, match=r"down_proj.lora_A.weight' has shape \(4, 128\), expected \(4, 96\)"):
        lora.load_peft(tmp_path / "b", tiny_config(intermediate_size=96), 8)
    with pytest.raises(lora.LoRAError, match="no adapter_config.json"):
        lora.load_peft(tmp_path / "missing", config, 8)
