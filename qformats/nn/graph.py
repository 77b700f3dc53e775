"""Find and replace modules in an NNX graph by path, keeping shared modules shared."""

from __future__ import annotations

from flax import nnx


def path_str(path) -> str:
    """An NNX graph path as the "/"-joined string the rules match ("encoder/layers/0/attention/query")."""
    return "/".join(str(p) for p in path)


def module_references(model: nnx.Module, kind) -> dict:
    """id(module of type `kind`) → (first path, module, [(parent, key), ...]) over the whole graph.

    A shared module appears once with every place that refers to it (attributes, `nnx.List` / `nnx.Dict`,
    and plain lists / dicts held as attributes), so swapping it at every place keeps it shared.
    """
    found = {}
    for path, node in nnx.iter_modules(model):
        if isinstance(node, kind) and id(node) not in found:
            found[id(node)] = (path_str(path), node, [])
    for _, parent in nnx.iter_modules(model):
        for key, value in list(vars(parent).items()):
            if isinstance(value, kind) and id(value) in found:
                found[id(value)][2].append((parent, key))
            elif isinstance(value, (list, dict)):  # plain containers held as attributes
                items = value.items() if isinstance(value, dict) else enumerate(value)
                for k, v in items:
                    if isinstance(v, kind) and id(v) in found:
                        found[id(v)][2].append((value, k))
    return found


def replace_child(parent, key, new) -> None:
    """parent[key] = new, or setattr(parent, key, new): one reference found by `module_references`."""
    if isinstance(parent, nnx.List):
        parent[int(key)] = new
    elif isinstance(parent, nnx.Module):
        setattr(parent, key, new)
    else:
        parent[key] = new
