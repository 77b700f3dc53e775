"""Real models end to end: all-MiniLM-L6-v2 in Flax NNX and a small LLaMA-style decoder."""
