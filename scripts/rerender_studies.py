"""Render committed studies again under the current analysis and study files, from their stored measures.

`python scripts/rerender_studies.py results/studies/2026-11-28 results/studies/2026-11-28-controls`
(docs/studies.md, "Controls"); `--fresh NAME=FOLDER` takes study NAME as a new run wrote it (FOLDER: its
results/<experiment>/studies/NAME) instead, for a study whose runs or evaluations changed. For each other
study folder of SOURCE: the study file config/studies/<name>.yaml as it is now (its controls), checked to have
the folder's testbed, applied to the folder's measures.csv; no run is trained or evaluated. A folder written
before the measures held the base models (runs ``base`` and ``base:<name>``) gets their Pass@1 from its
report.md, which states them to 0.1 point. A run the study file names that the folder lacks has no data (a
control on it is not supported). Never writes into SOURCE."""

from __future__ import annotations

import argparse
import copy
import re
import shutil
from pathlib import Path

import pandas as pd
import yaml

from d3s.analysis.studies import claim_rows, index_markdown, read_study, render_study, study_folders
from d3s.orchestration.workflow_config import check_workflow_config, validate_config
from d3s.provenance.manifest import atomic_write_text
from d3s.studies import base_run, parse_study
from d3s.variants import extended_config, run_variants

ROOT = Path(__file__).resolve().parents[1]
TESTBED = ("experiment", "base_model", "bases", "task", "seeds", "train", "eval")


def current_config(name: str) -> dict:
    """config/studies/<name>.yaml as the workflow resolves it."""
    raw = yaml.safe_load((ROOT / "config" / "studies" / f"{name}.yaml").read_text(encoding="utf-8"))
    config = extended_config(raw, ROOT)
    check_workflow_config(config, ROOT / "workflow" / "accelerate", ROOT / "config" / "schema.yaml")
    return config


def with_defaults(config: dict) -> dict:
    """A folder's config with the current schema's defaults filled in, so that a key the schema gained since
    (base_model.sft_task, empty by default) is no change of testbed."""
    filled = copy.deepcopy(config)
    validate_config(filled, ROOT / "config" / "schema.yaml")
    return filled


def bases_from_report(report: str) -> dict[tuple[str, str], float]:
    """(base run, measure) -> value, as an older report states them: its runs table's 'base model (its
    Pass@1)' cells and its line on the held-out longer problems."""
    found: dict[tuple[str, str], float] = {}
    for base, value in re.findall(r"\| (default|[a-z0-9_]+) \((\d+(?:\.\d+)?)\) \|", report):
        found[(base_run(None if base == "default" else base), "pass_at_1")] = float(value)
    ood = re.search(r"the base model's Pass@1 on them (\d+(?:\.\d+)?)", report)
    if ood:
        found[(base_run(None), "ood_pass_at_1")] = float(ood.group(1))
    return found


def rerender(source: Path, dest: Path, fresh: dict[str, Path] | None = None) -> list[str]:
    """Every study of ``source`` rendered into ``dest``, but those in ``fresh`` (name: a new run's study
    folder), copied as they were written; returns notes on what came from where."""
    notes = []
    fresh = fresh or {}
    for folder in study_folders(source):
        if folder.name in fresh:
            run = read_study(
                fresh[folder.name]
            )  # a complete study folder, or an error naming what is missing
            written = with_defaults(run.config)
            if written != current_config(folder.name) | {"study": written["study"]}:
                raise SystemExit(
                    f"{folder.name}: {fresh[folder.name]} was not written by the current study file"
                )
            shutil.copytree(fresh[folder.name], dest / folder.name)
            notes.append(f"{folder.name}: run again ({fresh[folder.name]}), not rendered from {source}")
            continue
        old = read_study(folder)
        config = current_config(folder.name)
        written = with_defaults(old.config)
        changed = [key for key in TESTBED if config.get(key) != written.get(key)]
        if changed:
            raise SystemExit(
                f"{folder.name}: the study file's testbed differs from the folder's in {changed}"
            )
        # other problems (ood: new evaluations) or another switch to calibrate (calibration: new runs)
        for key, what in (("ood", "held-out evaluation"), ("calibration", "calibration")):
            if config["study"].get(key) != old.config["study"].get(key):
                raise SystemExit(
                    f"{folder.name}: the study file's {what} (study.{key}) differs from the folder's; "
                    f"run the study again and pass --fresh {folder.name}=FOLDER"
                )
        values = old.values.copy()
        runs_with_data = set(values["run"])
        if not values["run"].astype(str).str.startswith("base").any():
            stated = bases_from_report((folder / "report.md").read_text(encoding="utf-8"))
            seeds = [int(s) for s in config["seeds"]]
            rows = [
                {"run": run, "seed": seed, "measure": measure, "value": value}
                for (run, measure), value in stated.items()
                for seed in seeds
            ]
            values = pd.concat([values, pd.DataFrame(rows)], ignore_index=True)
            stated_text = ", ".join(f"{run} {measure} {value:g}" for (run, measure), value in stated.items())
            notes.append(f"{folder.name}: base models from its report.md (0.1 point): {stated_text}")
        study = parse_study(config, run_variants(config))
        assert study is not None
        missing = [run for run in study.runs if run not in runs_with_data]
        if missing:
            notes.append(f"{folder.name}: no data for {missing} (not in the folder's measures.csv)")
        calibration = None
        if (folder / "calibration.csv").is_file():
            calibration = pd.read_csv(folder / "calibration.csv")
        render_study(dest / folder.name, config, values, calibration)
        # the claims are the folder's, recomputed: they must agree to the last digit
        claims = claim_rows(values, study, run_variants(config))
        for column in ("estimate", "ci_low", "ci_high", "p_value"):
            pd.testing.assert_series_equal(
                claims[column].reset_index(drop=True), old.claims[column].reset_index(drop=True), rtol=1e-9
            )
    return notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--fresh", action="append", default=[], metavar="NAME=FOLDER")
    args = parser.parse_args()
    if args.dest.resolve() == args.source.resolve():
        raise SystemExit("dest must be a new folder: a committed study folder is never overwritten")
    fresh = dict(item.split("=", 1) for item in args.fresh)
    notes = rerender(args.source, args.dest, {name: Path(folder) for name, folder in fresh.items()})
    times = {}
    index = (
        (args.source / "index.md").read_text(encoding="utf-8") if (args.source / "index.md").is_file() else ""
    )
    for name, time in re.findall(r"^\| \[(\w+)\]\([^)]*\) \|.*\| ([^|]+) \|$", index, flags=re.MULTILINE):
        if name not in fresh:  # a study run again took its own time, stated in the closing note
            times[name] = time.strip()
    text = "# Studies\n\n" + index_markdown(args.dest, times) + "\n\n"
    command = " ".join(
        [
            "python scripts/rerender_studies.py",
            str(args.source),
            str(args.dest),
            *(f"--fresh {item}" for item in args.fresh),
        ]
    )
    again = ", ".join(fresh) or "none"
    text += (
        f"Rendered again from {args.source}'s measures.csv (`{command}`) with the controls of "
        "config/studies/*.yaml; no run was trained or evaluated again but in the studies run again "
        f"({again}), and the claims rendered again are the same to the last digit. The wall times are those "
        f"of {args.source}, where there is one.\n\n"
    )
    text += "".join(f"- {note}\n" for note in notes)
    atomic_write_text(args.dest / "index.md", text)
    print(text)


if __name__ == "__main__":
    main()
