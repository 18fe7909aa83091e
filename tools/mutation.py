"""Mutation score of pdkv's accounting and layout modules, each against its own tests.

For every module named (default: blocks, scheduler, layout) this copies ``pdkv/``,
``tests/`` and ``pyproject.toml`` into a scratch folder, sets mutmut's ``only_mutate`` and
test selection from ``[tool.pdkv.mutation]`` in ``pyproject.toml``, runs ``mutmut run``
on every mutant (none sampled), and prints per module: mutants, killed (time-outs count as
killed), survived (no test covering the line counts as survived), equivalent mutants
excluded, and the score ``killed / (total - equivalent)``; then the survivors by name
with their diffs (``--diffs``), and as the very last line one JSON object.

Equivalent mutants (the same behaviour as the original, so no test can kill them) are
listed by name with a one-line reason in ``tools/mutation_equivalent.txt``.

Not part of CI (it takes tens of minutes on 2 cores). Needs ``pip install mutmut``.

    python tools/mutation.py                       # all three modules
    python tools/mutation.py blocks --diffs        # one, with the survivors' diffs
    python tools/mutation.py schedloop --tests tests/test_scheduler_model.py --why

``--why`` says how each killed mutant was caught, from the first failing test's exception
(mutmut stops at the first): ``assertion`` (an ``assert`` or ``pytest.raises`` of the tests,
or an invariant check of pdkv's they call, outside any teardown), ``teardown`` (a
teardown's checks: blocks home, nothing leaked), ``error`` (any other exception escaping a
test: the mutant crashed the code, or raised where the tests expected it not to) and
``timeout`` (no failure recorded: killed by mutmut's time limit). Of the assertions it also
counts, by type, those that failed on an exception the test did not predict (an assertion
raised ``from`` a non-assertion exception, as the model machine's outcome comparison does),
so that a mutant that raises is never counted as a wrong value or state.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EQUIVALENT = os.path.join(ROOT, "tools", "mutation_equivalent.txt")


def equivalents() -> dict[str, str]:
    """name -> reason, from tools/mutation_equivalent.txt (``name  # reason`` a line)."""
    out: dict[str, str] = {}
    if os.path.exists(EQUIVALENT):
        with open(EQUIVALENT) as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    name, _, why = line.partition("#")
                    out[name.strip()] = why.strip()
    return out


# appended to the scratch copy's tests/conftest.py by --why: one JSON line per failed test
WHY_HOOK = """

# ---- tools/mutation.py --why: how each mutant's first failure came about
import json as _why_json
import os as _why_os
import traceback as _why_tb

import pytest as _why_pytest


def _why_kind(exc, frames):
    in_teardown = any(f == "teardown" for _, f in frames)
    if isinstance(exc, (AssertionError, _why_pytest.fail.Exception)):
        return "teardown" if in_teardown else "assertion"
    return "error"


@_why_pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    mutant = _why_os.environ.get("MUTANT_UNDER_TEST", "")
    path = _why_os.environ.get("PDKV_MUTATION_WHY")
    if not (rep.failed and path and mutant and call.excinfo is not None):
        return
    exc = call.excinfo.value
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # hypothesis: several bugs
        exc = exc.exceptions[0]
    frames = [
        (_why_os.path.basename(fs.filename), fs.name)
        for fs in _why_tb.extract_tb(exc.__traceback__)
        if "/tests/" in fs.filename or "/pdkv/" in fs.filename
    ]
    kind = "teardown" if rep.when == "teardown" else _why_kind(exc, frames)
    cause = exc.__cause__
    raised = type(cause).__name__ if kind != "error" and isinstance(cause, Exception) and not isinstance(
        cause, AssertionError) else ""
    line = {"mutant": mutant, "test": item.nodeid, "when": rep.when, "kind": kind, "type": type(exc).__name__,
            "raised": raised, "where": ":".join(frames[-1]) if frames else ""}
    fd = _why_os.open(path, _why_os.O_WRONLY | _why_os.O_APPEND | _why_os.O_CREAT, 0o600)
    try:
        _why_os.write(fd, (_why_json.dumps(line) + "\\n").encode())
    finally:
        _why_os.close(fd)
"""


def why_of(path: str, status: dict[str, str]) -> dict[str, Any]:
    """Each killed mutant's first recorded failure, counted by kind."""
    first: dict[str, dict] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                first.setdefault(rec["mutant"], rec)
    kinds: dict[str, int] = {}
    errors: dict[str, int] = {}
    raised: dict[str, int] = {}  # assertions failed on an exception the tests did not predict, by type
    for name, st in status.items():
        if st not in ("killed", "timeout"):
            continue
        rec = first.get(name)
        kind = rec["kind"] if rec else "timeout"
        kinds[kind] = kinds.get(kind, 0) + 1
        if rec and kind == "error":
            errors[rec["type"]] = errors.get(rec["type"], 0) + 1
        if rec and rec.get("raised"):
            raised[rec["raised"]] = raised.get(rec["raised"], 0) + 1
    return {"by_kind": kinds, "error_types": errors, "raised_types": raised, "records": first}


def run_module(
    module: str, tests: list[str], children: int, diffs: bool, keep: str | None = None, why: bool = False
) -> dict:
    resume = keep is not None and os.path.isdir(os.path.join(keep, module, "mutants"))
    work = os.path.join(keep, module) if keep else tempfile.mkdtemp(prefix=f"pdkv-mutation-{module}-")
    try:
        if not resume:  # a kept folder with results goes on where it stopped (mutmut is incremental)
            os.makedirs(work, exist_ok=True)
            shutil.copytree(
                os.path.join(ROOT, "pdkv"), os.path.join(work, "pdkv"), ignore=shutil.ignore_patterns("__pycache__")
            )
            shutil.copytree(
                os.path.join(ROOT, "tests"),
                os.path.join(work, "tests"),
                ignore=shutil.ignore_patterns("__pycache__", ".hypothesis"),
            )
        with open(os.path.join(ROOT, "pyproject.toml")) as f:
            text = f.read()
        if resume:
            with open(os.path.join(work, "pyproject.toml")) as f:
                text = f.read()
        sel = ", ".join(json.dumps(t) for t in tests)
        # this run's module and tests, in mutmut's own table
        text = re.sub(r"(?m)^only_mutate = .*$", f'only_mutate = ["pdkv/{module}.py"]', text)
        text = re.sub(
            r"(?m)^pytest_add_cli_args_test_selection = .*$", f"pytest_add_cli_args_test_selection = [{sel}]", text
        )
        with open(os.path.join(work, "pyproject.toml"), "w") as f:
            f.write(text)
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        why_path = os.path.join(work, "why.jsonl")
        if why:
            if os.path.exists(why_path):
                os.unlink(why_path)
            conftest = os.path.join(work, "tests", "conftest.py")
            with open(conftest) as f:
                has_hook = "tools/mutation.py --why" in f.read()
            if not has_hook:
                with open(conftest, "a") as f:
                    f.write(WHY_HOOK)
            env["PDKV_MUTATION_WHY"] = why_path
        mm = [sys.executable, "-m", "mutmut"]
        run = subprocess.run(
            [*mm, "run", "--max-children", str(children)], cwd=work, env=env, capture_output=True, text=True
        )
        if run.returncode != 0:
            raise SystemExit(f"mutmut run failed for {module}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        res = subprocess.run([*mm, "results", "--all", "true"], cwd=work, env=env, capture_output=True, text=True)
        status: dict[str, str] = {}
        for line in res.stdout.splitlines():
            name, sep, st = line.strip().rpartition(": ")
            if sep:
                status[name] = st
        eq = equivalents()
        dead = ("killed", "timeout")
        # an entry naming a mutant that was killed is stale (mutmut numbers mutants per function,
        # so editing a function renumbers them): reported, never excluded
        stale = sorted(n for n, s in status.items() if n in eq and s in dead)
        excluded = sorted(n for n, s in status.items() if n in eq and s not in dead)
        survivors = sorted(n for n, s in status.items() if s not in dead and n not in eq)
        killed = sum(1 for s in status.values() if s in dead)
        total = len(status) - len(excluded)
        out = {
            "module": module,
            "mutants": len(status),
            "killed": killed,
            "survived": len(survivors),
            "equivalent": len(excluded),
            "score": killed / total if total else 1.0,
            "survivors": survivors,
            "stale_equivalents": stale,
            "by_status": {},
        }
        for s in status.values():
            out["by_status"][s] = out["by_status"].get(s, 0) + 1
        if why:
            out["why"] = why_of(why_path, status)
        if diffs:
            out["diffs"] = {}
            for n in survivors:
                d = subprocess.run([*mm, "show", n], cwd=work, env=env, capture_output=True, text=True)
                out["diffs"][n] = d.stdout
        return out
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        table = tomllib.load(f)["tool"]["pdkv"]["mutation"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modules", nargs="*", default=list(table), help=f"of {', '.join(table)}")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--diffs", action="store_true", help="print each survivor's diff")
    ap.add_argument("--keep", metavar="DIR", help="work in DIR/<module> and keep it; a second run resumes there")
    ap.add_argument(
        "--tests", help="comma-separated test files instead of the module's own (to see what one file alone kills)"
    )
    ap.add_argument("--why", action="store_true", help="count the killed mutants by how they were caught")
    a = ap.parse_args()
    results = []
    for m in a.modules:
        if m not in table:
            ap.error(f"unknown module {m!r}: choose from {', '.join(table)}")
        tests = a.tests.split(",") if a.tests else table[m]
        results.append(run_module(m, tests, a.max_children, a.diffs, a.keep, a.why))
    print(f"{'module':12} {'mutants':>8} {'killed':>7} {'survived':>9} {'equivalent':>11} {'score':>7}")
    for r in results:
        print(
            f"{r['module']:12} {r['mutants']:8d} {r['killed']:7d} {r['survived']:9d} {r['equivalent']:11d} "
            f"{r['score']:7.1%}"
        )
    if a.why:
        head = f"{'module':12} {'assertion':>9} {'(raised)':>9} {'teardown':>9} {'error':>6} {'timeout':>8}"
        print(f"\nhow the killed were caught: {head}")
        for r in results:
            k, w = r["why"]["by_kind"], r["why"]
            n_raised = sum(w["raised_types"].values())
            print(
                f"{'':27}{r['module']:12} {k.get('assertion', 0):9d} {n_raised:9d} {k.get('teardown', 0):9d} "
                f"{k.get('error', 0):6d} {k.get('timeout', 0):8d}"
            )
        print("(raised): assertions of the tests that failed on an exception they did not predict, by type:")
        for r in results:
            print(f"  {r['module']}: {r['why']['raised_types']}; errors escaping, by type: {r['why']['error_types']}")
    for r in results:
        if r["stale_equivalents"]:
            print(
                f"\nlisted as equivalent but killed (stale entries in {os.path.basename(EQUIVALENT)}): "
                + ", ".join(r["stale_equivalents"])
            )
        if r["survivors"]:
            print(f"\nsurvivors in pdkv/{r['module']}.py ({r['by_status']}):")
            for n in r["survivors"]:
                print(f"  {n}")
                if a.diffs:
                    print("    " + r["diffs"][n].replace("\n", "\n    "))
    print(
        json.dumps(
            {
                r["module"]: {k: r[k] for k in ("mutants", "killed", "survived", "equivalent", "score")}
                | (
                    {"caught_by": r["why"]["by_kind"], "assertions_on_a_raise": sum(r["why"]["raised_types"].values())}
                    if a.why
                    else {}
                )
                for r in results
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
