"""Inference: sampling, the paged KV cache, the block manager and scheduler (plain Python, no torch),
the model runner and its native CPU decode step, the :class:`~.engine.Engine`
(add_request/step/abort), the offline :class:`~.llm.LLM`, the :class:`~.async_engine.AsyncEngine`
the server drives, and the terminal session of ``baige generate``/``chat`` (``session``)."""
