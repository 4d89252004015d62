"""``python -m services.cli`` runs the ``esa`` command."""

from services.cli import main

main()
