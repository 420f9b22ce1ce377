"""jobs/shutdown.py: inside an armed StopRequest the first SIGTERM/SIGINT only sets the request; a
second one, or the deadline, hands the signal to the handler that was there before; `finish` too."""

import os
import signal
import time

import pytest

from areal_jax.jobs.shutdown import stop_on_signal


class Stopped(Exception):
    pass


@pytest.fixture
def raising_sigterm():
    def handler(signum, frame):
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_first_signal_requests_second_stops(raising_sigterm):
    with pytest.raises(Stopped), stop_on_signal(30.0) as stop:
        os.kill(os.getpid(), signal.SIGTERM)  # not armed yet: the previous handler
        time.sleep(0.01)
    assert not stop.requested
    with pytest.raises(Stopped), stop_on_signal(30.0) as stop:
        stop.arm()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop.requested and stop.signum == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        pytest.fail("the second signal did not stop")
    assert signal.getsignal(signal.SIGTERM).__name__ == "handler"  # restored


def test_the_deadline_and_finish_hand_the_signal_on(raising_sigterm):
    t0 = time.monotonic()
    with pytest.raises(Stopped), stop_on_signal(0.5) as stop:
        stop.arm()
        os.kill(os.getpid(), signal.SIGTERM)
        while time.monotonic() - t0 < 10:
            time.sleep(0.01)
    assert 0.4 < time.monotonic() - t0 < 5
    with pytest.raises(Stopped), stop_on_signal(30.0) as stop:
        stop.arm()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        stop.finish()
    with stop_on_signal(30.0) as stop:  # nothing requested: finish is a no-op
        stop.arm()
        stop.finish()
