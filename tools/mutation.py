"""Mutation score of pdkv's accounting and layout modules, each against its own tests.

For every module named (default: every module of the table; a module is its path under
``pdkv/``, dotted: ``scheduling.blocks``) this copies ``pdkv/``, ``tests/``, ``docs/`` (some
tests check the docs against the code), ``tools/`` (some drive a tool) and
``pyproject.toml`` into a scratch folder, sets mutmut's ``only_mutate`` and test selection
from ``[tool.pdkv.mutation]`` in ``pyproject.toml``, runs ``mutmut run`` on every mutant
(none sampled), and prints per module: mutants, killed (time-outs count as killed), survived
(no test covering the line counts as survived), equivalent mutants excluded, and the score
``killed / (total - equivalent)``; then the survivors by name with their diffs
(``--diffs``), and as the very last line one JSON object.

Equivalent mutants (the same behaviour as the original, so no test can kill them) are
listed by name with a one-line reason in ``tools/mutation_equivalent.txt``, each pinned to
its change by a fingerprint (``name  @1a2b3c4d  # reason``: the first 8 hex digits of the
SHA-256 of its diff's changed lines). mutmut numbers mutants per function, so editing a
function renumbers them: an entry whose name now holds another change is reported as moved
and counts as a survivor, one whose mutant is killed as stale; an entry without a
fingerprint is excluded but printed with the fingerprint to pin it.

Not part of CI (it takes tens of minutes on 2 cores). Needs ``pip install mutmut``.

    python tools/mutation.py                       # all three modules
    python tools/mutation.py scheduling.blocks --diffs        # one, with the survivors' diffs
    python tools/mutation.py scheduling.loop --tests tests/test_scheduler_model.py --why
    python tools/mutation.py scheduling.scheduler --mutants survivors.txt   # only these, against the module's tests
    python tools/mutation.py --keep DIR --write-table   # every module; its rows into tests/README.md

A module named ``path:Class`` (``transfer.transports.tcp:TcpReceiver``) is that class of the module
alone: only its mutants are run and counted.

``--check-table`` says which rows still stand for the checkout (the module, its tests and
the equivalents file unchanged since the row's commit) and which must be run again.

``--write-table`` replaces the rows of the modules run in the table of scores in
``tests/README.md`` (between its ``mutation-table`` markers; the other modules' rows stay)
with this run's figures, the date and the commit (``+`` when ``pdkv/`` or ``tests/`` differ
from it). Only a full run of a module writes its row: not with ``--tests`` or ``--mutants``.

``--why`` says how each killed mutant was caught, from the first failing test's exception
(mutmut stops at the first; of the distinct failures hypothesis reports for it, the best
catch): ``assertion`` (an ``assert`` or ``pytest.raises`` of the tests,
or an invariant check of pdkv's they call, outside any teardown), ``teardown`` (a
teardown's checks: blocks home, nothing leaked), ``error`` (any other exception escaping a
test: the mutant crashed the code, or raised where the tests expected it not to) and
``timeout`` (no failure recorded: killed by mutmut's time limit). Of the assertions and
teardown checks it also counts, by type, those that failed on an exception the test did not
predict (an assertion raised ``from`` a non-assertion exception, as the model machine's
outcome comparison does), so that a mutant that raises is never counted as a wrong value or
state.
"""

from __future__ import annotations

import argparse
import fnmatch
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
TABLE = os.path.join(ROOT, "tests", "README.md")
TABLE_BEGIN = "<!-- mutation-table: begin (tools/mutation.py --write-table) -->"
TABLE_END = "<!-- mutation-table: end -->"
TABLE_HEAD = [
    "| module | tests | mutants | killed | equivalent | score | date | commit |",
    "|---|---|--:|--:|--:|--:|---|---|",
]


def equivalents() -> dict[str, tuple[str, str]]:
    """name -> (fingerprint or "", reason), from tools/mutation_equivalent.txt (``name
    @fingerprint  # reason`` a line; the fingerprint optional)."""
    out: dict[str, tuple[str, str]] = {}
    if os.path.exists(EQUIVALENT):
        with open(EQUIVALENT) as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    head, _, why = line.partition("#")
                    name, _, pin = head.strip().partition(" ")
                    out[name] = (pin.strip().lstrip("@"), why.strip())
    return out


def fingerprint(diff: str) -> str:
    """A mutant's change, as 8 hex digits: the SHA-256 of its diff's removed and added lines
    (stripped; file headers and context left out)."""
    import hashlib

    changed = [
        ln[0] + ln[1:].strip()
        for ln in diff.splitlines()
        if ln.startswith(("-", "+")) and not ln.startswith(("---", "+++"))
    ]
    return hashlib.sha256("\n".join(changed).encode()).hexdigest()[:8]


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


def _why_leaves(exc):
    if isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # hypothesis: several distinct bugs
        return [leaf for e in exc.exceptions for leaf in _why_leaves(e)]
    return [exc]


_WHY_RANK = {"assertion": 0, "teardown": 1, "error": 2}


@_why_pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    mutant = _why_os.environ.get("MUTANT_UNDER_TEST", "")
    path = _why_os.environ.get("PDKV_MUTATION_WHY")
    if not (rep.failed and path and mutant and call.excinfo is not None):
        return
    found = []
    for exc in _why_leaves(call.excinfo.value):
        frames = [
            (_why_os.path.basename(fs.filename), fs.name)
            for fs in _why_tb.extract_tb(exc.__traceback__)
            if "/tests/" in fs.filename or "/pdkv/" in fs.filename
        ]
        kind = "teardown" if rep.when == "teardown" else _why_kind(exc, frames)
        cause = exc.__cause__
        raised = type(cause).__name__ if kind != "error" and isinstance(cause, Exception) and not isinstance(
            cause, AssertionError) else ""
        found.append({"kind": kind, "type": type(exc).__name__, "raised": raised,
                      "where": ":".join(frames[-1]) if frames else ""})
    # hypothesis reports each distinct failure it found; the test caught the mutant by the
    # best of them (an assertion of a step before a teardown's check before a crash)
    best = min(found, key=lambda f: _WHY_RANK[f["kind"]])
    line = {"mutant": mutant, "test": item.nodeid, "when": rep.when, **best, "failures": len(found)}
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
    raised: dict[str, int] = {}  # checks failed on an exception the tests did not predict, by type
    raised_by_kind: dict[str, int] = {}  # the same, by how the mutant was caught (assertion, teardown)
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
            raised_by_kind[kind] = raised_by_kind.get(kind, 0) + 1
    return {
        "by_kind": kinds,
        "error_types": errors,
        "raised_types": raised,
        "raised_by_kind": raised_by_kind,
        "records": first,
    }


def sources_digest() -> str:
    """SHA-256 over pdkv/, tests/, docs/ and tools/ (paths and contents) as a run copies them."""
    import hashlib

    h = hashlib.sha256()
    for top in ("pdkv", "tests", "docs", "tools"):
        for d, dirs, files in sorted(os.walk(os.path.join(ROOT, top))):
            dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", ".hypothesis"))
            for name in sorted(files):
                if name.endswith(".pyc") or (top == "tests" and name == "README.md"):
                    continue  # the table's own file changes with every written row
                path = os.path.join(d, name)
                h.update(os.path.relpath(path, ROOT).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def sweep_stale_segments() -> int:
    """Remove the pdkv segments whose creator is provably dead (``pdkv-shm clean``'s rule).
    mutmut runs each mutant's tests in a forked child that ends with ``os._exit``: a buffer a
    failing test still referenced is never released by the ``atexit`` hook that a normal
    pytest process runs, so a mutation run leaves some behind."""
    from pdkv.buffer.sweeper import clean

    return sum(1 for name in clean(dry_run=False).removed if "@" not in name)


def commit_label() -> str:
    """The checkout's short commit, ``+`` when pdkv/ or tests/ differ from it (the table's own
    file, which this tool writes, aside)."""
    git = ["git", "-C", ROOT]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    where = ["--", "pdkv", "tests", ":!tests/README.md"]
    dirty = subprocess.run([*git, "status", "--porcelain", *where], capture_output=True, text=True).stdout
    return (head or "unknown") + ("+" if dirty.strip() else "")


def table_row(r: dict, tests: list[str], date: str, commit: str) -> str:
    files = ", ".join(f"`{os.path.basename(t)}`" for t in tests)
    return (
        f"| `{r['module']}` | {files} | {r['mutants']} | {r['killed']} | {r['equivalent']} | "
        f"{r['score']:.1%} | {date} | {commit} |"
    )


def write_table(rows: dict[str, str], order: list[str], path: str = TABLE) -> None:
    """Replace the named modules' rows of the table between the markers in ``path``; rows of
    modules not named stay; rows come in ``order`` (the pyproject table's), others after."""
    with open(path) as f:
        text = f.read()
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise SystemExit(f"{path}: no mutation table markers ({TABLE_BEGIN} ... {TABLE_END})")
    head, rest = text.split(TABLE_BEGIN, 1)
    body, tail = rest.split(TABLE_END, 1)
    have: dict[str, str] = {}
    for line in body.splitlines():
        m = re.match(r"\| `([^`]+)` \|", line)
        if m:
            have[m.group(1)] = line
    have.update(rows)
    keys = [k for k in order if k in have] + sorted(k for k in have if k not in order)
    table = "\n".join([*TABLE_HEAD, *(have[k] for k in keys)])
    with open(path, "w") as f:
        f.write(f"{head}{TABLE_BEGIN}\n{table}\n{TABLE_END}{tail}")


def run_module(
    module: str,
    tests: list[str],
    children: int,
    diffs: bool,
    keep: str | None = None,
    why: bool = False,
    only: list[str] | None = None,
) -> dict:
    resume = keep is not None and os.path.isdir(os.path.join(keep, module, "mutants"))
    work = os.path.join(keep, module) if keep else tempfile.mkdtemp(prefix=f"pdkv-mutation-{module}-")
    digest = sources_digest()
    stamp = os.path.join(work, "sources.sha256")
    if resume:
        try:
            with open(stamp) as f:
                same = f.read().strip() == digest
        except OSError:
            same = False
        if not same:  # its results were of other code or other tests: they do not carry over
            print(f"{module}: the copied sources changed since the kept run in {work}: starting over", flush=True)
            shutil.rmtree(work)
            resume = False
    try:
        if not resume:  # a kept folder with results goes on where it stopped (mutmut is incremental)
            os.makedirs(work, exist_ok=True)
            with open(stamp, "w") as f:
                f.write(digest)
            shutil.copytree(
                os.path.join(ROOT, "pdkv"), os.path.join(work, "pdkv"), ignore=shutil.ignore_patterns("__pycache__")
            )
            shutil.copytree(os.path.join(ROOT, "docs"), os.path.join(work, "docs"))
            # tests that drive a tool (test_ports.py imports tools/flood_ports.py)
            shutil.copytree(
                os.path.join(ROOT, "tools"), os.path.join(work, "tools"), ignore=shutil.ignore_patterns("__pycache__")
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
        text = re.sub(r"(?m)^only_mutate = .*$", f'only_mutate = ["{source_of(module)}"]', text)
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
            [*mm, "run", "--max-children", str(children), *(only or [])],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        swept = sweep_stale_segments()
        if swept:
            print(f"{module}: removed {swept} shared-memory segment(s) left by mutant runs", file=sys.stderr)
        if run.returncode != 0:
            raise SystemExit(f"mutmut run failed for {module}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
        res = subprocess.run([*mm, "results", "--all", "true"], cwd=work, env=env, capture_output=True, text=True)
        status: dict[str, str] = {}
        for line in res.stdout.splitlines():
            name, sep, st = line.strip().rpartition(": ")
            if sep and (not only or any(fnmatch.fnmatchcase(name, pat) for pat in only)):
                status[name] = st
        eq = equivalents()
        dead = ("killed", "timeout")

        def show(n: str) -> str:
            return subprocess.run([*mm, "show", n], cwd=work, env=env, capture_output=True, text=True).stdout

        # an entry naming a mutant that was killed is stale (mutmut numbers mutants per function,
        # so editing a function renumbers them): reported, never excluded; one whose name now
        # holds another change than the one pinned has moved: reported, counted as a survivor
        stale = sorted(n for n, s in status.items() if n in eq and s in dead)
        listed = {n: fingerprint(show(n)) for n, s in status.items() if n in eq and s not in dead}
        moved = sorted(n for n, fp in listed.items() if eq[n][0] and eq[n][0] != fp)
        unpinned = {n: fp for n, fp in listed.items() if not eq[n][0]}
        excluded = sorted(n for n in listed if n not in moved)
        survivors = sorted(n for n, s in status.items() if s not in dead and (n not in eq or n in moved))
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
            "moved_equivalents": moved,
            "unpinned_equivalents": unpinned,
            "by_status": {},
        }
        for s in status.values():
            out["by_status"][s] = out["by_status"].get(s, 0) + 1
        if why:
            out["why"] = why_of(why_path, status)
        if diffs:
            out["diffs"] = {}
            for n in survivors:
                d = show(n)
                out["diffs"][n] = d + f"(fingerprint @{fingerprint(d)})"
        return out
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


def _lines_of(text: str, prefix: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(prefix)]


def source_of(module: str) -> str:
    """A table key's source file: ``transfer.transports.tcp:TcpReceiver`` -> ``pdkv/transfer/transports/tcp.py``."""
    return "pdkv/" + module.partition(":")[0].replace(".", "/") + ".py"


def check_table(table: dict[str, list[str]], only: list[str] | None = None, path: str = TABLE) -> int:
    """Each module's row against this checkout: it stands while the module's source, its
    tests and its own entries in the equivalents file are byte-identical to the row's commit
    and that commit was clean; else it must be run again. Prints one line a module; 1 if any
    does not stand."""
    with open(path) as f:
        text = f.read()
    rows = {}
    for line in text.split(TABLE_BEGIN, 1)[-1].split(TABLE_END, 1)[0].splitlines():
        m = re.match(r"\| `([^`]+)` \|.*\| ([0-9a-f]+)(\+?) \|$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    bad = 0
    for module in only or list(table):
        files = [source_of(module), *table[module]]
        row = rows.get(module)
        if row is None:
            why = "no row"
        elif row[1]:
            why = f"row from {row[0]}+ (a checkout with uncommitted changes)"
        else:
            diff = subprocess.run(
                ["git", "-C", ROOT, "diff", "--name-only", row[0], "--", *files], capture_output=True, text=True
            )
            changed = diff.stdout.split()
            eq_path = os.path.relpath(EQUIVALENT, ROOT)
            then = subprocess.run(["git", "-C", ROOT, "show", f"{row[0]}:{eq_path}"], capture_output=True, text=True)
            with open(EQUIVALENT) as f:
                now_eq = f.read()
            prefix = "pdkv." + module.partition(":")[0] + "."
            if _lines_of(then.stdout, prefix) != _lines_of(now_eq, prefix):
                changed.append(f"{eq_path} (this module's entries)")
            if diff.returncode:
                why = f"cannot compare with {row[0]}: {diff.stderr.strip()}"
            else:
                why = f"changed since {row[0]}: {', '.join(changed)}" if changed else ""
            dirty = subprocess.run(
                ["git", "-C", ROOT, "status", "--porcelain", "--", *files], capture_output=True, text=True
            ).stdout
            if dirty.strip():
                why = (
                    (why + "; " if why else "")
                    + "uncommitted changes: "
                    + ", ".join(ln[3:] for ln in dirty.splitlines())
                )
        print(f"{module:32} {'stands' if not why else 'run again: ' + why}")
        bad += bool(why)
    return 1 if bad else 0


def main() -> int:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        table = tomllib.load(f)["tool"]["pdkv"]["mutation"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modules", nargs="*", default=list(table), help=f"of {', '.join(table)}")
    ap.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--diffs", action="store_true", help="print each survivor's diff")
    ap.add_argument(
        "--keep",
        metavar="DIR",
        help="work in DIR/<module> and keep it; a second run resumes there while pdkv/, tests/ and docs/ are unchanged",
    )
    ap.add_argument(
        "--tests", help="comma-separated test files instead of the module's own (to see what one file alone kills)"
    )
    ap.add_argument("--why", action="store_true", help="count the killed mutants by how they were caught")
    ap.add_argument(
        "--write-table", action="store_true", help="write the modules' rows into tests/README.md's table of scores"
    )
    ap.add_argument(
        "--check-table",
        action="store_true",
        help="say which rows of the table still stand for this checkout (no run): exit 1 if any does not",
    )
    ap.add_argument(
        "--mutants",
        metavar="FILE",
        help="run only the mutants named in FILE (one name or glob a line; e.g. the survivors of another run)",
    )
    a = ap.parse_args()
    if a.check_table:
        return check_table(table, a.modules if a.modules != list(table) else None)
    if a.write_table and (a.tests or a.mutants):
        ap.error("--write-table records full runs only: not with --tests or --mutants")
    only = None
    if a.mutants:
        with open(a.mutants) as f:
            only = [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
    results = []
    for m in a.modules:
        if m not in table:
            ap.error(f"unknown module {m!r}: choose from {', '.join(table)}")
        tests = a.tests.split(",") if a.tests else table[m]
        mine = [n for n in only if n.startswith(f"pdkv.{m.partition(':')[0]}.")] if only is not None else None
        path, _, scope = m.partition(":")
        if scope:  # one class of the module: its mutants only (the others are never run)
            pat = f"pdkv.{path}.x\u01c1{scope}\u01c1*"
            mine = [pat] if mine is None else [n for n in mine if fnmatch.fnmatchcase(n, pat)]
        if mine == []:
            continue
        results.append(run_module(m, tests, a.max_children, a.diffs, a.keep, a.why, mine))
    if a.write_table:
        import datetime

        date, commit = datetime.date.today().isoformat(), commit_label()
        write_table({r["module"]: table_row(r, table[r["module"]], date, commit) for r in results}, list(table))
    print(f"{'module':28} {'mutants':>8} {'killed':>7} {'survived':>9} {'equivalent':>11} {'score':>7}")
    for r in results:
        print(
            f"{r['module']:28} {r['mutants']:8d} {r['killed']:7d} {r['survived']:9d} {r['equivalent']:11d} "
            f"{r['score']:7.1%}"
        )
    if a.why:
        print(
            "\nhow the killed were caught (in brackets: of those, the checks that failed on an exception the "
            "tests did not predict)"
        )
        print(f"{'module':28} {'assertion':>16} {'teardown':>16} {'error':>6} {'timeout':>8}")
        for r in results:
            k, rk = r["why"]["by_kind"], r["why"]["raised_by_kind"]
            cells = [f"{k.get(c, 0)} ({rk.get(c, 0)})" for c in ("assertion", "teardown")]
            print(f"{r['module']:28} {cells[0]:>16} {cells[1]:>16} {k.get('error', 0):6d} {k.get('timeout', 0):8d}")
        for r in results:
            print(
                f"  {r['module']}: checks failed on an exception, by type: {r['why']['raised_types']}; "
                f"errors escaping, by type: {r['why']['error_types']}"
            )
    for r in results:
        if r["stale_equivalents"]:
            print(
                f"\nlisted as equivalent but killed (stale entries in {os.path.basename(EQUIVALENT)}): "
                + ", ".join(r["stale_equivalents"])
            )
        if r["moved_equivalents"]:
            print(
                f"\nlisted as equivalent, but the name now holds another change (moved entries in "
                f"{os.path.basename(EQUIVALENT)}; counted as survivors): " + ", ".join(r["moved_equivalents"])
            )
        if r["unpinned_equivalents"]:
            print("\nlisted as equivalent without a fingerprint (pin them: name  @fingerprint  # reason):")
            for n, fp in sorted(r["unpinned_equivalents"].items()):
                print(f"  {n}  @{fp}")
        if r["survivors"]:
            print(f"\nsurvivors in {source_of(r['module'])} ({r['by_status']}):")
            for n in r["survivors"]:
                print(f"  {n}")
                if a.diffs:
                    print("    " + r["diffs"][n].replace("\n", "\n    "))
    print(
        json.dumps(
            {
                r["module"]: {k: r[k] for k in ("mutants", "killed", "survived", "equivalent", "score")}
                | (
                    {"caught_by": r["why"]["by_kind"], "checks_failed_on_a_raise": r["why"]["raised_by_kind"]}
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
