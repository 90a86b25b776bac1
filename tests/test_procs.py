"""verl_qerl.testing.procs: killing a child's whole process tree, including what left its session."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from verl_qerl.testing import procs

# The child starts a grandchild in a new session (as Ray's daemons do: out of the child's process group),
# writes its pid, and sleeps.
_PARENT = """
import os, subprocess, sys, time
ignore = sys.argv[2] == "ignore"
if ignore:
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
code = "import signal, time\\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" if ignore else "")
code += "open(__import__('sys').argv[1], 'w').close()\\ntime.sleep(300)"
ready = sys.argv[1] + ".g"
g = subprocess.Popen([sys.executable, "-c", code, ready], start_new_session=True)
while not os.path.exists(ready):
    time.sleep(0.02)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(g.pid))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(300)
"""


@contextlib.contextmanager
def _spawned(tmp_path: Path, ignore_term: bool) -> Iterator[tuple[subprocess.Popen, int]]:
    """The child and its grandchild's pid; whatever the test leaves alive is SIGKILLed afterwards."""
    proc, grandchild = _spawn(tmp_path, ignore_term)
    try:
        yield proc, grandchild
    finally:
        for pid in (proc.pid, grandchild):
            if procs.is_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _spawn(tmp_path: Path, ignore_term: bool) -> tuple[subprocess.Popen, int]:
    pid_file = tmp_path / "grandchild.pid"
    proc = subprocess.Popen([sys.executable, "-c", _PARENT, str(pid_file), "ignore" if ignore_term else "-"],
                            start_new_session=True)
    deadline = time.monotonic() + 30
    while not pid_file.exists():
        assert proc.poll() is None, f"child exited early (rc={proc.returncode})"
        assert time.monotonic() < deadline, "grandchild pid never written"
        time.sleep(0.05)
    return proc, int(pid_file.read_text())


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """Whether ``pid`` is gone or a zombie (its parent died: init reaps it, when it does) within ``within_s``."""
    deadline = time.monotonic() + within_s
    while procs.is_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_kills_grandchild_in_its_own_session(tmp_path):
    with _spawned(tmp_path, ignore_term=False) as (proc, grandchild):
        assert grandchild in procs.descendants(proc.pid)
        assert os.getsid(grandchild) != os.getsid(proc.pid)  # out of the child's session and group
        assert os.getpgid(grandchild) != proc.pid
        t0 = time.monotonic()
        procs.kill_process_trees([proc], grace_s=30.0)
        assert time.monotonic() - t0 < 15.0  # SIGTERM was enough: no need to sit out the grace period
        assert proc.returncode == -signal.SIGTERM
        assert _gone(grandchild)


def test_sigterm_ignored_is_killed_after_grace(tmp_path):
    with _spawned(tmp_path, ignore_term=True) as (proc, grandchild):
        t0 = time.monotonic()
        procs.kill_process_trees([proc], grace_s=1.0)
        elapsed = time.monotonic() - t0
        assert 1.0 <= elapsed < 15.0
        assert proc.returncode == -signal.SIGKILL
        assert _gone(grandchild)


def test_already_exited_and_empty():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    procs.kill_process_trees([proc], grace_s=0)  # reaped, group empty: nothing to do, no error
    assert proc.returncode == 0
    procs.kill_process_trees([])
    assert not procs.is_alive(2**22 + 12345)  # beyond pid_max's default: no such process


def test_kill_marked_stops_only_the_marked_and_spares_the_caller(tmp_path):
    """A shell launcher stops the leftovers of its own run (marked through the environment), never another run's,
    and never itself although it carries the marker too (`ray stop` would stop every cluster on the machine)."""
    # Each child says it is ready only once its SIGTERM disposition is set: on a loaded machine the one meant to
    # ignore SIGTERM could otherwise receive it before ``signal.signal`` ran and die of it.
    code = "import signal, sys, time\nif sys.argv[1] == 'ignore': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" \
           "open(sys.argv[2], 'w').close()\ntime.sleep(300)"
    mine = dict(os.environ, QERL_TEST_MARK=str(tmp_path))
    others = dict(os.environ, QERL_TEST_MARK=str(tmp_path) + "-other")
    ready = [tmp_path / f"ready-{i}" for i in range(3)]
    started = [subprocess.Popen([sys.executable, "-c", code, how, str(flag)], env=env, start_new_session=True)
               for (env, how), flag in zip(((mine, "term"), (mine, "ignore"), (others, "term")), ready)]
    try:
        deadline = time.monotonic() + 60
        while not all(flag.exists() for flag in ready):
            assert all(proc.poll() is None for proc in started), "a child exited before it was ready"
            assert time.monotonic() < deadline, "children never became ready"
            time.sleep(0.05)
        assert len(procs.marked_processes("QERL_TEST_MARK", str(tmp_path))) == 2
        # the caller is a shell carrying the same marker, as examples/tiny/grpo.sh is
        out = subprocess.run(["sh", "-c", f"{sys.executable} -m verl_qerl.testing.procs kill-marked QERL_TEST_MARK "
                              f"'{tmp_path}' && echo caller-alive"], env=mine, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert "stopped 2 process(es)" in out.stdout and "caller-alive" in out.stdout
        for proc in started[:2]:
            assert proc.wait(timeout=10) is not None  # SIGTERM, and SIGKILL for the one ignoring it
        assert started[1].returncode == -signal.SIGKILL
        assert started[2].poll() is None  # another run's process is untouched
        bad = subprocess.run([sys.executable, "-m", "verl_qerl.testing.procs", "kill-marked", "QERL_TEST_MARK", ""],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and "usage" in bad.stderr  # an empty value would match too much
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
