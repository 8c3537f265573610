"""API keys: constant-time comparison, and the rule that a non-loopback bind needs one."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

from ..errors import InsecureBindError
from .settings import ServerSettings


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a hostname other than localhost may resolve anywhere
        return False


def check_bind(settings: ServerSettings) -> None:
    """Refuse to serve a non-loopback address without an API key."""
    if not settings.api_keys and not settings.tenants and not is_loopback(settings.host):
        raise InsecureBindError(
            f"refusing to bind {settings.host!r} without an API key: anyone who can reach it could read and "
            "drive every session. Pass --api-key KEY (clients send 'Authorization: Bearer KEY'), "
            "or bind 127.0.0.1."
        )


def key_tenant(key: str) -> str:
    """The tenant of a key given without a tenant name: stable across restarts and key order, reveals nothing."""
    return "k" + hashlib.sha256(b"kda-tenant:" + key.encode()).hexdigest()[:20]


class KeyChecker:
    """Maps a presented bearer key to its tenant, in constant time. Keys from ``api_keys`` are each their own
    tenant (``key_tenant``); ``tenants`` maps a tenant name to the keys that act for it."""

    def __init__(self, keys: list[str], tenants: dict[str, list[str]] | None = None) -> None:
        # comparing fixed-length digests keeps the time independent of where the strings differ and of length
        pairs = [(k, key_tenant(k)) for k in keys] + [(k, t) for t, ks in (tenants or {}).items() for k in ks]
        self._digests = [hashlib.sha256(k.encode()).digest() for k, _ in pairs]
        self._names = [t for _, t in pairs]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def identify(self, presented: str | None) -> str | None:
        """The tenant of a valid key, None otherwise; with no keys configured, everyone is ``anonymous``."""
        if not self._digests:
            return "anonymous"
        if not presented:
            return None
        d = hashlib.sha256(presented.encode()).digest()
        match = None
        for i, want in enumerate(self._digests):  # no early exit: every key is compared
            if hmac.compare_digest(d, want):
                match = self._names[i]
        return match


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None
