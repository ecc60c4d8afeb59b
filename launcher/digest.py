"""SHA-256 without loading OpenSSL: `hashlib`'s import loads libcrypto (~2.5 ms), a tenth of `plan`'s own
start-up, for the one short digest every render writes into plan.json (the recipe's identity). CPython
builds the same function in (`_sha2` from 3.12, `_sha256` before), the one hashlib itself falls back to;
an interpreter built without it gets hashlib's."""
from __future__ import annotations

try:
    from _sha2 import sha256  # CPython >= 3.12
except ImportError:
    try:
        from _sha256 import sha256  # CPython 3.10, 3.11
    except ImportError:
        from hashlib import sha256


def sha256_hex(data: bytes) -> str:
    return sha256(data).hexdigest()
