"""Faults leave nothing behind: after an interrupt, an exception, ``SystemExit`` or a
``fork``, the next call gives the module's own answer.

Each case compares a DataParallel call with the bare module on random data, with
and without ``cache_replicas`` (cached replicas and the worker pool are kept between
calls, so they are where a fault could leave something behind).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from types import FrameType

import pytest
import torch
from torch import nn

from dpmethods import DataParallel, parallel_method

__all__: list[str] = []

D = 5
N_DEV = 3
ROWS = 2  # rows per replica


class Control:
    """What the test tells the replicas; one object shared by all, so changing it
    doesn't change the module's fingerprint (cached replicas are reused)."""

    def __init__(self) -> None:
        self.target = -1.0  # the first row id of the replica that faults or blocks
        self.fault: BaseException | None = None
        self.entered = threading.Event()
        self.release = threading.Event()
        self.slow_last: threading.Event | None = None
        self.mutate = False  # set self.scale on the faulting replica


class Faulty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale = 1.0
        self.ctl = Control()

    @parallel_method
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.scale
        first, ctl = x[0, 0].item(), self.ctl
        if first == ctl.target:
            if ctl.mutate:
                self.scale = 100.0  # a change to self that must not outlive the call
            if ctl.fault is not None:
                raise ctl.fault
            ctl.entered.set()
            assert ctl.release.wait(30), "the test never released the replica"
        if ctl.slow_last is not None and first == (N_DEV - 1) * ROWS:
            # Finish only after the call returned, or after a while: a call that
            # returns without waiting for this replica then has no output from it.
            ctl.slow_last.wait(1.0)
        return y


def _batch() -> torch.Tensor:
    x = torch.randn(N_DEV * ROWS, D)
    x[:, 0] = torch.arange(N_DEV * ROWS, dtype=x.dtype)  # row ids: which replica is which
    return x


def _context(cache: bool) -> torch.autograd.grad_mode.set_grad_enabled:
    return torch.set_grad_enabled(not cache)  # the cache works under no_grad only


def _check_next_calls(dp: DataParallel, model: Faulty, cache: bool) -> None:
    ctl = model.ctl
    ctl.target, ctl.fault = -1.0, None
    for k in range(3):
        ctl.slow_last = threading.Event() if k == 0 else None
        x = _batch()
        try:
            with _context(cache):
                out = dp.encode(x)
        finally:
            if ctl.slow_last is not None:
                ctl.slow_last.set()
        with torch.no_grad():
            ref = model.encode(x)
        torch.testing.assert_close(out, ref)


@pytest.fixture
def sigint_sets_event() -> Iterator[threading.Event]:
    """A SIGINT handler that records the interrupt, then raises KeyboardInterrupt as Python's does."""
    seen = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        seen.set()
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs signal.pthread_kill")
@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_ctrl_c_while_other_replicas_run(cache: bool, sigint_sets_event: threading.Event) -> None:
    """Ctrl-C while the caller waits for replica 1: the next calls are still right.

    Before the fix, the pool's shared completion queue kept replica 1's token, so
    the next cached call returned before its replicas ran (None outputs).
    """
    assert threading.current_thread() is threading.main_thread()
    model = Faulty()
    dp = DataParallel(model, device_ids=["cpu"] * N_DEV, cache_replicas=cache)
    with _context(cache):
        dp.encode(_batch())  # builds the cache and the pool
    model.ctl.target = float(ROWS)  # replica 1 blocks until the interrupt has landed
    model.ctl.release = sigint_sets_event
    main = threading.main_thread().ident
    assert main is not None

    def interrupt() -> None:
        if model.ctl.entered.wait(30):
            signal.pthread_kill(main, signal.SIGINT)

    t = threading.Thread(target=interrupt)
    t.start()
    with pytest.raises(KeyboardInterrupt), _context(cache):
        dp.encode(_batch())
    t.join()
    assert sigint_sets_event.is_set()
    _check_next_calls(dp, model, cache)


_FORK_SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch
    from torch import nn
    from dpmethods import DataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))
    dps = [DataParallel(model, device_ids=["cpu"] * 3, cache_replicas=c) for c in (True, False)]
    x = torch.randn(7, 5)
    with torch.no_grad():
        ref = model(x)
        for dp in dps:
            dp(x)  # the cached wrapper now holds replicas and a worker pool

    def check():
        with torch.no_grad():
            for dp in dps:
                for _ in range(3):
                    torch.testing.assert_close(dp(x), ref)
        out = dps[1](x)  # with grad: fresh replicas, fresh threads
        out.sum().backward()
        assert model[0].weight.grad is not None

    pid = os.fork()
    if pid == 0:
        try:
            check()
        except BaseException as exc:
            print("child failed:", repr(exc), flush=True)
            os._exit(1)
        os._exit(0)
    for _ in range(600):  # the parent kills a hung child, so a failure leaves no process
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise SystemExit("child hung")
    assert os.waitstatus_to_exitcode(status) == 0, status
    check()  # the parent still works too
    print("fork ok")
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_after_cached_call() -> None:
    """A child forked after a cached call works (it used to hang on the pool's dead workers)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT], cwd=root, env=env, capture_output=True,
        text=True, timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fork ok" in done.stdout
