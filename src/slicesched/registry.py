"""Named plug-in registries (schedulers, cost models, trace formats).

A decorator registers a factory under a name and rejects duplicates; outside packages add
their own through the entry-point group given to the registry (looked up once, lazily).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, entry_point_group: str | None = None) -> None:
        self.kind = kind
        self._group = entry_point_group
        self._items: dict[str, T] = {}
        self._loaded_entry_points = False

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} '{name}' is already registered")
            self._items[name] = obj
            return obj

        return deco

    def _load_entry_points(self) -> None:
        if self._loaded_entry_points or not self._group:
            return
        self._loaded_entry_points = True
        for ep in entry_points(group=self._group):
            if ep.name not in self._items:
                self._items[ep.name] = ep.load()

    def get(self, name: str) -> T:
        if name not in self._items:
            self._load_entry_points()
        try:
            return self._items[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} '{name}'; known: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items or name in self.names()
