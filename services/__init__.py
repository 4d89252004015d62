"""What sits above the two services, by role (docs/architecture.md, "Packages"):

* :mod:`services.cli` — the ``esa`` commands and the launcher (the top of the import graph);
* :mod:`services.tools` — populations, simulation, demo, channel catalogue, load test, audit.

What the services stand on is the package :mod:`runtime`, below them.
"""
