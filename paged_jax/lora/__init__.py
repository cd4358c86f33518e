"""LoRA adapters served beside the base model (vLLM's `vllm.lora`): the request that names one."""
