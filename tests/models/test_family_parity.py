"""Qwen2, Qwen3, Mistral (with and without a sliding window), Gemma 2 and Gemma 3 through `LLM(dir)` against
transformers' own `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `MistralForCausalLM`, `Gemma2ForCausalLM` and
`Gemma3ForCausalLM`
on checkpoints they saved: logits to f32 tolerance, greedy tokens exactly, with and without prefix
caching and preemption, and through the Pallas kernels in interpret mode."""
import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

from model_testing import (GEMMA2, GEMMA3, MISTRAL_WINDOW, dense_logits, hf_logits, max_rel_err, paged_prefill_logits,
                           tiny_config)
from models.checkpoint import load_model
from models.llama import fit_rope
from paged_jax import LLM, SamplingParams

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

LONGROPE = dict(rope_type="longrope", original_max_position_embeddings=16)
FAMILIES = {
    # Released Qwen2.5 small sizes: rope_theta 1e6, tied embeddings; q/k/v biases always.
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6),
    # q/k norms over an explicit head_dim that is not hidden / heads (64 / 4).
    "qwen3": dict(model_type="qwen3", head_dim=32),
    "qwen3_attention_bias": dict(model_type="qwen3", attention_bias=True),
    # Mistral v0.2 / v0.3: Llama's blocks with sliding_window null (to_hf_config writes it).
    "mistral": dict(model_type="mistral", rope_theta=1e6),
    "mistral_window": dict(MISTRAL_WINDOW, rope_theta=1e6),
    "gemma2": GEMMA2,
    "gemma3": GEMMA3,
    # Phi-3 and Phi-4: fused qkv_proj and gate_up_proj, untied; Phi-3-mini-4k's window in every layer.
    "phi3": dict(model_type="phi3", rope_theta=250000.0),
    "phi3_window": dict(model_type="phi3", sliding_window=12),
    # Phi-3.5-mini: LongRoPE past an original context of 16 tokens (the prompts outgrow it, so
    # transformers runs the long factors); Phi-4-mini: the same on half of each head (rotary 8 of 16).
    "phi3_longrope": dict(model_type="phi3", rope_scaling=dict(LONGROPE, short_factor=[1.0, 1.1, 1.3, 1.5, 2.0, 2.5, 3.0, 4.0],
                                                                long_factor=[1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0])),
    "phi4_mini": dict(model_type="phi3", partial_rotary_factor=0.5,
                      rope_scaling=dict(LONGROPE, short_factor=[1.0, 1.2, 1.5, 2.0], long_factor=[1.0, 3.0, 9.0, 27.0])),
}
NEW_TOKENS = 32
rng = np.random.default_rng(0)
SHARED = rng.integers(0, 256, 24).tolist()  # three full blocks of 8
PROMPTS = [SHARED + rng.integers(0, 256, n).tolist() for n in (3, 9, 14, 5)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def family_config(family):
    return tiny_config(vocab_size=256, **FAMILIES[family])


def hf_greedy(model, prompts, new_tokens=NEW_TOKENS):
    """transformers' greedy continuations, `new_tokens` each (no EOS stop, as `ignore_eos`). The mask
    is explicit: inferred from pad_token_id, it would hide the prompts' own 0 tokens."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(save_hf, family):
    config = family_config(family)
    directory, hf_model = save_hf(config)
    model = fit_rope(load_model(directory), 256)  # as the engine: LongRoPE's long factors past 16 tokens
    assert model.config == dataclasses.replace(config, long_rope=config.rope_scaling is not None)
    expected = hf_logits(hf_model, PROMPTS[0])
    assert max_rel_err(dense_logits(model, jnp.asarray(PROMPTS[0])[None])[0], expected) <= 1e-4
    assert max_rel_err(paged_prefill_logits(model, PROMPTS[0]), expected) <= 1e-4


# Null-window Mistral runs Llama's code path (its logits are checked above); its window runs here.
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral_window", "gemma2", "gemma3", "phi3_window",
                                    "phi4_mini"])
def test_greedy_tokens_match_transformers(save_hf, family):
    directory, hf_model = save_hf(family_config(family))
    expected = hf_greedy(hf_model, PROMPTS)
    plain = LLM(str(directory), block_size=8, num_blocks=64, max_num_seqs=4, enable_prefix_caching=False,
                log_stats=False)
    assert [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)] == expected
    # 15 usable blocks for four sequences of up to 70 tokens (9 blocks each): preemption is forced.
    # The window frees the blocks behind it (a sequence holds at most 4), so there only 8 blocks
    # and prefill chunks of 16 tokens force it.
    windowed = family in ("mistral_window", "phi3_window")
    tight = LLM(str(directory), block_size=8, num_blocks=9 if windowed else 16, max_num_seqs=4,
                max_num_batched_tokens=16 if windowed else None, log_stats=False)
    outs = tight.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    # The last prompt is admitted after the first has written SHARED: its three blocks come cached
    # (in 16-token chunks, the second prompt comes in when two of them are written).
    assert [o.num_cached_tokens for o in outs] == ([0, 16, 24, 24] if windowed else [0, 0, 0, len(SHARED)])
    if windowed:  # one 91-token generation holds a window's blocks (12 tokens + a step), not 12
        one = LLM(str(directory), block_size=8, num_blocks=64, max_num_seqs=1, log_stats=False)
        assert one.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        assert one.stats()["peak_blocks_used"] == 4


@pytest.mark.triton
@pytest.mark.parametrize("family", ["mistral_window", "gemma2", "gemma3"])
def test_pallas_interpret_greedy_tokens_match_transformers(save_hf, family):
    """The Pallas kernels (run on CPU): prefill in chunks of 8 and decode, past the window."""
    directory, hf_model = save_hf(family_config(family))
    prompt, new_tokens = PROMPTS[0][:20], 12
    expected = hf_greedy(hf_model, [prompt], new_tokens)
    llm = LLM(str(directory), block_size=4, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=8,
              num_decode_steps=4, attention_backend="pallas-interpret", log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == expected[0]


def save_gemma3_multimodal(directory, text: dict, *, names_of_4_52: bool):
    """A random `Gemma3ForConditionalGeneration` (tiny SigLIP tower) around the text model `text`,
    saved by transformers (the published tensor names) or renamed as transformers 4.52-4.57 saved
    them -> the torch model in f32."""
    from safetensors.torch import load_file, save_file
    import transformers

    torch.manual_seed(0)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=255, boi_token_index=253, eoi_token_index=254,
                                       attn_implementation="eager")
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # conftest.save_hf's weights: far from uniform attention
        for name, p in model.named_parameters():
            z = torch.randn(p.shape)
            p.copy_(z / p.shape[1] ** 0.5 if p.ndim == 2 else 1 + 0.1 * z if "norm" in name else 0.1 * z)
    model.save_pretrained(directory)
    if names_of_4_52:
        tensors = load_file(directory / "model.safetensors")
        renamed = {("model." + k if k.startswith(("vision_tower.", "multi_modal_projector.")) else
                    k.replace("language_model.model.", "model.language_model.")): v for k, v in tensors.items()}
        assert any(k.startswith("model.language_model.layers.") for k in renamed)
        save_file(renamed, directory / "model.safetensors", metadata={"format": "pt"})
    return model


@pytest.mark.parametrize("names_of_4_52", [False, True], ids=["published", "transformers_4_52"])
def test_a_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path, names_of_4_52):
    """Gemma 3 4B-27B are `Gemma3ForConditionalGeneration` directories: their language model loads
    from text_config and its tensors (the vision tower's are left unread), and gives the multimodal
    model's own text-only logits and greedy tokens."""
    config = family_config("gemma3")
    text = {k: v for k, v in config.to_hf_config().items() if k != "architectures"}
    hf_model = save_gemma3_multimodal(tmp_path / "mm", text, names_of_4_52=names_of_4_52)
    model = load_model(tmp_path / "mm")
    assert model.config == config
    expected = hf_logits(hf_model, PROMPTS[0])
    assert max_rel_err(dense_logits(model, jnp.asarray(PROMPTS[0])[None])[0], expected) <= 1e-4
    llm = LLM(str(tmp_path / "mm"), block_size=8, num_blocks=64, max_num_seqs=4, log_stats=False)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == hf_greedy(hf_model, PROMPTS[:2])


def test_longrope_within_the_original_context_runs_the_short_factors(save_hf):
    """An engine whose sequences stay within the original context (max_model_len 16) runs LongRoPE's
    short factors, as transformers does below it; one that may outgrow it, the long ones."""
    directory, hf_model = save_hf(family_config("phi4_mini"))
    prompt = PROMPTS[0][:8]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    short = LLM(str(directory), block_size=8, num_blocks=16, max_num_seqs=2, max_model_len=16, log_stats=False)
    assert short.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(hf_model, [prompt], 8)[0]
    assert not short.engine.model_config.long_rope and load_model(directory).config.long_rope is False
    long = LLM(str(directory), block_size=8, num_blocks=16, max_num_seqs=2, max_model_len=32, log_stats=False)
    assert long.engine.model_config.long_rope  # (transformers would switch only past 16 tokens)


def test_sliding_window_is_refused(save_hf):
    directory, _ = save_hf(family_config("qwen2"))
    config_file = directory / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "use_sliding_window": True}))
    with pytest.raises(ValueError, match="use_sliding_window: true .* is not supported yet"):
        LLM(str(directory), num_blocks=16, log_stats=False)


def test_what_the_engine_reads_of_a_window(save_hf):
    """kv_window: the window every layer shares (Mistral's), None when a layer attends globally."""
    directory, _ = save_hf(family_config("mistral_window"))
    assert load_model(directory).config.kv_window == 12
    directory, _ = save_hf(family_config("gemma2"), "gemma2")
    config = load_model(directory).config
    assert config.layer_windows == (16, None, 16) and config.kv_window is None


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("family", ["qwen3", "mistral_window"])
def test_speculative_greedy_tokens_match_transformers(save_hf, family, method, untimed_speculation):
    """Speculative decoding on a pool tight enough to preempt, with prefix hits and, for Mistral,
    the window freeing blocks behind it (the draft's pages with the target's): n-gram (every 1-gram
    proposes, so most calls verify) and a draft model (the checkpoint itself, loaded by path):
    transformers' greedy tokens."""
    directory, hf_model = save_hf(family_config(family))
    expected = hf_greedy(hf_model, PROMPTS, 48)  # long enough for the outputs to repeat themselves
    windowed = family == "mistral_window"
    config = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
              if method == "ngram" else {"method": "draft_model", "model": str(directory), "num_speculative_tokens": 3})
    llm = LLM(str(directory), block_size=8, num_blocks=9 if windowed else 16, max_num_seqs=4, num_decode_steps=4,
              max_num_batched_tokens=16 if windowed else None, log_stats=False, speculative_config=config)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_drafts"] >= 10 and stats["spec_decode_num_accepted_tokens"] > 0
