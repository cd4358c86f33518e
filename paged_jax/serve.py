"""`python -m paged_jax.serve`: the OpenAI-compatible server (paged_jax.entrypoints.openai.api_server)."""
from paged_jax.entrypoints.openai.api_server import main

if __name__ == "__main__":
    main()
