"""compressed-tensors / HF safetensors checkpoint I/O, whole-checkpoint quantization and the qformats CLI."""
