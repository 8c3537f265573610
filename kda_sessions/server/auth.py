"""API keys: constant-time comparison, and the rule that a non-loopback bind needs one."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

from .settings import ServerSettings


class InsecureBindError(RuntimeError):
    """The server would listen beyond this machine with no API key."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a hostname other than localhost may resolve anywhere
        return False


def check_bind(settings: ServerSettings) -> None:
    """Refuse to serve a non-loopback address without an API key."""
    if not settings.api_keys and not is_loopback(settings.host):
        raise InsecureBindError(
            f"refusing to bind {settings.host!r} without an API key: anyone who can reach it could read and "
            "drive every session. Pass --api-key KEY (clients send 'Authorization: Bearer KEY'), "
            "or bind 127.0.0.1."
        )


class KeyChecker:
    """Maps a presented bearer key to the name of the key it matches (its position), in constant time."""

    def __init__(self, keys: list[str]) -> None:
        # comparing fixed-length digests keeps the time independent of where the strings differ and of length
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def identify(self, presented: str | None) -> str | None:
        """``key-N`` for a valid key, None otherwise; with no keys configured, everyone is ``anonymous``."""
        if not self._digests:
            return "anonymous"
        if not presented:
            return None
        d = hashlib.sha256(presented.encode()).digest()
        match = None
        for i, want in enumerate(self._digests):  # no early exit: every key is compared
            if hmac.compare_digest(d, want):
                match = f"key-{i}"
        return match


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None
