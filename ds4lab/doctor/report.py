"""The doctor's rows and report: :class:`CheckResult` (one check's verdict) and :class:`Report`
(text, HTML, JSON renderings)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

__all__ = ["STATUSES", "CheckResult", "Report", "text_header", "text_row"]

STATUSES = ("pass", "warn", "fail")


@dataclass
class CheckResult:
    """One row of the report: ``name``, ``status`` in pass/warn/fail, ``evidence`` (what was
    seen), ``fix`` (the exact command or edit; empty when nothing is to be done)."""
    name: str
    status: str
    evidence: str
    fix: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r}: must be one of {STATUSES}")


@dataclass
class Report:
    """The results plus what they were run against; renders as text, HTML and JSON."""
    profile: str
    python: str
    results: list[CheckResult]

    @property
    def ok(self) -> bool:
        return not any(r.status == "fail" for r in self.results)

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in STATUSES}

    def to_dict(self) -> dict:
        return {"profile": self.profile, "python": self.python, "ok": self.ok, "counts": self.counts(),
                "checks": [asdict(r) for r in self.results]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def to_text(self, width: int = 110) -> str:
        """A plain-text table (no terminal codes): status, check, evidence, fix."""
        w_name = max(len(r.name) for r in self.results)
        lines = [text_header(self.profile, self.python), ""]
        lines += [text_row(r, w_name, width) for r in self.results]
        return "\n".join(lines + ["", self.text_footer()])

    def text_footer(self) -> str:
        c = self.counts()
        return f"{c['pass']} pass, {c['warn']} warn, {c['fail']} fail" + ("" if self.ok else "  -> NOT READY")

    def to_html(self) -> str:
        import html
        color = {"pass": "#1a7f37", "warn": "#9a6700", "fail": "#cf222e"}
        rows = "".join(
            f"<tr><td style='color:{color[r.status]};font-weight:bold'>{r.status}</td><td><code>{html.escape(r.name)}</code></td>"
            f"<td style='text-align:left'>{html.escape(r.evidence)}</td><td style='text-align:left'><code>{html.escape(r.fix)}</code></td></tr>"
            for r in self.results)
        return (f"<p>profile <b>{html.escape(self.profile)}</b>, python <code>{html.escape(self.python)}</code></p>"
                "<table><tr><th>status</th><th>check</th><th>evidence</th><th>fix</th></tr>" + rows + "</table>")

    def _repr_html_(self) -> str:
        return self.to_html()


def text_header(profile: str, python: str) -> str:
    """The first line of the text report."""
    return f"ds4lab doctor: profile {profile}, python {python}"


def text_row(r: CheckResult, w_name: int, width: int = 110) -> str:
    """One check as text lines: ``STATUS  name  evidence``, wrapped, then ``fix: ...`` (``w_name``: the
    name column's width, so rows printed one by one as they finish line up)."""
    import textwrap
    body_w = max(40, width - w_name - 8)
    ev = textwrap.wrap(r.evidence, body_w) or [""]
    pad = " " * (w_name + 8)
    lines = [f"{r.status.upper()}  {r.name:<{w_name}}  {ev[0]}"] + [pad + x for x in ev[1:]]
    if r.fix:
        lines += [pad + x for x in textwrap.wrap("fix: " + r.fix, body_w)]
    return "\n".join(lines)
