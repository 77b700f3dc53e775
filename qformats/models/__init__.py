"""Flax NNX model definitions (pure modules, no file I/O): `minilm` (all-MiniLM-L6-v2 BERT) and `decoder`
(the llama / mistral / qwen2 / qwen3 causal-LM family). Import the submodules directly."""
