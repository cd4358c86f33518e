"""The Llama family's config: `LlamaConfig` (read from and written to Hugging Face's config.json, the
family's variants told apart by `model_type`), the named shapes (`PRESETS`) and RoPE's frequencies.

The modules and the forward that this config shapes are models.llama, which re-exports these names.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = ("float32", "bfloat16")
# Hugging Face's dtype names for what we compute in; float16 runs as bfloat16 (same bytes, JAX's
# accelerators prefer it, and it does not overflow where float16 activations can).
_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "bfloat16"}
# config.json's model_types built from these blocks -> HF architecture. What a family changes that
# its config.json does not state (shared/notes/model-families.md) is derived from model_type below.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM"}
# rope_scaling types -> the fields each needs (Phi-3's original_max_position_embeddings comes from the
# config's top level when its rope_scaling lacks it).
_ROPE_FIELDS = {"llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
                "longrope": {"short_factor", "long_factor", "original_max_position_embeddings"}}
# The families whose config.json's sliding_window is the window of every layer (Phi-3-mini-4k: 2047).
WINDOWED = ("mistral", "phi3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    architectures: ClassVar[dict[str, str]] = ARCHITECTURES  # the model_types this class builds
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # None, the llama3 dict (rope_type "llama3", factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings) or Phi-3's longrope one (short_factor, long_factor: one per
    # rotary frequency; original_max_position_embeddings; attention_factor, optional); kept as
    # sorted (key, value) pairs so the config hashes: it is static data in the model's graphdef, a
    # jit cache key.
    rope_scaling: Any = None
    partial_rotary_factor: float = 1.0  # RoPE turns the first head_dim * this dims (Phi-4-mini: 0.75)
    # LongRoPE's long factors in use rather than its short ones: the engine's choice for its life
    # (models.llama.fit_rope: max_model_len past the original context, vLLM's rule).
    long_rope: bool = False
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k, v and o (HF Llama's and Qwen3's field)
    max_position_embeddings: int = 131072
    bos_token_id: int | None = 128000
    eos_token_id: Any = 128001  # int or a tuple of ints
    dtype: str = "float32"  # params and activations; norms and softmax accumulate in f32
    model_type: str = "llama"
    # Mistral's: a query at position p sees keys at (p - sliding_window, p] in every layer; None: all.
    sliding_window: int | None = None

    def __post_init__(self):
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1] and turn an even "
                             f"number of head_dim {self.head_dim}'s dims")
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", self._checked_rope_scaling())
        if isinstance(self.eos_token_id, (list, tuple)):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.model_type not in self.architectures:
            raise ValueError(f"unsupported model_type {self.model_type!r}: only {sorted(self.architectures)} "
                             "are implemented")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.sliding_window is not None and (
                isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int)
                or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window!r}")
        self._check_family()

    def _checked_rope_scaling(self) -> tuple:
        scaling = dict(self.rope_scaling)
        # Older HF configs name the type "type", some carry both keys; Phi-3's first name for LongRoPE was "su".
        kind = scaling.pop("rope_type", None) or scaling.pop("type", None)
        scaling.pop("type", None)
        kind = "longrope" if kind == "su" else kind
        if kind not in _ROPE_FIELDS:
            raise ValueError(f"unsupported rope_scaling type {kind!r}: only 'llama3' and 'longrope' are implemented")
        missing = _ROPE_FIELDS[kind] - set(scaling)
        if missing:
            raise ValueError(f"{kind} rope_scaling lacks {sorted(missing)}: {self.rope_scaling}")
        for name in ("short_factor", "long_factor") if kind == "longrope" else ():
            factors = scaling[name]
            if not isinstance(factors, (list, tuple)) or len(factors) != self.rotary_dim // 2 or not all(
                    isinstance(f, (int, float)) and f > 0 for f in factors):
                raise ValueError(f"longrope rope_scaling {name} must be {self.rotary_dim // 2} positive numbers "
                                 f"(one per rotary frequency), got {factors!r}"[:300])
            scaling[name] = tuple(float(f) for f in factors)
        return tuple(sorted({**scaling, "rope_type": kind}.items()))

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def _check_family(self):
        # HF's Llama and Qwen classes ignore a sliding_window (Qwen2's use_sliding_window is refused
        # on load): only Mistral's would round-trip through to_hf_config.
        if self.sliding_window is not None and self.model_type not in WINDOWED:
            raise ValueError(f"sliding_window={self.sliding_window} is for model_type 'mistral' or 'phi3' only, "
                             f"got {self.model_type!r}")

    @property
    def qkv_bias(self) -> bool:  # Qwen2 always biases q, k, v (not o)
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:  # Qwen3: RMSNorm over head_dim on every q and k head, before RoPE
        return self.model_type == "qwen3"

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: it attends to the whole sequence)."""
        return (self.sliding_window,) * self.num_layers

    @property
    def kv_window(self) -> int | None:
        """The window every layer shares, or None when any layer attends globally. A query at
        position p reads keys at (p - kv_window, p] only, so once a sequence's next query is at p,
        blocks wholly at or before p - kv_window are read by no layer again (the engine may free them)."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def sm_scale(self) -> float:  # the attention scores' scale
        return self.head_dim**-0.5

    @property
    def attn_soft_cap(self) -> float | None:  # cap * tanh(score / cap) on the scaled scores; Gemma 2's
        return None

    @classmethod
    def from_hf_config(cls, hf: dict, *, dtype=None) -> LlamaConfig:
        """From a Hugging Face `config.json` dict (transformers 4 or 5 style)."""
        model_type = hf.get("model_type", "llama")
        if hf.get("use_sliding_window"):
            raise ValueError(f"use_sliding_window: true ({model_type}, sliding_window="
                             f"{hf.get('sliding_window')}) is not supported yet")
        if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias", False):
            raise ValueError("unsupported Llama variant: hidden_act must be 'silu' and mlp_bias false, "
                             f"got {hf.get('hidden_act')!r}, {hf.get('mlp_bias')!r}")
        rotary = hf.get("partial_rotary_factor") or (hf.get("rope_parameters") or {}).get("partial_rotary_factor")
        fields = hf_common_fields(hf, dtype)
        if fields["rope_scaling"] is not None and "original_max_position_embeddings" in hf:  # Phi-3's place for it
            fields["rope_scaling"] = {"original_max_position_embeddings": hf["original_max_position_embeddings"],
                                      **fields["rope_scaling"]}
        # Qwen configs carry a sliding_window that they do not use (use_sliding_window false).
        window = hf.get("sliding_window") if model_type in WINDOWED else None
        return cls(**fields, attention_bias=hf.get("attention_bias", False), model_type=model_type,
                   sliding_window=window, partial_rotary_factor=float(rotary or 1.0))

    def to_hf_config(self) -> dict:
        """The transformers-4 style `config.json` (read by transformers 4 and 5, and by vLLM)."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        scaling = None if self.rope_scaling is None else {
            k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_scaling}
        return {
            "architectures": [self.architectures[self.model_type]], "model_type": self.model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": scaling,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "mlp_bias": False, "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id, "eos_token_id": eos, "torch_dtype": self.dtype,
            "sliding_window": self.sliding_window,  # explicit: MistralConfig's default is 4096, not None
            # Phi3Config's default pad_token_id (32000) is a token past any smaller vocabulary.
            **({"pad_token_id": None} if self.model_type == "phi3" else {}),
            **({"partial_rotary_factor": self.partial_rotary_factor} if self.partial_rotary_factor != 1 else {}),
            **({"original_max_position_embeddings": scaling["original_max_position_embeddings"]}
               if scaling and scaling["rope_type"] == "longrope" else {}),
        }


def hf_common_fields(hf: dict, dtype) -> dict:
    """The fields every family reads alike from an HF `config.json` dict."""
    # transformers 5 folds rope_theta and the scaling into `rope_parameters`; 4 keeps them apart.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope.pop("partial_rotary_factor", None)  # transformers 5 keeps it here; read by from_hf_config
    if not rope or rope.get("rope_type", rope.get("type")) == "default":
        rope = None
    saved = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if dtype is None and saved not in _HF_DTYPES:
        raise ValueError(f"unsupported checkpoint dtype {saved!r}; pass dtype= explicitly")
    heads = hf["num_attention_heads"]
    return dict(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=rope,
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
        dtype=dtype or _HF_DTYPES[saved])


_LLAMA3_SCALING = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)
_LLAMA3 = dict(vocab_size=128256, intermediate_size=8192, num_kv_heads=8, rms_norm_eps=1e-5,
               rope_theta=500000.0, max_position_embeddings=131072, bos_token_id=128000,
               eos_token_id=128001, dtype="bfloat16")
PRESETS = {
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, num_layers=16, num_heads=32, head_dim=64,
                         tie_word_embeddings=True, rope_scaling=dict(_LLAMA3_SCALING, factor=32.0)),
    "llama-3.2-3b": dict(_LLAMA3, hidden_size=3072, num_layers=28, num_heads=24, head_dim=128,
                         tie_word_embeddings=True, rope_scaling=dict(_LLAMA3_SCALING, factor=32.0)),
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_layers=32,
                         num_heads=32, head_dim=128, rope_scaling=dict(_LLAMA3_SCALING, factor=8.0)),
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=256,
                 bos_token_id=1, eos_token_id=2, dtype="float32"),
}


def preset(name: str, **overrides) -> LlamaConfig:
    """A named shape (`PRESETS`), with any field overridden: `preset("tiny", num_layers=4)`."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return LlamaConfig(**{**PRESETS[name], **overrides})


def rope_frequencies(theta: float, head_dim: int) -> np.ndarray:  # f32[head_dim // 2]
    """RoPE's unscaled frequencies: theta ** (-2i / head_dim)."""
    return (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)).astype(np.float32)


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:  # f32[rotary_dim // 2]
    """RoPE frequencies, with Llama 3.1's scaling (long wavelengths slowed by `factor`, short ones
    kept, a smooth blend between: Meta's llama-models `apply_scaling`, HF's
    `_compute_llama3_parameters`) or Phi-3's LongRoPE (each frequency divided by its own factor,
    short or long: HF's `_compute_longrope_parameters`)."""
    inv_freq = rope_frequencies(config.rope_theta, config.rotary_dim)
    if config.rope_scaling is None:
        return inv_freq.astype(np.float32)
    s = dict(config.rope_scaling)
    if s["rope_type"] == "longrope":
        factors = np.asarray(s["long_factor" if config.long_rope else "short_factor"], np.float32)
        d = config.rotary_dim
        return (1.0 / (factors * config.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))).astype(np.float32)
    old_len, low, high = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / s["factor"], inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / s["factor"] + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_attention_factor(config: LlamaConfig) -> float:
    """What LongRoPE scales cos and sin by (so q.k by its square): its attention_factor, or
    sqrt(1 + ln(scale) / ln(original)) with scale the context's growth (HF's and vLLM's); 1 otherwise."""
    s = dict(config.rope_scaling or ())
    if s.get("rope_type") != "longrope":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    original = s["original_max_position_embeddings"]
    scale = config.max_position_embeddings / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
