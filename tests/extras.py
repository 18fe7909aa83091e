"""Optional extras in tests: the README's test command installs ``[test]`` only, so a test
of an optional feature skips, naming the extra, and never fails for want of it."""

from __future__ import annotations

import pytest


def need(module: str, extra: str):
    """Import ``module`` or skip, naming the pdkv extra that installs it."""
    return pytest.importorskip(module, reason=f"needs {module}: pip install 'pdkv[{extra}]'")
