"""core_launch: the decision whether a built cuDNN graph launches through the native core after its
public execute (used by the torch path and the JAX bridge), and the launcher's re-registration after
the core's bounded registry dropped its plan, with a stand-in core."""

from __future__ import annotations

import pytest

from fusedattn.backends.cudnn import core_launch
from fusedattn.backends.cudnn.native import core


class Graph:
    def serialize(self, as_bytes=True):
        return b"graph bytes"


class FakeCore:
    """The core's C functions as ctypes shows them: execute answers from a script of statuses."""

    def __init__(self, statuses):
        self.statuses, self.calls = list(statuses), []

    def fusedattn_core_execute(self, plan, device, stream, slots, count, workspace, bytes_):
        self.calls.append((plan, device, stream, list(slots), count, workspace, bytes_))
        return self.statuses.pop(0)

    def fusedattn_core_last_error(self):
        return b"what went wrong"


@pytest.fixture
def fake_core(monkeypatch):
    registered = []

    def register(blob, uids, device):
        registered.append((blob, uids, device))
        return 100 + len(registered), 4096

    monkeypatch.setattr(core, "register", register)
    monkeypatch.setattr(core, "unavailable", lambda: None)
    monkeypatch.delenv(core_launch.ENV_SWITCH, raising=False)
    return registered


def test_a_graph_launches_through_the_core_after_its_public_execute(fake_core, monkeypatch):
    library = FakeCore([0])
    monkeypatch.setattr(core, "library", lambda: library)
    launch = core_launch.learn(Graph(), [7, 9], device=1)
    assert fake_core == [(b"graph bytes", (7, 9), 1)] and (launch.plan_id, launch.workspace) == (101, 4096)
    launch([0x1000, 0x2000], 0x3000, stream=0x55)
    assert library.calls == [(101, 1, 0x55, [0x1000, 0x2000], 2, 0x3000, 4096)]


def test_a_plan_the_core_dropped_is_registered_again(fake_core, monkeypatch):
    library = FakeCore([core.NOT_REGISTERED, 0])
    monkeypatch.setattr(core, "library", lambda: library)
    launch = core_launch.learn(Graph(), [7], device=0)
    launch([0x1000], 0, stream=0)
    assert [call[0] for call in library.calls] == [101, 102] and len(fake_core) == 2


def test_a_failed_launch_raises_the_cores_reason(fake_core, monkeypatch):
    monkeypatch.setattr(core, "library", lambda: FakeCore([-1]))
    with pytest.raises(RuntimeError, match="what went wrong"):
        core_launch.learn(Graph(), [7], device=0)([0x1000], 0, stream=0)


def test_the_public_execute_stays_without_the_core_or_with_the_switch_off(fake_core, monkeypatch):
    monkeypatch.setenv(core_launch.ENV_SWITCH, "0")
    assert core_launch.learn(Graph(), [7], device=0) is None and "=0" in core_launch.unavailable()
    monkeypatch.delenv(core_launch.ENV_SWITCH)
    monkeypatch.setattr(core, "unavailable", lambda: "no compiler")
    assert core_launch.learn(Graph(), [7], device=0) is None
    monkeypatch.setattr(core, "unavailable", lambda: None)
    monkeypatch.setattr(core, "register", lambda *args: "cuDNN could not rebuild it")
    assert core_launch.learn(Graph(), [7], device=0) is None

    class Unserializable(Graph):
        def serialize(self, as_bytes=True):
            raise RuntimeError("a graph on the frontend's own engines")

    assert core_launch.learn(Unserializable(), [7], device=0) is None
