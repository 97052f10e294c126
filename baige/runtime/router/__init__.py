"""``baige router``: an OpenAI-compatible HTTP front door over several ``baige serve`` (or vLLM)
backends. It imports no engine: :mod:`.policies` picks backends (plain Python), :mod:`.backends`
tracks their health and load, :mod:`.proxy` forwards requests (retries, streaming pass-through, the
prefill/decode flow), :mod:`.app` is the FastAPI application, :mod:`.dp` starts N ``baige serve``
processes behind one router (``baige serve --data-parallel-size N``)."""
