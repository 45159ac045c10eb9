"""The (drafter, verifier, block size, tree budget, temperature) combinations of a bench run.

`expand` forms the product of the requested axes, loads each drafter once and validates every
combination on the host with `jspec.api`'s own checks, so an impossible request (an unknown name, a
tree budget under the chain-only block rule, a greedy rule at temperature > 0, a tree from the small-LM
drafter) is refused as a whole, naming each bad combination, before anything is compiled.

Axes that do not apply collapse (each family's `with_shape` says which apply): a DFlash / DSpark checkpoint
drafts its own block size (the block-size axis is ignored for it) and a prompt-lookup tree ignores the
block size; duplicates are measured once.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

from jspec.api import BUILTIN_DIR, load_drafter, prepare_drafter
from jspec.drafters import Drafter, family
from jspec.verify import rules
from jspec.verify.sampling import SamplingParams

AUTO = "auto"  # greedy at temperature 0, Gumbel coupling otherwise (both give plain decoding's exact output)


@dataclasses.dataclass(frozen=True)
class Combo:
    """One measured configuration. `drafter` is the name as given; `drafts` = g (chain) or N (tree)."""

    drafter: str
    verifier: str
    kind: str  # "chain" | "tree"
    drafts: int
    temperature: float

    @property
    def label(self) -> str:
        size = f"g={self.drafts}" if self.kind == "chain" else f"tree N={self.drafts}"
        return f"{short_name(self.drafter)} {size} {self.verifier} T={self.temperature:g}"


@dataclasses.dataclass(frozen=True)
class Planned:
    combo: Combo
    drafter: Drafter  # prepared by jspec.api (checked against the target, the cache and the verifier)
    params: object


def short_name(drafter: str) -> str:
    if drafter.startswith("builtin:"):
        return drafter.split(":", 1)[1]
    return os.path.basename(os.path.normpath(drafter)) if os.sep in drafter else drafter


def installed_builtins() -> list[str]:
    return sorted(os.listdir(BUILTIN_DIR)) if os.path.isdir(BUILTIN_DIR) else []


def check_drafter_name(name: str) -> None:
    """Raise ValueError listing the valid drafters unless `name` names a parameter-free family, an
    installed built-in or a folder."""
    if name in family.named() or (not name.startswith("builtin:") and os.path.isdir(name)):
        return
    have = installed_builtins()
    if name.startswith("builtin:") and name.split(":", 1)[1] in have:
        return
    builtins = ", ".join(f"builtin:{n}" for n in have) or "none installed (train them with `jspec train`)"
    checkpoints = ", ".join(f.summary or f.name for f in family.FAMILIES.values() if f.detect is not None)
    raise ValueError(f"unknown drafter {name!r}: valid drafters are {', '.join(family.named())}, the built-in "
                     f"models ({builtins}), or the folder of a drafter checkpoint ({checkpoints}); plain AR "
                     "decoding always runs as the baseline")


def resolve_verifier(verifier: str, temperature: float) -> str:
    if verifier == AUTO:
        return rules.default_rule(temperature == 0)
    if verifier not in rules.RULES:
        raise ValueError(f"unknown verifier {verifier!r}: valid verifiers are {AUTO}, {', '.join(rules.RULES)}")
    return verifier


def expand(target, drafters, verifiers, block_sizes, tree_budgets, temperatures, cache_size: int) -> list[Planned]:
    """Every valid, distinct combination in axis order; ValueError naming all invalid ones otherwise."""
    for name in drafters:
        check_drafter_name(name)
    for v in verifiers:
        resolve_verifier(v, 0.0)
    for t in temperatures:
        SamplingParams(t)  # rejects negative temperatures with jspec's own message
    loaded = {n: load_drafter(n, target) for n in drafters}
    plan, seen, problems = [], set(), []
    for name, verifier, g, n, t in itertools.product(drafters, verifiers, block_sizes, tree_budgets, temperatures):
        sampling = SamplingParams(t)
        try:
            rule = resolve_verifier(verifier, t)
            dr, params = loaded[name]
            dr, params = prepare_drafter(target, (family.family_of(dr).with_shape(dr, g, n), params), sampling,
                                         rule, g, n, cache_size)
        except ValueError as err:
            what = f"tree N={n}" if n else f"g={g}"
            problem = f"{short_name(name)} {what} {verifier} T={t:g}: {err}"
            if problem not in problems:  # a tree ignores the block size: name it once
                problems.append(problem)
            continue
        combo = Combo(name, rule, dr.kind, dr.num_drafts, float(t))
        if combo not in seen:
            seen.add(combo)
            plan.append(Planned(combo, dr, params))
    if problems:
        raise ValueError(f"{len(problems)} requested combination(s) cannot run (nothing was compiled):\n  - "
                         + "\n  - ".join(problems))
    return plan
