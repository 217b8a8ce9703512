"""vLLM's command-line arguments, read by one rule wherever we look into them: an option is a
token that starts with `-` and is not a number; `--a_b` is `--a-b` (as vLLM reads it); its
values are `--x=v`, or the tokens after it up to the next option (`--api-key k1 k2`). Flags are
named here in vLLM's dash spelling, long and short (`--tensor-parallel-size`, `-tp`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    name: str  # the dash spelling (`--a_b=1` -> `--a-b`)
    start: int  # the option's index in the arguments
    end: int  # one past its last value
    values: tuple[str, ...]


def is_option(token: str) -> bool:
    if not token.startswith("-"):
        return False
    try:
        float(token)
        return False  # a negative number is a value
    except ValueError:
        return True


def spelling(token: str) -> str:
    """The flag of an option token in the dash spelling, without any `=value`."""
    name = token.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def options(args: Sequence[object]) -> list[Option]:
    """Every option in `args`, in order, with its values (tokens that are not strings are
    skipped, as vLLM's own argument lists may carry them)."""
    toks = [a for a in args if isinstance(a, str)]
    out, i = [], 0
    while i < len(toks):
        a = toks[i]
        if not is_option(a):
            i += 1
            continue
        j = i + 1
        if "=" in a:
            values: tuple[str, ...] = (a.split("=", 1)[1],)
        else:
            while j < len(toks) and not is_option(toks[j]):
                j += 1
            values = tuple(toks[i + 1 : j])
        out.append(Option(spelling(a), i, j, values))
        i = j
    return out


def values(args: Sequence[object], names: Iterable[str]) -> list[str]:
    """The value given to each occurrence of the named flags, in order (one without a value is
    left out)."""
    names = frozenset(names)
    return [o.values[0] for o in options(args) if o.name in names and o.values]


def last(args: Sequence[object], names: Iterable[str]) -> str | None:
    """The value vLLM takes for the named flag (its last occurrence), or None."""
    given = values(args, names)
    return given[-1] if given else None


def given(args: Sequence[object], names: Iterable[str]) -> bool:
    """Whether any of the named flags occurs, with or without a value."""
    names = frozenset(names)
    return any(o.name in names for o in options(args))


def without(args: Sequence[str], names: Iterable[str]) -> list[str]:
    """`args` without the named flags and all their values; the rest in order."""
    names = frozenset(names)
    drop = {k for o in options(args) if o.name in names for k in range(o.start, o.end)}
    return [a for k, a in enumerate(args) if k not in drop]


def take(args: Sequence[str], names: Iterable[str]) -> tuple[str | None, list[str]]:
    """(the value vLLM would take for the named flag or None, `args` without it). Raises
    ValueError where its last occurrence has no value."""
    names = frozenset(names)
    found = [o for o in options(args) if o.name in names]
    if found and not found[-1].values:
        raise ValueError(f"{found[-1].name} needs a value")
    return (found[-1].values[0] if found else None), without(args, names)
