"""What the shuffler and the analyzer import besides ``common``: settings base, database engine
and migrations, domain errors and their HTTP mapping, logging and metrics.

Nothing here imports ``shuffler``, ``analyzer``, ``services.cli`` or ``services.tools``.
"""
