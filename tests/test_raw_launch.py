"""raw_launch.learn, the one decision whether a built cuDNN graph gets a raw launcher after its public
execute (used by the torch path and the JAX lean path), with a stand-in cuDNN module and graphs."""

from __future__ import annotations

import sys
import types

import pytest

from fusedattn.backends.cudnn import raw_launch


class Graph:
    """A built graph as the frontend would show it to `_RawLaunch.usable`."""

    _is_built = True
    selected_engine = None
    _lowered_graph = object()


@pytest.fixture
def frontend(monkeypatch):
    module = types.ModuleType("cudnn")
    module.__version__ = raw_launch.RAW_LAUNCH_FRONTEND + "0"
    monkeypatch.setitem(sys.modules, "cudnn", module)
    monkeypatch.setattr(raw_launch, "ENV_RAW", "1")
    return module


def test_a_usable_graph_gets_a_launcher(frontend, monkeypatch):
    made = []
    monkeypatch.setattr(raw_launch, "_RawLaunch", type("Fake", (raw_launch._RawLaunch,), {
        "__init__": lambda self, *args: made.append(args)}))
    launcher = raw_launch.learn(Graph(), [3, 5], [0x1000, 0x2000], 0x3000)
    assert isinstance(launcher, raw_launch._RawLaunch)
    assert len(made) == 1 and made[0][1:] == ([3, 5], [0x1000, 0x2000], 0x3000)


def test_the_switch_another_frontend_or_another_engine_keeps_the_public_execute(frontend, monkeypatch):
    monkeypatch.setattr(raw_launch, "ENV_RAW", "0")
    assert raw_launch.learn(Graph(), [3], [0x1000], 0) is None
    monkeypatch.setattr(raw_launch, "ENV_RAW", "1")
    frontend.__version__ = "1.31.0"
    assert raw_launch.learn(Graph(), [3], [0x1000], 0) is None
    frontend.__version__ = raw_launch.RAW_LAUNCH_FRONTEND + "0"
    python_engine = Graph()
    python_engine.selected_engine = "frost"
    assert raw_launch.learn(python_engine, [3], [0x1000], 0) is None


def test_moved_internals_keep_the_public_execute(frontend):
    class Moved(Graph):
        def _uid_to_data(self, mapping):
            raise AttributeError("the frontend renamed its internals")

    assert raw_launch.learn(Moved(), [3], [0x1000], 0) is None
