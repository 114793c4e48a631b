"""Who is looking: logins held by the console, their cookies and their CSRF tokens.

With access tokens configured (the gRPC servers' tokens file), a person signs in by pasting a token
on `/login`; the console checks it against the same table the runtime uses and keeps, under a
random login id, the token's identity and a CSRF token. A trainer's token goes nowhere after the
check (the console calls the runtime on its own service token, naming the trainer's tenant); an
operator's is kept with the login, in this process only, because the runtime takes operator-only
calls (lifting a quarantine, reading code, every tenant's captures) from an operator's token
alone. The login id travels in a cookie that scripts cannot read (HttpOnly), that no other site's
page sends (SameSite=Strict) and, under TLS, that plain HTTP never carries (Secure).
Every POST must also carry the login's CSRF token in its form (`csrf`): a page of this console
shows it; a page elsewhere cannot read it.

Without tokens every visitor is an anonymous operator (the console then binds loopback only,
unless `--insecure`, as every server here does) and still gets a login id for the CSRF check.

Logins are bounded (`MAX_LOGINS`, the oldest dropped first) and lapse after `LOGIN_TTL_S`.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from codegym.server.auth import OPERATOR, TRAINER, Identity

COOKIE = "codegym_console"
MAX_LOGINS = 10_000
LOGIN_TTL_S = 12 * 3600.0
# Who may sign in: people. A server's own `service` token is not a person's.
CONSOLE_ROLES = frozenset({TRAINER, OPERATOR})
# Without tokens: the one who can reach a loopback (or --insecure) console runs it.
ANONYMOUS = Identity("", OPERATOR)


class LoginRefused(Exception):
    """A token the console does not take, with the reason shown on the login page."""


@dataclass(frozen=True)
class Login:
    """One signed-in browser: who, its CSRF token and when it lapses."""

    identity: Identity
    csrf: str
    expires: float
    # An operator's own token, which its runtime calls carry ("" for a trainer, or without tokens).
    token: str = ""

    @property
    def operator(self) -> bool:
        return self.identity.role == OPERATOR

    @property
    def tenant(self) -> str:
        """The tenant the console names on this login's runtime calls ("" for an operator, whose
        calls carry its own token)."""
        return "" if self.operator else self.identity.tenant


class Logins:
    """The console's logins, bounded, keyed by the random id its cookie carries."""

    def __init__(self, tokens: Mapping[str, Identity], max_logins: int = MAX_LOGINS) -> None:
        self.tokens = dict(tokens)
        self.max_logins = max_logins
        self._held: OrderedDict[str, Login] = OrderedDict()

    @property
    def required(self) -> bool:
        """Whether a person must sign in (tokens are configured)."""
        return bool(self.tokens)

    def sign_in(self, token: str) -> tuple[str, Login]:
        """A new login for `token` (with tokens off: an anonymous one); LoginRefused if unknown."""
        if self.required:
            identity = self.tokens.get(token.strip()) if token.strip() else None
            if identity is None:
                raise LoginRefused("this console does not know that token")
            if identity.role not in CONSOLE_ROLES:
                raise LoginRefused(
                    f"a {identity.role}'s token does not sign in here; use a trainer's or an operator's"
                )
        else:
            identity = ANONYMOUS
        login_id = secrets.token_urlsafe(32)
        own = token.strip() if self.required and identity.role == OPERATOR else ""
        login = Login(identity, secrets.token_urlsafe(32), time.monotonic() + LOGIN_TTL_S, own)
        self._held[login_id] = login
        while len(self._held) > self.max_logins:
            self._held.popitem(last=False)
        return login_id, login

    def find(self, login_id: str) -> Login | None:
        """The live login of a cookie's id, or None."""
        login = self._held.get(login_id) if login_id else None
        if login is None:
            return None
        if login.expires < time.monotonic():
            del self._held[login_id]
            return None
        return login

    def sign_out(self, login_id: str) -> None:
        self._held.pop(login_id, None)


def csrf_ok(login: Login, sent: str) -> bool:
    """Whether a form's CSRF token is its login's (compared in constant time)."""
    return bool(sent) and hmac.compare_digest(login.csrf.encode(), sent.encode())
