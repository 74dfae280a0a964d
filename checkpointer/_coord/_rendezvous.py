"""One rendezvous of the job's processes: a ticketed round in the coordination service's
key-value store (`jax.distributed`).

Every meeting of the processes is a *round*: the save agreement, the done reports and
commit announcement of a commit, the two rounds of a cooperative restore, the two tiers'
restore vote. A round is named by a key `K` that no other round uses (a save's number,
a generation, ...); its keys, all under `checkpointer/K/`:

```
p/<i>        process i's proposal, a JSON object; {"refused": "<error>", ...} when it
             cannot take part (it raises its own error; every other process raises
             the round's error naming it); a process that gives up waiting for
             process 0 replaces its proposal by such a refusal
verdict      process 0's answer: "ok:<payload>" | "error:<message>" | "timeout:<message>"
             | "details:[i, ...]"
detail/<i>   after "details": process i's full description (one process per distinct
             proposal), so process 0 can say what differs
final        after "details": "error:<message>"
ack/<i>      process i has the outcome; once every process has acknowledged (or
             refused), process 0 deletes every key of the round
```
O(P) keys and three requests per process (its proposal, the verdict, its ack).
Process 0 decides: it polls `p/` (5 ms, doubling up to `max_poll_s`) and calls the
round's `decide(proposals)` on what has arrived, so a refusal or a difference is known
without waiting for the rest (fail fast); a process that does not arrive within the
timeout is named. Process 0 publishes the verdict, so every process raises the same
message. The others block on the verdict: `timeout_s`, and as long again plus
`verdict_margin_s` when process 0 has arrived (it then answers within its own timeout).
With one process nothing goes through the store.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from .._errors import CheckpointError
from .._format import load_json
from ._distributed import _client, process_count, process_index

log = logging.getLogger("checkpointer")

PREFIX = "checkpointer"
# Differences shown per message (leaves, or groups of processes).
MAX_SHOWN = 8


def canonical(obj: object) -> str:
    """The canonical JSON text of `obj` (sorted keys, no spaces, ASCII): equal values,
    equal texts on every process (digests are taken over it)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


_V = TypeVar("_V")


def groups(values: Mapping[int, _V]) -> list[tuple[list[int], _V]]:
    """Processes grouped by equal value, in process order of first appearance."""
    out: list[tuple[list[int], _V]] = []
    for i in sorted(values):
        for procs_, v in out:
            if v == values[i]:
                procs_.append(i)
                break
        else:
            out.append(([i], values[i]))
    return out


def procs(processes: Sequence[int]) -> str:
    """`process 3`, or `processes 0, 1, 2` (at most `MAX_SHOWN` named, then the count)."""
    if len(processes) == 1:
        return f"process {processes[0]}"
    shown = ", ".join(map(str, processes[:MAX_SHOWN]))
    more = f", ... ({len(processes)} in all)" if len(processes) > MAX_SHOWN else ""
    return f"processes {shown}{more}"


def error_text(error: BaseException) -> str:
    """`Type: message`, as a refusal or an announcement carries an error."""
    return f"{type(error).__name__}: {error}"


def refusals(proposals: Mapping[int, Mapping]) -> dict[int, str]:
    """Process -> its error, for the proposals that are refusals."""
    return {i: str(p["refused"]) for i, p in proposals.items() if "refused" in p}


@dataclasses.dataclass(frozen=True)
class Details:
    """A verdict that needs more than the proposals: process 0 asks `processes` (one per
    distinct proposal) for their full description, then raises `message(descriptions)`
    on every process (a description is None when its process did not send it in time)."""

    processes: tuple[int, ...]
    message: Callable[[Mapping[int, object]], str]


# decide(proposals so far) -> the problem to raise on every process, a `Details`, or None.
Decide = Callable[[Mapping[int, dict]], str | Details | None]


class Round:
    """One meeting of every process, under the key `checkpointer/<key>/` (see the module).

    Args:
      key: the round's name, never used by another round (a series and a ticket).
      decide: process 0's rule, called with the proposals that have arrived (refusals
        included); returns the problem (a message naming the path, the processes and
        what differs), a `Details`, or None while nothing is wrong.
      timeout_s: how long process 0 waits for every proposal, seconds.
      what: the round in messages (`save #3 of /ckpt/100`).
      error: raised on a problem (and by the others on an error verdict).
      timeout_error: raised when processes did not arrive (default `error`).
      arrive: what a process that is late did not do (`arrive`, `report done`).
      timeout_name: the option that sets `timeout_s`, for messages (`agreement_timeout_s`).
      hint: the sentence that says how to fix a missing process.
      late_hint: the sentence for a process 0 that arrived but gave no verdict in time
        (it may have gone ahead; default `hint`).
      verdict_margin_s: extra time the others allow process 0 once it has arrived.
      max_poll_s: process 0's longest pause between polls.
      client, index, count: the key-value client and this job (tests pass fakes).

    Multi-process: every process makes the same rounds in the same order.
    """

    def __init__(
        self,
        key: str,
        *,
        decide: Decide,
        timeout_s: float,
        what: str,
        error: type[CheckpointError],
        timeout_error: type[CheckpointError] | None = None,
        arrive: str = "arrive",
        timeout_name: str = "",
        hint: str = "",
        late_hint: str | None = None,
        verdict_margin_s: float = 0.0,
        max_poll_s: float = 0.1,
        client: Any = None,
        index: int | None = None,
        count: int | None = None,
    ) -> None:
        self.key = key
        self.decide = decide
        self.timeout_s = timeout_s
        self.what = what
        self.error = error
        self.timeout_error = timeout_error or error
        self.arrive = arrive
        self.timeout_name = f" ({timeout_name})" if timeout_name else ""
        self.hint = hint
        self.late_hint = hint if late_hint is None else late_hint
        self.verdict_margin_s = verdict_margin_s
        self.max_poll_s = max_poll_s
        self.index = process_index() if index is None else index
        self.count = process_count() if count is None else count
        if client is None and self.count > 1:
            client = _client()
        self._client: Any = client if self.count > 1 else None  # None: one process, nothing to meet
        self._mine: dict = {}
        self._detail: Callable[[], object] | None = None
        self.deleted = threading.Event()  # set once process 0 has deleted the round's keys

    # --- keys --------------------------------------------------------------------------

    def _key(self, *parts: object) -> str:
        return "/".join([PREFIX, self.key, *map(str, parts)])

    def _hint(self) -> str:
        return f" {self.hint}" if self.hint else ""

    # --- every process -----------------------------------------------------------------

    def agree(
        self, proposal: Mapping, *, outcome: Callable[[dict[int, dict]], str] | None = None,
        detail: Callable[[], object] | None = None,
    ) -> str:
        """The whole round: posts `proposal`; process 0 gathers and decides, then
        publishes `outcome(proposals)` (default "") once nothing is wrong. Returns that
        payload on every process.

        Args:
          detail: this process's full description, sent only when process 0 asks
            (`Details`).
        Raises:
          `error` / `timeout_error`: the same message on every process. An exception
          of `outcome` is raised on process 0; the others raise `error` naming it.
        """
        self.post(proposal, detail=detail)
        if self.index != 0:
            return self.wait()
        got = self.gather()
        try:
            payload = outcome(got) if outcome is not None else ""
        except BaseException as e:
            self.publish_error(f"{self.what}: process 0 could not go ahead: {error_text(e)}")
            raise
        self.publish(payload)
        return payload

    def post(self, proposal: Mapping, *, detail: Callable[[], object] | None = None) -> None:
        """Posts this process's proposal (a JSON object)."""
        self._mine, self._detail = dict(proposal), detail
        if self._client is not None:
            self._client.key_value_set(self._key("p", self.index), json.dumps(self._mine))

    def refuse(self, error: BaseException | str, **fields: object) -> None:
        """Tells the others that this process will not take part (it failed before or
        instead of proposing), so they raise at once instead of waiting; its own
        caller raises its own error. Process 0 publishes the verdict too. Never raises."""
        text = error if isinstance(error, str) else error_text(error)
        self._mine = {**fields, "refused": text}
        if self._client is None:
            return
        try:
            self._client.key_value_set(self._key("p", self.index), json.dumps(self._mine))
            if self.index == 0:  # process 0 gives the verdict: there is nothing to wait for
                problem = self.decide({0: self._mine})
                self.publish_error(problem if isinstance(problem, str) else f"{self.what}: process 0 failed: {text}")
        except Exception:  # the service may be gone; the others then time out, naming us
            pass

    # --- process 0 ---------------------------------------------------------------------

    def gather(self) -> dict[int, dict]:
        """Process 0: waits for every proposal (or a problem `decide` sees in what has
        arrived); returns them all, by process.

        Raises:
          `error`: `decide` found a problem (published to the others first).
          `timeout_error`: processes did not arrive within `timeout_s` (named).
        """
        if self._client is None:
            got = {self.index: self._mine}
            problem = self.decide(got)
            if isinstance(problem, Details):
                raise self.error(problem.message({self.index: self._own_detail()}))
            if problem is not None:
                raise self.error(problem)
            return got
        deadline = time.monotonic() + self.timeout_s
        pause = 0.005
        while True:
            got = self._proposals()
            problem = self.decide(got)
            if problem is not None or len(got) == self.count or time.monotonic() >= deadline:
                break
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, self.max_poll_s)
        if isinstance(problem, Details):
            self._ask_details(problem)
        elif problem is not None:
            self._fail("error", problem)
        missing = [i for i in range(self.count) if i not in got]
        if missing:
            self._fail("timeout", (
                f"{self.what}: processes {missing} did not {self.arrive} within {self.timeout_s:g} s{self.timeout_name}; "
                f"processes {sorted(got)} did.{self._hint()}"
            ))
        return got

    def _proposals(self) -> dict[int, dict]:
        """The proposals posted so far (anything but a JSON object is skipped); an
        unreachable service reads as none."""
        try:
            entries = self._client.key_value_dir_get(self._key("p") + "/")
        except Exception:
            entries = []
        got: dict[int, dict] = {}
        for key, value in entries:
            try:
                i, proposal = int(key.rsplit("/", 1)[1]), load_json(value, what=f"proposal {key}")
            except (ValueError, TypeError):
                continue
            if isinstance(proposal, dict) and 0 <= i < self.count:
                got[i] = proposal
        return got

    def _own_detail(self) -> object:
        return self._detail() if self._detail is not None else None

    def _ask_details(self, details: Details) -> NoReturn:
        """Process 0: asks for the descriptions, then publishes the message; raises it."""
        self._client.key_value_set(self._key("verdict"), "details:" + json.dumps(list(details.processes)))
        descriptions: dict[int, object] = {self.index: self._own_detail()}
        wait_until = time.monotonic() + self.timeout_s
        for i in details.processes:
            if i == self.index:
                continue
            try:
                ms = max(1, int((wait_until - time.monotonic()) * 1000))
                descriptions[i] = load_json(self._client.blocking_key_value_get(self._key("detail", i), ms), what="a description")
            except Exception:
                descriptions[i] = None
        message = details.message(descriptions)
        self._set_outcome("final", "error:" + message)
        raise self.error(message)

    def _fail(self, kind: str, message: str) -> NoReturn:
        self.publish_error(message, kind=kind)
        raise (self.timeout_error if kind == "timeout" else self.error)(message)

    def publish(self, payload: str = "") -> None:
        """Process 0: the verdict "ok" with `payload` (what every process returns)."""
        self._set_outcome("verdict", "ok:" + payload)

    def publish_error(self, message: str, *, kind: str = "error") -> None:
        """Process 0: the error verdict (`kind` "error" or "timeout"); every other
        process raises `message`. Best effort: never raises."""
        try:
            self._set_outcome("verdict", f"{kind}:{message}")
        except Exception:
            pass

    def _set_outcome(self, name: str, value: str) -> None:
        if self._client is None:
            return
        self._client.key_value_set(self._key(name), value)
        if name == "final" or not value.startswith("details:"):
            self._detail = None  # asked for only before the outcome
        _janitor.watch(self)

    def wait_posted(self, timeout_s: float) -> list[int]:
        """Process 0, after a failure: waits until every process has posted (a
        proposal or a refusal), so none is still working on the round; returns the
        processes still silent at the deadline."""
        if self._client is None:
            return []
        deadline = time.monotonic() + timeout_s
        pause = 0.005
        while True:
            if self.deleted.is_set():  # deleted only once every process acknowledged
                return []
            missing = [i for i in range(self.count) if i not in self._proposals()]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.1)

    def complete(self) -> bool:
        """Process 0: whether every other process has acknowledged the outcome or
        refused, so the round's keys can go."""
        entries = dict(self._client.key_value_dir_get(self._key() + "/"))
        verdict = entries.get(self._key("verdict"))
        if verdict is None or (verdict.startswith("details:") and self._key("final") not in entries):
            return False
        for i in range(self.count):
            if i == self.index or self._key("ack", i) in entries:
                continue
            try:
                if "refused" in load_json(entries.get(self._key("p", i), ""), what="a proposal"):
                    continue
            except (ValueError, TypeError):
                pass
            return False
        return True

    def delete(self) -> None:
        """Process 0: deletes every key of the round."""
        self._client.key_value_delete(self._key())
        self.deleted.set()

    # --- the other processes -----------------------------------------------------------

    def wait(self) -> str:
        """Processes other than 0: the verdict's payload.

        Raises:
          `error`: process 0 published an error (its message).
          `timeout_error`: processes did not arrive (process 0's message), or process
            0 did not arrive or answer in time.
        """
        if self._client is None:
            return ""
        verdict = self._wait_verdict()
        kind, _, body = verdict.partition(":")
        if kind == "details":
            if self.index in load_json(body, what="the verdict", error=self.error):
                self._client.key_value_set(self._key("detail", self.index), json.dumps(self._own_detail()))
            wait_s = self.timeout_s + 5
            try:
                final = self._client.blocking_key_value_get(self._key("final"), int(wait_s * 1000))
            except Exception as e:
                raise self.error(
                    f"{self.what} (process {self.index}): the processes differ, and process 0 did not say how within "
                    f"{wait_s:g} s: {e}"
                ) from e
            kind, _, body = final.partition(":")
        self._detail = None
        try:
            self._client.key_value_set(self._key("ack", self.index), "")
        except Exception:  # only the clean-up of the round's keys depends on it
            pass
        if kind == "ok":
            return body
        raise (self.timeout_error if kind == "timeout" else self.error)(body)

    def _posted(self, i: int) -> bool:
        try:
            self._client.key_value_try_get(self._key("p", i))  # raises when absent
        except Exception:
            return False
        return True

    def _withdraw(self, error: BaseException) -> None:
        """Replaces this process's proposal by a refusal (the store does not overwrite
        a key: deleted, then set). Best effort: never raises."""
        self._mine = {**self._mine, "refused": error_text(error)}
        try:
            self._client.key_value_delete(self._key("p", self.index))
            self._client.key_value_set(self._key("p", self.index), json.dumps(self._mine))
        except Exception:
            pass

    def _wait_verdict(self) -> str:
        key = self._key("verdict")
        try:
            return self._client.blocking_key_value_get(key, int(self.timeout_s * 1000))
        except Exception as e:
            error = e
        if not self._posted(0):
            late = self.timeout_error(
                f"{self.what} (process {self.index}): process 0 did not {self.arrive} within "
                f"{self.timeout_s:g} s{self.timeout_name} ({error}).{self._hint()}"
            )
            # This process gives up: withdraw its proposal, so that process 0, when it
            # comes, sees a refusal instead of going ahead (committing) without it.
            # Process 0 arriving meanwhile may have seen either: its verdict then counts.
            self._withdraw(late)
            if not self._posted(0):
                raise late from error
        wait_s = self.timeout_s + self.verdict_margin_s
        try:  # process 0 is there: it answers within its own timeout
            return self._client.blocking_key_value_get(key, int(wait_s * 1000))
        except Exception as e:
            raise self.timeout_error(
                f"{self.what} (process {self.index}): process 0 arrived but gave no verdict within "
                f"{self.timeout_s + wait_s:g} s ({e}).{' ' + self.late_hint if self.late_hint else ''}"
            ) from e


class _Janitor:
    """Process 0's one background thread that deletes finished rounds: it checks each
    published round (one directory read) every 50 ms until every process has
    acknowledged, and gives up on a round after twice its timeout plus its margin (a
    process that never came keeps its round's keys; the job has failed anyway). The
    thread exits when nothing is left to watch, and at interpreter exit (`stop`, an
    `atexit` hook registered after JAX's own, so it runs first): a daemon thread still
    calling the distributed client while JAX shuts it down aborted the process
    (`terminate called after throwing an instance of ''`) after its save had committed."""

    _PAUSE_S = 0.05

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._rounds: dict[str, tuple[Round, float]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._hooked = False

    def watch(self, r: Round) -> None:
        give_up = time.monotonic() + 2 * r.timeout_s + r.verdict_margin_s + 10
        with self._mu:
            self._rounds[r.key] = (r, give_up)
            if self._thread is None and not self._stopping.is_set():
                if not self._hooked:  # after `import jax` registered its clean-up: runs before it
                    atexit.register(self.stop)
                    self._hooked = True
                self._thread = threading.Thread(target=self._run, name="checkpointer-rendezvous-cleanup", daemon=True)
                self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stops the thread (at exit): no client call after it returns, unless the
        thread is stuck in one longer than `timeout_s`. Keys left go with the service."""
        self._stopping.set()
        with self._mu:
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._mu:
                if not self._rounds or self._stopping.is_set():
                    self._thread = None
                    return
                watched = list(self._rounds.values())
            for r, give_up in watched:
                if self._stopping.is_set():
                    break
                try:
                    done = r.complete()
                    if done:
                        r.delete()
                except Exception:
                    done = False
                if done or time.monotonic() >= give_up:
                    with self._mu:
                        self._rounds.pop(r.key, None)
            self._stopping.wait(self._PAUSE_S)


_janitor = _Janitor()
