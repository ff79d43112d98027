"""Name -> class registries (attention backends, KV pools): an option's value picks the class.

A new implementation is a class registered under a new name, so the runner and the model
never branch on which one is in use.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from kvserve.errors import InvalidArgumentError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, option: str):
        self.kind = kind  # what the names name, for error messages
        self.option = option  # the engine option that chooses one
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str, cls: type[T]) -> None:
        self._classes[name] = cls

    def get(self, name: str) -> type[T]:
        try:
            return self._classes[name]
        except KeyError:
            flag = "--" + self.option.replace("_", "-")
            raise InvalidArgumentError(f"unknown {self.kind} {name!r} ({flag}): one of {', '.join(self.names())}",
                                       param=self.option) from None

    def names(self) -> list[str]:
        return sorted(self._classes)
