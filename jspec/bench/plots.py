"""PNG plots of a bench report (matplotlib, no display needed)."""

from __future__ import annotations

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

    combos = report["combos"]
    settings = report["settings"]
    title = f"{report['target']['name']}, {settings['prompts']} prompts x {settings['max_new_tokens']} tokens"

    def save(fig, ax, name):
        ax.grid(alpha=0.3)
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
    for c in combos:
        cond = c["acceptance"]["conditional_acceptance"]
        xs = [i + 1 for i, v in enumerate(cond) if v is not None]
        ax.plot(xs, [v for v in cond if v is not None], marker="o", ms=3, label=c["label"])
    ax.set(xlabel="draft position i", ylabel="P(draft i accepted | drafts < i accepted)", ylim=(0, 1.02),
           title=f"Acceptance by position\n{title}")
    save(fig, ax, "acceptance_by_position")

    fig, ax = axes()
    for c in combos:
        s = c["acceptance"]["survival"]
        ax.plot(range(0, len(s) + 1), [1.0] + s, marker="o", ms=3, label=c["label"])
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
            (c["drafts"], c["speedup"]["value"]))
    for (name, kind, verifier, temperature), pts in groups.items():
        pts.sort()
        # Colour: drafter; marker: chain (o) or tree (s); dashed: sampling (T > 0).
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=plt.cm.tab10(drafters.index(name) % 10),
                marker="o" if kind == "chain" else "s", ls="-" if temperature == 0 else "--",
                label=f"{name} {kind} {verifier} T={temperature:g}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="block size g (chains) / tree budget N (trees)", ylabel="speedup over plain AR (decode)",
           title=f"Speedup vs block size\n{title}")
    save(fig, ax, "speedup_vs_block")
    return dict(PLOTS)
