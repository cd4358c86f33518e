"""paged-jax: PagedAttention (vLLM's KV-cache design) in JAX."""
