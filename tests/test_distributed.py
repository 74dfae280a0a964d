"""The coordination service's polling, with a fake key-value client (no processes)."""

import time

import pytest

import checkpointer as ckpt
from checkpointer._coord import _distributed


class _FakeClient:
    """`key_value_dir_get` of a dict; `arrivals[n]` lands before the n-th poll."""

    def __init__(self, arrivals=(), fail_polls=()):
        self.kv: dict[str, str] = {}
        self.arrivals = list(arrivals)
        self.fail_polls = set(fail_polls)
        self.polls = 0

    def key_value_dir_get(self, prefix):
        n, self.polls = self.polls, self.polls + 1
        if n < len(self.arrivals):
            self.kv.update(self.arrivals[n])
        if n in self.fail_polls:
            raise RuntimeError("coordination service unreachable")
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def _coordinator(client, process_count, timeout_s=5.0):
    coord = _distributed.Coordinator("g1", timeout_s=timeout_s)
    coord.process_count, coord._client = process_count, client
    return coord


def test_poll_reports_waits_until_done_and_skips_foreign_keys():
    client = _FakeClient(arrivals=[{"x/0": "a"}, {"x/other": "?", "y/1": "b"}, {"x/1": "c"}], fail_polls=[1])
    reports = _distributed.poll_reports(client, "x/", time.monotonic() + 5, lambda r: len(r) == 2)
    assert reports == {0: "a", 1: "c"} and client.polls == 3  # the unreachable poll read as no reports


def test_poll_reports_returns_what_it_has_at_the_deadline():
    client = _FakeClient(arrivals=[{"x/0": "a"}])
    assert _distributed.poll_reports(client, "x/", time.monotonic() + 0.05, lambda r: False) == {0: "a"}


def test_wait_all_done_returns_summaries_in_process_order():
    client = _FakeClient(arrivals=[{"checkpointer/g1/done/1": "ok:20"}, {"checkpointer/g1/done/0": "ok:10"}])
    assert _coordinator(client, 2).wait_all_done() == ["10", "20"]


def test_wait_all_done_raises_a_reported_error_without_waiting_for_the_rest():
    client = _FakeClient(arrivals=[{"checkpointer/g1/done/2": "error:OSError: disk full"}])
    with pytest.raises(ckpt.SaveError, match="process 2 failed to write its shards: OSError: disk full"):
        _coordinator(client, 3).wait_all_done()
    assert client.polls == 1


def test_wait_all_done_names_the_silent_processes_at_the_timeout():
    client = _FakeClient(arrivals=[{"checkpointer/g1/done/0": "ok:1"}])
    with pytest.raises(ckpt.CommitTimeoutError, match=r"processes \[1, 2\] did not report"):
        _coordinator(client, 3, timeout_s=0.05).wait_all_done()


def test_wait_all_reported_counts_errors_as_reports():
    client = _FakeClient(arrivals=[{"checkpointer/g1/done/0": "error:boom", "checkpointer/g1/done/2": "ok:1"}])
    assert _coordinator(client, 3).wait_all_reported(0.05) == [1]
    client.kv["checkpointer/g1/done/1"] = "ok:1"
    assert _coordinator(client, 3).wait_all_reported(5) == []
