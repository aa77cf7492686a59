"""The `rdma` transport's verbs (pyverbs): the engine registers the slot table, the ingress reads and writes it.

One reliable-connected queue pair per ingress. The engine host's side (`TableTarget`) registers the table's
pages for remote read and write and brings up a queue pair for each `RdmaConnect` on its control socket; after
that its host takes no part in a request. The ingress's side (`VerbsMemory`) is the remote memory under a
`ReplicaTable`: RDMA writes from, and RDMA reads into, its registered replica, in order on the one queue pair.
A completion error or a queue pair in error raises TransportLost.

pyverbs is imported only here and only when used: `pip install blink-serve[rdma]` builds it against rdma-core, or
Debian's `python3-pyverbs` serves a venv made with `--system-site-packages` (Python 3.11).
"""

from __future__ import annotations

import ctypes
import mmap
import random
import time
from dataclasses import dataclass

from blink.shared.control import RdmaPeer
from blink.shared.remote_memory import Region, TransportLost

PORT = 1
COMPLETION_TIMEOUT_S = 1.0
QUEUE_DEPTH = 256  # work requests in flight on one queue pair: a refresh reads two regions per busy slot


class RdmaUnavailable(RuntimeError):
    """This machine cannot run the rdma transport; the message names what is missing."""


def verbs():
    try:
        import pyverbs.enums as e
        from pyverbs import addr, cq, device, mr, pd, qp, wr
        from pyverbs.pyverbs_error import PyverbsError
    except ImportError as err:
        raise RdmaUnavailable(
            f"pyverbs is not installed ({err}): pip install 'blink-serve[rdma]' (needs rdma-core's headers), or "
            "apt install python3-pyverbs and make a venv with --system-site-packages") from None
    return e, addr, cq, device, mr, pd, qp, wr, PyverbsError


def devices() -> list[str]:
    """The RDMA devices ibv_devices would list; raises RdmaUnavailable without pyverbs."""
    _, _, _, device, *_, PyverbsError = verbs()
    try:
        return [d.name.decode() for d in device.get_device_list()]
    except PyverbsError as err:  # a kernel without RDMA support has no device list at all
        raise RdmaUnavailable(f"no RDMA device: the device list cannot be read ({err})") from None


def pick_device(name: str | None) -> str:
    found = devices()
    if not found:
        raise RdmaUnavailable("no RDMA device: ibv_devices lists none (a NIC with RDMA, or rdma_rxe, is needed)")
    if name is None:
        return found[0]
    if name not in found:
        raise RdmaUnavailable(f"no RDMA device {name!r}; this machine has {', '.join(found)}")
    return name


def buffer_address(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


@dataclass
class _Port:
    """An open device, its protection domain and what a peer needs of its port."""

    name: str
    gid_index: int

    def __post_init__(self) -> None:
        e, _, _, device, _, pd, *_, PyverbsError = verbs()
        self.e = e
        try:
            self.context = device.Context(name=self.name)
            attr = self.context.query_port(PORT)
            self.lid, self.mtu = attr.lid, attr.active_mtu
            self.gid = self.context.query_gid(PORT, self.gid_index).gid
            self.pd = pd.PD(self.context)
        except PyverbsError as err:
            raise RdmaUnavailable(f"{self.name}: {err}") from err
        if attr.state != e.IBV_PORT_ACTIVE:
            raise RdmaUnavailable(f"port {PORT} of {self.name} is not active")

    def register(self, address: int, length: int):
        _, _, _, _, mr, *_ = verbs()
        e = self.e
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        return mr.MR(self.pd, length, access, address=address)


class QueuePair:
    """One end of a reliable-connected queue pair, and the completion queue its work lands on."""

    def __init__(self, port: _Port):
        e, _, cq, _, _, _, qp, *_ = verbs()
        self.port, self.e = port, e
        self.cq = cq.CQ(port.context, QUEUE_DEPTH, None, None, 0)
        cap = qp.QPCap(max_send_wr=QUEUE_DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        self.qp = qp.QP(port.pd, qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.psn = random.getrandbits(24)

    def peer(self) -> RdmaPeer:
        p = self.port
        return RdmaPeer(device=p.name, port=PORT, gid=p.gid, lid=p.lid, qp_num=self.qp.qp_num, psn=self.psn)

    def connect(self, remote: RdmaPeer) -> None:
        try:
            self._connect(remote)
        except verbs()[-1] as err:
            raise TransportLost(f"could not connect the queue pair to {remote.device} ({remote.gid}): {err}") from err

    def _connect(self, remote: RdmaPeer) -> None:
        e, addr, _, _, _, _, qp, *_ = verbs()
        a = qp.QPAttr(port_num=PORT)
        a.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        a.pkey_index = 0
        a.path_mtu = self.port.mtu
        a.dest_qp_num, a.rq_psn, a.sq_psn = remote.qp_num, remote.psn, self.psn
        a.max_dest_rd_atomic = a.max_rd_atomic = 1
        a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7
        route = addr.GlobalRoute(dgid=addr.GID(remote.gid), sgid_index=self.port.gid_index)
        a.ah_attr = addr.AHAttr(port_num=PORT, is_global=1, gr=route, dlid=remote.lid)
        self.qp.to_rts(a)

    def in_error(self) -> bool:
        attr, _ = self.qp.query(self.e.IBV_QP_STATE)
        return attr.qp_state == self.e.IBV_QPS_ERR

    def close(self) -> None:
        self.qp.close()
        self.cq.close()


MAX_PAIRS = 64  # queue pairs a table keeps for its ingresses (each ingress reads over one)


class TableTarget:
    """The engine host's side: the slot table's pages registered for remote access, a queue pair per ingress."""

    def __init__(self, table_map: mmap.mmap, device: str | None, gid_index: int):
        self.port = _Port(pick_device(device), gid_index)
        self.size = len(table_map)
        self.mr = self.port.register(buffer_address(table_map), self.size)
        self.pairs: list[QueuePair] = []

    def accept(self, remote: RdmaPeer) -> tuple[RdmaPeer, int, int]:
        """A queue pair connected to `remote`; returns our end, the table's address and its remote key. An ingress
        whose path broke handshakes again with a new pair, leaving its old one: pairs in the error state are closed
        here, and past MAX_PAIRS the oldest."""
        for old in [p for p in self.pairs if p.in_error()]:
            old.close()
            self.pairs.remove(old)
        while len(self.pairs) >= MAX_PAIRS:
            self.pairs.pop(0).close()
        pair = QueuePair(self.port)
        pair.connect(remote)
        self.pairs.append(pair)
        return pair.peer(), self.mr.buf, self.mr.rkey

    def close(self) -> None:
        for pair in self.pairs:
            pair.close()
        self.mr.close()


class VerbsMemory:
    """The ingress's side: RemoteMemory over one queue pair into the engine's registered table."""

    def __init__(self, device: str | None, gid_index: int, name: str):
        self.name = name
        self.port = _Port(pick_device(device), gid_index)
        self.pair = QueuePair(self.port)
        self._remote: tuple[int, int] | None = None  # the table's address and remote key
        self._mr = None
        self._local_address = 0

    def peer(self) -> RdmaPeer:
        return self.pair.peer()

    def connect(self, remote: RdmaPeer, address: int, rkey: int) -> None:
        self.pair.connect(remote)
        self._remote = (address, rkey)

    def attach(self, local: mmap.mmap) -> None:
        self._local_address = buffer_address(local)
        self._mr = self.port.register(self._local_address, len(local))

    def read(self, regions: list[Region]) -> None:
        # Posted one after another on one queue pair: the responder executes RDMA reads in order.
        self._post(self.pair.e.IBV_WR_RDMA_READ, regions)

    def write(self, regions: list[Region]) -> None:
        self._post(self.pair.e.IBV_WR_RDMA_WRITE, regions)

    def _post(self, opcode: int, regions: list[Region]) -> None:
        if self._remote is None or self._mr is None:
            raise TransportLost("the queue pair is not connected")
        e, _, _, _, _, _, _, wr, PyverbsError = verbs()
        address, rkey = self._remote
        try:
            for start in range(0, len(regions), QUEUE_DEPTH):
                batch = regions[start:start + QUEUE_DEPTH]
                for i, (offset, length) in enumerate(batch):
                    sge = wr.SGE(self._local_address + offset, length, self._mr.lkey)
                    request = wr.SendWR(wr_id=i, opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
                    request.set_wr_rdma(rkey, address + offset)
                    self.pair.qp.post_send(request)
                self._complete(len(batch))
        except PyverbsError as err:
            raise TransportLost(f"RDMA to the slot table failed: {err}") from err

    def _complete(self, expected: int) -> None:
        from pyverbs.cq import cqe_status_to_str

        deadline = time.monotonic() + COMPLETION_TIMEOUT_S
        while expected:
            n, completions = self.pair.cq.poll(num_entries=expected)
            for wc in completions:
                if wc.status != self.pair.e.IBV_WC_SUCCESS:
                    raise TransportLost(f"RDMA completion error: {cqe_status_to_str(wc.status)}")
            expected -= n
            if expected and time.monotonic() > deadline:
                state = "in error" if self.pair.in_error() else "silent"
                raise TransportLost(f"no RDMA completion within {COMPLETION_TIMEOUT_S} s (queue pair {state})")

    def close(self) -> None:
        if self._mr is not None:
            self._mr.close()
        self.pair.close()
