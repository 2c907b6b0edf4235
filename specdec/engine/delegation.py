"""Members a class reads through one of its parts: ``Delegated`` (a read-only attribute, as a
property would be) and ``delegated_method`` (a method with the part's signature), each declared
in one line instead of a property or method that only forwards."""

from __future__ import annotations

import functools
from collections.abc import Callable
from operator import attrgetter
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

T = TypeVar("T")
P = ParamSpec("P")


class Delegated(Generic[T]):
    """``vocab_size = Delegated[int]("model.cfg.vocab_size")``: reading ``obj.vocab_size`` reads
    ``obj.model.cfg.vocab_size``; assigning it raises, as for a property without a setter."""

    def __init__(self, path: str, doc: str | None = None) -> None:
        self.path = path
        self.__doc__ = doc
        self._read = attrgetter(path)
        self._name = path.rpartition(".")[2]

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> Delegated[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> Delegated[T] | T:
        return self if obj is None else self._read(obj)

    def __set__(self, obj: object, value: T) -> None:
        raise AttributeError(
            f"property {self._name!r} of {type(obj).__name__!r} object has no setter"
        )


def delegated_method(
    path: str, method: Callable[Concatenate[Any, P], T], doc: str | None = None
) -> Callable[Concatenate[Any, P], T]:
    """A method that calls ``method``'s namesake on ``self.<path>`` (the same signature; the
    part's own class, a subclass or a stand-in answers), documented by ``doc`` or ``method``."""
    read, name = attrgetter(path), method.__name__

    @functools.wraps(method)
    def call(self: Any, *args: P.args, **kwargs: P.kwargs) -> T:
        return getattr(read(self), name)(*args, **kwargs)

    if doc is not None:
        call.__doc__ = doc
    return call
