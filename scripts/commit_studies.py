"""Copy the studies of a run (results/<experiment>/studies/<name>/) into a committed folder with an index.

`python scripts/commit_studies.py results/tiny/studies results/studies/<date> --times results/study_times.txt`
(docs/studies.md). Copies each study's report, tables, figure and resolved config, never its runs."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from d3s.analysis.studies import index_markdown, study_folders
from d3s.provenance.manifest import atomic_write_text

FILES = ("report.md", "claims.csv", "controls.csv", "measures.csv", "calibration.csv", "config.yaml")
FILES += ("figure.png", "figure.pdf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--times", type=Path, help="lines '<study> rc=0 <seconds> s ...' of each study's run")
    args = parser.parse_args()
    seconds: dict[str, int] = {}  # each study's snakemake runs (adaptive_calibration, adaptive) summed
    if args.times and args.times.is_file():
        for line in args.times.read_text().splitlines():
            name, code, elapsed = line.split()[:3]
            study = next((s.name for s in study_folders(args.source) if name.startswith(s.name)), name)
            if code == "rc=0":
                seconds[study] = seconds.get(study, 0) + int(elapsed)
    times = {name: f"{total // 60} min {total % 60} s" for name, total in seconds.items()}
    for folder in study_folders(args.source):
        target = args.dest / folder.name
        target.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            if (folder / name).is_file():
                shutil.copy2(folder / name, target / name)
    index = "# Studies\n\n" + index_markdown(args.dest, times) + "\n"
    atomic_write_text(args.dest / "index.md", index)
    print(index)


if __name__ == "__main__":
    main()
