"""The OpenAI-compatible HTTP server: request schemas and error shape (``protocol``), Prometheus
metrics (``metrics``), route handlers (``routes``) and the FastAPI app with auth (``app``, the only
importer of the web framework)."""
