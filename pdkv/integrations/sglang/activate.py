"""Adds pdkv to SGLang's transfer backends without editing SGLang's files.

SGLang chooses a backend by ``--disaggregation-transfer-backend``, checked against its
``TransferBackend`` enum, and looks the classes up with ``get_kv_class`` (both in
``sglang.srt.disaggregation.utils``). :func:`install` adds a ``PDKV`` member (value
``"pdkv"``) to the enum and wraps ``get_kv_class`` so that it answers pdkv's classes for it
and defers to SGLang for every other backend; the command-line choice list gains ``pdkv``.

**Every process.** SGLang starts its schedulers (and its data-parallel controller and
detokenizer) with the ``spawn`` start method: a fresh interpreter that never saw an
activation done in the launcher. So pdkv is an SGLang *general plugin*: its distribution
declares the entry point ``pdkv = "pdkv.integrations.sglang.activate:plugin"`` in the group
``sglang.srt.plugins``, and SGLang's ``load_plugins()`` calls :func:`plugin` early in every
process it starts (the launcher before parsing arguments, each scheduler, the engine API),
whatever the start method. Installing pdkv is the whole activation; ``SGLANG_PLUGINS``, when
set, must name ``pdkv``.

The plugin never fails SGLang's start: with an SGLang outside :data:`TESTED` the backend is
still listed, and choosing it fails in one line naming the tested version.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from ...errors import PdkvError

__all__ = ["TESTED", "install", "plugin"]

TESTED = ("0.5.23",)
_log = logging.getLogger(__name__)


def _check_version() -> str:
    try:
        from sglang.version import __version__ as v
    except ImportError as exc:
        raise PdkvError(f"pdkv's SGLang backend needs SGLang {' or '.join(TESTED)}: {exc}") from None
    if v not in TESTED:
        raise PdkvError(f"pdkv's SGLang backend is tested with SGLang {', '.join(TESTED)}; this is {v}")
    return str(v)


def install() -> None:
    """Make ``--disaggregation-transfer-backend pdkv`` work in this process (idempotent).
    Raises PdkvError for an SGLang outside :data:`TESTED`."""
    _check_version()
    _register("")


def plugin() -> None:
    """SGLang's general-plugin entry point (``sglang.srt.plugins``): :func:`install`, except
    that an untested SGLang only logs; choosing ``pdkv`` there fails naming the version."""
    try:
        _check_version()
        refused = ""
    except PdkvError as exc:
        refused = str(exc)
    try:
        _register(refused)
    except Exception as exc:  # an SGLang whose internals moved: say so, start without pdkv
        _log.warning("pdkv could not add itself to SGLang's transfer backends: %s (%s)", exc, refused or "")


def _register(refused: str) -> None:
    from sglang.srt.disaggregation import utils

    enum_cls = utils.TransferBackend
    if "PDKV" not in enum_cls.__members__:
        member = object.__new__(enum_cls)
        member._name_, member._value_ = "PDKV", "pdkv"
        enum_cls._member_map_["PDKV"] = member
        enum_cls._value2member_map_["pdkv"] = member
        enum_cls._member_names_.append("PDKV")
    pdkv_member = enum_cls["PDKV"]
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices

    if "pdkv" not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices(["pdkv"])
    original = utils.get_kv_class
    if getattr(original, "_pdkv", False):
        return

    def get_kv_class(backend: Any, class_type: Any) -> Any:
        if backend == pdkv_member or getattr(backend, "value", backend) == "pdkv":
            if refused:
                raise PdkvError(refused)
            from . import conn

            kinds = utils.KVClassType
            table = {
                kinds.MANAGER: conn.PdkvKVManager,
                kinds.SENDER: conn.PdkvKVSender,
                kinds.RECEIVER: conn.PdkvKVReceiver,
                kinds.BOOTSTRAP_SERVER: conn.PdkvKVBootstrapServer,
            }
            if class_type == kinds.KVARGS:
                from sglang.srt.disaggregation.base.conn import KVArgs

                return KVArgs
            if class_type not in table:
                raise ValueError(f"pdkv's SGLang backend has no {class_type}")
            return table[class_type]
        return original(backend, class_type)

    setattr(get_kv_class, "_pdkv", True)  # noqa: B010
    # utils, and every module that imported get_kv_class by name (its own global)
    for name, mod in list(sys.modules.items()):
        if name.startswith("sglang.") and getattr(mod, "get_kv_class", None) is original:
            setattr(mod, "get_kv_class", get_kv_class)  # noqa: B010
