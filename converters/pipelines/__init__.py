"""Whole-checkpoint jobs: quantize, calibrate, rotate, dequantize, inspect, and load / save causal LMs and Flax models.

  quantize_checkpoint    dense HF checkpoint -> compressed-tensors checkpoint, one tensor at a time
  calibrate              calibrated quantization (the embedded MiniLM; causal LMs layer by layer)
  rotate                 SpinQuant rotations fused into a checkpoint
  dequantize_checkpoint  compressed-tensors checkpoint -> dense checkpoint
  inspect_checkpoint     per-tensor table of a checkpoint
  causal_lm              load / save a llama / mistral / qwen causal LM (directory or .gguf)
  mesh_load              a causal LM placed on a device mesh, each device reading its own slices
  flax_io                load / save a Flax NNX model's Linear layers from / to compressed-tensors
"""
