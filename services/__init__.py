"""Everything around the two services, by role (ARCHITECTURE.md, "Layout"):

* :mod:`services.runtime` — what ``shuffler`` and ``analyzer`` import besides ``common``;
* :mod:`services.cli` — the ``esa`` commands and the launcher (the top of the import graph);
* :mod:`services.tools` — populations, simulation, demo, channel catalogue, load test, audit.
"""
