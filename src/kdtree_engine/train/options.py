"""Command-line options from a frozen config dataclass: every field with a scalar default becomes
`--field-name` (booleans become flags), and `config_from_args` builds the config back, so a training
command and its config object cannot drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import typing

_SCALARS = {int: int, float: float, str: str}


def _scalar_type(cls, field: dataclasses.Field):
    """The argparse type of a field, or None when it is not a plain scalar (tuples, dicts)."""
    hint = typing.get_type_hints(cls)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return _SCALARS.get(args[0]) if len(args) == 1 else None


def add_config_arguments(parser: argparse.ArgumentParser, cls, help_texts: dict[str, str]) -> None:
    """One option per scalar field of `cls`; help_texts: field name -> help."""
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        help_text = help_texts.get(field.name, "")
        if hint_is_bool(cls, field):
            parser.add_argument(flag, action="store_true", default=field.default, help=help_text)
            continue
        kind = _scalar_type(cls, field)
        if kind is not None:
            parser.add_argument(flag, type=kind, default=field.default, help=help_text)


def hint_is_bool(cls, field: dataclasses.Field) -> bool:
    return typing.get_type_hints(cls)[field.name] is bool


def config_from_args(cls, args: argparse.Namespace):
    """The config whose scalar fields come from the parsed options (others keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    return cls(**values)
