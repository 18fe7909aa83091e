"""pdkv as SGLang's disaggregation transfer backend (SGLang 0.5.23), the first to implement
its decode host receive (``supports_host_destination``): decode's host pages receive the KV
through pdkv's sessions (authenticated, leased, fenced) over tcp or NIXL, and its device pages
too (on a GPU through pdkv's staging buffer and a copy, ``staged``).

``layouts`` (SGLang's ``KVArgs`` as pdkv layouts), ``bootstrap`` (prefill ranks' table,
signed entries over HTTP), ``aux`` (a request's metadata bytes into decode's slot), ``sides``
(the prefill and decode halves in plain ids, over ``integrations.core``), ``staged`` (a
GPU decode's device destination) are pure pdkv;
``conn`` (the classes SGLang's queues drive) imports SGLang's ``base.conn``; ``activate``
adds the backend to SGLang's enum and class lookup without editing SGLang's files, and
``launch_server`` is SGLang's launcher with it added.

May import every part of pdkv below the integrations and ``integrations.core``; nothing in
pdkv imports it. SGLang is imported only by ``conn``, ``activate`` and ``launch_server``.
"""
