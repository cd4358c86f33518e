"""The LoRA adapters a server offers as models (vLLM's `--lora-modules`), and with
`--allow-runtime-lora-updating` those added and removed while it runs (vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter`). A client names one in `model`."""
from __future__ import annotations

import threading

from models import lora
from paged_jax.entrypoints.openai import protocol
from paged_jax.entrypoints.openai.protocol import APIError
from paged_jax.lora.request import LoRARequest


class LoRAAdapters:
    def __init__(self, requests, engine=None):
        """`requests`: the --lora-modules' LoRARequests; `engine`: the LLMEngine an added adapter is
        checked against (read only then)."""
        self.by_name = {r.lora_name: r for r in requests}
        self.engine = engine
        # An added adapter takes a new id, never one used before: the engine keeps adapters by id.
        self.next_id = 1 + max((r.lora_int_id for r in requests), default=0)
        self.lock = threading.Lock()  # adds run on the server's worker threads

    def get(self, name: str) -> LoRARequest | None:
        return self.by_name.get(name)

    def add(self, body, base_model: str) -> str:
        """Read and check the adapter a load request names, then offer it (APIError naming what is wrong)."""
        name, path = (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise APIError("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.by_name or name == base_model:
            raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        try:  # what the engine reads on the adapter's first request, checked now
            lora.load_peft(path, self.engine.model_config, self.engine.config.lora.max_lora_rank)
        except ValueError as e:
            raise APIError(str(e), param="lora_path") from None
        with self.lock:
            if name in self.by_name:
                raise APIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            self.by_name[name] = LoRARequest(name, self.next_id, path)
            self.next_id += 1
        return f"Success: LoRA adapter '{name}' added successfully."

    def remove(self, body) -> str:
        """Stop offering an adapter (requests already running with it finish with it)."""
        name = body.get("lora_name") if isinstance(body, dict) else None
        with self.lock:
            if self.by_name.pop(name, None) is None:
                raise protocol.not_found(f"The lora adapter '{name}' cannot be found.")
        return f"Success: LoRA adapter '{name}' removed successfully."
