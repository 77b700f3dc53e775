"""A checkpoint's chat template: found where `qformats convert` and transformers store it, rendered in a sandbox."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from qformats.errors import CheckpointError

__all__ = ["load_chat_template", "render_chat"]

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


def load_chat_template(src: "str | os.PathLike") -> Tuple[Optional[str], Dict[str, str], str]:
    """(template or None, special tokens {"bos_token": ..., ...}, where it was found) of the causal LM at `src`.

    Looked up as transformers does: a directory's chat_template.jinja (what `qformats convert` and transformers
    >= 4.47 write), else the "chat_template" of its tokenizer_config.json (a string, or a list of {"name",
    "template"} whose "default" entry is taken); a .gguf file's tokenizer.chat_template metadata. The special
    tokens come from tokenizer_config.json (a string, or a dict with "content")."""
    from converters.formats.safetensors_io import read_json

    p = Path(src)
    if p.is_file() and p.suffix == ".gguf":
        from converters.formats.gguf_convert import open_gguf

        files = open_gguf(p).tokenizer_files()
        return files.get("chat_template.jinja"), _special(files.get("tokenizer_config.json")), f"{p} (GGUF metadata)"
    tc_path = p / "tokenizer_config.json"
    tc = read_json(tc_path) if tc_path.is_file() else {}
    tc = tc if isinstance(tc, dict) else {}
    jinja = p / "chat_template.jinja"
    if jinja.is_file():
        from converters.evaluation.calibration_data import read_text_file
        return read_text_file(jinja, "chat template"), _special(tc), str(jinja)
    t = tc.get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    if t is not None and not isinstance(t, str):
        raise CheckpointError(f"{tc_path}: chat_template: expected a string, found {type(t).__name__}")
    return t, _special(tc), str(tc_path)


def _special(tc: Any) -> Dict[str, str]:
    out = {}
    for k in _SPECIAL:
        v = tc.get(k) if isinstance(tc, Mapping) else None
        v = v.get("content") if isinstance(v, Mapping) else v
        if isinstance(v, str):
            out[k] = v
    return out


def render_chat(template: str, messages: List[Dict[str, str]], *, add_generation_prompt: bool = True,
                where: str = "chat template", **context: Any) -> str:
    """The text of `messages` ([{"role", "content"}]) through the jinja `template`, as transformers'
    `apply_chat_template` renders it: an immutable sandboxed jinja2 environment (templates cannot touch
    Python objects' internals or mutate their arguments) with trim_blocks, lstrip_blocks and loop controls, a
    `tojson` filter that keeps non-ASCII characters, the `raise_exception` / `strftime_now` globals, `dict`, and a
    `namespace` that refuses underscore attributes.
    `context` holds the special tokens (bos_token, ...). The result is tokenized without special tokens.

    Raises CheckpointError naming `where` for a template that does not parse or raises while rendering."""
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise CheckpointError(f"{where}: rendering a chat template needs the 'jinja2' package; found it not "
                              f"installed (pip install 'qformats[llm]' or pip install jinja2)") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        import datetime
        return datetime.datetime.now().strftime(fmt)

    class Namespace(jinja2.utils.Namespace):  # no underscore attributes: no road to CPython internals
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot store the underscore attribute "
                                                      f"{name!r} on a namespace")

    class Dict:  # dict(...) and dict.fromkeys(...), no attribute access to the type itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = Dict()
    env.globals["namespace"] = Namespace
    try:
        return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **context)
    except jinja2.exceptions.TemplateError as e:
        raise CheckpointError(f"{where}: {type(e).__name__}: {e}") from None
