"""The power calculation of the studies' primary claims (docs/studies/power.md).

`python scripts/study_power.py results/studies/2026-11-29` prints, study by study, the primary claims (marked
`primary: true` in config/studies/<name>.yaml as it is now) computed from the folder's measures.csv: each
comparison's verdict after Holm, the spread of its paired differences across seeds, the smallest effect its
seeds detect, and the paired seeds that would detect 1.5 points at that spread; then how many runs x seeds
the undecided ones need added. Nothing is trained or evaluated."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from rerender_studies import current_config

from d3s.analysis.studies import TARGET_EFFECT, power_markdown, power_table, read_study, study_folders
from d3s.studies import BASE, parse_study


def claim_key(claim) -> tuple:
    return (claim.kind, claim.measure, claim.runs, claim.reference)


def study_power(folder: Path, effect: float = TARGET_EFFECT) -> str:
    """One study's section: its status, its primary claims' power table and the runs x seeds to add."""
    result = read_study(folder)
    current = parse_study(current_config(folder.name), result.variants)
    primary = {claim_key(claim) for claim in current.claims if claim.primary}
    claims = tuple(dataclasses.replace(c, primary=claim_key(c) in primary) for c in result.study.claims)
    study = dataclasses.replace(result.study, claims=claims)
    lines = [f"**{study.title}** (`{folder.name}`)"]
    if not result.informative:
        lines.append(
            "Uninformative (a control failed): the figures below are for its redesign, not findings."
        )
    if not primary:
        return "\n\n".join([*lines, "No primary claim named."])
    table = power_table(result.values, study, result.variants, effect)
    lines.append(power_markdown(table, effect))
    short = table[~table["enough"]]
    if short.empty:
        lines.append(f"Every primary comparison is decided or detects {effect:g} points with its seeds.")
        return "\n\n".join(lines)
    seeds = int(table["seeds"].max())
    needed = [n for n in short["seeds_needed"] if n is not None and not math.isnan(n)]
    runs = sorted(
        {run for c in claims if c.primary for run in (*c.runs, c.reference) if run not in (None, BASE)}
    )
    if len(needed) < len(short):
        lines.append("At least one undecided comparison needs over 1,000 seeds at its spread.")
    if needed:
        extra = max(needed) - seeds
        lines.append(
            f"To detect {effect:g} points in every undecided primary comparison: {max(needed):.0f} paired "
            f"seeds, {extra:.0f} more for each of the {len(runs)} runs of the primary claims "
            f"({', '.join(runs)}): {extra * len(runs):.0f} runs x seeds to train and evaluate."
        )
    return "\n\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("studies", type=Path, help="a folder of study folders (results/studies/<date>)")
    parser.add_argument("--effect", type=float, default=TARGET_EFFECT, help="points of Pass@1 to detect")
    args = parser.parse_args()
    print("\n\n".join(study_power(folder, args.effect) for folder in study_folders(args.studies)))


if __name__ == "__main__":
    main()
