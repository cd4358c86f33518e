"""The LoRA adapters on the device (vLLM's LRUCacheWorkerLoRAManager): which adapter each of the
`max_loras` slots holds. A call whose rows need an adapter no slot holds loads it into the least
recently used slot that none of the call's rows needs (the scheduler admits no more adapters than
slots, so one is always there). Adapters read from disk stay in host memory, up to `max_cpu_loras`,
the least recently used dropped first and read again when asked for.

A slot is written by a new array (models.lora.write_slot, nothing donated): a call in flight keeps
reading the array it was given, so an overlapped plan may load an adapter while the call before runs.
"""
from __future__ import annotations

import collections

import numpy as np

from models import lora
from paged_jax.lora.request import LoRARequest


class LoRAManager:
    def __init__(self, model_config, config, place):
        """`config`: the engine's LoRAConfig; `place`: puts arrays where the model's weights are."""
        self.model_config, self.config = model_config, config
        self.weights = place(lora.LoRAWeights.zeros(model_config, config.max_loras, config.max_lora_rank))
        self.slot_ids = [0] * config.max_loras  # the lora_int_id each slot holds (0: none)
        self.slot_used = [0] * config.max_loras  # the call count at each slot's last use
        self.calls = 0
        self.loaded: collections.OrderedDict[int, tuple[dict, dict]] = collections.OrderedDict()  # in host memory
        self.num_loads = 0  # adapters written into a slot

    def load(self, request: LoRARequest) -> tuple[dict, dict]:
        """The adapter's arrays, read from its directory unless host memory holds them (LoRAError
        naming what is wrong with it)."""
        arrays = self.loaded.pop(request.lora_int_id, None)
        if arrays is None:
            arrays = lora.load_peft(request.lora_path, self.model_config, self.config.max_lora_rank)
        self.loaded[request.lora_int_id] = arrays
        while len(self.loaded) > self.config.max_cpu_loras:
            self.loaded.popitem(last=False)
        return arrays

    def inputs(self, seqs, num_rows: int) -> lora.LoRAInputs:
        """The call's LoRAInputs: the slots (loading what its rows need) and each row's slot (host
        i32[num_rows]), -1 for a row without an adapter and for padding rows. Rows without adapters
        change nothing here (the warm-up's compiles call this from other threads)."""
        requests = {s.request.lora_id: s.request.lora_request for s in seqs if s.request.lora_id}
        self.calls += bool(requests)
        if len(requests) > len(self.slot_ids):
            raise RuntimeError(f"internal error: a call needs {len(requests)} LoRA adapters, "
                               f"max_loras is {len(self.slot_ids)}")
        for lora_id, request in requests.items():
            if lora_id not in self.slot_ids:
                slot = min((i for i, held in enumerate(self.slot_ids) if held not in requests),
                           key=lambda i: self.slot_used[i])
                self.weights = lora.write_slot(self.weights, np.int32(slot), *self.load(request))
                self.slot_ids[slot] = lora_id
                self.num_loads += 1
            self.slot_used[self.slot_ids.index(lora_id)] = self.calls
        rows = np.full(num_rows, -1, np.int32)
        rows[: len(seqs)] = [self.slot_ids.index(s.request.lora_id) if s.request.lora_id else -1 for s in seqs]
        return lora.LoRAInputs(self.weights, rows)
