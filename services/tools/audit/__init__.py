"""``esa audit``: a black-box audit of a shuffler run by another party.

* :mod:`~services.tools.audit.sink`: the process the audited shuffler forwards to; it records
  every batch part exactly as the analyzer would receive it and answers as the analyzer does.
* :mod:`~services.tools.audit.canary`: the auditor's canary devices, whose fragments are sealed
  to a key the auditor holds, so it can read back where each one landed.
* :mod:`~services.tools.audit.checks`: the statistical and structural checks.
* :mod:`~services.tools.audit.runner`: one audit run, end to end.
* :mod:`~services.tools.audit.report`: the JSON and HTML reports.
"""
