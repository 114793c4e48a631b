"""Errors of the environment contract, each naming what is wrong and where."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Violation:
    """One way a source breaks the contract. `code` is stable for programs, `message` is for people."""

    code: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        return f"{where}{self.message} [{self.code}]"


class ContractError(ValueError):
    """A source that cannot be used as an environment."""

    def __init__(self, violations: list[Violation]) -> None:
        self.violations = violations
        super().__init__("; ".join(str(v) for v in violations))


class EnvStringError(ValueError):
    """A malformed env string or ability string."""
