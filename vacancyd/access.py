"""What a credential check decided, as a value.

Kept apart from auth.py (which reads token files) so that a pure rule, the proxy's
front-door policy, can take and make one without importing file access.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class AuthResult:
    allowed: bool
    status: int = 200
    code: str = ""
    message: str = ""
    # Who was let in, for per-borrower accounting: the matching token's name, LOCAL for
    # a trusted loopback caller, or ANONYMOUS where no token guards the scope.
    token_name: str = ""
