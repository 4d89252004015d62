"""What the shuffler and the analyzer stand on besides ``common``: settings base, database
engine and migrations, domain errors and their HTTP mapping, the HTTP server, logging and the
conservation metrics' names. A package of its own, below the services.

Nothing here imports ``shuffler``, ``analyzer``, ``services.cli`` or ``services.tools``.
"""
