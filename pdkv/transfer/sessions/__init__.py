"""The two sessions over the transports: prefill's (``prefill``: :class:`PrefillSender`)
and decode's (``decode``: :class:`DecodeReceiver`, over ``receiver``, its state), and what
they share: ``handshake`` (both halves of session setup) with ``identity`` (instance keys,
pending handshakes), ``guard`` (decode's control connections), ``reservations`` (prefill's
requests in flight), ``channel`` (the control socket) and ``options``.

May import: the transports' registry (``transports.base``) and everything below
``pdkv.transfer``; a session never imports a transport module: it reaches transports
through the registry.
"""
