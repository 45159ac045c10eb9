"""Drafters: one module per family (its `Drafter`, checkpoint format and training recipe), each registered
in `family.FAMILIES`; importing this package imports every built-in family, so the registry is complete."""

from jspec.drafters import dflash, dflash2, dloop, dspark, eagle3, heads, lm, lookup, mtp, pard, peagle, refine
from jspec.drafters.base import CommitInfo, DraftContext, Drafter, PrefillInfo, Proposal
from jspec.drafters.family import FAMILIES, Family, TrainRecipe, family_of, get_family, register_family

__all__ = ["FAMILIES", "CommitInfo", "DraftContext", "Drafter", "Family", "PrefillInfo", "Proposal", "TrainRecipe",
           "dflash", "dflash2", "dloop", "dspark", "eagle3", "family_of", "get_family", "heads", "lm", "lookup", "mtp", "pard", "peagle", "refine", "register_family"]
