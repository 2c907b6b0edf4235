"""The responses ``/v1/responses`` keeps for ``previous_response_id`` and ``GET``: in memory,
per tenant, bounded in count and bytes (stdlib only: ``specdec serve`` reads its defaults before
anything heavy is imported)."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

DEFAULT_STORE_SIZE = 1024  # responses kept, all clients together
DEFAULT_STORE_BYTES = 64 << 20  # their JSON, all clients together


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as answered
    items: list[dict[str, Any]]  # the conversation's input items: history, then this input
    size: int  # bytes of JSON, what the store's byte cap counts


@dataclass
class _Tenant:
    entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    size: int = 0


class ResponseStore:
    """Stored responses in memory, per tenant (a client: its API key's hash, else its host).

    At most ``max_entries`` responses and ``max_bytes`` bytes of JSON in all; beyond either,
    the least recently used response (created or read) of the tenant holding the most goes
    first, so a client that floods the store evicts its own responses before anyone else's.
    A tenant only ever sees its own ids: another's reads as unknown. Event-loop only.
    """

    def __init__(
        self, max_entries: int = DEFAULT_STORE_SIZE, max_bytes: int = DEFAULT_STORE_BYTES
    ) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("the responses store's caps must be >= 0")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._tenants: dict[str, _Tenant] = {}
        self.num_entries, self.num_bytes = 0, 0

    def put(self, tenant: str, response: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Keep ``response`` (False where it alone is over a cap, or the store is off)."""
        size = len(json.dumps([response, items], ensure_ascii=False).encode())
        if self.max_entries == 0 or size > self.max_bytes:
            return False
        self.delete(tenant, response["id"])
        own = self._tenants.setdefault(tenant, _Tenant())
        own.entries[response["id"]] = StoredResponse(response, items, size)
        own.size += size
        self.num_entries += 1
        self.num_bytes += size
        while self.num_entries > self.max_entries or self.num_bytes > self.max_bytes:
            self._evict(by_bytes=self.num_bytes > self.max_bytes)
        return True

    def get(self, tenant: str, rid: str) -> StoredResponse | None:
        own = self._tenants.get(tenant)
        found = own.entries.get(rid) if own is not None else None
        if found is not None:
            own.entries.move_to_end(rid)  # type: ignore[union-attr]
        return found

    def delete(self, tenant: str, rid: str) -> bool:
        own = self._tenants.get(tenant)
        gone = own.entries.pop(rid, None) if own is not None else None
        if gone is None:
            return False
        self._forget(tenant, own, gone)  # type: ignore[arg-type]
        return True

    def _evict(self, by_bytes: bool) -> None:
        def held(item: tuple[str, _Tenant]) -> int:
            return item[1].size if by_bytes else len(item[1].entries)

        tenant, own = max(self._tenants.items(), key=held)
        _, gone = own.entries.popitem(last=False)
        self._forget(tenant, own, gone)

    def _forget(self, tenant: str, own: _Tenant, gone: StoredResponse) -> None:
        own.size -= gone.size
        self.num_entries -= 1
        self.num_bytes -= gone.size
        if not own.entries:
            del self._tenants[tenant]
