"""Reading untrusted job YAML: ``load_yaml`` (safe types only, no aliases, bounded size; every
failure a ``ConfigError`` naming the source and the line) and ``field_lines`` (where each
``section.field`` sits in the text, so a later message can name the line).

Named ``yamlio`` so that it never shadows PyYAML. Imports only ``config.fields`` from
``varuna_sdk`` (``config`` is the bottom of the dependency graph); never the config types.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from .fields import MAX_CONFIG_BYTES, ConfigError


class _NoAliasLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses aliases (``*name``): a few lines of anchors and aliases can
    expand to gigabytes ("billion laughs"), and a job config never needs them."""

    def construct_mapping(self, node, deep=False):  # noqa: D102 - PyYAML's hook
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: key {key!r} appears twice (first on line "
                                  f"{seen[key]}); the second would silently replace the first: keep one")
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)

    def compose_node(self, parent, index):  # noqa: D102 - PyYAML's hook
        if self.check_event(yaml.events.AliasEvent):
            ev = self.peek_event()
            raise ConfigError(f"line {ev.start_mark.line + 1}: YAML alias *{ev.anchor} is not allowed in a job config "
                              "(aliases can expand a small file enormously); write the value out")
        return super().compose_node(parent, index)


# YAML 1.2 floats: PyYAML follows YAML 1.1, where a number needs a dot to be a float, so a learning
# rate written ``1e-3`` or ``3e-4`` would be read as a string; here it is the float it looks like
_NoAliasLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def unknown_key_line(msg: str, text: str) -> str:
    """``"line N: "`` for a message about an unknown section or key (``from_dict``'s), else ``""``."""
    m = re.search(r"unknown key\(s\) \['([^']+)'.*? in '(\w+)'", msg) or re.search(r"unknown config section '([^']+)'", msg)
    if m is None:
        return ""
    key = f"{m.group(2)}.{m.group(1)}" if m.lastindex == 2 else m.group(1)
    hit = field_lines(text).get(key)
    return f"line {hit[0]}: " if hit else ""


def field_lines(text: str) -> dict[str, tuple[int, Any]]:
    """``"section.field"`` → (its line in ``text``, 1-based; the value there) for every field of a
    job config's sections, for messages that name the line. Empty when ``text`` does not parse
    (``load_yaml`` has said why by then)."""
    try:
        root = yaml.compose(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except (yaml.YAMLError, ConfigError, RecursionError, ValueError):
        return {}
    out: dict[str, tuple[int, Any]] = {}
    if not isinstance(root, yaml.MappingNode):
        return out
    for sec_key, sec in root.value:
        out[str(sec_key.value)] = (sec_key.start_mark.line + 1, None)
        if not isinstance(sec, yaml.MappingNode):
            continue
        for key, val in sec.value:
            try:
                value = yaml.load(yaml.serialize(val), Loader=_NoAliasLoader)  # noqa: S506
            except (yaml.YAMLError, ConfigError, RecursionError, ValueError):
                continue
            out[f"{sec_key.value}.{key.value}"] = (key.start_mark.line + 1, value)
    return out


def load_yaml(text: str, *, source: str = "<config text>") -> Any:
    """Parse untrusted YAML: safe types only, no aliases, at most ``MAX_CONFIG_BYTES``; every
    failure is a ``ConfigError`` naming ``source`` and the line (never a PyYAML traceback)."""
    if not isinstance(text, str):
        raise ConfigError(f"{source}: expected YAML text, got {type(text).__name__}")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source} is more than {MAX_CONFIG_BYTES} bytes; a config is at most that")
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{source}:{where}: not valid YAML: {e.problem or e.context}") from None
    except (yaml.YAMLError, RecursionError, ValueError) as e:
        raise ConfigError(f"{source}: not valid YAML ({type(e).__name__}: {str(e)[:200]})") from None
