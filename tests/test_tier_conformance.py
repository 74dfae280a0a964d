"""One tier interface (`_manage._tier.Tier`): the same conformance test runs against the
local, peer and durable tiers; and one storage registry (`register_storage`, a Storage
object or a (Storage, path) pair wherever a location is accepted)."""

import threading

import numpy as np
import pytest

import checkpointer as ckpt
from checkpointer._manage._peers import PeerService, step_files
from checkpointer._manage._tier import DurableTier, LocalStepTier, PeerCopyTier, Tier
from checkpointer._restore import RestoreOptions, restore_from
from checkpointer._storage import KvStorage, LocalStorage, storage_for


def _tree(step):
    return {"w": np.arange(12.0, dtype=np.float32).reshape(3, 4) + step, "step": step}


@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    """Every tier holding steps 1 and 2 of one manager (one process): the local tier, the
    durable tier, and a peer tier (this process's own server holding a copy it sent)."""
    root = tmp_path_factory.mktemp("tiers")
    mngr = ckpt.CheckpointManager(str(root / "durable"), local_directory=str(root / "local"),
                                  keep_local=ckpt.KeepLatest(2), async_save=False)
    for step in (1, 2):
        mngr.save(step, _tree(step))
    local = mngr._tiers
    peers = PeerService(local.root, mngr.directory, copies=1, node="a", timeout_s=30)
    try:
        for step in (1, 2):  # to itself: the same server and checks a peer on another node runs
            peers._put(0, step, local.tier.generation(step), step_files(f"{local.root}/{step}"), [1, 2])
    finally:
        peers.close()
    out = {"local": local.tier, "durable": local.durable_tier, "peer": peers.held(0)}
    yield out
    mngr.close()


@pytest.mark.parametrize("name", ["local", "peer", "durable"])
def test_every_tier_lists_reads_names_and_removes_its_steps_alike(tiers, name):
    tier: Tier = tiers[name]
    assert isinstance(tier, Tier) and tier.name == name and tier.survives
    assert {"local": LocalStepTier, "peer": PeerCopyTier, "durable": DurableTier}[name] is type(tier)
    assert isinstance(tier.retention_mu, type(threading.Lock()))
    assert tier.root in tier.describe()
    assert tier.steps() == [1, 2]
    # The same save attempt on every tier: a step is never assembled from two saves.
    assert tier.generation(2) == tiers["local"].generation(2) and tier.generation(2) is not None
    assert tier.generation(7) is None
    out = restore_from(tier.storage, tier.step_path(2), None, RestoreOptions())
    np.testing.assert_array_equal(out["w"], _tree(2)["w"])
    assert out["step"] == 2
    with pytest.raises(ckpt.CheckpointError, match="holds no committed step 7"):
        tier.step_path(7)
    with tier.retention_mu:
        tier.remove(1)
    assert tier.steps() == [2]


def test_a_peer_copy_that_fails_its_crc32c_check_is_refused_and_nothing_is_committed(tmp_path):
    root = str(tmp_path / "process-0")
    ckpt.save(f"{root}/5", _tree(5))
    files = step_files(f"{root}/5")
    peers = PeerService(root, str(tmp_path / "dir"), copies=1, node="a", timeout_s=30)

    def flip_a_manifest_byte(key, block):  # after the sender took its crc32c: damaged on the way
        if key.endswith("manifest.json"):
            block[0] ^= 1

    try:
        peers.damage_sent = flip_a_manifest_byte
        with pytest.raises(ckpt.CheckpointError, match=r"manifest.json has crc32c 0x[0-9a-f]+, expected 0x[0-9a-f]+"):
            peers._put(0, 5, "g", files, [5])
        assert peers.held(0).steps() == []
        peers.damage_sent = None
        peers._put(0, 5, "g", files, [5])  # the bytes intact: held, checked
        assert peers.held(0).steps() == [5] and peers.held(0).generation(5) is not None
    finally:
        peers.close()
    import os

    assert os.listdir(peers.held(0).root) == ["5"]  # no partial folder left behind


def test_a_holder_writes_the_next_copy_over_the_files_of_the_copy_it_dropped(tmp_path):
    import os

    from checkpointer._manage._peer_copy import SPARE

    root = str(tmp_path / "process-0")
    for step in (1, 2, 3):
        ckpt.save(f"{root}/{step}", _tree(step))
    peers = PeerService(root, str(tmp_path / "dir"), copies=1, node="a", timeout_s=30)
    try:
        held = peers.held(0)
        peers._put(0, 1, "g", step_files(f"{root}/1"), [1])
        inode = os.stat(f"{held.root}/1/manifest.json").st_ino
        peers._put(0, 2, "g", step_files(f"{root}/2"), [2])
        assert sorted(os.listdir(held.root)) == ["2", SPARE] and held.steps() == [2]  # the spare is no step
        peers._put(0, 3, "g", step_files(f"{root}/3"), [3])
        assert sorted(os.listdir(held.root)) == ["3", SPARE] and held.steps() == [3]
        assert os.stat(f"{held.root}/3/manifest.json").st_ino == inode  # step 1's file, written over
        out = restore_from(held.storage, held.step_path(3), None, RestoreOptions())
        assert out["step"] == 3
    finally:
        peers.close()


def test_storage_backends_come_from_one_registry_and_a_storage_object_is_a_location(tmp_path):
    opened = []

    class Recording(LocalStorage):
        pass

    def factory(url):
        opened.append(url)
        return Recording(), str(tmp_path / url.split("://", 1)[1])

    ckpt.register_storage("rec", factory)
    try:
        with pytest.raises(ValueError, match="registered already"):
            ckpt.register_storage("rec", factory)
        storage, path = storage_for("rec://run")
        assert isinstance(storage, Recording) and path == str(tmp_path / "run") and opened == ["rec://run"]
        ckpt.save("rec://run/3", _tree(3))
        assert ckpt.restore(str(tmp_path / "run" / "3"))["step"] == 3
    finally:
        from checkpointer._storage import _kvstore

        _kvstore._BACKENDS.pop("rec")
    with pytest.raises(ckpt.CheckpointError, match=r"register a backend of rec://"):
        storage_for("rec://run")
    with pytest.raises(ValueError, match="scheme"):
        ckpt.register_storage("Bad Scheme", factory)
    # A (Storage, path) pair, or a Storage object with a root, instead of a URL.
    pair = (LocalStorage(), str(tmp_path / "pairs"))
    with ckpt.CheckpointManager(pair, async_save=False) as mngr:
        mngr.save(4, _tree(4))
        assert mngr.all_steps() == [4] and mngr.directory == str(tmp_path / "pairs")
    mem = KvStorage("memory://")
    assert storage_for(mem) == (mem, "memory://")
    with pytest.raises(TypeError, match=r"pass \(storage, path\)"):
        storage_for(LocalStorage())


def test_a_peer_put_whose_names_would_leave_the_tier_is_refused_and_touches_nothing(tmp_path):
    """Owner, step and generation of a put become folder names on the holder (which
    removes a stale partial folder first): a hostile or broken peer must not reach
    anything outside the holder's tier."""
    import json
    import os
    import socket
    import struct

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    root = str(tmp_path / "process-0")
    peers = PeerService(root, str(tmp_path / "dir"), copies=1, node="a", timeout_s=30)
    try:
        address = peers.address(0)
        hostile = "x/../../../../victim"  # <tier>/5.partial-x/../../../../victim is tmp_path/victim
        for owner, step, generation in ((0, 5, hostile), (0, 5, hostile), (0, 5, "a/b"), (0, -1, "g"), (7, 5, "g")):
            request = json.dumps({"op": "put", "owner": owner, "step": step, "generation": generation,
                                  "keep": [], "files": []}).encode()
            with socket.create_connection((address.host, address.port), timeout=30) as sock:
                sock.sendall(struct.pack(">I", len(request)) + request)
                sock.shutdown(socket.SHUT_WR)
                answer = b"".join(iter(lambda: sock.recv(1 << 16), b""))
                assert b'"ok": true' not in answer
        assert (victim / "keep.txt").read_text() == "precious"
        assert peers.held(0).steps() == []
        assert not os.path.exists(f"{root}/peer-copies") or all(
            not name.startswith("5") for _, dirs, files in os.walk(f"{root}/peer-copies") for name in dirs + files)
    finally:
        peers.close()
