"""Sessions of one tenant: the public session API, scoped.

Every tenant has its own snapshot store namespace (blob keys, manifests), its own prefix index and its own
session ids: another tenant's valid id answers exactly like an unknown one, and prefix reuse never crosses
tenants. ``Engine``'s own methods act for the default tenant (None); a server maps each API key to a tenant and
uses ``engine.for_tenant(name)``.
"""

from __future__ import annotations

from typing import Any

from ..constrain.tool_choice import check_tools
from ..tokenizer import encode_chat
from ..types import SessionInfo
from .manager import SessionManager
from .prefix_index import TokenList
from .session import Session
from .state import SessionState
from .store_io import StoreIO


class TenantSessions:
    """The session API of ``Engine`` (create, resume, fork, list, delete, forget) for one tenant."""

    def __init__(self, manager: SessionManager, tenant: str | None) -> None:
        self.manager = manager
        self.tenant = tenant

    @property
    def io(self) -> StoreIO:
        """This tenant's store and prefix index."""
        return self.manager.store_of(self.tenant)

    @property
    def sessions(self) -> dict[str, SessionState]:
        """This tenant's sessions held by the engine, by id."""
        return self.manager.held(self.tenant)

    def holds(self, session_id: str) -> bool:
        """Whether this engine holds the session in memory (resident or moved out), not just in the store."""
        return self.manager.is_held(self.tenant, session_id)

    # -- create ----------------------------------------------------------------------------------------------

    async def create_session(
        self, system: str | None = None, tools: list[dict[str, Any]] | None = None, *, session_id: str | None = None
    ) -> Session:
        messages = [{"role": "system", "content": system}] if system else []
        return await self.create_session_from_messages(messages, tools, session_id=session_id)

    async def create_session_from_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, *, session_id: str | None = None
    ) -> Session:
        m = self.manager
        sid = self.manager.new_id(self.tenant, session_id)
        check_tools(tools)
        tokens = (encode_chat(m.tokenizer, messages, tools, add_generation_prompt=False, template=m.template,
                              scope=self.tenant, out=TokenList())
                  if (messages or tools) else TokenList())
        s = await m.new_state(self.tenant, sid, tokens)
        s.system = next((x.get("content") for x in messages if x.get("role") == "system"), None)
        s.tools = tools
        s.messages = [dict(x) for x in messages]
        s.next_message_index = len(messages)
        s.turn_open = False
        return Session(m, s)

    # -- resume, fork ----------------------------------------------------------------------------------------

    async def resume(self, session_id: str) -> Session:
        return Session(self.manager, await self.manager.resume_state(self.tenant, session_id))

    async def fork(self, session_id: str, checkpoint: str | None = None, *, new_id: str | None = None) -> Session:
        sid = self.manager.new_id(self.tenant, new_id)
        return Session(self.manager, await self.manager.fork(self.tenant, session_id, checkpoint, sid))

    # -- list, delete ----------------------------------------------------------------------------------------

    async def list_sessions(self) -> list[SessionInfo]:
        return await self.manager.list_sessions(self.tenant)

    async def delete_session(self, session_id: str) -> None:
        await self.manager.delete(self.tenant, session_id)

    async def forget(self, session_id: str, drop_unsaved: bool = False) -> bool:
        """Drop a held session from this engine's memory, leaving the store as it is: its slot, KV pages and
        checkpoint states are freed and its write lease given back. A saved session can be resumed again from
        the store; an unsaved one is gone. With ``drop_unsaved``, a copy the engine wrote only to evict the
        session (nobody asked for a save) is deleted from the store as well. False if the engine does not hold
        it or it is answering a call."""
        return await self.manager.forget(self.tenant, session_id, drop_unsaved)

    def stats(self) -> dict[str, Any]:
        return self.manager.stats()
