"""The native cuDNN custom call's Python side (fusedattn/jax/native), without a GPU.

The handler itself runs in tests/gpu/test_jax.py. Here: when the path says it is unavailable
and why, how a pass is registered (the uid of every buffer, then the workspace; one
registration per config, direction and buffer count), what happens when cuDNN cannot rebuild
a graph, and the header search's errors.
"""

from __future__ import annotations

import sys
import types

import pytest

pytest.importorskip("jax")

from fusedattn.cache import LRUCache  # noqa: E402
from fusedattn.jax import native  # noqa: E402


@pytest.fixture
def fresh(monkeypatch):
    """A native module with no decision taken and no plans registered."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_plans", LRUCache(16))
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    return native


class FakeLibrary:
    """The C entry points, recording what Python hands them."""

    def __init__(self, workspace=4096, error=b""):
        self.registered, self.prepared = [], []
        self.workspace, self.error = workspace, error

    def fusedattn_register(self, data, size, uids, count, digest):
        self.registered.append((bytes(data)[:size], list(uids)[:count], digest))
        return len(self.registered) - 1

    def fusedattn_prepare(self, plan, device):
        self.prepared.append((plan, device))
        return self.workspace

    def fusedattn_last_error(self):
        return self.error


class FakeRunner:
    def __init__(self, cfg="cfg-a"):
        self.cfg = cfg
        self.serialized_calls = 0

    def serialized(self, direction, device):
        self.serialized_calls += 1
        return b"graph-" + direction.encode(), (11, 12, 13, 14) + ((15,) if direction == "forward" else (15, 16))


def test_switched_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.unavailable() == f"{native.ENV_SWITCH}=0"
    assert native.plan_id(FakeRunner(), "forward", 0, 6) is None


def test_a_failed_load_is_a_reason_not_an_error(fresh, monkeypatch):
    def broken():
        raise FileNotFoundError("cudnn.h not found in /nowhere")

    monkeypatch.setattr(native, "_load", broken)
    reason = native.unavailable()
    assert reason == "FileNotFoundError: cudnn.h not found in /nowhere"
    assert native.unavailable() == reason  # decided once
    assert native.plan_id(FakeRunner(), "forward", 0, 6) is None


def test_registration_binds_every_buffer_then_the_workspace_once_per_pass(fresh):
    library = FakeLibrary(workspace=4096)
    native._state["library"] = library
    runner = FakeRunner()
    # forward: q, k, v, then out, lse, max_logit: the graph binds five, max_logit is unbound
    forward = native.plan_id(runner, "forward", 3, 6)
    assert forward[:2] == (0, 4096)
    assert native.plan_id(runner, "forward", 3, 6) == forward  # cached: no second registration
    backward = native.plan_id(runner, "backward", 3, 9)
    assert backward[:2] == (1, 4096)
    assert runner.serialized_calls == 2
    (blob, uids, digest), (_, backward_uids, backward_digest) = library.registered
    assert (forward[2], backward[2]) == (digest, backward_digest) and digest != backward_digest
    assert -2**63 <= digest < 2**63
    assert blob == b"graph-forward"
    assert uids == [11, 12, 13, 14, 15, native.UNBOUND, native.WORKSPACE]
    assert backward_uids == [11, 12, 13, 14, 15, 16, native.UNBOUND, native.UNBOUND, native.UNBOUND,
                             native.WORKSPACE]
    assert library.prepared == [(0, 3), (1, 3)]  # deserialized on the tracing device at once
    assert native.plan_id(FakeRunner("cfg-b"), "forward", 3, 6)[:2] == (2, 4096)  # another config


def test_a_graph_cudnn_cannot_rebuild_keeps_the_callback_with_a_warning(fresh):
    library = FakeLibrary(workspace=-1, error=b"deserialize: no engine")
    native._state["library"] = library
    with pytest.warns(RuntimeWarning, match="could not rebuild the forward graph .*no engine.*Python callback"):
        assert native.plan_id(FakeRunner(), "forward", 0, 6) is None


def test_a_missing_header_names_it_and_where_it_was_looked_for(tmp_path):
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "found.h").write_text("")
    assert native._first_with("found.h", [tmp_path / "nowhere", tmp_path / "here"]) == tmp_path / "here"
    with pytest.raises(FileNotFoundError, match=r"missing\.h not found in .*nowhere"):
        native._first_with("missing.h", [tmp_path / "nowhere"])


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV_CACHE, str(tmp_path))
    assert native._cache_dir() == tmp_path / "native"
    monkeypatch.delenv(native.ENV_CACHE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native._cache_dir() == tmp_path / "xdg" / "fusedattn" / "native"


def test_the_loaded_cudnn_is_read_from_the_process_maps(monkeypatch, tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 123 /site/nvidia/cudnn/lib/libcudnn.so.9\n")
    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))
    assert native._loaded_cudnn(str(maps)) == "/site/nvidia/cudnn/lib/libcudnn.so.9"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 123 /usr/lib/libc.so.6\n")
    assert native._loaded_cudnn(str(maps)) == "libcudnn.so.9"  # not loaded yet: by name
