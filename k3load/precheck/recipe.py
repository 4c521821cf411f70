"""Load a deployment recipe (`recipes/*.yaml`) and validate it against `schemas/recipe.schema.json`.

Why data and strict: the official Kimi K3 requirements (vLLM, CUDA, driver, image, GPUs) change with
upstream releases, so they live in a versioned file rather than in code; and a misspelt key must not
quietly stop a requirement from being checked, so unknown keys are load errors naming file and field.
The recipe's sha256 is recorded in compat.json so a verdict names the exact requirements it used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from k3load.errors import InputError
from k3load.yamlfile import YamlFileError, decode_text, load_yaml_text

GPU_GROUPS = ("image", "cuda", "driver", "gpu")


class RecipeError(InputError):
    """A recipe that cannot be used: the message names the file and the field."""


@dataclass(frozen=True)
class Recipe:
    """A validated recipe plus where it came from (path and sha256 of the exact bytes)."""

    data: dict[str, Any]
    path: Path
    sha256: str

    @property
    def name(self) -> str:
        return self.data["name"]

    @property
    def production(self) -> bool:
        return bool(self.data["production"])

    @property
    def platform(self) -> str:
        return self.data["platform"]

    def section(self, key: str) -> dict[str, Any]:
        return self.data[key]

    def not_applicable(self, key: str) -> str | None:
        """The recipe's reason when a rule group (image, cuda, driver, gpu) does not apply, else None."""
        value = self.data.get(key)
        return value.get("not_applicable") if isinstance(value, dict) else None

    def summary(self) -> dict[str, Any]:
        """What compat.json records about the recipe."""
        return {"name": self.name, "version": self.data["version"], "as_of": self.data["as_of"],
                "support": self.data["support"], "production": self.production, "platform": self.platform,
                "path": str(self.path), "sha256": self.sha256}


def _schema() -> dict[str, Any]:
    return json.loads(resources.files("k3load").joinpath("schemas/recipe.schema.json").read_text())


def _where(error: jsonschema.ValidationError) -> str:
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    return path.lstrip(".") or "(top level)"


def _best(error: jsonschema.ValidationError) -> jsonschema.ValidationError:
    """For a oneOf failure, the error of the branch the author meant (the one with the fewest errors)."""
    if not error.context:
        return error
    by_branch: dict[int | str, list[jsonschema.ValidationError]] = {}
    for sub in error.context:
        by_branch.setdefault(sub.schema_path[0] if sub.schema_path else 0, []).append(sub)
    branch = min(by_branch.values(), key=len)
    return _best(min(branch, key=lambda e: -len(e.absolute_path)))


def _message(error: jsonschema.ValidationError) -> str:
    if error.validator == "not" and error.absolute_path and error.absolute_path[-1] in GPU_GROUPS:
        return "a production recipe cannot mark this group not_applicable"
    if error.validator == "const" and list(error.absolute_path) == ["target", "allow_sim"]:
        return "a production recipe never accepts the sim (allow_sim must be false)"
    return error.message


def validate_recipe(data: Any, path: Path) -> None:
    """Raise RecipeError naming the file and field of the first problem (and how many more)."""
    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        first = _best(errors[0])
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise RecipeError(f"{path}: {_where(first)}: {_message(first)}{more}")


def load_recipe(path: Path) -> Recipe:
    """Read, parse and validate a recipe file; the sha256 is of the bytes on disk."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = load_yaml_text(decode_text(raw, path, "recipe"), path)
    except YamlFileError as exc:
        raise RecipeError(str(exc)) from None
    validate_recipe(data, path)
    return Recipe(data=data, path=path, sha256=hashlib.sha256(raw).hexdigest())
