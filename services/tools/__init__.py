"""Tools that drive a deployment from outside: simulated populations, paper-scale simulation,
the demo, the default channel catalogue (and the load test and audit).

Tools talk to services over HTTP and use the SDK; they never import ``shuffler`` or
``analyzer``.
"""
