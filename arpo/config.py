"""One small config system for every arpo command.

A component's configuration is one dataclass whose fields are declared with
`option(default, "what it means")`, so every field carries its documentation.
Configurations load from a TOML file (nested dataclasses are TOML tables) and
are overridden from the command line with `section.field=value` (the value is
TOML: `lr=1e-6`, `tasks=["a","b"]`, `name="x"`; a bare word is taken as a string
where the field is a string).

Every error is a `ConfigError` that names the field by its dotted path and says
how to fix it: an unknown name (with the closest known names), a value of the
wrong type, an unparsable override, or an invalid combination reported by the
dataclass's own `validate()` (call `fail(field, reason)` there). A config whose checks need
only its own fields also runs them when it is built (`__post_init__` calling
`check_on_build`), so one made in code is refused as one loaded from a file.

    @dataclass
    class LearnerConfig:
        lr: float = option(1e-6, "AdamW learning rate.")
        group_size: int = option(8, "Episodes per task group.")

        def validate(self) -> None:
            if self.group_size < 2:
                fail("group_size", "must be at least 2 (GRPO needs a group to compare)")

    cfg = load_config(LearnerConfig, "run.toml", ["lr=3e-6"])
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import math
import re
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from arpo.errors import ConfigError

T = TypeVar("T")

_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, doc: str = "", *, factory: Callable[[], Any] | None = None):
    """Declare a documented config field. Mutable defaults go through `factory`."""
    if not doc:
        raise TypeError("option() needs a documentation string for the field")
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"doc": doc})
    if isinstance(default, list | dict | set):
        raise TypeError("use option(factory=...) for list, dict or set defaults")
    if dataclasses.is_dataclass(default) and not isinstance(default, type):
        # A nested config's default instance: build a fresh one for every parent.
        return dataclasses.field(
            default_factory=lambda d=default: dataclasses.replace(d), metadata={"doc": doc}
        )
    return dataclasses.field(default=default, metadata={"doc": doc})


class _FieldFailure(Exception):
    def __init__(self, field: str, reason: str):
        super().__init__(field, reason)
        self.field = field
        self.reason = reason


def fail(field: str, reason: str) -> typing.NoReturn:
    """Raise from a config's `validate()`: `field` is the field's name, `reason` the fix."""
    raise _FieldFailure(field, reason)


class FieldError(ConfigError):
    """A config that checks itself when it is built (`check_on_build`) has a bad field:
    `field` is its name, `reason` the fix. `from_dict` puts the field's dotted path in front."""

    def __init__(self, owner: str, field: str, reason: str):
        super().__init__(f"{owner}.{field}: {reason}")
        self.field = field
        self.reason = reason


def check_on_build(cfg: Any, check: Callable[[], None] | None = None) -> None:
    """Run `cfg.validate()` (or `check`, which calls `fail`) from its `__post_init__`, so a
    config built in code (an `Actor` made without `load_config`, `dataclasses.replace`) is
    checked as one loaded from a file: a bad field raises `FieldError` (a `ValueError`)
    naming it. For configs whose checks need nothing but their own fields and whose
    defaults pass them."""
    try:
        (check or cfg.validate)()
    except _FieldFailure as e:
        raise FieldError(type(cfg).__name__, e.field, e.reason) from None


# ---------------------------------------------------------------------------- range checks
# Shared by the `validate()` of every component, so a field refused by `arpo train`, by
# `arpo-actor`, by `arpo-learner` or by a pool command is refused with the same message.

MAX_SECONDS = 7 * 24 * 3600.0
"""Longest duration any setting in seconds accepts (a week): timeouts, deadlines, intervals
and delays. A longer one is a typo that never fires (a failed call holding its grant for
ever); 1e300 overflows the clocks of asyncio and `time.sleep` outright."""

MAX_TEMPERATURE = 100.0
"""Highest sampling temperature any setting accepts (episodes, evaluations, the learner's
rollouts): a policy's logits span a few tens, so divided by more than 100 they sample
nearly uniformly from the whole vocabulary, which writes no action."""

SET_BY_TRAIN = "(set by arpo train)"
"""The value of a field of `arpo train`'s embedded learner and actor that train fills in
itself before it starts them (the model and the task pool: arpo.train); the checks of
paths and model names let it through."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[A-Za-z0-9][\w.-]{0,95})?$")


def _num(x: float) -> str:
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x)


def check_range(
    field: str, value: float, lo: float, hi: float, what: str = "", *, lo_open: bool = False
) -> None:
    """`fail(field, ...)` unless `value` is finite and in [lo, hi] ((lo, hi] with `lo_open`);
    the message gives the value, the allowed range and `what` the field is."""
    above = value > lo if lo_open else value >= lo
    if not (above and value <= hi):  # nan fails both comparisons, inf the second
        where = f"{'(' if lo_open else '['}{_num(lo)}, {_num(hi)}]"
        fail(field, f"is {value!r}; must be in {where}" + (f" ({what})" if what else ""))


def check_seconds(field: str, value: float, what: str = "", *, zero: str | None = None) -> None:
    """A duration in seconds: in (0, MAX_SECONDS], or [0, MAX_SECONDS] when `zero` says what
    0 means (e.g. "0: none")."""
    note = "; ".join(x for x in ("seconds", what, zero) if x)
    check_range(field, value, 0.0, MAX_SECONDS, note, lo_open=zero is None)


def url_problem(url: str) -> str | None:
    """Why `url` cannot be an environment server's address, or None: it needs the scheme
    http:// or https://, a host, a valid port if any, and no whitespace."""
    from urllib.parse import urlsplit

    if not url or len(url) > 2048 or any(c.isspace() or not c.isprintable() for c in url):
        return f"{url!r:.100} is not a URL of 1..2048 printable characters without spaces"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError as e:
        return f"{url!r} is not a URL: {e}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return (
            f"{url!r} must be http://HOST[:PORT] or https://HOST[:PORT] (e.g. http://10.0.0.5:5000)"
        )
    return None


def folder_problem(path: str) -> str | None:
    """Why `path` cannot be a folder a command writes into, or None ('' is none): it exists
    and is not a folder."""
    if path and Path(path).exists() and not Path(path).is_dir():
        return f"{path!r} exists and is not a folder"
    return None


def model_problem(model: str) -> str | None:
    """Why `model` cannot name a policy to load, or None: it must be a folder holding a
    Hugging Face `config.json`, or a Hugging Face hub id (`org/name`, looked up when it is
    loaded). A path that does not exist and is not shaped like a hub id is refused."""
    if model == SET_BY_TRAIN:
        return None
    p = Path(model)
    if p.is_dir():
        if not (p / "config.json").is_file():
            return f"{model!r} is a folder without config.json (not a Hugging Face model folder)"
        from arpo.policy.family import check_folder

        try:
            check_folder(p)
        except ValueError as e:
            return str(e)
        return None
    if p.exists():
        return f"{model!r} is not a folder (give a Hugging Face model folder or a hub id)"
    if not _HUB_ID.match(model) or ".." in model or "--" in model:
        return (
            f"{model!r} does not exist and is not a Hugging Face hub id (org/name): give a "
            "model folder (with config.json) or a hub id"
        )
    return None


RENAMED = "renamed_fields"
"""Name of the class attribute in which a config lists its renamed fields, old name -> new
name (`renamed_fields: ClassVar[Mapping[str, str]] = MappingProxyType({...})`): a file or
an override that gives the old name is refused with an error naming the new one."""


def _renamed_error(cls: type, key: str, prefix: str, where: str = "") -> ConfigError | None:
    """The error for `key` when `cls` renamed that field, else None."""
    new = getattr(cls, RENAMED, {}).get(key)
    if new is None:
        return None
    return ConfigError(
        f"config field {prefix + key!r}{where} was renamed {prefix + new!r}: give "
        f"{prefix + new}=... instead"
    )


def field_docs(cls: type) -> dict[str, str]:
    """The documentation of every field of a config dataclass, by dotted path."""
    out: dict[str, str] = {}
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        out[f.name] = f.metadata.get("doc", "")
        sub = hints[f.name]
        if dataclasses.is_dataclass(sub):
            for k, v in field_docs(sub).items():
                out[f"{f.name}.{k}"] = v
    return out


def describe(cls: type) -> str:
    """A plain-text listing of every field, its type, default and documentation."""
    lines = []
    defaults = to_dict(cls())
    hints = get_type_hints(cls)

    def walk(c: type, prefix: str, values: Mapping[str, Any]) -> None:
        h = get_type_hints(c)
        for f in dataclasses.fields(c):
            t = h[f.name]
            if dataclasses.is_dataclass(t):
                lines.append(f"[{prefix}{f.name}]  {f.metadata.get('doc', '')}")
                walk(t, f"{prefix}{f.name}.", values[f.name])
            else:
                lines.append(
                    f"  {prefix}{f.name}: {_type_name(t)} = {values[f.name]!r}\n"
                    f"      {f.metadata.get('doc', '')}"
                )

    del hints
    walk(cls, "", defaults)
    return "\n".join(lines)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config as plain data (enums by value, paths as strings), TOML-serialisable."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, tuple | list):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(cfg)


def _toml_value(v: Any, path: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "nan"
        if v in (float("inf"), float("-inf")):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON's escapes are TOML basic-string escapes
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x, path) for x in v) + "]"
    raise ConfigError(f"config field {path}: {type(v).__name__} values cannot be written as TOML")


def changed_overrides(cfg: Any, prefix: str = "", skip: Sequence[str] = ()) -> list[str]:
    """`field=value` overrides (`load_config`'s syntax, `prefix` before each field) of the
    fields of `cfg` that differ from its class's defaults, nested configs field by field;
    fields named in `skip` (dotted below `cfg`) are left out."""
    base = to_dict(type(cfg)())
    out: list[str] = []

    def walk(now: Mapping[str, Any], was: Mapping[str, Any], path: str) -> None:
        for k, v in now.items():
            if path + k in skip:
                continue
            if isinstance(v, dict):
                walk(v, was.get(k, {}), f"{path}{k}.")
            elif v != was.get(k):
                out.append(f"{prefix}{path}{k}={_toml_value(v, path + k)}")

    walk(to_dict(cfg), base, "")
    return out


def to_toml(cfg: Any) -> str:
    """A config as a TOML document that `load_config` reads back to an equal config."""
    lines: list[str] = []

    def table(data: Mapping[str, Any], prefix: str) -> None:
        subs = [(k, v) for k, v in data.items() if isinstance(v, dict)]
        for k, v in data.items():
            if not isinstance(v, dict):
                lines.append(f"{k} = {_toml_value(v, prefix + k)}")
        for k, v in subs:
            lines.append("")
            lines.append(f"[{prefix}{k}]")
            table(v, f"{prefix}{k}.")

    table(to_dict(cfg), "")
    return "\n".join(lines).lstrip("\n") + "\n"


def from_dict(cls: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """Build a config dataclass from plain data, checking every name and type."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{prefix.rstrip('.') or 'config'}: expected a table of fields, "
            f"got {type(data).__name__}"
        )
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            if renamed := _renamed_error(cls, str(key), prefix):
                raise renamed
            close = difflib.get_close_matches(str(key), fields, n=3)
            hint = f"; did you mean {', '.join(repr(prefix + c) for c in close)}?" if close else ""
            known = ", ".join(sorted(fields))
            raise ConfigError(
                f"unknown config field {path!r}{hint} (known fields of "
                f"{prefix.rstrip('.') or cls.__name__}: {known})"
            )
        t = hints[key]
        if dataclasses.is_dataclass(t):
            # Fields given for a nested config change its declared default (e.g. `arpo
            # train`'s embedded learner), not the nested class's own defaults.
            f = fields[key]
            if f.default_factory is not _MISSING and isinstance(value, Mapping):
                value = _merged(to_dict(f.default_factory()), value)
            kwargs[key] = from_dict(t, value, prefix=f"{path}.")
        else:
            kwargs[key] = _coerce(value, t, path)
    try:
        cfg = cls(**kwargs)
    except TypeError as e:  # a required field without a default
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from None
    except FieldError as e:  # a dataclass that checks itself in __post_init__
        raise ConfigError(f"config field {prefix}{e.field}: {e.reason}") from None
    except ConfigError:
        raise
    except ValueError as e:  # a dataclass that checks itself in __post_init__
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from None
    _validate(cfg, prefix)
    return cfg


def _merged(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `over` laid on top, table by table."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merged(out[k], v)
        else:
            out[k] = v
    return out


def _validate(cfg: Any, prefix: str) -> None:
    hints = get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        if dataclasses.is_dataclass(hints[f.name]):
            _validate(getattr(cfg, f.name), f"{prefix}{f.name}.")
    check = getattr(cfg, "validate", None)
    if check is not None:
        try:
            check()
        except _FieldFailure as e:
            raise ConfigError(f"config field {prefix}{e.field!s}: {e.reason}") from None


def validate(cfg: Any) -> Any:
    """Run the type checks and `validate()` of a config built in code; returns it."""
    return from_dict(type(cfg), to_dict(cfg))


def parse_override(text: str) -> tuple[list[str], str]:
    """Split `a.b=value` into (["a", "b"], "value")."""
    if "=" not in text:
        raise ConfigError(
            f"override {text!r} is not of the form field=value (e.g. learner.lr=1e-6)"
        )
    key, value = text.split("=", 1)
    key = key.strip().removeprefix("--")
    if not key or any(not part.strip() for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty field name")
    return [p.strip() for p in key.split(".")], value.strip()


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Defaults, then the TOML file at `path` (if any), then `field=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {str(p)!r} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
    hints_cache: dict[type, dict[str, Any]] = {}
    for text in overrides:
        keys, raw = parse_override(text)
        # Walk the dataclass to find the target type, so a bare word can be a string.
        cur: type = cls
        target: Any = None
        for i, k in enumerate(keys):
            hints = hints_cache.setdefault(cur, get_type_hints(cur))
            if k not in hints or k == RENAMED:
                prefix = ".".join(keys[:i]) + "." if i else ""
                if renamed := _renamed_error(cur, k, prefix, f" in override {text!r}"):
                    raise renamed
                dotted = ".".join(keys[: i + 1])
                close = difflib.get_close_matches(k, [h for h in hints if h != RENAMED], n=3)
                hint = (
                    f"; did you mean {', '.join(repr(prefix + c) for c in close)}?" if close else ""
                )
                raise ConfigError(f"unknown config field {dotted!r} in override {text!r}{hint}")
            target = hints[k]
            if i < len(keys) - 1:
                if not dataclasses.is_dataclass(target):
                    raise ConfigError(
                        f"override {text!r}: {'.'.join(keys[: i + 1])!r} is a "
                        f"{_type_name(target)}, not a table"
                    )
                cur = target
        value = _parse_value(raw, target, ".".join(keys))
        node = data
        for k in keys[:-1]:
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: {k!r} is not a table in the config file")
            node = nxt
        node[keys[-1]] = value
    return from_dict(cls, data)


def _parse_value(raw: str, target: Any, path: str) -> Any:
    if dataclasses.is_dataclass(target):
        raise ConfigError(f"override of {path!r}: it is a table; set its fields ({path}.NAME=...)")
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        if _accepts_str(target):
            return raw
        raise ConfigError(
            f"config field {path!r}: cannot parse {raw!r} as a {_type_name(target)} "
            f"(write the value in TOML syntax, strings in quotes)"
        ) from None


def _accepts_str(t: Any) -> bool:
    if t is str or t is Path or (isinstance(t, type) and issubclass(t, enum.Enum)):
        return True
    if get_origin(t) is Literal:
        return any(isinstance(a, str) for a in get_args(t))
    if get_origin(t) in (typing.Union, types.UnionType):
        return any(_accepts_str(a) for a in get_args(t))
    return False


def _type_name(t: Any) -> str:
    if get_origin(t) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(t))
    if isinstance(t, type):
        return t.__name__
    return str(t).replace("typing.", "")


def _coerce(value: Any, t: Any, path: str) -> Any:
    """Check `value` against the annotation `t`; convert int->float and str->Path/enum."""
    origin = get_origin(t)

    def bad(expected: str | None = None) -> ConfigError:
        return ConfigError(
            f"config field {path!r} must be {expected or _type_name(t)}, "
            f"got {value!r} ({type(value).__name__})"
        )

    if t is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(t)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, path)
            except ConfigError as e:
                errors.append(e)
        raise bad()
    if origin is Literal:
        if value in get_args(t) and type(value) in {type(a) for a in get_args(t)}:
            return value
        raise bad()
    if t is bool:
        if isinstance(value, bool):
            return value
        raise bad("true or false")
    if t is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -(2**63) <= value < 2**63:
                raise bad("an integer that fits in 64 bits")
            return value
        raise bad("an integer")
    if t is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):  # nan / inf make no setting of this project sane
                raise bad("a finite number")
            return float(value)
        raise bad("a number")
    if t is str:
        if isinstance(value, str):
            return value
        raise bad("a string")
    if t is Path:
        if isinstance(value, str | Path):
            return Path(value)
        raise bad("a path (string)")
    if isinstance(t, type) and issubclass(t, enum.Enum):
        try:
            return t(value)
        except ValueError:
            raise bad("one of " + ", ".join(repr(m.value) for m in t)) from None
    if origin in (list, tuple, Sequence) or t in (list, tuple):
        if not isinstance(value, list | tuple):
            raise bad("a list")
        args = get_args(t)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise bad(f"a list of {len(args)} items")
            items = [
                _coerce(v, a, f"{path}[{i}]")
                for i, (v, a) in enumerate(zip(value, args, strict=True))
            ]
        else:
            a = args[0] if args else Any
            items = [_coerce(v, a, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or t is tuple else items
    if origin in (dict, Mapping) or t is dict:
        if not isinstance(value, Mapping):
            raise bad("a table")
        args = get_args(t) or (str, Any)
        return {
            _coerce(k, args[0], f"{path}.<key>"): _coerce(v, args[1], f"{path}.{k}")
            for k, v in value.items()
        }
    if isinstance(t, type) and isinstance(value, t):
        return value
    raise bad()


def main_help(cls: type) -> None:  # pragma: no cover - convenience for CLIs
    sys.stdout.write(describe(cls) + "\n")
