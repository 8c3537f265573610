"""Engine/Session and Client/RemoteSession satisfy the shared protocols: same names, parameters, defaults,
and return types (with the session class standing for SessionLike)."""

from __future__ import annotations

import inspect
import typing

import pytest

import kda_sessions as ks
from kda_sessions.client import Client, RemoteSession
from kda_sessions.protocol import EngineLike, SessionLike

SESSION_CLASSES = {ks.Session, RemoteSession, SessionLike}


def _members(proto: type) -> list[str]:
    return sorted(n for n in vars(proto) if not n.startswith("_") or n in ("__aenter__", "__aexit__"))


def _norm_return(hint: typing.Any) -> typing.Any:
    if hint in SESSION_CLASSES:
        return SessionLike
    if hint in (ks.Engine, Client):
        return EngineLike
    origin = typing.get_origin(hint)
    if origin is not None and typing.get_args(hint):
        return (origin, tuple(_norm_return(a) for a in typing.get_args(hint)))
    return hint


def _shape(func: typing.Any) -> tuple[list[tuple[str, typing.Any, typing.Any]], typing.Any, bool]:
    sig = inspect.signature(func)
    params = [(p.name, p.kind, p.default) for p in list(sig.parameters.values())[1:]]
    hints = typing.get_type_hints(func)
    is_async = inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func)
    return params, _norm_return(hints.get("return")), is_async


@pytest.mark.parametrize(
    ("impl", "proto"),
    [(ks.Engine, EngineLike), (Client, EngineLike), (ks.Session, SessionLike), (RemoteSession, SessionLike)],
    ids=["Engine", "Client", "Session", "RemoteSession"],
)
def test_class_satisfies_protocol(impl, proto):
    for name in _members(proto):
        want = getattr(proto, name)
        got = getattr(impl, name, None)
        assert got is not None, f"{impl.__name__} lacks {name}"
        if isinstance(want, property):
            assert isinstance(got, property), f"{impl.__name__}.{name} must be a property"
            continue
        w_params, w_ret, w_async = _shape(want)
        g_params, g_ret, g_async = _shape(got)
        assert g_params == w_params, f"{impl.__name__}.{name}{inspect.signature(got)} != {inspect.signature(want)}"
        assert g_ret == w_ret, f"{impl.__name__}.{name} returns {g_ret}, protocol says {w_ret}"
        if name != "stream":  # an async generator function is declared as a plain def in the protocol
            assert g_async == w_async, f"{impl.__name__}.{name}: async mismatch"


def _public(cls: type) -> dict[str, str]:
    """Every public member a class defines (its own and inherited), by kind."""
    kinds: dict[str, str] = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        member = inspect.getattr_static(cls, name)
        if isinstance(member, property):
            kinds[name] = "property"
        elif inspect.isasyncgenfunction(member):
            kinds[name] = "async generator"
        elif inspect.iscoroutinefunction(member):
            kinds[name] = "async method"
        elif callable(member):
            kinds[name] = "method"
    return kinds


def test_session_classes_expose_the_same_members():
    """Not only the protocol's members: anything a user can reach on one session class exists on the other,
    as the same kind (property, coroutine, async generator) with the same parameters."""
    local, remote = _public(ks.Session), _public(RemoteSession)
    assert local == remote, f"only on Session: {set(local.items()) - set(remote.items())}; " \
                            f"only on RemoteSession: {set(remote.items()) - set(local.items())}"
    for name, kind in local.items():
        if kind == "property":
            continue
        g_params, g_ret, _ = _shape(getattr(RemoteSession, name))
        w_params, w_ret, _ = _shape(getattr(ks.Session, name))
        assert g_params == w_params, f"RemoteSession.{name} parameters differ from Session.{name}"
        assert g_ret == w_ret, f"RemoteSession.{name} returns {g_ret}, Session.{name} {w_ret}"


def test_session_protocol_names_every_public_member():
    assert set(_public(ks.Session)) == set(_members(SessionLike))
