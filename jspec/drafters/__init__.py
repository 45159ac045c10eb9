"""Drafters: one module per family, registered by name in `base.REGISTRY`."""

from jspec.drafters import lm, lookup
from jspec.drafters.base import REGISTRY, CommitInfo, DraftContext, Drafter, PrefillInfo, Proposal, register

__all__ = ["REGISTRY", "CommitInfo", "DraftContext", "Drafter", "PrefillInfo", "Proposal", "lm", "lookup", "register"]
