"""ds4lab.tables.format_table: the one plain-text table formatter (CLI, notebook tests)."""
from __future__ import annotations

from ds4lab.tables import format_table


def test_left_default_and_rstrip():
    t = format_table([{"mode": "watched", "util": 0.97}, {"mode": "unattended (fixed)", "util": 0.955}])
    lines = t.splitlines()
    assert lines[0] == "mode                util" and lines[1].startswith("------------------  -----")
    assert lines[2] == "watched             0.97" and all(x == x.rstrip() for x in lines)


def test_digits_none_columns_max_rows_right_empty():
    rows = [{"a": 1.23456, "b": None, "c": "x"}] * 3
    t = format_table(rows, ["c", "a"], digits=3, max_rows=2)
    assert t.splitlines() == ["c  a", "-  ----", "x  1.23", "x  1.23", "... 1 more rows"]
    r = format_table([{"run": "mtp1", "tok/s": 1.5, "x": None}], none="-", right=True)
    assert r.splitlines() == [" run  tok/s  x", "----  -----  -", "mtp1    1.5  -"]
    assert format_table([]) == "(no rows)" and format_table([], empty="") == ""
