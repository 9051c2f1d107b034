"""The closing table of a ``verify.op`` run over several ops (``--all``, or several names): one
row an op, so a whole library's state reads at a glance; each op's own report comes before it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Summary:
    ops: list[str]  # the ops to check, in order
    not_in_impl: list[str]  # ops ``--all --impl MODULE`` has no function for: not checked
    impl: str | None  # --impl as given; None: the registered kernels
    backend: str
    profile: str
    reports: list[dict] = field(default_factory=list)  # each op's JSON report, as checked
    stopped_by: str | None = None  # why the run ended before the last op (a hang, a lost GPU)

    @property
    def failed(self) -> list[str]:
        return [r["op"] for r in self.reports if not r["passed"]]

    @property
    def not_run(self) -> list[str]:
        return self.ops[len(self.reports) :]

    @property
    def passed(self) -> bool:
        return not self.failed and not self.not_run

    def text(self) -> str:
        who = self.impl or "registered kernels"
        lines = [f"summary: {len(self.ops)} ops, {who}, backend {self.backend}, profile {self.profile}"]
        header = ("op", "verdict", "named", "cases", "closest to failing", "seconds")
        rows = [header, *map(_row, self.reports), *((op, "not run", *"----") for op in self.not_run)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
            cells += [cell.rjust(width) for cell, width in zip(row[2:], widths[2:], strict=True)]
            lines.append("  ".join(cells).rstrip())
        if self.not_in_impl:
            missing = ", ".join(self.not_in_impl)
            lines.append(f"not checked ({self.impl} has no function of their name): {missing}")
        if self.stopped_by:
            lines.append(f"the run stopped when {self.stopped_by}")
        lines.append(self.verdict())
        return "\n".join(lines)

    def verdict(self) -> str:
        checked = f"{len(self.ops)} op{'s' if len(self.ops) != 1 else ''}"
        if self.failed or self.not_run:
            parts = [f"{len(self.failed)} of {checked} ({', '.join(self.failed)})"] if self.failed else []
            parts += [f"{len(self.not_run)} of {checked} not run"] if self.not_run else []
            return f"DIVERGES: {'; '.join(parts)}"
        unchecked = f"; {len(self.not_in_impl)} not in {self.impl}, not checked" if self.not_in_impl else ""
        return f"VERIFIED: all {checked}{unchecked}"

    def as_json(self) -> dict:
        return {
            "impl": self.impl,
            "backend": self.backend,
            "profile": self.profile,
            "passed": self.passed,
            "ops": self.reports,
            "not_run": self.not_run,
            "not_in_impl": self.not_in_impl,
            "stopped_by": self.stopped_by,
        }


def _row(report: dict) -> tuple[str, ...]:
    if report.get("hung"):
        return (report["op"], "HANGS", *"----")
    verdict = "VERIFIED" if report["passed"] else "DIVERGES"
    used = report["worst_tolerance_used"]
    closest = "-" if not report["passed"] else "exact" if used is None else f"{used:.0%} of tolerance"
    counts = (str(report["examples"]), str(report["cases"]))
    return (report["op"], verdict, *counts, closest, f"{report['seconds']:.1f}")
