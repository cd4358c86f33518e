"""`LLM`: vLLM's offline interface. `LLM(model).generate(prompts, sampling_params)`."""
from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
from pathlib import Path

from paged_jax.engine.arg_utils import EngineArgs
from paged_jax.engine.beam_search import BeamSearchOutput, beam_search
from models.quantize import quantize
from paged_jax.engine.llm_engine import LLMEngine
from paged_jax.engine.outputs import RequestOutput
from paged_jax.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

# config.json's model_type -> the module that loads it, imported only when used (as vLLM's registry
# does), so that paged_jax never imports models at module level.
MODEL_LOADERS = {"llama": "models", "qwen2": "models", "qwen3": "models", "mistral": "models",
                 "gemma2": "models", "gemma3_text": "models", "gemma3": "models", "phi3": "models"}
# A GGUF file names its architecture inside: this module's load_gguf reads it (and refuses one it does
# not build), parsing the metadata once for the model and the tokenizer.
GGUF_LOADER = "models"


def load_model(path, dtype=None):
    """(model, tokenizer or None) from a checkpoint directory (Hugging Face or Orbax) or a GGUF file."""
    if Path(path).is_file() or Path(path).suffix == ".gguf":  # a missing .gguf: say so, not "no config.json"
        return importlib.import_module(GGUF_LOADER).load_gguf(path, dtype=dtype)
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: no config.json, so {path} is not a model directory")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in MODEL_LOADERS:
        raise ValueError(f"{config_file}: model_type {model_type!r} is not supported; supported: {sorted(MODEL_LOADERS)}")
    module = importlib.import_module(MODEL_LOADERS[model_type])
    return module.load_model(path, dtype=dtype), module.load_tokenizer(path)


def load_tokenizer(path):
    """vLLM's `tokenizer=`: the tokenizer of a checkpoint directory (tokenizer.json) or a GGUF file,
    used instead of the model's own (for a GGUF, vLLM advises its base model's original tokenizer)."""
    tokenizer = importlib.import_module(GGUF_LOADER).load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"tokenizer={str(path)!r} has no tokenizer: give a directory with tokenizer.json "
                         "or a GGUF file with tokenizer.ggml.* metadata")
    return tokenizer


def _prompt_list(prompts) -> list:
    """One prompt (a string, a dict, or token ids) is a list of one: a dict iterated would give its keys."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return prompts


def _unpack(prompt):
    """(text or token ids, cache_salt or None) of one prompt; a dict holds "prompt" or "prompt_token_ids"."""
    if not isinstance(prompt, dict):
        return prompt, None
    return (prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]), prompt.get("cache_salt")


class LLM:
    def __init__(self, model, *, tokenizer=None, mesh=None, **kwargs):
        """`model`: a checkpoint directory (Hugging Face safetensors or a converted Orbax one), a GGUF
        file (dequantized at load) or a model object (e.g. `models.Llama`), with an optional
        `tokenizer` (an object, or a directory / GGUF file whose tokenizer replaces the model's).
        `kwargs`: EngineArgs' fields (paged_jax/engine/arg_utils.py), vLLM's names.
        Memory, as vLLM's: `gpu_memory_utilization` (default 0.9) is the fraction of the device this
        engine may use, weights, activation peak and KV together; `kv_cache_memory_fraction`, if
        given, wins and gives the KV that fraction of what the weights leave (engine.config.kv_budget_bytes).
        `kv_cache_dtype` "int8" and "fp8_e4m3" store the pages quantized with a scale per (token, KV
        head), about half (bf16) or a quarter (f32) of the bytes per block, so more blocks in the
        same budget. `quantization` "int8" stores the matmul weights as int8 (models/quantize.py).
        `mesh`, `preemption_mode`, `async_scheduling`: see LLMEngine."""
        args = EngineArgs(**kwargs)
        if isinstance(tokenizer, (str, Path)):  # before the model: a bad path fails fast
            tokenizer = load_tokenizer(tokenizer)
        if isinstance(model, (str, Path)):
            model, found = load_model(model, dtype=args.dtype)
            model = quantize(model, args.quantization)  # before sizing: the unquantized weights are freed
            tokenizer = tokenizer or found
        self.engine = LLMEngine(model, tokenizer, mesh=mesh, engine_args=args)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params=None, *, use_tqdm=False, lora_request=None) -> list[RequestOutput]:
        """Outputs in the order of `prompts`: a string, a list of strings, a list of token-id lists,
        or dicts `{"prompt": str | "prompt_token_ids": list[int], "cache_salt": str}`.
        `lora_request`: a LoRARequest for every prompt, or a list of one (or None) per prompt
        (the engine needs enable_lora=True)."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} LoRA requests for {len(prompts)} prompts")
        # Check every prompt before queueing any, so a bad one leaves the engine untouched.
        requests = []
        for prompt, params, lora in zip(prompts, sampling_params, loras):
            prompt, salt = _unpack(prompt)
            self.engine.tokenize_prompt(prompt)
            if lora is not None:
                self.engine.add_lora(lora)
            # Only finished outputs are read here: no per-step copies of every request (vLLM's choice too).
            params = dataclasses.replace(params or SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY)
            requests.append((f"gen-{next(self._ids)}", prompt, params, salt, lora))
        for request_id, prompt, params, salt, lora in requests:
            self.engine.add_request(request_id, prompt, params, cache_salt=salt, lora_request=lora)
        order = {request_id: i for i, (request_id, *_) in enumerate(requests)}
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="requests", unit="req")
        while len(done) < len(requests):
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return sorted(done.values(), key=lambda o: order[o.request_id])

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's beam search (paged_jax.engine.beam_search: its rules, and where they differ from
        transformers'): one `BeamSearchOutput` per prompt, in order, its sequences best first.
        Prompts as for `generate`; a dict's cache_salt is not used (beams do not touch the prefix
        cache). ValueError, before anything runs, for a bad prompt or beam_width > max_num_seqs."""
        parsed = []
        for prompt in _prompt_list(prompts):
            parsed.append(self.engine.tokenize_prompt(_unpack(prompt)[0]))
        return beam_search(self.engine, parsed, params)

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (vLLM's name); False, changing nothing, while requests hold blocks."""
        return self.engine.reset_prefix_cache()
