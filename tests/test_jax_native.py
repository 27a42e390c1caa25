"""The native cuDNN custom call's Python side (fusedattn.jax.native) and its handler's build, without
a GPU.

The handler runs in tests/gpu/test_jax.py. Here: when the path says it is unavailable and why, how
a pass is registered with the launch core (the uid of every buffer, then the workspace, then the
pass-by-value scalars; one registration per config, direction and slots; the bytes, uids and digest as the call's
attributes), what happens when cuDNN cannot rebuild a graph, the handler library building from
XLA's headers alone and finding the core's functions, and the header search's errors.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

pytest.importorskip("jax")

from fusedattn.backends.cudnn.native import build, core  # noqa: E402
from fusedattn.cache import LRUCache  # noqa: E402
from fusedattn.jax import native  # noqa: E402


@pytest.fixture
def fresh(monkeypatch):
    """A native module with no decision taken and no plans registered."""
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_plans", LRUCache(16))
    monkeypatch.delenv(native.ENV_SWITCH, raising=False)
    return native


class FakeCore:
    """core.register, recording what Python hands it."""

    def __init__(self, workspace=4096, error=None):
        self.registered = []
        self.workspace, self.error = workspace, error

    def __call__(self, blob, uids, device):
        self.registered.append((blob, uids, device))
        return self.error if self.error is not None else (core.digest(blob, uids), self.workspace)


class FakeGraphs:
    """native.serialized: a graph's bytes and {graph tensor name: uid}, counting the builds asked for."""

    def __init__(self):
        self.calls = 0

    def __call__(self, cfg, direction, device):
        self.calls += 1
        uids = {"q": 11, "k": 12, "v": 13, "o": 14, "stats": 15, "mod:cap": 21}
        if direction == "backward":
            uids.update(dO=16, dq=17, dk=18, dv=19)
        return b"graph-" + direction.encode() + cfg.encode(), uids


FORWARD = ("q", "k", "v", "o", "stats", "row_max")


def test_switched_off_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.unavailable() == f"{native.ENV_SWITCH}=0"
    assert native.plan("cfg-a", "forward", 0, FORWARD) is None


def test_a_failed_load_is_a_reason_not_an_error(fresh, monkeypatch):
    def broken():
        raise FileNotFoundError("cudnn.h not found in /nowhere")

    monkeypatch.setattr(native, "_load", broken)
    reason = native.unavailable()
    assert reason == "FileNotFoundError: cudnn.h not found in /nowhere"
    assert native.unavailable() == reason  # decided once
    assert native.plan("cfg-a", "forward", 0, FORWARD) is None


def test_registration_binds_every_buffer_then_the_workspace_then_the_scalars_once_per_pass(fresh, monkeypatch):
    fake, graphs = FakeCore(workspace=4096), FakeGraphs()
    monkeypatch.setattr(core, "register", fake)
    monkeypatch.setattr(native, "serialized", graphs)
    native._state["library"] = object()
    # forward: q, k, v, then out, stats and row_max, which this graph does not have: left unbound
    forward = native.plan("cfg-a", "forward", 3, FORWARD, ("mod:cap",))
    assert forward.workspace == 4096
    assert native.plan("cfg-a", "forward", 3, FORWARD, ("mod:cap",)) is forward  # cached: no second registration
    backward = native.plan("cfg-a", "backward", 3, ("q", "k", "v", "o", "dO", "stats", "dq", "dk", "dv", "dbias"),
                           ("mod:cap",))
    assert graphs.calls == 2 and len(fake.registered) == 2
    (blob, uids, device), (_, backward_uids, _) = fake.registered
    assert blob == b"graph-forwardcfg-a" and device == 3  # deserialized on the tracing device at once
    buffer = core.buffer_slot
    assert uids == (*map(buffer, (11, 12, 13, 14, 15)), core.UNBOUND, core.WORKSPACE, core.value_slot(21))
    assert backward_uids == (*map(buffer, (11, 12, 13, 14, 16, 15, 17, 18, 19)), core.UNBOUND, core.WORKSPACE,
                             core.value_slot(21))
    # the call carries what the handler needs to register the plan again: bytes, uids, digest
    attributes = forward.attributes
    assert set(attributes) == {"plan", "blob", "uids"}
    assert attributes["blob"].dtype == np.uint8 and attributes["blob"].tobytes() == blob
    assert attributes["uids"].dtype == np.int64 and tuple(attributes["uids"]) == uids
    assert attributes["plan"] == core.digest(blob, uids) != backward.attributes["plan"]
    assert native.plan("cfg-b", "forward", 3, FORWARD, ("mod:cap",)) is not forward  # another config
    assert native.plan("cfg-a", "forward", 3, FORWARD[:-1], ("mod:cap",)) is not forward  # other slots
    assert len(fake.registered) == 4


def test_a_graph_tensor_the_call_does_not_pass_is_an_error_when_traced(fresh, monkeypatch):
    monkeypatch.setattr(core, "register", FakeCore())
    monkeypatch.setattr(native, "serialized", FakeGraphs())
    native._state["library"] = object()
    with pytest.raises(RuntimeError, match=r"forward graph binds \['mod:cap'\], which the call does not pass"):
        native.plan("cfg-a", "forward", 0, FORWARD)


def test_digests_are_non_negative_and_name_the_content():
    digests = {core.digest(bytes([i]) * 7, (1, 2, i)) for i in range(200)}
    assert len(digests) == 200 and all(0 <= d < 2**63 for d in digests)
    assert core.digest(b"abc", (1, 2)) == core.digest(b"abc", (1, 2)) != core.digest(b"abc", (2, 1))


def test_a_graph_cudnn_cannot_rebuild_is_none_with_a_warning(fresh, monkeypatch):
    monkeypatch.setattr(core, "register", FakeCore(error="deserialize: no engine"))
    monkeypatch.setattr(native, "serialized", FakeGraphs())
    native._state["library"] = object()
    with pytest.warns(RuntimeWarning, match="could not rebuild the forward graph .*no engine"):
        assert native.plan("cfg-a", "forward", 0, FORWARD, ("mod:cap",)) is None


class _Cfg(types.SimpleNamespace):
    """The fields of a config the cudnn backend's JAX check reads; hashable, and bytes for FakeGraphs."""

    def __hash__(self):
        return hash(tuple(sorted(vars(self).items())))

    def encode(self):
        return self.name.encode()


def test_selection_moves_on_from_a_graph_cudnn_cannot_rebuild_and_says_why(fresh, monkeypatch):
    """The cudnn backend's JAX reasons ask native.rebuild_reason after its probe: a config whose forward or
    backward graph cuDNN cannot rebuild from its bytes gets that reason (selection moves on, explain shows
    it) instead of failing when the call is traced; one that rebuilds gets none; each is asked once."""
    import fusedattn.backends.cudnn as cudnn_backend

    graph_cache = types.ModuleType("fusedattn.backends.cudnn.graph_cache")  # (the real one imports cudnn)
    graph_cache.probe = lambda cfg: []
    graph_cache.current_device = lambda framework: 0
    monkeypatch.setitem(sys.modules, graph_cache.__name__, graph_cache)
    monkeypatch.setattr(native, "_rebuilds", LRUCache(16))
    monkeypatch.setattr(native, "serialized", FakeGraphs())
    monkeypatch.setattr(cudnn_backend, "unsupported", lambda cfg: [])
    monkeypatch.setattr(cudnn_backend, "_jax_launch", lambda cfg: [])
    monkeypatch.setattr(cudnn_backend, "rows_with_keys_config", lambda cfg: cfg)
    native._state["library"] = object()
    backend = cudnn_backend.CudnnBackend()
    failing = FakeCore(error="deserialize: no engine")
    monkeypatch.setattr(core, "register", failing)
    training = _Cfg(framework="jax", is_training=True, name="a")
    for _ in range(2):
        assert backend._reasons(training) == [
            "cuDNN could not rebuild the forward graph from its serialized bytes (deserialize: no engine); a JAX "
            "call launches from those bytes alone"]
    assert len(failing.registered) == 1  # asked once per config and device
    working = FakeCore()
    monkeypatch.setattr(core, "register", working)
    assert backend._reasons(_Cfg(framework="jax", is_training=True, name="b")) == []
    assert [blob for blob, _, _ in working.registered] == [b"graph-forwardb", b"graph-backwardb"]
    assert working.registered[0][1][-1] == core.WORKSPACE
    assert backend._reasons(_Cfg(framework="torch", is_training=True, name="c")) == []  # torch: not asked
    assert len(working.registered) == 2


_FAKE_CORE = r"""
#include <stdint.h>
const char *fusedattn_core_last_error(void) { return "fake"; }
int64_t fusedattn_core_register(const uint8_t *b, int64_t n, const int64_t *u, int64_t c, int64_t d) { return d; }
int64_t fusedattn_core_prepare(int64_t p, int32_t d) { return 0; }
""" + "{last}"


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_the_handler_builds_from_xla_headers_alone_and_finds_the_cores_functions(tmp_path, monkeypatch):
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path / "cache"))
    messages = []
    path = build.library_path("jax", announce=messages.append)
    assert len(messages) == 2 and "compiling" in messages[0] and "built in" in messages[1]
    import jax

    # XLA's FFI headers and our own, no cuDNN or CUDA: the core owns the only copy of the frontend
    assert build.include_dirs("jax") == [jax.ffi.include_dir(), str(build.HERE)]
    handler = ctypes.CDLL(str(path))
    assert handler.fusedattn_cudnn_execute  # the FFI symbol JAX registers
    handler.fusedattn_jax_init.argtypes = [ctypes.c_char_p]
    handler.fusedattn_jax_last_error.restype = ctypes.c_char_p

    def fake_core(name, with_execute):
        source = tmp_path / f"{name}.c"
        execute = ("int fusedattn_core_execute(int64_t p, int32_t d, void *s, void *const *x, int64_t n, void *w, "
                   "int64_t b) { return 0; }") if with_execute else ""
        source.write_text(_FAKE_CORE.replace("{last}", execute))
        target = tmp_path / f"lib{name}.so"
        compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("c++")
        subprocess.run([compiler, "-x", "c", "-shared", "-fPIC", str(source), "-o", str(target)], check=True)
        return str(target).encode()

    assert handler.fusedattn_jax_init(str(tmp_path / "missing.so").encode()) == 1
    assert b"missing.so" in handler.fusedattn_jax_last_error()
    assert handler.fusedattn_jax_init(fake_core("partial", with_execute=False)) == 1
    assert b"lacks its functions" in handler.fusedattn_jax_last_error()
    assert handler.fusedattn_jax_init(fake_core("whole", with_execute=True)) == 0


def test_a_missing_header_names_it_and_where_it_was_looked_for(tmp_path):
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "found.h").write_text("")
    assert build._first_with("found.h", [tmp_path / "nowhere", tmp_path / "here"]) == tmp_path / "here"
    with pytest.raises(FileNotFoundError, match=r"missing\.h not found in .*nowhere"):
        build._first_with("missing.h", [tmp_path / "nowhere"])


def test_the_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path))
    assert build.cache_dir() == tmp_path / "native"
    monkeypatch.delenv(build.ENV_CACHE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_dir() == tmp_path / "xdg" / "fusedattn" / "native"


def test_the_loaded_cudnn_is_read_from_the_process_maps(monkeypatch, tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 123 /site/nvidia/cudnn/lib/libcudnn.so.9\n")
    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))
    assert build.loaded_cudnn(str(maps)) == "/site/nvidia/cudnn/lib/libcudnn.so.9"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 123 /usr/lib/libc.so.6\n")
    assert build.loaded_cudnn(str(maps)) == "libcudnn.so.9"  # not loaded yet: by name


@pytest.fixture(scope="module")
def handler_library(tmp_path_factory):
    """The handler library, built once for the module's tests into a cache of their own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(build.ENV_CACHE, str(tmp_path_factory.mktemp("handler") / "cache"))
        handler = ctypes.CDLL(str(build.library_path("jax", announce=lambda message: None)))
    handler.fusedattn_jax_launch_words.restype = ctypes.c_int64
    handler.fusedattn_jax_last_error.restype = ctypes.c_char_p
    return handler


@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_the_handler_decodes_each_planned_launch_as_python_encoded_it(handler_library, monkeypatch, layout):
    """A padded or THD pass's own kernels: Python plans them (jax/sequence_steps.py) and encodes them
    (native.attributes_of_steps); the handler's decoder (jax_call.cc: each_launch, reached through
    fusedattn_jax_launch_words) gives back every launch's kernel, blocks and words, with each buffer
    word its buffer's address plus the byte offset. The kernels run in tests/gpu/test_jax.py."""
    from fusedattn.backends.cudnn.native import sequence_plans
    from fusedattn.config import AttentionConfig
    from fusedattn.jax import sequence_steps

    handler = handler_library
    monkeypatch.setattr(sequence_plans, "_compile", lambda function, cfg, target, constants, divisible=None: (
        function.__name__.encode() * 3, function.__name__, 4, 128))
    monkeypatch.setattr(sequence_steps, "_target", lambda device: types.SimpleNamespace(arch="decoder test"))
    monkeypatch.setattr(native, "_prepare_kernels", lambda key, attributes, device: None)
    ragged = layout == "thd"
    cfg = AttentionConfig(dtype="bfloat16", layout=layout, batch=3, seqlen_q=32, seqlen_kv=24, heads_q=4, heads_kv=2,
                          head_dim_qk=64, head_dim_v=32, is_training=True, device="cuda", framework="jax",
                          mask="padding_causal", softmax="learnable", padded_offsets=ragged)
    q, k, v = ((50, 4, 64), (40, 2, 64), (40, 2, 32)) if ragged else ((3, 32, 4, 64), (3, 24, 2, 64), (3, 24, 2, 32))
    forward = sequence_steps.forward(cfg, 0, {"q": q, "k": k, "o": q[:-1] + (32,),
                                              "stats": (50, 4) if ragged else (3, 4, 32)})
    backward = sequence_steps.backward(cfg, 0, {"q": q, "k": k, "v": v})
    offsets = sequence_steps.OFFSET_NAMES if ragged else sequence_steps.OFFSET_NAMES[:2]
    forward_buffers = ("q", "k", "v", "sink", *offsets, "o", "stats", sequence_steps.TABLE, "workspace")
    calls = [(forward, forward_buffers),
             (backward, ("q", "k", "v", "sink", *offsets, "o", "dO", "stats", "dq", "dk", "dv", "dsink",
                         sequence_steps.TABLE, "workspace"))]
    for steps, buffers in calls:
        attributes = native.attributes_of_steps(steps, buffers, tuple(steps.table_slots), 0)
        addresses = [0x10000 * (i + 1) for i in range(len(buffers))]
        encoded = attributes["steps"]
        for phase in (sequence_steps.BEFORE, sequence_steps.AFTER):
            out = (ctypes.c_uint64 * 1024)()
            written = handler.fusedattn_jax_launch_words(
                encoded.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(encoded.size), ctypes.c_int64(phase),
                (ctypes.c_uint64 * len(addresses))(*addresses), ctypes.c_int64(len(addresses)), out,
                ctypes.c_int64(1024))
            assert written >= 0, handler.fusedattn_jax_last_error()
            want = []
            for launch in steps.launches:
                if launch.phase == phase:
                    want += [launch.kernel, launch.blocks, len(launch.words)]
                    want += [addresses[buffers.index(w[0])] + w[1] if isinstance(w, tuple) else w % 2**64
                             for w in launch.words]
            assert list(out[:written]) == want and want
        pairs = attributes["derived"].reshape(-1, 2).tolist()
        assert pairs == [[buffers.index(sequence_steps.TABLE), offset] for offset in steps.table_slots.values()]
        images, meta = attributes["kernel_images"].tobytes(), attributes["kernel_meta"].reshape(-1, 6)
        assert [(images[a:a + n], images[c:c + m].decode(), w, s) for a, n, c, m, w, s in meta.tolist()] == [
            tuple(kernel) for kernel in steps.kernels]
    truncated = native.attributes_of_steps(forward, forward_buffers, (), 0)["steps"][:-1]
    out = (ctypes.c_uint64 * 1024)()
    assert handler.fusedattn_jax_launch_words(
        truncated.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(truncated.size), ctypes.c_int64(1),
        (ctypes.c_uint64 * 32)(*range(32)), ctypes.c_int64(32), out, ctypes.c_int64(1024)) == -1
    assert b"outside its attribute" in handler.fusedattn_jax_last_error()
