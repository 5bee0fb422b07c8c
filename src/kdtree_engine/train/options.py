"""Command-line options from a frozen config dataclass, and the config back from the parsed options, so
that a command and its config object cannot drift apart: the option names, types and defaults come
from the fields, the help from one table next to the command. Used by the training commands and by
`kdtree-engine generate` (GenerationConfig).

Fields and their options:
- int, float, str (optional ones too): `--field-name VALUE`, default the field's;
- bool: a flag `--field-name`; bool | None defaulting to None: `--no-field-name` (sets False);
- a dataclass (e.g. GenerationConfig.sampling): its own fields, flattened into options of their own;
- tuple[scalar, ...]: a repeatable option, only where `flags` names it (each use adds one value);
- anything else (dicts, tuples of tuples): no option, the field keeps its default.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

_SCALARS = {int: int, float: float, str: str}


def int_or_word(text: str) -> int | str:
    """An `int | str` field's value on the command line: an int where the text is one, else the word
    (e.g. --budget auto), which the config's own check accepts or refuses."""
    try:
        return int(text)
    except ValueError:
        return text


def _hint(cls, field: dataclasses.Field):
    return typing.get_type_hints(cls)[field.name]


def _non_none(hint) -> list:
    """The types of a hint without None: [int] for `int | None`, [hint] for a plain type."""
    return [a for a in typing.get_args(hint) if a is not type(None)] or [hint]


def _scalar_type(cls, field: dataclasses.Field):
    """The argparse type of a field, or None when it is not a plain scalar (tuples, dicts)."""
    args = _non_none(_hint(cls, field))
    if sorted(args, key=str) == sorted([int, str], key=str):
        return int_or_word
    return _SCALARS.get(args[0]) if len(args) == 1 else None


def _element_type(cls, field: dataclasses.Field):
    """The scalar type of a tuple[T, ...] field, or None."""
    hint = _hint(cls, field)
    if typing.get_origin(hint) is not tuple:
        return None
    args = typing.get_args(hint)
    return _SCALARS.get(args[0]) if len(args) == 2 and args[1] is Ellipsis else None


def _nested(cls, field: dataclasses.Field):
    """The dataclass type of a field that holds a config of its own, or None."""
    hint = _hint(cls, field)
    return hint if dataclasses.is_dataclass(hint) else None


def hint_is_bool(cls, field: dataclasses.Field) -> bool:
    return _hint(cls, field) is bool


def _optional_bool(cls, field: dataclasses.Field) -> bool:
    hint = _hint(cls, field)
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and _non_none(hint) == [bool]


def _default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def add_config_arguments(
    parser: argparse.ArgumentParser,
    cls,
    help_texts: dict[str, str],
    *,
    flags: dict[str, str] | None = None,
    deferred: tuple[str, ...] = (),
    metavars: dict[str, str] | None = None,
) -> None:
    """Options for the fields of `cls` (see the module docstring). help_texts: field name -> help.
    flags: field name -> option string where it is not `--field-name` (and the tuple fields that get
    an option). deferred: fields whose option defaults to None ("not given"), so that
    config_from_args can take a value from elsewhere (e.g. a checkpoint's generation_config.json)
    before the field's default; their help ends with the field's default. metavars: field name -> the
    placeholder of its value in the help (default: the field name in capitals)."""
    flags, metavars = flags or {}, metavars or {}
    for field in dataclasses.fields(cls):
        nested = _nested(cls, field)
        if nested is not None:
            add_config_arguments(
                parser, nested, help_texts, flags=flags, deferred=deferred, metavars=metavars
            )
            continue
        flag = flags.get(field.name, "--" + field.name.replace("_", "-"))
        help_text = help_texts.get(field.name, "")
        value = {"metavar": metavars[field.name]} if field.name in metavars else {}
        default = _default(field)
        if field.name in deferred and "default" not in help_text:
            help_text = f"{help_text} (default: {default})".lstrip()
        if field.name in deferred:
            default = None
        if hint_is_bool(cls, field):
            parser.add_argument(flag, dest=field.name, action="store_true", default=default, help=help_text)
        elif _optional_bool(cls, field) and field.default is None:
            off = flags.get(field.name, "--no-" + field.name.replace("_", "-"))
            parser.add_argument(off, dest=field.name, action="store_const", const=False, help=help_text)
        elif _scalar_type(cls, field) is not None:
            kind = _scalar_type(cls, field)
            parser.add_argument(flag, dest=field.name, type=kind, default=default, help=help_text, **value)
        elif _element_type(cls, field) is not None and field.name in flags:
            kind = _element_type(cls, field)
            parser.add_argument(
                flag, dest=field.name, type=kind, action="append", default=None, help=help_text, **value
            )


def config_from_args(cls, args: argparse.Namespace, fallback: dict | None = None):
    """The config of the parsed options. An option left out (None: a deferred or optional field, a
    repeatable option never used) takes fallback[field] when there is one, else the field's default;
    fields without an option keep their defaults; nested configs are built from their own options."""
    fallback = fallback or {}
    values = {}
    for field in dataclasses.fields(cls):
        nested = _nested(cls, field)
        if nested is not None:
            values[field.name] = config_from_args(nested, args, fallback)
            continue
        value = getattr(args, field.name, None)
        if value is None:
            value = fallback.get(field.name)
        if value is not None:
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)
