"""Dependency-light code shared by the device SDK and the servers.

Nothing in ``common`` imports from ``encoder_client``, ``shuffler``, ``analyzer`` or
``services`` (see docs/architecture.md, dependency rules).
"""
