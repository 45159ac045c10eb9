"""PNG plots of a bench report (matplotlib, no display needed)."""

from __future__ import annotations

import math
import os

PLOTS = {
    "acceptance_by_position": "acceptance_by_position.png",
    "survival": "survival.png",
    "verify_cost": "verify_cost.png",
    "speedup_vs_block": "speedup_vs_block.png",
}


def write_plots(report: dict, out_dir: str) -> dict[str, str]:
    """Write the four plots of `report` into out_dir; returns {plot name: file name}."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never open a window
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    combos = report["combos"]
    settings = report["settings"]
    title = f"{report['target']['name']}, {settings['prompts']} prompts x {settings['max_new_tokens']} tokens"

    def save(fig, ax, name):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # positions, block sizes and widths are integers
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, PLOTS[name]), dpi=110)
        plt.close(fig)

    def axes():
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # up to 20 runs in distinct colours
        return fig, ax

    fig, ax = axes()
    for k, c in enumerate(combos):
        acc = c["acceptance"]
        reached = [acc["rounds"]] + acc["accepted_per_position"][:-1]  # rounds that reached draft i
        pts = [(i + 1, v, n) for i, (v, n) in enumerate(zip(acc["conditional_acceptance"], reached)) if v is not None]
        xs = [x + dodge(k, len(combos)) for x, _, _ in pts]
        ys = [v for _, v, _ in pts]
        lo_hi = [wilson(v, n) for _, v, n in pts]
        ax.errorbar(xs, ys, yerr=[[y - lo for y, (lo, _) in zip(ys, lo_hi)], [hi - y for y, (_, hi) in zip(ys, lo_hi)]],
                    marker="o", ms=3, capsize=2, lw=1, label=f"{c['label']} ({acc['rounds']} rounds)")
    ax.set(xlabel="draft position i", ylabel="P(draft i accepted | drafts < i accepted)", ylim=(0, 1.02),
           title=f"Acceptance by position (95% Wilson intervals)\n{title}")
    save(fig, ax, "acceptance_by_position")

    fig, ax = axes()
    for k, c in enumerate(combos):
        s = c["acceptance"]["survival"]
        ax.plot([i + dodge(k, len(combos)) for i in range(0, len(s) + 1)], [1.0] + s, marker="o", ms=3,
                label=f"{c['label']} ({c['acceptance']['rounds']} rounds)")
    ax.set(xlabel="i", ylabel="S(i) = share of rounds accepting >= i drafts", ylim=(0, 1.02),
           title=f"Survival of drafts\n{title}")
    save(fig, ax, "survival")

    fig, ax = axes()
    curve = report["verify_curve"]
    xs = [n for n in curve["n"] if n >= 1]
    ax.plot(xs, [r for n, r in zip(curve["n"], curve["ratio_to_t1"]) if n >= 1], marker="o", ms=3,
            label="T(n) / T(1) measured")
    ax.set(xlabel="n = drafts verified beside the anchor", ylabel="T(n) / T(1)",
           title=f"Verify-pass cost (context {curve['context']})\n{report['target']['name']}")
    save(fig, ax, "verify_cost")

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    drafters = list(dict.fromkeys(c["drafter_short"] for c in combos))
    groups: dict[tuple, list] = {}
    for c in combos:
        groups.setdefault((c["drafter_short"], c["kind"], c["verifier"], c["temperature"]), []).append(
            (c["drafts"], c["speedup"]))
    for k, ((name, kind, verifier, temperature), pts) in enumerate(groups.items()):
        pts.sort(key=lambda p: p[0])
        lo, hi = zip(*(interval(sp) for _, sp in pts))
        ys = [sp["value"] for _, sp in pts]
        # Colour: drafter; marker: chain (o) or tree (s); dashed: sampling (T > 0); each series shifted a
        # little along x so that equal values stay visible.
        ax.errorbar([p[0] + dodge(k, len(groups)) for p in pts], ys,
                    yerr=[[y - a for y, a in zip(ys, lo)], [b - y for y, b in zip(ys, hi)]], capsize=2,
                    color=plt.cm.tab10(drafters.index(name) % 10), marker="o" if kind == "chain" else "s",
                    ls="-" if temperature == 0 else "--", label=f"{name} {kind} {verifier} T={temperature:g}")
    ax.axhline(1.0, color="grey", lw=0.8)
    bars = "95% bootstrap intervals" if all(c["speedup"].get("ci95") for c in combos) else "per-repeat range"
    ax.set(xlabel="drafts per round g (chains) / tree budget N (trees)", ylabel="speedup over plain AR (decode)",
           title=f"Speedup vs block size ({bars})\n{title}")
    save(fig, ax, "speedup_vs_block")
    return dict(PLOTS)


def dodge(k: int, n: int, width: float = 0.24) -> float:
    """x offset of series k of n: spread over `width` around 0, so that series with equal values stay visible."""
    return 0.0 if n < 2 else width * (k / (n - 1) - 0.5)


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion p observed over n trials."""
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def interval(sp: dict) -> tuple[float, float]:
    """A speedup's error bar: its 95% interval, else the per-repeat range, else the value itself."""
    if sp.get("ci95"):
        return sp["ci95"]["low"], sp["ci95"]["high"]
    if sp["repeats"]:
        return min(sp["repeats"]["min"], sp["value"]), max(sp["repeats"]["max"], sp["value"])
    return sp["value"], sp["value"]
