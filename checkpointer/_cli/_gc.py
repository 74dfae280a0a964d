"""`gc`: the maintenance of a manager's writer (`_manage.maintain`: crashed saves removed
or rolled forward, then `--keep-latest` retention), under the directory's writer's
lock; `--dry-run` only shows what it would do."""

from __future__ import annotations

from .. import _commit, _format, _manage
from .._errors import CheckpointError
from .._format import format_bytes
from ._inputs import _lock_holder, _open_dir
from ._ui import _UI


def _cmd_gc(args, ui: _UI) -> int:
    storage, directory = _open_dir(args.directory)
    holder = _lock_holder(storage, directory)
    if holder and not args.dry_run:
        raise CheckpointError(
            f"a CheckpointManager is using {directory} ({holder}); gc would race its saves. Run gc after it closes "
            "(a manager also removes crashed saves itself on its first save)"
        )
    actions = _commit.plan_recovery(storage, directory)
    rolled = [n for n, a in actions if a == "roll forward"]
    steps = sorted(set(_commit.committed_steps(storage, directory)) | {int(n.split(".", 1)[0]) for n in rolled})
    folders = _commit.committed_folders(storage, directory)
    own_bytes = {st: _step_bytes(storage, directory, f) for st, f in folders.items()}
    held: dict[int, list[int]] = {}
    retired_bytes: dict[int, tuple[int, int]] = {}  # step -> (freed, kept) bytes
    lock = None
    if not args.dry_run:
        if storage.supports_locks:
            from .._manage import DirectoryLock

            try:
                lock = DirectoryLock(storage, directory)
            except CheckpointError as e:
                raise CheckpointError(f"{e} (gc needs the directory to itself)") from e
        try:
            keep = _manage.KeepLatest(args.keep_latest) if args.keep_latest else None
            sizes = {st: storage.folder_bytes(f"{directory}/{f}") for st, f in folders.items()}
            recovered, doomed = _manage.maintain(storage, directory, keep=keep, kept_for_references=held)  # as a manager's writer does
            actions = [(n, a) for n, a in actions if n in set(recovered)]
            steps = sorted(set(_commit.committed_steps(storage, directory)) | set(doomed))
            for st in held:  # POSIX: what retiring freed (object stores: None, a request per file)
                before, after = sizes.get(st), storage.folder_bytes(f"{directory}/{folders.get(st, st)}")
                if before is not None and after is not None:
                    retired_bytes[st] = (max(0, before - after), after)  # the marker adds a few bytes
        finally:
            if lock is not None:
                lock.release()
    else:
        doomed = steps[: -args.keep_latest] if args.keep_latest else []
        if doomed:
            refs = {st: _manage.referenced_steps(storage, directory, f) for st, f in folders.items()}
            held = _manage.users_among(steps, doomed, refs)  # retired, not removed
            doomed = [st for st in doomed if st not in held]
    kept = [s for s in steps if s not in doomed]
    verb = {"remove": "would remove" if args.dry_run else "removed",
            "roll forward": "would roll forward" if args.dry_run else "rolled forward"}
    if ui.json_mode:
        ui.json({"directory": directory, "dry_run": args.dry_run,
                 "removed_partial": [n for n, a in actions if a == "remove"],
                 "rolled_forward": [n for n, a in actions if a == "roll forward"],
                 "removed_steps": doomed, "kept_steps": kept,
                 "freed_bytes": sum(own_bytes.get(st, 0) for st in doomed),
                 "kept_for_references": {str(st): users for st, users in held.items()},
                 "retired_steps": {str(st): {"referenced_by": users, "freed_bytes": retired_bytes.get(st, (None, None))[0],
                                             "kept_bytes": retired_bytes.get(st, (None, None))[1]}
                                   for st, users in held.items()}})
        return 0
    rows = [(verb[a], n, "crashed or replaced save" if a == "remove" else "committed, not yet renamed") for n, a in actions]
    rows += [("would remove" if args.dry_run else "removed", str(s),
              f"beyond the newest {args.keep_latest}; frees {format_bytes(own_bytes.get(s, 0))}" if s in own_bytes
              else "a retired step no step references any more") for s in doomed]
    rows += [("would retire" if args.dry_run else "retired", str(st),
              f"beyond the newest {args.keep_latest}; hidden, only the chunks steps {', '.join(map(str, users))} reference "
              f"kept (incremental saves); " + (f"freed {format_bytes(retired_bytes[st][0])}, kept {format_bytes(retired_bytes[st][1])}"
                                               if st in retired_bytes else f"held {format_bytes(own_bytes.get(st, 0))}"))
             for st, users in sorted(held.items())]
    if rows:
        ui.table(["action", "folder", "why"], rows, title=f"{directory}{' (dry run)' if args.dry_run else ''}")
    else:
        ui.line(f"{directory}: nothing to remove{' (dry run)' if args.dry_run else ''}")
    ui.line(f"kept steps: {', '.join(map(str, kept)) or 'none'}")
    if holder:
        ui.line(f"A CheckpointManager holds this directory ({holder}): gc without --dry-run would refuse to run.")
    return 0


def _step_bytes(storage, directory: str, folder: str) -> int:
    """Bytes of chunk files the step holds itself (its manifest's `process_bytes_written`;
    referenced chunks are the other steps'); 0 when unreadable."""
    try:
        return sum(_format.read_metadata(storage, f"{directory}/{folder}", check_references=False).process_bytes_written)
    except (CheckpointError, OSError):
        return 0
