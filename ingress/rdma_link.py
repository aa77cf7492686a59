"""The `rdma` transport's connection from the ingress: a queue pair into the engine's slot table, set up (and set
up again after a loss) through a handshake on the engine's control socket."""

from __future__ import annotations

from blink.ingress.client import NoPath
from blink.ingress.slots import SlotClient, table_client
from blink.shared import control
from blink.shared.rdma import RdmaUnavailable, VerbsMemory
from blink.shared.remote_memory import TransportLost
from blink.shared.replica_table import ReplicaTable
from blink.shared.settings import Settings
from blink.shared.slot_table import Geometry
from blink.shared.sockets import Keys

HANDSHAKE_S = 2.0


class RdmaLink:
    def __init__(self, settings: Settings, keys: Keys):
        self.settings, self.keys = settings, keys
        self.table: ReplicaTable | None = None

    def open(self) -> ReplicaTable:
        """Connects and pulls the table; raises RdmaUnavailable (this host or the engine's cannot) or
        TransportLost (the queue pair would not come up)."""
        memory, geometry = self._connect()
        self.table = ReplicaTable(memory, geometry)
        return self.table

    def relink(self) -> None:
        """A new queue pair for the table after the last one was lost; the table is pulled again."""
        memory, geometry = self._connect()
        if geometry != self.table.geometry:
            memory.close()
            raise RuntimeError("the engine came back with another slot table geometry")
        self.table.rebind(memory)

    def _connect(self) -> tuple[VerbsMemory, Geometry]:
        s = self.settings
        memory = VerbsMemory(s.rdma_device, s.rdma_gid_index, name=f"rdma:{s.engine_host}/{s.deployment}")
        try:
            reply = control.request(s.control_endpoint, control.RdmaConnect(peer=memory.peer()), self.keys, HANDSHAKE_S)
            if not isinstance(reply, control.RdmaAccept):
                raise RdmaUnavailable(reply.message if isinstance(reply, control.Failure) else f"engine answered "
                                      f"{reply.type!r} to rdma_connect")
            memory.connect(reply.peer, reply.address, reply.rkey)
        except BaseException:
            memory.close()
            raise
        return memory, reply.geometry


def connect(settings: Settings, keys: Keys, info: control.EngineInfo) -> SlotClient:
    """The `rdma` transport: a SlotClient on a replica of the engine's table, relinked when its path is lost."""
    link = RdmaLink(settings, keys)
    try:
        return table_client(link.open(), settings, info, relink=link.relink)
    except (RdmaUnavailable, TransportLost, TimeoutError) as e:
        raise NoPath(str(e)) from e
