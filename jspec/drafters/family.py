"""Drafter families: everything around the decode loop that differs from one kind of drafter to another.

Inside the loop a drafter is its `Drafter` object (jspec.drafters.base). Around it, a `Family` says how
such drafters are found and made: how to recognise their checkpoints (`detect` on the HF config.json),
`load` and `save` them, build one from its name alone (`lookup`: parameter-free drafters such as
prompt lookup, or a module the target's own checkpoint carries, such as MTP), set its draft shape (`with_shape`: block size, tree budget) and, optionally, how to train
one (`TrainRecipe`). Parameter declarations (shapes, initialisers, logical sharding axes) belong to the
drafter's network module and reach sharding through `Drafter.param_axes`.

A new drafter family is one module that defines its `Drafter` and ends with

    register_family(Family(name="mine", drafter=MyDrafter, detect=..., load=..., save=..., ...))

`jspec.drafters` imports every built-in family module, so the registry is complete on import; a family
defined elsewhere (a research script, a test) registers itself the same way and is then loaded by
`jspec.load_drafter`, trained by `jspec train mine`, and measured by `jspec bench`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jspec.drafters.base import Drafter
from jspec.io.drafters import read_config


@dataclasses.dataclass(frozen=True)
class TrainRecipe:
    """How `jspec train <family>` trains a drafter of this family on self-distilled sequences.

    build(run_config, target, key) -> (Drafter, random params): from the run config's "drafter" section
        (and "init_std" at the top level), for this target; checks the config against the target.
    loss(params, target_params, target_cfg, drafter, spec, batch, key) -> (scalar loss, metrics dict): one
        training step's objective, a pure function of the drafter's parameters (frozen ones included) and
        the frozen target's; batch holds tokens [B, T] and loss_mask [B, T]; spec is a
        jspec.train.drafter.DrafterLoss; metrics are scalars (the trainer logs them).
    frozen: top-level parameter names that stay fixed (copies of the target's embedding / head).
    own_loss: the name of the family's own published objective, when it has one that is not a loss of
        jspec.train.losses (EAGLE-3's "ttt", DSpark's "dspark"): the run's default loss, and one more name
        the drafter section's "loss" accepts beside losses.LOSSES (which the recipe applies to its drafts).
    data: what the run prepares: "distilled" (prompts from the corpus continued by the target).
    """

    build: Callable[[dict, Any, Any], tuple[Drafter, Any]]
    loss: Callable[..., tuple[Any, dict]]
    frozen: tuple[str, ...] = ()
    data: str = "distilled"
    own_loss: str | None = None


def _no_shape(drafter: Drafter, block_size: int, tree_budget: int) -> Drafter:
    return drafter


@dataclasses.dataclass(frozen=True)
class Family:
    """One registered drafter family (see the module docstring). Optional parts are None.

    detect(hf_config: dict) -> bool: is a checkpoint folder with this config.json one of ours?
    load(path, target, dtype) -> (Drafter, params): strict; target is the jspec Target the drafter will
        serve (its config, tokenizer), or None when a checkpoint is only converted (then skip the
        checks against a target).
    save(path, drafter, params, dtype=None): writes a folder `load` reads back exactly.
    lookup(target) -> Drafter or (Drafter, params): a drafter built from the family name alone (parameter-free,
        or with parameters read from the target's own checkpoint, e.g. its MTP module).
    with_shape(drafter, block_size, tree_budget) -> Drafter: the drafter at this draft shape; a family
        whose shape is fixed by its checkpoint keeps what it cannot change, and raises ValueError
        naming the fix for a shape it cannot draft (e.g. a tree from a chain-only drafter).
    example(target) -> (Drafter, params): a small drafter of the family for this target (random weights,
        or derived from the target), which the conformance suite (tests/conformance.py) runs every
        registered family's checks on.
    offline(target_params, target_cfg, drafter, dparams, taps, tokens, sampling) -> blocks: what the exact
        offline round evaluator (jspec.train.evaluate) reads of a chain drafter along given texts tokens
        [B, T], with the target's taps of them at drafter.taps ([n, B, T, H]) and its served sampling
        (a `Served`). blocks(anchors [B, A]) -> (logits, log q) [B, A, g, V] of the rounds anchored at
        those token indices: slot k's row given drafts 1..k-1 equal to the text (teacher-forced), its
        argmax the greedy draft and log q the served law the loop reports (-inf: never drafted, e.g. a
        slot past a data-dependent draft length). None: the evaluator does not cover the family.
    fallback: the family's `detect` accepts any plain causal LM (the small-LM drafter); it loads a folder
        only when no other family's `detect` does (a drafter format built on a causal-LM config wins).
    """

    name: str
    drafter: type[Drafter]
    detect: Callable[[dict], bool] | None = None
    load: Callable[[str, Any, Any], tuple[Drafter, Any]] | None = None
    save: Callable[..., None] | None = None
    lookup: Callable[[Any], Any] | None = None
    with_shape: Callable[[Drafter, int, int], Drafter] = _no_shape
    recipe: TrainRecipe | None = None
    example: Callable[[Any], tuple[Drafter, Any]] | None = None
    offline: Callable[..., Callable] | None = None
    fallback: bool = False
    summary: str = ""  # one line for listings: what the family is
    wraps: bool = False  # its folders are another family's folder plus settings of its own (DLoop): when
    # both accept a folder, the wrapping family is the one


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add a family to the registry (a second registration under one name replaces the first, so a
    research module can be re-imported)."""
    if not family.name or not family.name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"family names are words (letters, digits, - or _), got {family.name!r}")
    FAMILIES[family.name] = family
    return family


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown drafter family {name!r}: registered families are {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(drafter: Drafter) -> Family:
    """The family of a drafter object: the registration of its class, or of the nearest base class."""
    for cls in type(drafter).__mro__:
        for fam in FAMILIES.values():
            if fam.drafter is cls:
                return fam
    raise ValueError(f"{type(drafter).__name__} belongs to no registered drafter family: register it with "
                     "jspec.drafters.family.register_family")


def named() -> list[str]:
    """Families a drafter can be built from by name alone (e.g. "lookup", "mtp")."""
    return [n for n, f in FAMILIES.items() if f.lookup is not None]


def trainable() -> list[str]:
    """Families with a training recipe (`jspec train <name>`)."""
    return [n for n, f in FAMILIES.items() if f.recipe is not None]


def detect(path: str) -> Family:
    """The one family whose `detect` accepts the checkpoint folder's config.json (a fallback family only
    when no other does); ValueError when none or several do (naming them)."""
    return detect_config(read_config(path), path)


def detect_config(hf: dict, path: str, wrapping: bool = True) -> Family:
    """`detect` of a config.json's contents (wrapping=False: among the families that wrap none)."""
    hits = [f for f in FAMILIES.values() if f.detect is not None and (wrapping or not f.wraps) and f.detect(hf)]
    if len(hits) > 1:
        hits = [f for f in hits if f.wraps] or [f for f in hits if not f.fallback] or hits
    if len(hits) == 1:
        return hits[0]
    arch = hf.get("architectures")
    if not hits:
        known = ", ".join(f"{f.name} ({f.summary})" if f.summary else f.name
                          for f in FAMILIES.values() if f.detect is not None)
        raise ValueError(f"{path!r} (architectures {arch}) is no drafter checkpoint jspec knows: the checkpoint "
                         f"families are {known}")
    raise ValueError(f"{path!r} (architectures {arch}) matches several drafter families "
                     f"({', '.join(f.name for f in hits)}): their detect rules overlap; make one stricter")
