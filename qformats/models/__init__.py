"""Flax NNX model definitions (pure modules, no file I/O): `minilm` (all-MiniLM-L6-v2 BERT), `decoder`
(the llama / mistral / qwen2 / qwen3 causal-LM family, a package: the model, its HF names and its adapters), `abstract`
(a model built as shapes only, the loaders' skeleton).
Import the submodules directly."""
