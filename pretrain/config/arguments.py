"""Flags and YAML -> ``Config``. Precedence: defaults < ``--config FILE.yaml`` < flags.

Flags are generated from the config dataclasses' fields (``hidden_size`` -> ``--hidden-size``);
a YAML file uses the same names with ``_``. An unknown YAML key or a value of the wrong type is an
error that names it.
"""

from __future__ import annotations

import argparse
import difflib
import dataclasses
import functools
import types
import typing

import yaml

from pretrain.config.schema import Config, all_fields
from pretrain.config.megatron_flags import add_megatron_flags, resolve_megatron_flags


class ConfigError(ValueError):
    """A setting that cannot work, with the flag to change and how."""


def _field_type(f: dataclasses.Field) -> tuple[type, bool, bool]:
    """(base type, optional?, list?) of a field annotation such as ``int | None`` or ``list[str] | None``."""
    return _annotation_type(f.type)


@functools.lru_cache(maxsize=None)
def _annotation_type(annotation: str) -> tuple[type, bool, bool]:
    """``_field_type`` of one annotation string: evaluated once a process (a few dozen distinct strings
    among hundreds of fields; evaluating each field's cost most of a parse)."""
    hints = typing.get_type_hints(type("_", (), {"__annotations__": {"x": annotation}}))["x"]
    args = typing.get_args(hints)
    optional = type(None) in args
    if isinstance(hints, types.UnionType) or typing.get_origin(hints) is typing.Union:
        hints = next(a for a in args if a is not type(None))
    if typing.get_origin(hints) is list:
        return typing.get_args(hints)[0], optional, True
    return hints, optional, False


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scaled(base: type, factor: float):
    def parse(text: str):
        return base(float(text) * factor)
    parse.__name__ = base.__name__
    return parse


def nearest(name: str, known) -> str | None:
    """The valid name closest to a misspelt ``name`` (underscores and dashes alike), if one is close."""
    canonical = {k.replace("-", "_").strip("_"): k for k in known}
    close = difflib.get_close_matches(name.replace("-", "_").strip("_"), list(canonical), n=1, cutoff=0.75)
    return canonical[close[0]] if close else None


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are ConfigErrors (one line, said once by the caller), unknown flags with the
    nearest valid flag."""

    def error(self, message: str):
        unknown = message.split("unrecognized arguments: ", 1)
        if len(unknown) == 2:
            flags = [word for word in unknown[1].split() if word.startswith("--")]
            known = [option for action in self._actions for option in action.option_strings]
            hints = [flag + (f" (did you mean {close}?)" if close else "")
                     for flag, close in ((flag, nearest(flag, known)) for flag in flags)]
            message = f"unknown flag{'s' if len(hints) > 1 else ''} {', '.join(hints) or unknown[1]}"
        raise ConfigError(f"{message}; python -m pretrain --help lists every flag")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m pretrain", description="3D-parallel GPT pretraining with ZeRO",
                     argument_default=argparse.SUPPRESS, allow_abbrev=False)
    parser.add_argument("--config", help="YAML file with settings (same names as the flags, with _)")
    for section, group_fields in _sections().items():
        group = parser.add_argument_group(section)
        for f in group_fields:
            base, _, is_list = _field_type(f)
            kwargs = {"help": f.metadata.get("help", "") + _default_text(f)}
            if base is bool:  # a switch named --no-X is only a switch: argparse would read it as X's "off"
                kwargs["action"] = ("store_true" if f.name.startswith("no_")
                                    else argparse.BooleanOptionalAction)
            else:
                kwargs["type"] = base
                if is_list:
                    kwargs["nargs"] = f.metadata.get("nargs", "+")
                if "choices" in f.metadata:  # an optional choice is turned off by "none" (a YAML's too)
                    kwargs["choices"] = f.metadata["choices"] + (["none"] if _field_type(f)[1] else [])
            aliases = f.metadata.get("aliases", [])
            same = [alias for alias in aliases if not isinstance(aliases, dict) or aliases[alias] == 1]
            group.add_argument(_flag_name(f.name), *same, dest=f.name, **kwargs)
            for alias, factor in (aliases.items() if isinstance(aliases, dict) else []):
                if factor != 1:  # another unit: the value is scaled into ours
                    group.add_argument(alias, dest=f.name,
                                       help=f"{_flag_name(f.name)} in other units (x {factor:g})",
                                       type=_scaled(base, factor))
    add_megatron_flags(parser)
    return parser


def _default_text(f: dataclasses.Field) -> str:
    """' (default: X)' for ``--help``; nothing where the default is unset (None: derived from other
    settings, as each help says) or a switch that is off."""
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if default is None or default is False or default is dataclasses.MISSING:
        return ""
    shown = " ".join(map(str, default)) if isinstance(default, list) else default
    return f" (default: {shown})".replace("%", "%%")


def aliases() -> dict[str, str]:
    """Every other spelling of a setting (without --, with _) -> the setting's name."""
    names = {}
    for name, (_, f) in all_fields().items():
        for alias in f.metadata.get("aliases", []):
            names[alias[2:].replace("-", "_")] = name
    return names


def _sections() -> dict[str, list[dataclasses.Field]]:
    sections: dict[str, list[dataclasses.Field]] = {}
    for section, f in all_fields().values():
        sections.setdefault(section, []).append(f)
    return sections


def _coerce(name: str, value, f: dataclasses.Field):
    base, optional, is_list = _field_type(f)
    if value == "none" and optional and "choices" in f.metadata:
        value = None
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name}: null is not allowed for {_flag_name(name)}")
    try:
        if is_list:
            items = value if isinstance(value, list) else str(value).split()
            return [base(v) for v in items]
        if base is bool:
            if not isinstance(value, bool):
                raise TypeError
            return value
        if base is int and (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())):
            raise TypeError
        value = base(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {value!r} is not a valid {base.__name__} "
                          f"for {_flag_name(name)}") from None
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{name}: {value!r} is not one of {choices} ({_flag_name(name)})")
    return value


def load_yaml(path: str) -> dict:
    """Read a flat YAML mapping of settings; unknown keys are an error naming the key."""
    try:
        with open(path) as handle:
            values = yaml.safe_load(handle) or {}
    except OSError as error:
        raise ConfigError(f"--config {path}: cannot read it ({error.strerror})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"--config {path}: not valid YAML ({error})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--config {path}: expected a mapping of setting: value")
    known = all_fields()
    spellings = aliases()
    values = {spellings.get(key, key): value for key, value in values.items()}
    unknown = sorted(k for k in values if k not in known)
    if unknown:
        hints = []
        for key in unknown:
            close = nearest(str(key), known)
            hints.append(f"{key!r}" + (f" (did you mean {close!r}?)" if close else ""))
        raise ConfigError(f"--config {path}: unknown key(s) {', '.join(hints)}; keys are the flag "
                          "names with _")
    return values


def parse_config(argv: list[str] | None = None) -> Config:
    """Build the Config from ``--config`` YAML and flags. Raises ConfigError with the offending flag."""
    args = vars(build_parser().parse_args(argv))
    try:
        implied, ignored = resolve_megatron_flags(args)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    values = load_yaml(args.pop("config")) if "config" in args else {}
    values.update(implied)
    values.update(args)
    config = Config(ignored_flags=ignored, given=set(values))
    known = all_fields()
    for name, value in values.items():
        section, f = known[name]
        setattr(getattr(config, section), name, _coerce(name, value, f))
    return config
