"""GitHub Markdown tables, for the reports of the analysis, the evaluation's audit and the perf scripts."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any


def markdown_table(rows: Iterable[Any], columns: Mapping[str, str | Callable[[Any], Any]]) -> str:
    """A GitHub Markdown table, one column per header: its cells ``cell.format_map(row)`` or ``cell(row)``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = (cell.format_map(row) if isinstance(cell, str) else cell(row) for cell in columns.values())
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)
