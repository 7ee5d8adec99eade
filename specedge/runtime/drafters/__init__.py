"""The drafters (one module each, the role in base.py) and the one place that picks one by name."""

from __future__ import annotations

from .base import Drafter
from .head import HeadDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["DRAFTERS", "Drafter", "check_draft_name", "drafter_class"]

DRAFTERS: dict[str, type[Drafter]] = {cls.kind: cls for cls in (ModelDrafter, NgramDrafter, HeadDrafter)}


def check_draft_name(name: str | None) -> None:
    """Refuse (ValueError) a `draft` that names no drafter; None means the bundle's own."""
    if name is not None and name not in DRAFTERS:
        raise ValueError(f"draft must be {', '.join(repr(n) for n in DRAFTERS)} or None, got {name!r}")


def drafter_class(name: str | None, manifest) -> type[Drafter]:
    """The drafter `name` names (None: the bundle's own: its draft model, else prompt lookup),
    refused with one sentence when the bundle lacks what it needs."""
    check_draft_name(name)
    cls = DRAFTERS[name] if name is not None else ModelDrafter if manifest.draft.is_model else NgramDrafter
    cls.check_bundle(manifest)
    return cls
