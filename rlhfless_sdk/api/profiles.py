"""Time-per-token profiles and drafters' acceptances: shipped YAML files in ``configs/profiles`` and
``configs/acceptance`` (package ``rlhfless_configs``), or any path."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError

from rlhfless_sdk.api.config import parse_yaml, problems_from_validation, read_yaml_text
from rlhfless_sdk.api.errors import ConfigError, ConfigProblem, UnknownPolicyError
from rlhfless_sdk.api.records import TimePerTokenProfile
from rlhfless_sdk.api.speculation import Acceptance, geometric

M = TypeVar("M", TimePerTokenProfile, Acceptance)


def _shipped(kind: str = "profiles") -> dict[str, str]:
    folder = files("rlhfless_configs").joinpath(kind)
    return {
        e.name.removesuffix(".yaml"): e.read_text(encoding="utf-8")
        for e in folder.iterdir()
        if e.name.endswith(".yaml")
    }


def profile_names() -> list[str]:
    return sorted(_shipped())


def _parse(model: type[M], text: str, source: str, what: str) -> M:
    """``model`` from YAML ``text`` (``source`` names it in errors, each with its YAML path and line)."""
    data, root = parse_yaml(text, source)
    if not isinstance(data, dict):
        raise ConfigError(source, [ConfigProblem("", f"expected a mapping of {what} fields", 1)])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, problems_from_validation(exc, root=root)) from None


def parse_profile(text: str, source: str) -> TimePerTokenProfile:
    return _parse(TimePerTokenProfile, text, source, "profile")


def load_profile(name_or_path: str | Path) -> TimePerTokenProfile:
    """A shipped profile by name (see ``profile_names()``), or a profile YAML file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return parse_profile(read_yaml_text(path), str(path))
    shipped = _shipped()
    if str(name_or_path) not in shipped:
        raise UnknownPolicyError("profile", str(name_or_path), sorted(shipped))
    return parse_profile(shipped[str(name_or_path)], f"configs/profiles/{name_or_path}.yaml")


def load_acceptance(name_or_path: str | Path) -> Acceptance:
    """A drafter's acceptance: a shipped one by name (``configs/acceptance``: ``history`` and ``ngram`` measured by
    ``rlhfless drafter-bench``, ``das-assumption``), ``geometric:A`` (an assumed per-token acceptance A), or an
    acceptance YAML file by path."""
    text = str(name_or_path)
    if text.startswith("geometric:"):  # an assumed per-token acceptance, for sweeps
        try:
            rate = float(text.partition(":")[2])
        except ValueError:
            rate = -1.0
        if not 0.0 <= rate < 1.0:
            raise ConfigError(text, [ConfigProblem("", "geometric:A takes a per-token acceptance 0 <= A < 1")])
        return Acceptance(
            drafter="any",
            source=f"ASSUMED per-token acceptance {rate:g} (a draft every step, the j-th token kept with {rate:g}^j)",
            assumption=True,
            draft_rate=1.0,
            accepted_at=geometric(rate, 8),
            drafted_per_draft=8.0,
        )
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        text, source = read_yaml_text(path), str(path)
    else:
        shipped = _shipped("acceptance")
        if str(name_or_path) not in shipped:
            raise UnknownPolicyError("acceptance", str(name_or_path), sorted(shipped))
        text, source = shipped[str(name_or_path)], f"configs/acceptance/{name_or_path}.yaml"
    return _parse(Acceptance, text, source, "acceptance")
