"""Version markers of the wire formats (docs/protocol.md, "Versions"), with no dependency, so that
``esa --version`` can name them without loading the cryptography and schema stacks."""

from __future__ import annotations

#: The first bytes of every contribution envelope this version seals (docs/protocol.md,
#: "Contribution bytes").
CONTRIBUTION_MAGIC = b"ESA2"
#: The envelope of wire version 1, recognised only to refuse it as unsupported.
OLD_CONTRIBUTION_MAGIC = b"ESA1"
#: The version field of the collection config this version signs and verifies.
COLLECTION_CONFIG_VERSION = 2
