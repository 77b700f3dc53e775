"""Checkpoint file formats: safetensors I/O, compressed-tensors (config, reader, writer, targets, transforms), GGUF.

  safetensors_io      safetensors files and sharded checkpoints: validated headers, lazy memory-mapped reads
  safe_files          regular-file checks, strict JSON, the side files copied next to a checkpoint
  shard_writer        the streaming, atomic writer of sharded safetensors checkpoints
  compressed_tensors  compressed-tensors' quantization_config, its reader / writer, `re:` targets, transforms
  gguf_convert        GGUF files through llama.cpp's `gguf` reader -> dense HF checkpoints
"""
