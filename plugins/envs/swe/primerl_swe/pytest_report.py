"""A pytest plugin that writes the swe harness's structured report (``-p primerl_swe.pytest_report``).

The harness never parses pytest's text: this plugin, loaded into the test run inside the
sandbox, writes one JSON object to ``--primerl-report PATH`` at the end of the session:

* ``outcomes``: ``{node id: PASSED | FAILED | ERROR | SKIPPED | XFAIL | XPASS}`` from pytest's
  own reports (``pytest_runtest_logreport``), so any node id pytest produces works (spaces,
  brackets, unicode). A failing setup or teardown makes the test ERROR.
* ``collected``: the node ids collected; ``collect_errors``: ``[{"nodeid", "message"}]`` of
  the files that failed to collect, ``message`` the exception line pytest shows (``E ...``).
* ``from_checkout``: the top-level modules imported from the checkout (``--primerl-checkout``);
  ``shadowed``: ``{module: file}`` for modules imported from *outside* the checkout although
  the checkout holds a module of that name (at its root, in ``src/``, or on a ``sys.path``
  entry inside it) or ``--primerl-modules`` names them (the modules a setup check found
  coming from the checkout). An installed copy shadowing the checkout is how a task would
  score without its fix; the harness makes it an error, never a reward.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("primerl", "primerl swe harness report")
    group.addoption("--primerl-report", dest="primerl_report", default=None, help="Write the JSON report here.")
    group.addoption("--primerl-checkout", dest="primerl_checkout", default=None,
                    help="The checkout the tests must import the code under test from.")
    group.addoption("--primerl-modules", dest="primerl_modules", default="",
                    help="Comma-separated top-level modules that must be imported from the checkout.")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("primerl_report")
    if path:
        checkout = config.getoption("primerl_checkout") or os.getcwd()
        wanted = [m for m in config.getoption("primerl_modules").split(",") if m]
        config.pluginmanager.register(Reporter(Path(path), Path(checkout), wanted), "primerl-swe-report")


def _inside(path: str | None, root: str) -> bool:
    if not path:
        return False
    p = os.path.realpath(path)
    return p == root or p.startswith(root + os.sep)


class Reporter:
    def __init__(self, path: Path, checkout: Path, wanted: list[str]) -> None:
        self.path = path
        self.root = os.path.realpath(checkout)
        self.wanted = wanted
        self.outcomes: dict[str, str] = {}
        self.collected: list[str] = []
        self.collect_errors: list[dict[str, str]] = []

    # -- outcomes ------------------------------------------------------------------------------

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid, when = report.nodeid, report.when
        xfail = hasattr(report, "wasxfail")
        if when == "call":
            if report.passed:
                outcome = "XPASS" if xfail else "PASSED"
            elif report.skipped:
                outcome = "XFAIL" if xfail else "SKIPPED"
            else:
                outcome = "FAILED"
            if self.outcomes.get(nodeid) != "ERROR":
                self.outcomes[nodeid] = outcome
        elif report.failed:  # setup or teardown
            self.outcomes[nodeid] = "ERROR"
        elif when == "setup" and report.skipped:
            self.outcomes[nodeid] = "XFAIL" if xfail else "SKIPPED"

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors.append({"nodeid": report.nodeid, "message": _error_line(report)})

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected = [item.nodeid for item in session.items]

    # -- where the code under test came from ----------------------------------------------------

    def _roots(self) -> list[str]:
        roots = [self.root, os.path.join(self.root, "src")]
        roots += [os.path.realpath(p) for p in sys.path if p and _inside(p, self.root)]
        return list(dict.fromkeys(roots))

    def _in_checkout(self, name: str, roots: list[str]) -> bool:
        return any(os.path.isfile(os.path.join(r, name, "__init__.py")) or os.path.isfile(os.path.join(r, name + ".py"))
                   for r in roots)

    def imports(self) -> tuple[list[str], dict[str, str]]:
        roots = self._roots()
        from_checkout, shadowed = [], {}
        for name, module in sorted(sys.modules.items()):
            if "." in name or module is None:
                continue
            places = [getattr(module, "__file__", None), *list(getattr(module, "__path__", None) or [])]
            places = [p for p in places if p]
            if not places:
                continue  # built in or frozen
            if any(_inside(p, self.root) for p in places):
                from_checkout.append(name)
            elif name in self.wanted or self._in_checkout(name, roots):
                shadowed[name] = places[0]
        return from_checkout, shadowed

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        from_checkout, shadowed = self.imports()
        data: dict[str, Any] = {"outcomes": self.outcomes, "collected": self.collected,
                                "collect_errors": self.collect_errors, "from_checkout": from_checkout,
                                "shadowed": shadowed}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)


def _error_line(report: pytest.CollectReport) -> str:
    """The exception pytest shows for a failed collection, in one line (its last ``E`` lines)."""
    text = str(report.longrepr or "")
    lines = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    lines = [ln for ln in lines if ln]
    if lines:
        return " ".join(lines[-3:])[:500]
    kept = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (kept[-1] if kept else "collection failed")[:500]
