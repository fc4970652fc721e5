"""Exceptions rlhfless raises; each message names what is wrong and where."""

from __future__ import annotations

from dataclasses import dataclass


class RlhflessError(Exception):
    """Base of every error rlhfless raises on purpose."""


class PluginError(RlhflessError):
    """A plugin failed to load, misspelled a hook, or registered a name twice."""


class UnknownPolicyError(RlhflessError, LookupError):
    """A policy or scheduler name that no plugin registered; the message lists the valid names."""

    def __init__(self, kind: str, name: str, valid: list[str], hint: str = "") -> None:
        import difflib

        self.kind, self.name, self.valid = kind, name, valid
        close = difflib.get_close_matches(name, valid, n=1)
        msg = f"no {kind} named {name!r}; valid: {', '.join(valid) if valid else '(none registered)'}"
        if close:
            msg += f" (did you mean {close[0]!r}?)"
        if hint:
            msg += f". {hint}"
        super().__init__(msg)

    def __str__(self) -> str:  # LookupError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class ConfigProblem:
    """One bad field: its dotted YAML path, the line it is on (when known) and why it is bad."""

    path: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.path or '<top level>'}" + (f" (line {self.line})" if self.line else "")
        return f"{where}: {self.message}"


class ConfigError(RlhflessError):
    """A scheduler config that cannot be used; lists every problem found."""

    def __init__(self, source: str, problems: list[ConfigProblem]) -> None:
        self.source, self.problems = source, problems
        lines = [f"{source}: {len(problems)} problem(s)"] + [f"  {p}" for p in problems]
        super().__init__("\n".join(lines))
