"""The one rendezvous (`_coord.Round`), with a fake key-value store shared by threads that
play the processes (no JAX processes): fail fast, the same message everywhere, the
missing named, details asked for, and a finished round's keys deleted."""

import threading
import time

import pytest

from checkpointer._coord import _rendezvous
from checkpointer._errors import CommitTimeoutError, SaveAgreementError, SaveError


class FakeKV:
    """The coordination service's key-value calls the library uses, over one dict."""

    def __init__(self):
        self.kv: dict[str, str] = {}
        self.cond = threading.Condition()

    def key_value_set(self, key, value):
        with self.cond:
            if key in self.kv:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.kv[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.kv, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.kv[key]

    def key_value_try_get(self, key):
        with self.cond:
            if key not in self.kv:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.kv[key]

    def key_value_dir_get(self, prefix):
        with self.cond:
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def key_value_delete(self, key):
        with self.cond:
            for k in [k for k in self.kv if k == key or k.startswith(key + "/")]:
                del self.kv[k]

    def keys_under(self, key):
        with self.cond:
            return sorted(k for k in self.kv if k.startswith(f"checkpointer/{key}/"))


def _differ(field):
    """A decide rule: a refusal, or processes whose `field` differs (fail fast)."""

    def decide(got):
        refused = _rendezvous.refusals(got)
        if refused:
            return "refused: " + "; ".join(f"process {i}: {t}" for i, t in sorted(refused.items()))
        values = {i: p.get(field) for i, p in got.items()}
        if len(set(values.values())) > 1:
            return "differ: " + "; ".join(f"{_rendezvous.procs(ps)}: {v}" for ps, v in _rendezvous.groups(values))
        return None

    return decide


def _round(kv, i, n, decide, timeout_s=2.0, error=SaveAgreementError, **kw):
    return _rendezvous.Round(
        "test/1", decide=decide, timeout_s=timeout_s, what="round #1 of /ckpt/7", error=error,
        client=kv, index=i, count=n, **kw,
    )


def _run(n, body, delays=None):
    """Runs `body(i)` on n threads (thread i starts after delays[i] s); returns per
    process ("ok", value) or (error type, message)."""
    out: dict[int, tuple] = {}

    def go(i):
        time.sleep((delays or {}).get(i, 0))
        try:
            out[i] = ("ok", body(i))
        except Exception as e:
            out[i] = (type(e).__name__, str(e))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [out.get(i) for i in range(n)]


def _wait_deleted(kv, key="test/1"):
    deadline = time.monotonic() + 5
    while kv.keys_under(key) and time.monotonic() < deadline:
        time.sleep(0.02)
    return kv.keys_under(key)


def test_a_round_returns_process_0s_payload_everywhere_and_then_deletes_its_keys():
    kv = FakeKV()
    got = _run(4, lambda i: _round(kv, i, 4, _differ("v")).agree({"v": 1}, outcome=lambda props: f"gen-{len(props)}"))
    assert got == [("ok", "gen-4")] * 4
    assert _wait_deleted(kv) == []


def test_a_difference_fails_fast_with_one_message_on_every_process():
    kv = FakeKV()
    t0 = time.monotonic()
    # Process 2 arrives late: the difference between 0 and 1 is known before it comes.
    got = _run(3, lambda i: _round(kv, i, 3, _differ("v"), timeout_s=10).agree({"v": min(i, 1)}), delays={2: 0.5})
    assert time.monotonic() - t0 < 5
    assert got == [("SaveAgreementError", "differ: process 0: 0; process 1: 1")] * 3, got
    assert _wait_deleted(kv) == []


def test_a_process_that_does_not_arrive_is_named_after_the_timeout():
    kv = FakeKV()
    got = _run(3, lambda i: None if i == 2 else _round(
        kv, i, 3, _differ("v"), timeout_s=0.3, timeout_error=CommitTimeoutError, arrive="report done",
        timeout_name="commit_timeout_s", hint="Is it alive?").agree({"v": 1}))
    message = "round #1 of /ckpt/7: processes [2] did not report done within 0.3 s (commit_timeout_s); processes [0, 1] did. Is it alive?"
    assert got[:2] == [("CommitTimeoutError", message)] * 2
    # A process that never came keeps its round's keys (the others acknowledged).
    assert "checkpointer/test/1/ack/1" in kv.keys_under("test/1")


def test_a_refusal_makes_the_others_raise_naming_it_and_the_refuser_does_not_wait():
    kv = FakeKV()

    def body(i):
        r = _round(kv, i, 3, _differ("v"), timeout_s=10)
        if i == 1:
            r.refuse(OSError("disk full"), path="/ckpt/7")
            return "refused"
        return r.agree({"v": 1})

    t0 = time.monotonic()
    got = _run(3, body)
    assert time.monotonic() - t0 < 5
    assert got[1] == ("ok", "refused")
    assert got[0] == got[2] == ("SaveAgreementError", "refused: process 1: OSError: disk full")
    assert _wait_deleted(kv) == []  # the refusal counts as process 1's acknowledgement


def test_process_0s_refusal_is_its_verdict():
    kv = FakeKV()

    def body(i):
        r = _round(kv, i, 2, _differ("v"), error=SaveError)
        if i == 0:
            r.refuse("ValueError: bad leaf")
            return "refused"
        return r.agree({"v": 1})

    got = _run(2, body, delays={1: 0.2})
    assert got == [("ok", "refused"), ("SaveError", "refused: process 0: ValueError: bad leaf")]


def test_process_0_absent_is_named_by_the_others():
    kv = FakeKV()
    got = _run(2, lambda i: None if i == 0 else _round(kv, i, 2, _differ("v"), timeout_s=0.2).agree({"v": 1}))
    assert got[1][0] == "SaveAgreementError" and "(process 1): process 0 did not arrive within 0.2 s" in got[1][1], got


def test_a_process_that_gave_up_on_process_0_makes_process_0_fail_when_it_comes():
    """Process 1 raised a timeout (for a commit: "nothing was committed"); process 0,
    arriving later, must not find every proposal there and go ahead (commit) without it."""
    kv = FakeKV()
    went_ahead = []

    def body(i):
        r = _round(kv, i, 2, _differ("v"), timeout_s=0.2 if i == 1 else 5, timeout_error=CommitTimeoutError)
        return r.agree({"v": 1}, outcome=lambda got: went_ahead.append(sorted(got)) or "committed")

    got = _run(2, body, delays={0: 0.6})
    assert got[1][0] == "CommitTimeoutError" and "(process 1): process 0 did not arrive within 0.2 s" in got[1][1], got
    assert went_ahead == [] and got[0][0] == "SaveAgreementError", got
    assert "refused: process 1: CommitTimeoutError" in got[0][1] and "process 0 did not arrive" in got[0][1], got
    assert _wait_deleted(kv) == []  # the withdrawal counts as process 1's acknowledgement


def test_details_are_asked_of_one_process_per_difference():
    kv = FakeKV()
    asked = []

    def decide(got):
        if len(got) < 3:
            return None
        digests = {i: p["digest"] for i, p in got.items()}
        if len(set(digests.values())) == 1:
            return None
        reps = tuple(ps[0] for ps, _ in _rendezvous.groups(digests))
        return _rendezvous.Details(reps, lambda descs: "leaf differs: " + ", ".join(f"{i}={descs[i]}" for i in sorted(descs)))

    def body(i):
        def detail():
            asked.append(i)
            return {"w": "f32[8]" if i == 0 else "f32[16]"}

        return _round(kv, i, 3, decide).agree({"digest": "a" if i == 0 else "b"}, detail=detail)

    got = _run(3, body)
    message = "leaf differs: 0={'w': 'f32[8]'}, 1={'w': 'f32[16]'}"
    assert got == [("SaveAgreementError", message)] * 3
    assert sorted(asked) == [0, 1]  # process 2 has process 1's digest: not asked
    assert _wait_deleted(kv) == []


def test_an_error_in_process_0s_outcome_reaches_every_process():
    kv = FakeKV()

    def outcome(got):
        raise OSError("cannot clear the old step")

    got = _run(2, lambda i: _round(kv, i, 2, _differ("v")).agree({"v": 1}, outcome=outcome))
    assert got[0] == ("OSError", "cannot clear the old step")
    assert got[1] == ("SaveAgreementError", "round #1 of /ckpt/7: process 0 could not go ahead: OSError: cannot clear the old step")


def test_wait_posted_returns_the_silent_processes():
    kv = FakeKV()
    r0 = _round(kv, 0, 3, _differ("v"))
    r0.refuse("OSError: boom")
    _round(kv, 2, 3, _differ("v")).post({"v": 1})
    assert r0.wait_posted(0.05) == [1]
    _round(kv, 1, 3, _differ("v")).post({"v": 1})
    assert r0.wait_posted(5) == []


def test_one_process_needs_no_store():
    r = _rendezvous.Round("test/1", decide=_differ("v"), timeout_s=1, what="w", error=SaveError, index=0, count=1)
    assert r.agree({"v": 1}, outcome=lambda got: "x") == "x"
    with pytest.raises(SaveError, match="refused: process 0"):
        _rendezvous.Round("test/2", decide=_differ("v"), timeout_s=1, what="w", error=SaveError, index=0, count=1).agree(
            {"refused": "no"})


def test_helpers_group_and_name_processes():
    assert _rendezvous.groups({0: "a", 1: "b", 2: "a"}) == [([0, 2], "a"), ([1], "b")]
    assert _rendezvous.procs([3]) == "process 3"
    assert _rendezvous.procs(list(range(10))) == "processes 0, 1, 2, 3, 4, 5, 6, 7, ... (10 in all)"
    assert _rendezvous.canonical({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}'


def test_the_cleanup_thread_stops_calling_the_client_at_exit():
    """At interpreter exit JAX shuts its distributed client down; a cleanup thread still
    calling it then aborted process 0 (`terminate called ...`) after its save had
    committed. `stop` (the janitor's atexit hook) ends the thread, and no call follows."""
    from checkpointer._coord._rendezvous import _Janitor

    calls, lock = [], threading.Lock()

    class NeverDone:  # a round whose other processes never acknowledge
        key = "test/never"
        timeout_s, verdict_margin_s = 60.0, 0.0

        def complete(self):
            with lock:
                calls.append(time.monotonic())
            return False

        def delete(self):
            raise AssertionError("not complete: never deleted")

    janitor = _Janitor()
    janitor.watch(NeverDone())
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls, "the janitor polls the round"
    thread = janitor._thread
    janitor.stop()
    stopped_at = time.monotonic()
    assert thread is not None and not thread.is_alive()
    time.sleep(0.2)  # several polling periods
    with lock:
        assert all(t <= stopped_at for t in calls), "a client call after stop()"
    janitor.watch(NeverDone())  # after stop (at exit), nothing starts again
    assert janitor._thread is None
