"""What users call: the offline `LLM`."""
