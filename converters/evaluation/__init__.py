"""Evaluation: causal-LM perplexity, MiniLM embedding fidelity, calibration data and the embedded demo models.

  perplexity          perplexity of a causal-LM checkpoint on a text, per scheme (`qformats eval` of a causal LM)
  embedding_fidelity  cosine fidelity of quantized MiniLM sentence embeddings (`qformats eval` of MiniLM)
  calibration_data    calibration samples from text / jsonl / .npy files
  embedded            locators of the embedded demo packages (all-MiniLM-L6-v2, SmolLM2) and the shipped sentences
  data/               the shipped sentence sets (package data)
"""
