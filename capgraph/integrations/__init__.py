"""Adapters that make capgraph selectable inside serving engines.

Each adapter is a module of its own that imports its engine on import, so nothing here is
loaded by ``import capgraph``; install the engine (or the matching extra) to use one:

- :mod:`capgraph.integrations.sglang`: the ``capgraph`` grammar backend of SGLang
  (``--grammar-backend capgraph``).
"""
