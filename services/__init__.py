"""Server runtime shared by the shuffler and the analyzer, and the ``esa`` command line."""
