"""The one plain-text table formatter (CLI output and the short tables tests read).

Notebooks show tables as pandas DataFrames (they render as HTML and scroll); the CLI and the
notebook tests keep these short fixed-width tables.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

__all__ = ["format_table"]


def format_table(rows: Sequence[Mapping[str, Any]], columns: Iterable[str] | None = None, *,
                 digits: int | None = None, max_rows: int | None = None, none: str = "",
                 right: Iterable[str] | bool = (), empty: str = "(no rows)") -> str:
    """Rows of mappings as a fixed-width text table: a header, a dashes line, one line per row.

    Parameters
    ----------
    columns : the columns, in order (default: the first row's keys); a missing key prints as ``none``.
    digits : floats printed with ``digits`` significant figures (``f"{v:.{digits}g}"``); None: ``str(v)``.
    max_rows : print at most this many rows, then ``... N more rows``; None: all.
    none : the text for a ``None`` cell.
    right : columns to right-align (True: every column); the rest are left-aligned.
    empty : returned when there are no rows.

    Trailing blanks are stripped from every line.
    """
    if not rows:
        return empty
    cols = list(columns) if columns is not None else list(rows[0].keys())
    rset = set(cols) if right is True else set(right or ())

    def cell(v: Any) -> str:
        if v is None:
            return none
        if digits is not None and isinstance(v, float):
            return f"{v:.{digits}g}"
        return str(v)

    shown = rows if max_rows is None else rows[:max_rows]
    body = [[cell(r.get(c)) for c in cols] for r in shown]
    w = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]

    def line(vals: list[str]) -> str:
        return "  ".join(v.rjust(w[i]) if cols[i] in rset else v.ljust(w[i]) for i, v in enumerate(vals)).rstrip()

    lines = [line(cols), "  ".join("-" * x for x in w)] + [line(b) for b in body]
    if len(rows) > len(shown):
        lines.append(f"... {len(rows) - len(shown)} more rows")
    return "\n".join(lines)
