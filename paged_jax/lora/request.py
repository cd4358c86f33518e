"""`LoRARequest`: the adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`)."""
from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """`lora_name`: how outputs and the server name it; `lora_int_id`: its identity in the engine
    (>= 1, unique per adapter: the engine loads each id once and keeps it while requests use it);
    `lora_path`: a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name or not isinstance(self.lora_name, str):
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r} needs a lora_path (a PEFT adapter directory)")
        object.__setattr__(self, "lora_path", str(self.lora_path))


def parse_lora_modules(values: list[str]) -> list[LoRARequest]:
    """The server's `--lora-modules` (vLLM's): each `NAME=PATH` or `{"name": NAME, "path": PATH}`,
    numbered from lora_int_id 1 in order (ValueError naming a bad or repeated one)."""
    requests = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                fields = json.loads(value)
                name, path = fields["name"], fields["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{value!r} is not JSON with a name and a path") from None
        else:
            name, sep, path = value.partition("=")
            if not sep:
                raise ValueError(f"{value!r} is not NAME=PATH")
        if any(r.lora_name == name for r in requests):
            raise ValueError(f"the name {name!r} is given twice")
        requests.append(LoRARequest(name, len(requests) + 1, path))
    return requests
