"""Weight quantization: schemes and their math (``scheme``), :class:`~.linear.QuantizedLinear`
(``linear``), Mixture-of-Experts experts held one module per expert (``experts``), the model
transform by RTN or GPTQ (``apply``, ``gptq``), the compressed-tensors checkpoint format
(``format``) and the load-time fp16-weight transform (``fp16_weight``). Writing a checkpoint is the
caller's step (:mod:`baige.runtime.quantize`)."""
