"""Quantization algorithms as pure functions of arrays (weights, Hessians, activation statistics); no flax.

Modules (import them directly): `gptq` (GPTQ: Hessian in, codes out), `weight_search` (round-to-nearest, MSE
clipping and GPTQ searches, the output error that decides between them), `awq` (AWQ's grid search of per-channel
scales), `smoothquant` (SmoothQuant's smoothing factors), `shared_scales` (the NVFP4 global scale that fused
sibling projections share) and `sequential` (calibration batches and input groups for layer-by-layer
calibration). The Flax adapters that collect the statistics from a model live in `qformats.nn` (generic layers)
and `qformats.models.decoder.calibration` (the decoder family).
"""
