"""The Hugging Face fixture of the model tests (skipped where transformers/torch are missing)."""
import copy

import pytest

from models.llama import LlamaConfig


@pytest.fixture
def save_hf(tmp_path):
    """Factory: a random transformers model of our config (`LlamaForCausalLM`, `Qwen2ForCausalLM`,
    ... by its model_type) saved with `save_pretrained` -> (directory, the torch model in f32)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    def build(config: LlamaConfig, name="hf", *, seed=0, torch_dtype=None, max_shard_size=None):
        torch.manual_seed(seed)
        hf = config.to_hf_config()
        # Gemma: eager attention, transformers' CPU implementation that soft-caps the scores (Gemma 2)
        # and that transformers advises for Gemma 3.
        attn = dict(attn_implementation="eager") if hf["model_type"].startswith("gemma") else {}
        hf_config = transformers.AutoConfig.for_model(**hf, **attn)
        model = getattr(transformers, hf["architectures"][0])(hf_config).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                z = torch.randn(p.shape)
                p.copy_(z / p.shape[1] ** 0.5 if p.ndim == 2 else 1 + 0.1 * z if "norm" in pname else 0.1 * z)
                if torch_dtype is not None:  # the returned f32 model holds exactly the saved values
                    p.copy_(p.to(torch_dtype).float())
        # Save a converted copy: `.to(dtype)` would also round the f32 RoPE buffer of the model we return.
        saved = model if torch_dtype is None else copy.deepcopy(model).to(torch_dtype)
        kwargs = {} if max_shard_size is None else dict(max_shard_size=max_shard_size)
        saved.save_pretrained(tmp_path / name, **kwargs)
        return tmp_path / name, model

    return build
