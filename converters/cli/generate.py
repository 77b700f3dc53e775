"""`qformats generate SRC --prompt TEXT [...]`: jit-compiled text generation with a causal LM, on one device or N."""

from __future__ import annotations

import sys

from converters.cli.common import Usage, parse_schemes, skipped_text

__all__ = ["add_parser", "run"]


def add_parser(sub) -> None:
    """Registers the subcommand and its arguments on the `qformats` subparsers."""
    g = sub.add_parser("generate", help="generate text with a causal LM (dense or compressed-tensors checkpoint "
                                        "directory, or .gguf), jit-compiled")
    g.add_argument("src", metavar="SRC", help="dense HF or compressed-tensors checkpoint directory, or a .gguf file")
    g.add_argument("--prompt", required=True, help="the prompt text (tokenized as the tokenizer does by default)")
    g.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (default 32; fewer when an "
                                                                  "end-of-sequence token comes first)")
    g.add_argument("--scheme", default=None, help="quantize a dense SRC round-to-nearest first (lm_head stays "
                                                  "dense), e.g. W4A16:g64; an error on a quantized SRC")
    g.add_argument("--skip-indivisible", action="store_true",
                   help="with --scheme: leave dense the projections the group size does not divide (listed on stderr)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    g.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    g.add_argument("--top-p", type=float, default=None, help="sample in the smallest set of probability >= p")
    g.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling (default 0)")
    g.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="run on N devices, Megatron-style (q/k/v/gate/up split by output channels, o/down by "
                        "input channels, embeddings by vocabulary, KV cache by heads); on a CPU-only host N CPU "
                        "devices are made before JAX starts. A shape N cannot divide is an error naming the layer")
    g.add_argument("--json", action="store_true", help='print {"tokens": [new token ids], "text": ...} (with '
                                                       '--tensor-parallel also "param_bytes_per_device")')


def run(a) -> int:
    """Generates up to a.max_new_tokens after a.prompt (`qformats.models.generate.generate`: greedy, or sampled
    with a.temperature / a.top_k / a.top_p and a.seed) and prints the text (or JSON); returns the exit status."""
    import json

    import jax
    import numpy as np

    from converters.evaluation.perplexity import load_for_scheme
    from qformats.models.generate import generate
    if a.max_new_tokens < 1:
        raise Usage("qformats generate: error: --max-new-tokens must be >= 1")
    if a.scheme is not None:
        parse_schemes(a.scheme)
    elif a.skip_indivisible:
        raise Usage("qformats generate: error: --skip-indivisible needs --scheme")
    mesh = None
    if a.tensor_parallel is not None:
        from converters.pipelines.mesh_load import tensor_parallel_setup
        if a.tensor_parallel < 1:
            raise Usage("qformats generate: error: --tensor-parallel must be >= 1")
        mesh = tensor_parallel_setup(a.tensor_parallel)  # before any other JAX operation
    if mesh is not None and a.scheme is None:
        from converters.pipelines.causal_lm import load_causal_lm
        model, cfg, tok = load_causal_lm(a.src, mesh=mesh)  # each device's slice read straight from the file
        skipped = []
    else:
        model, cfg, tok, skipped = load_for_scheme(a.src, a.scheme or "stored", skip_indivisible=a.skip_indivisible)
        if mesh is not None:  # quantized in memory on one device, then laid out on the mesh
            from qformats.models.decoder import tensor_parallel_rules
            from qformats.sharding import shard_model
            model = shard_model(model, mesh, tensor_parallel_rules(model.config, mesh.axis_names[0]))
    if skipped:
        print(skipped_text("qformats: ", skipped), file=sys.stderr)
    if tok is None:
        raise Usage(f"qformats generate: error: {a.src}: expected a tokenizer.json beside the checkpoint, found none")
    ids = tok.encode(a.prompt).ids
    if not ids:
        raise Usage("qformats generate: error: --prompt gives no tokens")
    eos = cfg.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else [e for e in (eos or []) if isinstance(e, int)]
    key = jax.random.key(a.seed) if a.temperature > 0 else None
    out = np.asarray(generate(model, np.asarray(ids, np.int32), a.max_new_tokens, key=key,
                              temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, eos_id=eos or None))
    tokens = [int(t) for t in out]
    for i, t in enumerate(tokens):  # generate pads a finished row with eos: keep up to the first one
        if t in eos:
            tokens = tokens[: i + 1]
            break
    text = tok.decode(tokens, skip_special_tokens=True)
    out = {"tokens": tokens, "text": text}
    if mesh is not None:
        from qformats.sharding import param_bytes_per_device
        per = param_bytes_per_device(model)
        out["param_bytes_per_device"] = [int(per[d]) for d in mesh.devices.flat]
    print(json.dumps(out) if a.json else text)
    return 0
