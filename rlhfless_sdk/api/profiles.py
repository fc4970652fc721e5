"""Time-per-token profiles: shipped YAML files in ``configs/profiles`` (package ``rlhfless_configs``) or any path."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from pydantic import ValidationError

from rlhfless_sdk.api.config import parse_yaml, problems_from_validation, read_yaml_text
from rlhfless_sdk.api.errors import ConfigError, ConfigProblem, UnknownPolicyError
from rlhfless_sdk.api.records import TimePerTokenProfile


def _shipped() -> dict[str, str]:
    folder = files("rlhfless_configs").joinpath("profiles")
    return {
        e.name.removesuffix(".yaml"): e.read_text(encoding="utf-8")
        for e in folder.iterdir()
        if e.name.endswith(".yaml")
    }


def profile_names() -> list[str]:
    return sorted(_shipped())


def parse_profile(text: str, source: str) -> TimePerTokenProfile:
    data, root = parse_yaml(text, source)
    if not isinstance(data, dict):
        raise ConfigError(source, [ConfigProblem("", "expected a mapping of profile fields", 1)])
    try:
        return TimePerTokenProfile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, problems_from_validation(exc, root=root)) from None


def load_profile(name_or_path: str | Path) -> TimePerTokenProfile:
    """A shipped profile by name (see ``profile_names()``), or a profile YAML file by path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return parse_profile(read_yaml_text(path), str(path))
    shipped = _shipped()
    if str(name_or_path) not in shipped:
        raise UnknownPolicyError("profile", str(name_or_path), sorted(shipped))
    return parse_profile(shipped[str(name_or_path)], f"configs/profiles/{name_or_path}.yaml")
