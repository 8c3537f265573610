"""The public surface: the client, types and errors import without torch; every public error is a KdaSessionsError."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kda_sessions as ks
from kda_sessions import errors

TORCH_FREE = ["kda_sessions", "kda_sessions.client", "kda_sessions.types", "kda_sessions.errors",
              "kda_sessions.protocol", "kda_sessions.engine.types"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_module_imports_without_torch(module: str) -> None:
    code = (f"import sys, {module}\n"
            "heavy = sorted(m for m in ('torch', 'triton', 'safetensors', 'numpy') if m in sys.modules)\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "", f"importing {module} imported {out.strip()}"


def test_client_types_and_errors_without_torch() -> None:
    code = ("import sys\n"
            "import kda_sessions as ks\n"
            "ks.Client('http://127.0.0.1:1'); ks.SamplingParams(max_tokens=4); ks.Usage(); ks.SaveResult\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _error_classes(namespace: object) -> list[type[BaseException]]:
    names = getattr(namespace, "__all__", dir(namespace))
    found = [getattr(namespace, n) for n in names]
    return [c for c in found if isinstance(c, type) and issubclass(c, BaseException)]


def test_every_public_error_is_a_kda_sessions_error() -> None:
    classes = _error_classes(ks) + _error_classes(errors) + _error_classes(ks.client)
    assert len(classes) >= 19
    outside = [c.__name__ for c in classes if not issubclass(c, ks.KdaSessionsError)]
    assert outside == []


def test_errors_keep_their_builtin_bases() -> None:
    assert issubclass(ks.ConfigError, ValueError) and issubclass(ks.CheckpointError, ValueError)
    assert issubclass(ks.EngineBusy, RuntimeError) and issubclass(ks.OutOfPages, RuntimeError)
    assert issubclass(ks.OutOfSlots, RuntimeError) and issubclass(ks.SessionNotFound, KeyError)
    assert issubclass(ks.SnapshotConflict, ks.SessionBusy) and issubclass(ks.StoreUnavailable, ks.StoreError)
    assert str(ks.SessionNotFound("no session 'a'")) == "no session 'a'"


def test_old_import_paths_name_the_same_classes() -> None:
    from kda_sessions.client import AuthenticationError, ServerError, ServerUnreachable
    from kda_sessions.config import ConfigError
    from kda_sessions.engine.pool import OutOfPages, OutOfSlots
    from kda_sessions.engine.sampler import SamplingParams
    from kda_sessions.engine.scheduler import EngineBusy
    from kda_sessions.engine.types import Reply, Usage
    from kda_sessions.model import CheckpointError
    from kda_sessions.storage import SaveResult, StoreError
    from kda_sessions.storage.errors import BlobNotFound, KdaSessionsError

    assert (AuthenticationError, ServerError, ServerUnreachable) == (
        errors.AuthenticationError, errors.ServerError, errors.ServerUnreachable)
    assert (ConfigError, OutOfPages, OutOfSlots, EngineBusy, CheckpointError) == (
        ks.ConfigError, ks.OutOfPages, ks.OutOfSlots, ks.EngineBusy, ks.CheckpointError)
    assert (SamplingParams, Reply, Usage, SaveResult) == (ks.SamplingParams, ks.Reply, ks.Usage, ks.types.SaveResult)
    assert (StoreError, BlobNotFound, KdaSessionsError) == (ks.StoreError, errors.BlobNotFound, ks.KdaSessionsError)


def test_lazy_names_resolve() -> None:
    assert ks.Engine.__name__ == "Engine" and ks.Session.__name__ == "Session"
    assert callable(ks.load_model) and callable(ks.save_model) and ks.HybridModel.__name__ == "HybridModel"
    assert set(ks.__all__) <= set(dir(ks))
    with pytest.raises(AttributeError):
        ks.NoSuchName  # noqa: B018


def test_tokenizer_tool_and_server_errors_are_kda_sessions_errors() -> None:
    from kda_sessions.server.auth import InsecureBindError
    from kda_sessions.tokenizer.chat import ChatTemplateError
    from kda_sessions.tokenizer.loader import TokenizerNotFound
    from kda_sessions.tokenizer.tool_calls import ToolCallParseError
    from kda_sessions.tools import ToolError

    for cls in (InsecureBindError, ChatTemplateError, TokenizerNotFound, ToolCallParseError, ToolError):
        assert issubclass(cls, ks.KdaSessionsError), cls.__name__
        assert getattr(errors, cls.__name__) is cls
    assert issubclass(ToolError, ValueError) and issubclass(InsecureBindError, RuntimeError)
