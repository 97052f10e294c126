"""The runtime, by subsystem, in dependency order (``tests/test_architecture.py`` enforces it):

``model`` <- ``quant`` <- ``weights`` <- {``infer``, ``train``} <- {``server``, ``quantize``,
``evaluate``} <- ``bench``. At this root: ``config`` (one dataclass per command), ``settings`` (the
environment, read once), ``roofline`` (FLOP/byte counts and machine limits, shared by train and bench)
and the command pipelines ``quantize`` and ``evaluate``. Everything calls hot ops through the public
API of :mod:`baige.kernels` only.
"""
