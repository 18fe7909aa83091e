"""pdkv.integrations.sglang.launch_server: SGLang's own launcher, run as ``__main__`` with
its arguments as given, after pdkv is installed in SGLang (test_sglang_served.py starts real
servers through it; this checks what it hands SGLang, without SGLang)."""

from __future__ import annotations

import sys

from pdkv.integrations.sglang import activate, launch_server


def test_the_launcher_installs_pdkv_then_runs_sglangs_with_the_arguments_as_given(monkeypatch):
    calls = []
    monkeypatch.setattr(activate, "install", lambda: calls.append(("install",)))

    def run_module(name, **kw):
        calls.append(("run", name, tuple(sorted(kw.items())), list(sys.argv)))

    monkeypatch.setattr(launch_server.runpy, "run_module", run_module)
    monkeypatch.setattr(sys, "argv", ["/x/launch_server.py", "--model-path", "m", "--port", "30000"])
    launch_server.main()
    assert calls == [
        ("install",),
        (
            "run",
            "sglang.launch_server",
            (("alter_sys", True), ("run_name", "__main__")),
            ["sglang.launch_server", "--model-path", "m", "--port", "30000"],
        ),
    ]
