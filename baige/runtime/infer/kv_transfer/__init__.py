"""Prefill/decode disaggregation: moving a prompt's KV blocks from the engine that computed them (a
producer) into the paged cache of the engine that decodes (a consumer), vLLM's NIXL-connector flow.

- :mod:`.connector`: the transport interface (:class:`~.connector.KVConnector`); :mod:`.registry`:
  the transports and ``"auto"``'s choice; :mod:`.zmq_connector`: the ZeroMQ transport.
- :mod:`.blocks`: a block's bytes read from / written into the KV-cache tensors, and the model
  fingerprint both sides compare.
- :mod:`.manager`: what the engine calls (:class:`~.manager.KVTransfer`): pinning a finished prefill's
  blocks and answering pulls (producer), allocating blocks and pulling into them on a background
  thread, falling back to computing the prompt when a pull fails (consumer).
"""
