"""The compressed-tensors checkpoint format (as compressed-tensors 0.20 writes it and vLLM reads it).

  config      quantization_config <-> QuantConfig (schemes, config groups, ignore, kv_cache_scheme)
  read        checkpoint -> QArrays (or dense arrays), header-checked before any tensor data is read
  write       QArrays -> compressed-tensors tensors, the streaming CompressedWriter
  patterns    compressed-tensors' `re:` targets, matched in linear time (RE2)
  transforms  transform_config: rotations fused into the weights (SpinQuant / QuIP)
"""
