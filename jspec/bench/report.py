"""Markdown tables of a bench report (what the command prints and the README shows)."""

from __future__ import annotations


def _speedup(sp: dict) -> str:
    """Pooled speedup, its 95% interval (bootstrap over repeats, from 5 repeats) or else the range of
    per-repeat speedups; below 1 it says "slower". Repeats whose decode time came out <= 0 s (timing noise
    larger than the decode) are named."""
    r, ci = sp["repeats"], sp.get("ci95")
    text = f"{sp['value']:.2f}x" + (" (slower)" if sp["value"] < 1 else "")
    if ci:
        text += f", 95% CI {ci['low']:.2f}-{ci['high']:.2f}"
    elif r:
        text += f", repeats {r['min']:.2f}-{r['max']:.2f}"
    if sp["noisy_repeats"]:
        text += f" [{sp['noisy_repeats']} repeat(s) with decode <= 0 s: timing noise, use more tokens]"
    return text


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def main_table(report: dict) -> str:
    """One row per run: tau, speedup over plain AR (pooled over prompts and repeats, with its 95% interval),
    drafter cost c, and a round split into the verify pass, the drafter pass, their contention when run
    together and the rest, all timed in the same repeats (their shares sum to 100%); absolute rates only
    on an accelerator (DESIGN.md)."""
    absolute = report["environment"]["accelerator"]
    head = ["run", "tau", "speedup", "c", "verify / round", "draft / round", "contention / round",
            "overhead / round"]
    if absolute:
        head += ["tok/s", "ms / round"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for run in report["ar"] + report["combos"]:
        cost = run["cost"]
        cells = [run["label"], f"{run['acceptance']['tau']:.2f}" if "acceptance" in run else "1.00",
                 _speedup(run["speedup"]) if "speedup" in run else "1",
                 f"{cost['c']:.2f}" if cost.get("c") is not None else "-",
                 _pct(cost["verify_share"]), _pct(cost["draft_share"]), _pct(cost["contention_share"]),
                 _pct(cost["overhead_share"])]
        if absolute:
            cells += [f"{run['timing']['tokens_per_s']:.1f}", f"{1e3 * cost['round_s']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peer_table(report: dict) -> str | None:
    peer = report["peer"]
    if "skipped" in peer:
        return None
    g = peer["block_size"]
    rows = [("plain AR", "ar", "ar"), (f"assisted, early-exit 1-layer assistant, g={g}", "assisted", "small_lm"),
            (f"prompt lookup, g={g}", "prompt_lookup", "lookup")]
    lines = ["| method (HF / jspec) | HF tok/s | jspec tok/s | jspec / HF |", "| --- | --- | --- | --- |"]
    for label, hf, js in rows:
        h, j = peer["hf"][hf]["tokens_per_s"], peer["jspec"][js]["tokens_per_s"]
        lines.append(f"| {label} | {h:.0f} | {j:.0f} | {peer['ratio'][f'jspec_{js}_over_hf_{hf}']:.2f}x |")
    return "\n".join(lines)


def roofline_table(report: dict) -> str | None:
    """The verify pass T(n) against the bandwidth bound (weights + cached K/V read once per pass)."""
    roof = report["roofline"]
    if "skipped" in roof:
        return None
    lines = ["| n | T(n) ms | roofline ms | share of roofline |", "| --- | --- | --- | --- |"]
    for n, s, share in zip(roof["n"], roof["seconds"], roof["share_of_roofline"]):
        lines.append(f"| {n} | {1e3 * s:.3f} | {1e3 * roof['roofline_s']:.3f} | {100 * share:.0f}% |")
    return "\n".join(lines)
