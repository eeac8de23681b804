"""The OpenAI-compatible HTTP API (``server.ApiServer``) and its routes."""
