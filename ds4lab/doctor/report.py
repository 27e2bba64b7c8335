"""The doctor's rows and report: :class:`CheckResult` (one check's verdict) and :class:`Report`
(text, HTML, JSON renderings)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

__all__ = ["STATUSES", "CheckResult", "Report"]

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
        import textwrap
        mark = {"pass": "PASS", "warn": "WARN", "fail": "FAIL"}
        w_name = max(len(r.name) for r in self.results)
        body_w = max(40, width - w_name - 8)
        lines = [f"ds4lab doctor: profile {self.profile}, python {self.python}", ""]
        for r in self.results:
            ev = textwrap.wrap(r.evidence, body_w) or [""]
            lines.append(f"{mark[r.status]}  {r.name:<{w_name}}  {ev[0]}")
            pad = " " * (w_name + 8)
            lines += [pad + x for x in ev[1:]]
            if r.fix:
                fx = textwrap.wrap("fix: " + r.fix, body_w)
                lines += [pad + x for x in fx]
        c = self.counts()
        lines += ["", f"{c['pass']} pass, {c['warn']} warn, {c['fail']} fail" + ("" if self.ok else "  -> NOT READY")]
        return "\n".join(lines)

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

