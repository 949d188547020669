"""Names of Modal's API that this facade has but refuses: each raises NotImplementedError
naming itself and why, and carries the reason as ``__refused__`` (docs/compat.md's tables
are checked against it: tests/unit/test_compat_modal_names.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

SEE = "docs/compat.md"


def refusal(name: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"{name}: {why} ({SEE})")


def refused(name: str, why: str) -> Callable[..., NoReturn]:
    """A function (or method) ``name`` that refuses, whatever its arguments."""

    def call(*args: Any, **kwargs: Any) -> NoReturn:
        raise refusal(name, why)

    call.__name__ = name.rsplit(".", 1)[-1]
    call.__qualname__ = name
    call.__doc__ = f"Refused: {why}."
    call.__refused__ = why  # type: ignore[attr-defined]
    return call


def refused_static(name: str, why: str) -> staticmethod:
    return staticmethod(refused(name, why))


def refused_property(name: str, why: str) -> property:
    fget = refused(name, why)
    return property(fget, doc=fget.__doc__)


class refused_attribute:  # noqa: N801 - used like property
    """A class attribute that refuses when read, on the class or an instance (Modal's
    class properties, e.g. ``Secret.objects``)."""

    def __init__(self, name: str, why: str) -> None:
        self._name, self.__refused__ = name, why

    def __get__(self, obj: Any, objtype: type | None = None) -> NoReturn:
        raise refusal(self._name, self.__refused__)


def is_refused(attr: Any) -> bool:
    """Whether a facade attribute (function, property, staticmethod) is a refusal."""
    if isinstance(attr, property):
        attr = attr.fget
    if isinstance(attr, staticmethod | classmethod):
        attr = attr.__func__
    return hasattr(attr, "__refused__")
