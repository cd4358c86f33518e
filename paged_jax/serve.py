"""`python -m paged_jax.serve`: the OpenAI-compatible server (paged_jax.entrypoints.openai.cli)."""
from paged_jax.entrypoints.openai.cli import main

if __name__ == "__main__":
    main()
