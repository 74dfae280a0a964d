"""Local steps held by peers: each process's committed local step is copied into the
local tiers of `peer_copies` processes on other nodes, over TCP, in the background.

Who serves: every process of a manager with `peer_copies > 0` serves its own local tier
on a TCP socket it opens itself (the user starts nothing): bound to the address this
process uses to reach the `jax.distributed` coordinator, on an ephemeral port, and
advertised in the coordination service's key-value store under
`checkpointer/peers/<tag>/addr/<i>` (`{"host", "port", "node"}`; `tag` hashes the
manager's directory). A peer looks the address up when it first needs it.

Protocol (one request per connection; every message is a 4-byte big-endian length and
a JSON object; file bytes travel raw, in `CHUNK_BYTES` pieces, so memory stays bounded):

```
put   owner → holder   {"op": "put", "owner", "step", "generation", "keep": [steps],
                        "files": [{"key", "size"}, ...]}  then each file's bytes and the
                       owner's crc32c of them (4 bytes: a chunk file's crc32c when
                       intact, from its layout; any other file's, taken as it read it;
                       the marker `COMMITTED` last; `_peer_copy.send_copy`).  The holder
                       writes them into process-<h>/peer-copies/process-<owner>/<step>.partial-<g>/
                       (past the page cache, fsynced, `_peer_copy.receive_copy`), taking
                       the crc32c of the bytes as they arrive: each file's length and
                       crc32c must be the owner's. It writes `peer-copy.json` (the header
                       with the checked crc32c), renames the folder to
                       <step>/, drops the owner's copies not in `keep` (the first one
                       it drops becomes the owner's spare, `peer-copy-spare/`, whose files
                       the next put writes over: `_peer_copy.take_spare`), and answers
                       {"ok": true} or {"error": text}.
get   any → holder     {"op": "get", "owner", "step", "generation"}: answers the copy's
                       `peer-copy.json` (or {"error"}) then each file's bytes; the
                       receiver checks length and crc32c of each file against it.
```
A copy counts (`node_losses_survived`) only once the holder answered ok to its put,
i.e. after its checks, and for its save attempt only (`_peer_counts`). Nothing here
issues a device collective: only sockets and the coordination service's key-value
store, so it runs on background threads. The
sender's and the server's threads run at the direct writer's lower CPU priority
(`BACKGROUND_NICE`), so the training step keeps its cores.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import crc32c

from .. import _commit, _coord, _format
from .._errors import CheckpointError, CorruptCheckpointError, RestoreAgreementError
from . import _peer_copy, _tier_references
from ._peer_copy import (
    CHUNK_BYTES,
    COPY_RECORD,
    MAX_HEADER_BYTES,
    block_with_timeout,
    lower_thread_priority,
    recv_json as _recv_json,
    send_json as _send_json,
    step_files,
    stream_files,
    timeouts_named,
)
from ._peer_counts import CopyCounts
from ._tier import PeerCopyTier, held_owners, peer_copy_root, recover_peer_copies

log = logging.getLogger("checkpointer")

_GENERATION_RE = re.compile(r"[0-9a-z-]{1,64}")  # what `_format.new_generation` writes, loosely


def _receive_files(sock: socket.socket, folder: str, files: Sequence[dict]) -> None:
    """Writes the streamed files into `folder`, each file's crc32c computed over the bytes
    as they are written and fsynced: its length and crc32c must be the header's (the
    owner's, computed from its committed files). Raises CorruptCheckpointError naming
    the file; memory: one `CHUNK_BYTES` buffer."""
    view = memoryview(bytearray(CHUNK_BYTES))  # the one buffer of this transfer
    for f in files:
        key, size = str(f["key"]), int(f["size"])
        if key.startswith("/") or ".." in key.split("/"):
            raise ConnectionError(f"a peer sent the file name {key!r}")
        path = _received_path(folder, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        left, crc = size, 0
        with open(path, "wb", buffering=0) as out, timeouts_named():
            while left:
                n = sock.recv_into(view, min(left, CHUNK_BYTES), socket.MSG_WAITALL)
                if not n:
                    raise ConnectionError(f"the peer closed the connection in {key} ({size - left} of {size} bytes)")
                out.write(view[:n])
                crc = crc32c.crc32c(view[:n], crc)
                left -= n
            os.fsync(out.fileno())
        if crc != int(f["crc32c"]):
            raise CorruptCheckpointError(
                f"the copy {path} has crc32c {crc:#010x}, expected {int(f['crc32c']):#010x} ({size} bytes): the bytes "
                "were damaged on the sender's disk or on the way"
            )


def _received_path(folder: str, key: str) -> str:
    """Where a received file is written: the marker under another name until every file
    is checked (`_commit_folder`), so a holder that dies mid-copy never leaves a partial
    folder that a listing would take for a committed one."""
    return f"{folder}/{_format.COMMITTED}.received" if key == _format.COMMITTED else f"{folder}/{key}"


def _commit_folder(partial: str, final: str, record: dict) -> None:
    """Writes the copy's record and renames `partial` to `final`. An old `final` (a step
    put or fetched again) is first renamed to a `.deleting-` name and removed after the
    rename, as `_commit`'s `RenameCommit` replaces a step: a process killed meanwhile
    leaves a whole copy listed (the old one, or the new one in its committed partial
    folder), never a published folder half deleted."""
    with open(f"{partial}/{COPY_RECORD}", "w") as f:
        f.write(json.dumps(record))  # one write (`json.dump` writes each token)
        f.flush()
        os.fsync(f.fileno())
    os.rename(f"{partial}/{_format.COMMITTED}.received", f"{partial}/{_format.COMMITTED}")
    old = _commit.strategy_for(_local_storage()).unpublish(final) if os.path.isdir(final) else None
    os.rename(partial, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class PeerAddress:
    host: str
    port: int
    node: str


def _own_host() -> str:
    """The address of this host that reaches the `jax.distributed` coordinator."""
    from jax._src import distributed  # the address jax.distributed.initialize() was given

    coordinator = getattr(distributed.global_state, "coordinator_address", None) or "127.0.0.1:1"
    host = coordinator.rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: the kernel picks the route's source address
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class PeerService:
    """This process's part of the peer copies of one manager.

    Args:
      local_root: this process's local folder (`LOCAL/process-<i>`); the copies it
        holds go to `<local_root>/peer-copies/process-<owner>/`.
      directory: the manager's directory (names the coordination keys).
      copies: how many other nodes hold each local step (`peer_copies`).
      node: this process's node name (default: the host name); processes with the same
        name are on one node and never hold each other's copies.
      timeout_s: how long a peer may take to answer, and to advertise its address.
    """

    def __init__(self, local_root: str, directory: str, *, copies: int, node: str | None, timeout_s: float) -> None:
        self.process_index, self.process_count = _coord.process_index(), _coord.process_count()
        self.local_root = local_root
        self.copies = copies
        self.node = node if node is not None else socket.gethostname()
        self.timeout_s = timeout_s
        self._tag = hashlib.sha256(directory.encode()).hexdigest()[:12]
        self._client = _coord.client() if self.process_count > 1 else None
        self._addresses: dict[int, PeerAddress] = {}
        self._held: dict[int, PeerCopyTier] = {}
        self._receiving: set[str] = set()  # the partial folders of the puts being received
        self._serving: dict[tuple[int, int], int] = {}  # (owner, step) -> gets serving that copy now
        self._mu = threading.Lock()
        self._sending: dict[int, str] = {}  # step -> the folder its copy is sent from (`_tier_references`)
        self._sender = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpointer-peers",
                                                             initializer=lower_thread_priority)
        self._jobs: dict[int, concurrent.futures.Future] = {}
        self.last_error: str | None = None
        # CPU seconds of this process's copy threads: "send" (its own steps, with the
        # bookkeeping after each), "serve" (the requests of its peers); benchmarks read it.
        self.copy_cpu_s: dict[str, float] = {}
        self.before_send: Callable[[int, int], None] | None = None  # tests: (step, holder) before each put
        self.damage_sent: Callable[[str, memoryview], None] | None = None  # tests: a copy damaged on the way
        # a killed holder's committed copies rolled forward, its partial folders removed: before
        # the server starts, so no put is in flight (only this process writes under local_root)
        recover_peer_copies(_local_storage(), local_root)
        self._server = self._serve()
        host, port = self._server.server_address[:2]
        self._address = PeerAddress(str(host), int(port), self.node)
        if self._client is not None:
            self._client.key_value_set(self._key("addr", self.process_index),
                                       json.dumps(dataclasses.asdict(self._address)), allow_overwrite=True)
        self.counts = CopyCounts(self._client, self._key("copies"), self.process_index, self.process_count, local_root,
                                 timeout_s)

    # --- serving ------------------------------------------------------------------------

    def _key(self, *parts: object) -> str:
        return "/".join(["checkpointer", "peers", self._tag, *map(str, parts)])

    def held(self, owner: int) -> PeerCopyTier:
        """The copies this process holds of process `owner`'s local steps (one tier, so
        one retention lock, per owner)."""
        root = peer_copy_root(self.local_root, owner)
        with self._mu:
            tier = self._held.get(owner)
            if tier is None or tier.root != root:
                tier = self._held[owner] = PeerCopyTier(_local_storage(), root, owner)
            return tier

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Holds the retention lock of every held tier (every owner of the job, and any
        owner whose folder an earlier job left), owners ascending: while a restart reads
        the copies this process holds, no put takes a spare, replaces a copy or drops one
        (`_handle_put` runs those under the held tier's lock). Lock order: a caller holds
        the local tier's `retention_mu` first; a put takes one held tier's lock and never
        the local tier's, and `self._mu` is taken inside either, never around them. A get
        (`_handle_get`) takes no lock: a restart fetching over TCP from a holder in its
        own restart would wait for it. Not a collective."""
        try:
            owners = set(held_owners(_local_storage(), self.local_root))
        except OSError:
            owners = set()
        with contextlib.ExitStack() as stack:
            for owner in sorted(owners | set(range(self.process_count))):
                stack.enter_context(self.held(owner).retention_mu)
            yield

    def _serve(self) -> socketserver.ThreadingTCPServer:
        service = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                lower_thread_priority()
                block_with_timeout(self.request, service.timeout_s)
                cpu_s = time.thread_time()
                try:
                    request = _recv_json(self.request)
                    if request.get("op") == "put":
                        service._handle_put(self.request, request)
                    elif request.get("op") == "get":
                        service._handle_get(self.request, request)
                    else:
                        _send_json(self.request, {"error": f"unknown request {request.get('op')!r}"})
                except (OSError, ValueError, KeyError, TypeError) as e:
                    log.warning("a peer request to process %d failed: %s", service.process_index, e)
                finally:
                    service._count_cpu("serve", time.thread_time() - cpu_s)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        server = Server((_own_host(), 0), Handler)
        threading.Thread(target=server.serve_forever, name="checkpointer-peer-server", daemon=True).start()
        return server

    def _handle_put(self, sock: socket.socket, request: dict) -> None:
        owner, step, generation = int(request["owner"]), int(request["step"]), str(request["generation"])
        if step < 0 or not _GENERATION_RE.fullmatch(generation) or not 0 <= owner < self.process_count:
            # Names from the network become folder names: refuse any that could leave the tier.
            raise ValueError(f"a peer sent owner {owner!r}, step {step!r}, generation {generation!r}")
        tier = self.held(owner)
        os.makedirs(tier.root, exist_ok=True)
        partial = f"{tier.root}/{_format.partial_name(str(step), generation)}"
        with self._mu:
            self._receiving.add(partial)
        try:
            shutil.rmtree(partial, ignore_errors=True)
            with tier.retention_mu:  # one put at a time takes the spare (an owner's puts overlap after its timeout)
                spare = _peer_copy.take_spare(tier.root, partial, self._served(owner))  # a dropped copy, written over
            if spare is None:
                os.makedirs(partial)
            files = _peer_copy.receive_copy(sock, partial, request["files"], _received_path, spare)
            with tier.retention_mu:  # a restart reading the held copies (`holding`) sees none replaced
                _commit_folder(partial, f"{tier.root}/{step}", {"owner": owner, "step": step, "generation": generation,
                                                                "files": files})
        except (OSError, CheckpointError) as e:
            shutil.rmtree(partial, ignore_errors=True)
            self._received(partial)
            text = f"process {self.process_index} could not hold step {step} of process {owner} in {tier.root}: " + (
                f"{os.strerror(e.errno)} ({e})" if isinstance(e, OSError) and e.errno is not None else str(e))
            try:
                _send_json(sock, {"error": text})
                while sock.recv(CHUNK_BYTES):  # the rest of the stream, so the sender reads the answer
                    pass
            except OSError:
                pass
            return
        except BaseException:  # a bug, MemoryError: no partial folder (it may hold a whole spare) stays behind
            shutil.rmtree(partial, ignore_errors=True)
            self._received(partial)
            raise
        self._received(partial)
        keep = {int(s) for s in request.get("keep", [])} | {step} | self._served(owner)  # a get's files stay as they are
        with tier.retention_mu:
            for s, name in tier.folders().items():
                if s not in keep:
                    try:
                        if name != str(s) or not _peer_copy.keep_spare(tier.root, f"{tier.root}/{name}"):
                            tier.remove(s)
                    except OSError as e:
                        log.warning("could not remove the copy of step %d of process %d: %s", s, owner, e)
            self._remove_leftovers(tier)
        _send_json(sock, {"ok": True})

    def _received(self, partial: str) -> None:
        with self._mu:
            self._receiving.discard(partial)

    def _remove_leftovers(self, tier: PeerCopyTier) -> None:
        """Removes what killed puts left in `tier` (uncommitted partial folders: since the
        spare, a whole copy's bytes; `.deleting-` folders), not the puts' in flight (listed
        first: a put names its partial before it makes it). A committed partial folder is a
        listed copy, which retention removes when it is not kept."""
        found = _commit.entries(tier.storage, tier.root)
        with self._mu:
            receiving = set(self._receiving)
        for path in (f"{tier.root}/{e.name}" for e in found if not e.committed):
            if path not in receiving:
                shutil.rmtree(path, ignore_errors=True)

    def _served(self, owner: int) -> set[int]:
        """The steps of `owner` whose held copies gets are serving now: a put neither drops
        them nor writes over them (no lock: `restore(None)` holds the tiers' locks while a
        replaced process fetches from them)."""
        with self._mu:
            return {s for o, s in self._serving if o == owner}

    def _handle_get(self, sock: socket.socket, request: dict) -> None:
        key = owner, step = int(request["owner"]), int(request["step"])
        with self._mu:  # before the folder is looked up: a put's retention from now on keeps it
            self._serving[key] = self._serving.get(key, 0) + 1
        try:
            self._send_held(sock, request, owner, step)
        finally:
            with self._mu:
                self._serving[key] -= 1
                if not self._serving[key]:
                    del self._serving[key]

    def _send_held(self, sock: socket.socket, request: dict, owner: int, step: int) -> None:
        try:
            folder = self.held(owner).step_path(step)  # `<step>/`, or the committed partial folder a kill left
            with open(f"{folder}/{COPY_RECORD}", "rb") as f:
                record = _format.load_json(f.read(MAX_HEADER_BYTES + 1), what=f"{folder}/{COPY_RECORD}", max_bytes=MAX_HEADER_BYTES)
            if str(record.get("generation")) != str(request.get("generation")):
                raise FileNotFoundError(f"{folder} holds generation {record.get('generation')}")
        except (OSError, ValueError, CheckpointError) as e:
            _send_json(sock, {"error": f"process {self.process_index} holds no copy of step {step} of process {owner}: {e}"})
            return
        _send_json(sock, record)
        sock.settimeout(self.timeout_s)  # `socket.sendfile` waits on a blocking socket with no timeout
        stream_files(sock, folder, record["files"])

    # --- addresses and holders ----------------------------------------------------------

    def address(self, process: int) -> PeerAddress:
        """Process `process`'s advertised address (waits up to `timeout_s` for it)."""
        with self._mu:
            if process in self._addresses:
                return self._addresses[process]
        if process == self.process_index:
            return self._address
        assert self._client is not None
        raw = self._client.blocking_key_value_get(self._key("addr", process), int(self.timeout_s * 1000))
        obj = _format.load_json(raw, what=f"the peer address of process {process}")
        address = PeerAddress(str(obj["host"]), int(obj["port"]), str(obj["node"]))
        with self._mu:
            self._addresses[process] = address
        return address

    def holders(self, owner: int) -> list[int]:
        """The processes that hold `owner`'s copies: one on each of the next `copies`
        nodes after the owner's (nodes sorted by name), the one at the owner's position
        within its node (modulo the node's size). Fewer when there are fewer other nodes."""
        nodes: dict[str, list[int]] = {}
        for p in range(self.process_count):
            nodes.setdefault(self.address(p).node, []).append(p)
        names = sorted(nodes)
        own = self.address(owner).node
        at = names.index(own)
        position = nodes[own].index(owner)
        out = []
        for d in range(1, min(self.copies, len(names) - 1) + 1):
            procs = nodes[names[(at + d) % len(names)]]
            out.append(procs[position % len(procs)])
        return out

    # --- sending ------------------------------------------------------------------------

    def enqueue(self, step: int, generation: str, keep: Callable[[], list[int]], after: Callable[[], None] | None,
                on_done: Callable[[int, int], None]) -> concurrent.futures.Future:
        """Sends committed local `step` to its holders in the background (after `after`,
        the local save, succeeded)."""
        job = self._sender.submit(self._send, step, generation, keep, after, on_done)
        with self._mu:
            self._jobs[step] = job
        return job

    def _send(self, step: int, generation: str, keep: Callable[[], list[int]],
              after: Callable[[], None] | None, on_done: Callable[[int, int], None]) -> int:
        if after is not None:
            try:
                after()
            except BaseException:  # the local save failed: the manager reports it; the others need not wait
                self.counts.finished(step, generation, 0, keep())
                return 0
        folder, cleanup = f"{self.local_root}/{step}", None
        verified, cpu_s = 0, time.thread_time()
        try:
            # Incremental saves: a standalone folder that carries the referenced chunks.
            folder, cleanup = _tier_references.peer_copy_folder(self.local_root, step)
            files = step_files(folder)
            holders = self.holders(self.process_index)
        except Exception as e:  # a file gone, or the coordination service has no address (jaxlib's error)
            self._failed(step, f"step {step}: {type(e).__name__}: {e}")
            holders, files = [], []
        try:
            for holder in holders:
                try:
                    if self.before_send is not None:
                        self.before_send(step, holder)
                    self._sending[step] = folder
                    self._put(holder, step, generation, files, keep())
                    verified += 1
                except Exception as e:  # the holder's answer, a broken connection, no address
                    self._failed(step, f"step {step} to process {holder}: {type(e).__name__}: {e}")
        finally:
            self._sending.pop(step, None)
            if cleanup is not None:
                cleanup()
        self.counts.finished(step, generation, verified, keep())
        self.counts.wait_counted(generation)  # local retention (`on_done`) judges by the job's counts of this attempt
        on_done(step, verified)
        self._count_cpu("send", time.thread_time() - cpu_s)
        return verified

    def _count_cpu(self, side: str, cpu_s: float) -> None:
        with self._mu:
            self.copy_cpu_s[side] = self.copy_cpu_s.get(side, 0.0) + cpu_s

    def _failed(self, step: int, text: str) -> None:
        with self._mu:
            self.last_error = text
        log.error("the peer copy of %s failed; the step survives fewer node losses", text)

    def _put(self, holder: int, step: int, generation: str, files: list[dict], keep: list[int]) -> None:
        address = self.address(holder)
        with socket.create_connection((address.host, address.port), timeout=self.timeout_s) as sock:
            block_with_timeout(sock, self.timeout_s)
            _send_json(sock, {"op": "put", "owner": self.process_index, "step": step, "generation": generation,
                              "keep": keep, "files": files})
            try:
                _peer_copy.send_copy(sock, self._sending.get(step, f"{self.local_root}/{step}"), files, self.damage_sent)
            except OSError as e:  # the holder may have answered why it stopped reading
                try:
                    answer = _recv_json(sock)
                except (OSError, ValueError):
                    raise e from None
            else:
                answer = _recv_json(sock)
        if not answer.get("ok"):
            raise CheckpointError(str(answer.get("error", "no answer")))

    def wait_all(self) -> None:
        with self._mu:
            jobs = list(self._jobs.values())
        concurrent.futures.wait(jobs)

    def pending_steps(self) -> set[int]:
        with self._mu:
            return {s for s, j in self._jobs.items() if not j.done()}

    # --- what survives ------------------------------------------------------------------

    def job_survives(self) -> dict[int, int]:
        """Own local step → node losses it survives in the whole job (`CopyCounts.job_survives`)."""
        return self.counts.job_survives()

    # --- restore ------------------------------------------------------------------------

    def inventory(self, own_steps: dict[int, str], newer_than: int | None) -> dict:
        """What this process holds newer than `newer_than`: its own steps and the copies
        it holds, each step with its generation."""
        held: dict[str, dict[str, str]] = {}
        try:
            owners = held_owners(_local_storage(), self.local_root)
        except OSError:
            owners = []
        for owner in owners:
            tier = self.held(owner)
            steps = {str(s): g for s in tier.steps() if (g := tier.generation(s)) and (newer_than is None or s > newer_than)}
            if steps:
                held[str(tier.owner)] = steps
        own = {str(s): g for s, g in own_steps.items() if newer_than is None or s > newer_than}
        return {"own": own, "held": held, "node": self.node}

    def fetch(self, step: int, generation: str, sources: Sequence[int]) -> str | None:
        """Fetches this process's own copy of `step` from the first of `sources` that
        serves it whole (lengths and crc32c checked) into its local tier. Returns None,
        or what failed at every source."""
        tier_root = self.local_root
        os.makedirs(tier_root, exist_ok=True)
        failures = []
        for source in sources:
            partial = f"{tier_root}/{_format.partial_name(str(step), generation)}"
            try:
                address = self.address(source)
                with socket.create_connection((address.host, address.port), timeout=self.timeout_s) as sock:
                    block_with_timeout(sock, self.timeout_s)
                    _send_json(sock, {"op": "get", "owner": self.process_index, "step": step, "generation": generation})
                    record = _recv_json(sock)
                    if "error" in record:
                        raise CheckpointError(str(record["error"]))
                    shutil.rmtree(partial, ignore_errors=True)
                    os.makedirs(partial)
                    _receive_files(sock, partial, record["files"])
                _commit_folder(partial, f"{tier_root}/{step}", record)
                log.warning("process %d fetched its copy of step %d from process %d", self.process_index, step, source)
                return None
            except Exception as e:  # the holder's answer, a broken connection, a damaged copy, no address
                shutil.rmtree(partial, ignore_errors=True)
                failures.append(f"process {source}: {type(e).__name__}: {e}")
                log.warning("fetching step %d of process %d from process %d failed: %s", step,
                            self.process_index, source, e)
        return "; ".join(failures) or "no process holds a copy"

    def close(self) -> None:
        self.wait_all()
        self._sender.shutdown(wait=True)
        self._server.shutdown()
        self._server.server_close()


def holding(peers: PeerService | None) -> contextlib.AbstractContextManager[None]:
    """`peers.holding()`; nothing to hold without peer copies (`peers` None)."""
    return contextlib.nullcontext() if peers is None else peers.holding()


def _local_storage():
    from .._storage import LocalStorage

    return LocalStorage()


def choose_peer_step(inventories: list[dict], directory: str) -> tuple[int, str, list[list[int]]] | None:
    """From every process's inventory (`PeerService.inventory`, in process order): the
    newest step whose share of every process is held whole (own copy or a peer's copy
    of the same generation), its generation, and per process the processes to fetch
    its share from ([] for a process with its own copy); None when no step is.

    Raises:
      RestoreAgreementError: two processes' own copies of that step are of different
        generations (a step is never assembled from two saves).
    """
    n = len(inventories)
    steps: set[int] = set()
    for inv in inventories:
        steps |= {int(s) for s in inv.get("own", {})}
        steps |= {int(s) for held in inv.get("held", {}).values() for s in held}
    for step in sorted(steps, reverse=True):
        key = str(step)
        owned = {p: str(inventories[p]["own"][key]) for p in range(n) if key in inventories[p].get("own", {})}
        if len(set(owned.values())) > 1:
            groups = "; ".join(f"{_coord.procs(ps)}: generation {g}" for ps, g in _coord.groups(owned))
            raise RestoreAgreementError(
                f"the processes disagree about step {step} of {directory}: their local copies are of different saves "
                f"({groups}); a step is never assembled from two saves. Remove the local directories' copies of step "
                f"{step} (or restore an explicit durable step) and restart"
            )
        generations = set(owned.values()) | {
            str(held[str(p)][key]) for held in (inv.get("held", {}) for inv in inventories) for p in range(n)
            if key in held.get(str(p), {})}
        generation = next(iter(owned.values())) if owned else (min(generations) if len(generations) == 1 else None)
        if generation is None:
            continue
        sources: list[list[int]] = []
        for p in range(n):
            if owned.get(p) == generation:
                sources.append([])
                continue
            holders = [h for h in range(n) if h != p and str(inventories[h].get("held", {}).get(str(p), {}).get(key)) == generation]
            if not holders:
                break
            sources.append(holders)
        else:
            return step, generation, sources
    return None
