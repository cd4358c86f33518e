"""The OpenAI-compatible server: protocol, serving, metrics, the FastAPI app."""
