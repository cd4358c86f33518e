"""Models on the paged KV cache and their checkpoints.

The engine imports this package lazily and calls `load_model(dir)`: config.json's `model_type`
selects the entry of `MODEL_REGISTRY`, and the directory's contents select HF or Orbax loading. A
GGUF file goes through `load_gguf(file)`, whose `general.architecture` selects the entry."""
from models.checkpoint import MODEL_REGISTRY, CheckpointError, load_model, save_orbax
from models.gemma2 import Gemma2, Gemma2Config
from models.gguf import load_gguf
from models.llama import Llama, LlamaConfig, forward, preset
from models.tokenizer import Tokenizer, load_tokenizer

__all__ = ["MODEL_REGISTRY", "CheckpointError", "Gemma2", "Gemma2Config", "Llama", "LlamaConfig", "Tokenizer",
           "forward", "load_gguf", "load_model", "load_tokenizer", "preset", "save_orbax"]
