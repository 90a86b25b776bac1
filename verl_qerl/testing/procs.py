"""Kill a child's whole process tree: the one way the benchmarks and example launchers stop a run.

Why more than ``proc.kill()``: ``python -m verl.trainer.main_ppo`` (and a vLLM ``LLM``) starts Ray workers,
Ray daemons and vLLM engine cores, and leaves them running when the driver dies or is killed. Killing the
child's process group (the callers start it with ``start_new_session=True``) gets most of them, but some
leave the group: Ray's daemons call ``setsid``, and a process whose parent died is reparented to init, out of
its ancestors' tree. They keep GPU memory and ports, so the next run on that GPU fails or measures wrongly.
:func:`kill_process_trees` therefore signals the group, every descendant found through ``/proc`` (whatever
its group or session), every member of the group found through ``/proc`` and, optionally, every process
carrying a marker variable in its environment (which survives reparenting); SIGTERM first, so they can shut
down, then SIGKILL for what is left after a grace period.

Linux only for the ``/proc`` walks; elsewhere only the process groups are signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["descendants", "free_port", "is_alive", "kill_marked", "kill_process_trees", "marked_processes",
           "signal_at_marker"]


def _proc_table() -> dict[int, tuple[str, int, int]]:
    """{pid: (state, ppid, pgrp)} of every process in ``/proc`` (empty where there is no ``/proc``)."""
    table: dict[int, tuple[str, int, int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
                fields = f.read().rsplit(")", 1)[1].split()
            table[int(entry)] = (fields[0], int(fields[1]), int(fields[2]))
        except (OSError, ValueError, IndexError):
            continue
    return table


def _descendants(pid: int, table: dict[int, tuple[str, int, int]]) -> set[int]:
    kids: dict[int, list[int]] = {}
    for child, (_, ppid, _) in table.items():
        kids.setdefault(ppid, []).append(child)
    found: set[int] = set()
    stack = list(kids.get(pid, []))
    while stack:
        p = stack.pop()
        if p not in found:
            found.add(p)
            stack += kids.get(p, [])
    return found


def descendants(pid: int) -> set[int]:
    """The pids of every process below ``pid`` (children, grandchildren, ...), whatever their group or
    session; not ``pid`` itself. Processes whose parent has died are reparented, so no longer found here."""
    return _descendants(pid, _proc_table())


def marked_processes(name: str, value: str) -> set[int]:
    """The pids of the processes (of this user) whose environment has ``name=value``; never this process."""
    needle = f"{name}={value}".encode()
    found: set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.add(int(entry))
        except OSError:  # gone, or another user's
            continue
    return found


def is_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a zombie has exited; only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc here: ask the kernel (a zombie counts as alive then)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _tree(procs: list[subprocess.Popen], env_markers: list[tuple[str, str]]) -> set[int]:
    """Every process of the trees of ``procs``: themselves (while not reaped), their descendants, the members of
    their process groups, and the processes marked with one of ``env_markers``."""
    table = _proc_table()
    pids: set[int] = set()
    for proc in procs:
        if proc.returncode is None:  # once reaped, its pid may belong to someone else
            pids.add(proc.pid)
            pids |= _descendants(proc.pid, table)
        pids |= {p for p, (_, _, pgrp) in table.items() if pgrp == proc.pid}
    for name, value in env_markers:
        pids |= marked_processes(name, value)
    return pids - _ancestors(os.getpid(), table)  # never this process or what started it


def _signal_all(procs: list[subprocess.Popen], pids: set[int], sig: int) -> None:
    own_group = os.getpgrp()
    for proc in procs:
        if proc.pid != own_group:  # the callers' children lead their own session: never signal ours
            try:
                os.killpg(proc.pid, sig)
            except OSError:  # ProcessLookupError: group already empty; PermissionError
                pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def kill_process_trees(procs: list[subprocess.Popen], grace_s: float = 3.0, *,
                       env_markers: Iterable[tuple[str, str]] = (), reap_timeout_s: float | None = 10.0) -> None:
    """Stop ``procs`` and everything they started, then reap ``procs``.

    SIGTERM each process group (``proc.pid``, as ``start_new_session=True`` makes it) and every process of the
    trees found now (descendants through ``/proc`` even when they left the group or session, group members,
    processes whose environment holds one of ``env_markers``' ``(NAME, value)``); wait up to ``grace_s`` for them
    to exit; SIGKILL the groups and whatever is left of the trees (looked up again: new processes included);
    then ``proc.wait()`` each, for at most ``reap_timeout_s`` (``None``: no limit; a process stuck in the kernel
    can outlive SIGKILL for a while). Already-exited processes and vanished pids are fine; errors from signals
    (ProcessLookupError, PermissionError) are ignored. ``grace_s=0`` kills at once.
    """
    procs = list(procs)
    env_markers = list(env_markers)
    first = _tree(procs, env_markers)
    _signal_all(procs, first, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        for proc in procs:
            proc.poll()  # reaps a child that exited, so that it does not linger as a zombie
        if all(proc.returncode is not None for proc in procs) and not any(is_alive(p) for p in first):
            break
        time.sleep(0.05)
    _signal_all(procs, first | _tree(procs, env_markers), signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=reap_timeout_s)
        except subprocess.TimeoutExpired:
            pass


def _ancestors(pid: int, table: dict[int, tuple[str, int, int]]) -> set[int]:
    found: set[int] = set()
    while pid in table and pid not in found and pid > 1:
        found.add(pid)
        pid = table[pid][1]
    return found


def kill_marked(name: str, value: str, grace_s: float = 5.0) -> set[int]:
    """Stop every process whose environment holds ``name=value`` (:func:`kill_process_trees` with that marker and
    no tree of its own), except this process and its ancestors (a launcher that exported the marker to its run
    also carries it). Returns the pids found marked at the start. Why: a shell launcher whose run left daemons
    behind (Ray's gcs, raylet and workers, reparented to init) stops exactly its own, where ``ray stop`` would stop
    every Ray cluster on the machine."""
    found = marked_processes(name, value) - _ancestors(os.getpid(), _proc_table())
    kill_process_trees([], grace_s, env_markers=[(name, value)])
    return found


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a torch.distributed rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shutdown_vllm_engine(llm: object) -> None:
    """Tear a vLLM ``LLM`` down so the next engine in this process starts clean (vLLM leaves
    process-global distributed state behind otherwise)."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    shutdown = getattr(llm, "shutdown", None) or getattr(llm.llm_engine.engine_core, "shutdown", None)  # type: ignore[attr-defined]
    if shutdown is not None:
        shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


if __name__ == "__main__":  # python -m verl_qerl.testing.procs kill-marked NAME VALUE (shell launchers)
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "kill-marked" or not sys.argv[3]:
        sys.exit("usage: python -m verl_qerl.testing.procs kill-marked NAME VALUE (VALUE non-empty)")
    stopped = kill_marked(sys.argv[2], sys.argv[3])
    print(f"[procs] stopped {len(stopped)} process(es) marked {sys.argv[2]}={sys.argv[3]}")


def signal_at_marker(cmd: list[str], marker: Path, signum: int = signal.SIGTERM,
                     start_timeout: float = 240.0) -> tuple[int, str]:
    """Run ``cmd``, send it ``signum`` once it has created ``marker`` (the point a test stops it at); its exit status
    and stderr. A process that exits, or never gets there within ``start_timeout`` s, fails the calling test."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + start_timeout
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"{cmd[:3]} never created {marker}"
            time.sleep(0.05)
        proc.send_signal(signum)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err
