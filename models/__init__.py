"""Models on the paged KV cache and their checkpoints.

The engine imports this package lazily and calls `load_model(dir)`: config.json's `model_type`
selects the entry of `MODEL_REGISTRY`, and the directory's contents select HF or Orbax loading. A
GGUF file goes through `load_gguf(file)`, whose `general.architecture` selects the entry.

The modules import one way, each from those above it here, at module level
(tests/models/test_import_layers.py):
    errors, layers, llama_config, chat_template
    gguf_file (the GGUF reader)   llama (modules, forward)     tokenizer_base (Tokenizer)
    gguf_tokenizer                gemma2, gemma3
    tokenizer (load_tokenizer)    loading (registry, tensor placement, buffers)
    gguf (load_gguf)
    checkpoint (HF, Orbax; load_model, which hands a file to gguf)"""
from models.checkpoint import load_model, save_orbax
from models.errors import CheckpointError
from models.gemma2 import Gemma2, Gemma2Config
from models.gemma3 import Gemma3, Gemma3Config
from models.gguf import load_gguf
from models.llama import Llama, forward
from models.llama_config import LlamaConfig, preset
from models.loading import MODEL_REGISTRY
from models.tokenizer import load_tokenizer
from models.tokenizer_base import Tokenizer

__all__ = ["MODEL_REGISTRY", "CheckpointError", "Gemma2", "Gemma2Config", "Gemma3", "Gemma3Config", "Llama",
           "LlamaConfig", "Tokenizer",
           "forward", "load_gguf", "load_model", "load_tokenizer", "preset", "save_orbax"]
