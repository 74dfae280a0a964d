"""The copies of each local step counted per save attempt (`_manage/_peer_counts`): two
peer services in one process play processes 0 and 1 of a job over a fake key-value store
(no JAX processes; each put is answered ok by a stub, so each copy job checks one copy).
A `force=True` re-save of a step is a second save attempt of it, with a new generation
on every process: the counts published for the first attempt must neither end a copy
job's wait for the new one nor count for it when local retention asks what survives."""

import json
import os
import threading

import pytest

from checkpointer import _coord, _format
from checkpointer._manage._peers import PeerService

G1, G2 = "20261203090000-0000000a", "20261203090500-0000000b"  # two save attempts of one step


class FakeKV:
    """The coordination service's key-value calls a peer service makes, over one dict;
    `count_reads` counts the reads of the copy counts (`.../copies/`)."""

    def __init__(self):
        self.kv: dict[str, str] = {}
        self.cond = threading.Condition()
        self.count_reads = 0

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cond:
            assert allow_overwrite or key not in self.kv, key
            self.kv[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.kv, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.kv[key]

    def key_value_dir_get(self, prefix):
        with self.cond:
            if prefix.endswith("/copies/"):
                self.count_reads += 1
                self.cond.notify_all()
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


@pytest.fixture
def job(tmp_path, monkeypatch):
    """(kv, [process 0's service, process 1's]) of a job of two processes on two nodes."""
    kv, index = FakeKV(), {"i": 0}
    monkeypatch.setattr(_coord, "process_index", lambda: index["i"])
    monkeypatch.setattr(_coord, "process_count", lambda: 2)
    monkeypatch.setattr(_coord, "client", lambda: kv)
    services = []
    for i in (0, 1):
        index["i"] = i
        s = PeerService(str(tmp_path / f"process-{i}"), str(tmp_path / "dir"), copies=1, node=f"node-{i}", timeout_s=120)
        s.holders = lambda owner: [1 - owner]  # the other process holds each process's copy
        s._put = lambda holder, step, generation, files, keep: None  # the holder answers ok
        services.append(s)
    try:
        yield kv, services
    finally:
        for s in services:
            s.close()


def _commit_local(service, step, generation):
    """A committed local step of `service`'s process, of the save attempt `generation` (its
    marker names it, as a local commit's does); a re-save replaces it."""
    folder = f"{service.local_root}/{step}"
    os.makedirs(folder, exist_ok=True)
    with open(f"{folder}/{_format.MANIFEST}", "w") as f:
        f.write("{}")
    with open(f"{folder}/{_format.COMMITTED}", "w") as f:
        f.write(json.dumps({"generation": generation, "process_index": service.process_index}))


def _copy_jobs(services, step, generation, keep):
    """Every process's copy job of `step`'s attempt `generation`, run together (each waits
    for the others' counts) and joined."""
    errors = []

    def run(s):
        try:
            s._send(step, generation, lambda: keep, None, lambda step, copies: None)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(s,)) for s in services]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_a_copy_job_of_a_new_attempt_waits_for_every_process_to_count_that_attempt(job):
    """Process 0 finishes its copy job of the re-save of step 5 first. Its wait ended at
    once on process 1's count of the first save of step 5, so local retention judged by
    counts of copies that the new attempt does not have."""
    kv, (p0, p1) = job
    for s in (p0, p1):
        _commit_local(s, 5, G1)
    _copy_jobs([p0, p1], 5, G1, [5])
    assert p0.job_survives() == p1.job_survives() == {5: 1}
    for s in (p0, p1):
        _commit_local(s, 5, G2)  # the re-save, committed locally on every process

    seen: dict[str, object] = {}

    def on_done(step, copies):  # local retention runs here
        with kv.cond:
            seen["done"] = True
            kv.cond.notify_all()
        seen["survives"] = p0.job_survives()

    reads = kv.count_reads
    sender = threading.Thread(target=p0._send, args=(5, G2, lambda: [5], None, on_done))
    sender.start()
    try:
        with kv.cond:  # its copy job ends, or it reads the counts a second time: it waits
            kv.cond.wait_for(lambda: seen.get("done") or kv.count_reads >= reads + 2, timeout=120)
            waited = not seen.get("done")
        assert waited, "process 0's copy job of the re-save ended on process 1's counts of the first save"
        assert p0.job_survives() == {5: 0}  # process 1 has counted the first save only
    finally:
        p1._send(5, G2, lambda: [5], None, lambda step, copies: None)  # process 1's copy job ends the wait
        sender.join()
    assert seen["survives"] == {5: 1}
    # Each process's key holds the count of the new attempt only: the first one's is gone.
    for i in (0, 1):
        value = json.loads(kv.kv[f"{p0._key('copies', i)}"])
        assert value["copies"] == {"5": [G2, 1]}, value


def test_a_step_saved_again_survives_no_node_loss_until_its_new_copies_are_counted(job):
    """Steps 4 and 5 survive one node loss each. Step 5 is saved again (force=True) and
    committed locally; its copies are not sent yet. The counts of its first save made it
    survive one node loss, so local retention dropped step 4 (superseded by step 5, which
    survives as many), though the copies the holders have of step 5 are of the other save."""
    _, (p0, p1) = job
    for step, generation in ((4, "20261203085000-00000004"), (5, G1)):
        for s in (p0, p1):
            _commit_local(s, step, generation)
        _copy_jobs([p0, p1], step, generation, [4, 5])
    assert p0.job_survives() == p1.job_survives() == {4: 1, 5: 1}
    for s in (p0, p1):
        _commit_local(s, 5, G2)
    assert p0.job_survives() == p1.job_survives() == {4: 1, 5: 0}
    _copy_jobs([p0, p1], 5, G2, [4, 5])
    assert p0.job_survives() == p1.job_survives() == {4: 1, 5: 1}
