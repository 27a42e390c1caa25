"""The `fusedattn` command (`python -m fusedattn info | explain`), run as subprocesses on a machine
without a GPU, and `import fusedattn` staying free of torch and JAX."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
from needs_torch import import_torch

ROOT = Path(__file__).resolve().parents[1]
BACKEND_NAMES = ("small_seq", "cudnn", "triton", "reference")
TIMEOUT = 120

# name -> argv after `python -m fusedattn`; all run at once (each start imports Python, some torch).
COMMANDS = {
    "info": ["info"],
    "explain-default": ["explain"],
    "explain-cpu": ["explain", "--device", "cpu"],
    "explain-thd": ["explain", "--mask", "causal", "--window", "128,0", "--hkv", "4", "--dv", "64", "--layout", "thd",
                    "--dtype", "float16", "--bias", "alibi", "--softmax", "learnable", "--dropout", "0.1",
                    "--no-training", "--device", "cpu"],
    "explain-bias": ["explain", "--mask", "causal", "--window", "128,0", "--hkv", "4", "--dv", "64",
                     "--dtype", "float16", "--bias", "post_scale", "--softmax", "learnable", "--dropout", "0.1",
                     "--no-training", "--device", "cpu"],
    "explain-cuda": ["explain", "--device", "cuda", "--dtype", "float16"],
    "explain-forced": ["explain", "--device", "cuda", "--backend", "cudnn"],
    "explain-jax": ["explain", "--device", "cpu", "--framework", "jax", "--sq", "1", "--skv", "16"],
    "bad-window-causal": ["explain", "--mask", "causal", "--window", "4,4", "--device", "cpu"],
    "bad-window-text": ["explain", "--window", "4", "--device", "cpu"],
    "bad-thd-bias": ["explain", "--layout", "thd", "--bias", "post_scale", "--device", "cpu"],
    "bad-gqa": ["explain", "--hq", "16", "--hkv", "3", "--device", "cpu"],
    "bad-backend-name": ["explain", "--backend", "flash", "--device", "cpu"],
    "bad-subcommand": ["bench-everything"],
    # first-hour spellings: short dtype names, a window starting with "-" after a space
    "explain-aliases": ["explain", "--dtype", "bf16", "--window", "-1,-1", "--device", "cpu"],
    "explain-fp16": ["explain", "--dtype", "fp16", "--window=-1,-1", "--device", "cpu"],
    "explain-fp32": ["explain", "--dtype", "fp32", "--window", "-1,0", "--mask", "causal", "--device", "cpu"],
    "bad-explain-flag": ["explain", "--windw", "4", "--device", "cpu"],
    "bad-dtype": ["explain", "--dtype", "int8", "--device", "cpu"],
}


def _env():
    env = dict(os.environ)
    env.pop("FUSEDATTN_BACKEND", None)
    env.pop("FUSEDATTN_LOG", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def runs():
    """Every command's CompletedProcess, run in parallel."""
    procs = {
        name: subprocess.Popen([sys.executable, "-m", "fusedattn", *argv], cwd=ROOT, env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, argv in COMMANDS.items()
    }
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=TIMEOUT)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


def ok(runs, name) -> list[str]:
    result = runs[name]
    assert result.returncode == 0, f"{name}: exit {result.returncode}\n{result.stderr}"
    return result.stdout.splitlines()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


# --------------------------------------------------------------------------- info

def test_info_lists_versions(runs):
    lines = ok(runs, "info")
    import fusedattn

    assert lines[0] == f"fusedattn {fusedattn.__version__}"
    assert lines[1].startswith(f"python {sys.version.split()[0]} (")
    for label, dist in (("torch", "torch"), ("jax", "jax"), ("jaxlib", "jaxlib"), ("triton", "triton")):
        assert f"{label}: {_version(dist)}" in lines, label
    if importlib.util.find_spec("cudnn") is None:
        assert "cudnn frontend: not installed" in lines
    else:
        assert any(line.startswith("cudnn frontend: ") for line in lines)


def test_info_lists_devices_without_a_gpu(runs):
    lines = ok(runs, "info")
    devices = lines[lines.index("devices:") + 1:lines.index("backends (in selection order):")]
    assert devices and all(line.startswith("  ") for line in devices)
    torch = import_torch("checks torch's device line")
    if not torch.cuda.is_available():
        assert "  torch: no CUDA device" in devices


def test_info_lists_every_backend_with_availability_and_reasons(runs):
    lines = ok(runs, "info")
    table = lines[lines.index("backends (in selection order):") + 1:]
    table = table[:next(i for i, line in enumerate(table) if line.startswith("native launch libraries"))]
    heads = [line for line in table if line.startswith("  ") and not line.startswith("    ")]
    assert [h.split(":")[0].strip() for h in heads] == list(BACKEND_NAMES)
    assert "  reference: available" in heads
    assert "  cudnn: unavailable" in heads
    if importlib.util.find_spec("cudnn") is None:
        assert "    - package nvidia-cudnn-frontend not installed (import cudnn)" in table
    assert ("    runs on: cpu, cuda; dtypes: float16, bfloat16, float32, float64; frameworks: torch, jax"
            in table)
    # each backend has at least its "runs on" line, and every unavailable one a reason
    for i, head in enumerate(heads):
        body = table[table.index(head) + 1:table.index(heads[i + 1]) if i + 1 < len(heads) else None]
        assert body[-1].startswith("    runs on: ")
        if head.endswith("unavailable"):
            assert body[0].startswith("    - ")


# --------------------------------------------------------------------------- explain

def backend_lines(lines: list[str]) -> dict[str, str]:
    table = lines[lines.index("backends (in selection order):") + 1:]
    return {line.split(":")[0].strip(): line.split(":", 1)[1].strip()
            for line in table if line.startswith("  ") and not line.startswith("    ")}


@pytest.mark.parametrize("name", ["explain-default", "explain-cpu", "explain-thd", "explain-bias", "explain-cuda",
                                  "explain-forced", "explain-jax"])
def test_explain_prints_selection_and_every_backend(runs, name):
    lines = ok(runs, name)
    assert lines[0].startswith("config: layout=")
    assert lines[1].startswith("selected: ")
    verdicts = backend_lines(lines)
    assert list(verdicts) == list(BACKEND_NAMES)


def test_explain_default_flags(runs):
    lines = ok(runs, "explain-default")
    torch = import_torch("explain's default device is torch's")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert lines[0] == ("config: layout=bshd dtype=bfloat16 B=4 Sq=4096 Skv=4096 Hq=16 Hkv=16 D=128 Dv=128 "
                        f"mask=none scale=0.0883883 training=True device={device} framework=torch")
    if device == "cpu":
        assert lines == ok(runs, "explain-cpu")


def test_explain_cpu(runs):
    lines = ok(runs, "explain-cpu")
    assert lines[1] == "selected: reference"
    verdicts = backend_lines(lines)
    assert verdicts["reference"] == "selected"
    assert all(verdicts[n] == "rejected" for n in ("small_seq", "cudnn", "triton"))
    assert lines.count("    - device cpu not supported (needs cuda)") == 3


def test_explain_with_many_flags(runs):
    lines = ok(runs, "explain-thd")
    assert lines[0] == ("config: layout=thd dtype=float16 B=4 Sq=4096 Skv=4096 Hq=16 Hkv=4 D=128 Dv=64 "
                        "mask=padding_causal window=(128, 0) bias=alibi[16] softmax=learnable dropout_p=0.1 "
                        "scale=0.0883883 training=False device=cpu framework=torch")
    assert lines[1] == "selected: reference"
    lines = ok(runs, "explain-bias")
    assert " bias=post_scale[1, 16, 4096, 4096] " in lines[0]
    assert " Hkv=4 D=128 Dv=64 mask=causal window=(128, 0) " in lines[0]
    assert lines[1] == "selected: reference"


def test_explain_for_a_gpu_on_a_machine_without_one(runs):
    lines = ok(runs, "explain-cuda")
    assert " device=cuda " in lines[0]
    assert lines[1] == "selected: reference"
    assert not any("device cuda not supported" in line for line in lines)


def test_explain_forced_backend(runs):
    lines = ok(runs, "explain-forced")
    assert lines[1] == ("selected: none; backend 'cudnn' (forced by backend='cudnn') cannot run this call, "
                        "which raises NoBackendError")
    verdicts = backend_lines(lines)
    assert verdicts["cudnn"] == "rejected"
    assert verdicts["reference"] == "supported (not used: forced by backend='cudnn')"


def test_explain_jax_framework(runs):
    lines = ok(runs, "explain-jax")
    assert " Sq=1 Skv=16 " in lines[0] and lines[0].endswith(" framework=jax")
    assert "    - framework jax not supported (supports torch)" in lines


# --------------------------------------------------------------------------- bad flags

@pytest.mark.parametrize("name, message", [
    ("bad-window-causal",
     "fusedattn explain: window: right=4 looks ahead of the diagonal, which mask 'causal' forbids"),
    ("bad-window-text", "argument --window: expected LEFT,RIGHT such as 128,0 or -1,-1 (-1 = unbounded), got '4'"),
    ("bad-thd-bias", "fusedattn explain: bias: a bias tensor is not defined for THD layouts"),
    ("bad-gqa", "fusedattn explain: heads: Hq=16 must be a multiple of Hkv=3"),
    ("bad-subcommand", "invalid choice: 'bench-everything'"),
    ("bad-backend-name", "--backend: invalid choice: 'flash'"),
], ids=lambda value: value if value in COMMANDS else "")
def test_bad_flags_exit_2_with_the_message_on_stderr(runs, name, message):
    result = runs[name]
    assert result.returncode == 2, f"{name}: exit {result.returncode}\nstdout:\n{result.stdout}"
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


# --------------------------------------------------------------------------- first-hour spellings

def test_explain_takes_short_dtype_names_and_a_window_written_with_a_space(runs):
    assert ok(runs, "explain-aliases") == ok(runs, "explain-cpu")  # bf16 is the default's alias; -1,-1 the default
    assert " dtype=float16 " in ok(runs, "explain-fp16")[0]
    first = ok(runs, "explain-fp32")[0]
    assert " dtype=float32 " in first and " mask=causal " in first


def test_the_window_hint_is_a_spelling_that_parses(runs):
    result = runs["bad-window-text"]
    assert "such as 128,0 or -1,-1" in result.stderr
    assert ok(runs, "explain-aliases")  # `--window -1,-1`, as the hint writes it, parses


def test_an_unknown_explain_flag_shows_explains_usage_and_flags(runs):
    result = runs["bad-explain-flag"]
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.startswith("usage: fusedattn explain ")
    assert "fusedattn explain: error: unrecognized arguments: --windw 4" in result.stderr
    assert "--windw: did you mean --window?" in result.stderr
    takes = next(line for line in result.stderr.splitlines() if line.startswith("fusedattn explain takes: "))
    for flag in ("--layout", "--dtype", "--window", "--device", "--backend"):
        assert flag in takes


def test_a_bad_dtype_lists_the_names(runs):
    result = runs["bad-dtype"]
    assert result.returncode == 2
    assert "argument --dtype: invalid choice: 'int8'" in result.stderr and "bfloat16" in result.stderr


def test_info_into_a_reader_that_stops_early_ends_without_a_traceback():
    # Unbuffered, so info writes line by line and meets the closed pipe (buffered, one final write could fit).
    env = {**_env(), "PYTHONUNBUFFERED": "1"}
    info = subprocess.Popen([sys.executable, "-m", "fusedattn", "info"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader = subprocess.run([sys.executable, "-c", "import sys; sys.stdin.readline()"], stdin=info.stdout,
                            capture_output=True, timeout=TIMEOUT)
    info.stdout.close()  # the reader's end is the only one left open: it has gone
    err = info.communicate(timeout=TIMEOUT)[1].decode()
    assert reader.returncode == 0
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert info.returncode in (0, 1)


def test_info_does_not_call_a_gpu_only_backend_available_without_a_gpu(runs):
    torch = import_torch("small_seq's reason names torch's CUDA devices")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    lines = ok(runs, "info")
    start = lines.index("  small_seq: unavailable")
    assert lines[start + 1].startswith("    - no CUDA device visible to torch")


def test_info_says_a_backend_on_the_triton_interpreter_is_cpu_only(monkeypatch, capsys):
    from fusedattn import cli
    from fusedattn.backends.small_seq import ENV_ON_CPU

    monkeypatch.setenv(ENV_ON_CPU, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = next(b for b in cli.BACKENDS if b.name == "small_seq")
    status, reasons = cli._backend_status(backend, (False, "no CUDA device visible to torch"))
    if backend.availability():
        pytest.skip(f"small_seq unavailable here anyway: {backend.availability()}")
    assert status == "available (Triton interpreter on the CPU only: no CUDA device visible to torch)"
    assert reasons == []
    status, reasons = cli._backend_status(backend, (True, ""))
    assert status == "available"


# --------------------------------------------------------------------------- console script, imports

def _console_script() -> str | None:
    sibling = Path(sys.executable).with_name("fusedattn")
    if sibling.is_file() and os.access(sibling, os.X_OK):
        return str(sibling)
    return shutil.which("fusedattn")


def test_console_script():
    script = _console_script()
    if script is None:
        pytest.skip("the fusedattn console script is not installed (not next to python, not on PATH)")
    result = subprocess.run([script, "explain", "--device", "cpu"], capture_output=True, text=True, env=_env(),
                            timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert "selected: reference" in result.stdout.splitlines()
    result = subprocess.run([script, "explain", "--mask", "causal", "--window", "4,4", "--device", "cpu"],
                            capture_output=True, text=True, env=_env(), timeout=TIMEOUT)
    assert result.returncode == 2 and "window: right=4" in result.stderr


@pytest.mark.parametrize("statement", [
    "import fusedattn",
    "import fusedattn.cli",
    "import fusedattn, fusedattn.layout, fusedattn.cache, fusedattn.arguments",
])
def test_import_fusedattn_imports_neither_torch_nor_jax(statement):
    script = textwrap.dedent(f"""\
        import sys
        {statement}
        heavy = sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'jax', 'jaxlib', 'flax'}})
        print(','.join(heavy))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(),
                            cwd=ROOT, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_info_says_where_the_native_libraries_are_and_why_not(runs):
    lines = ok(runs, "info")
    native = lines[next(i for i, line in enumerate(lines) if line.startswith("native launch libraries")) + 1:]
    assert [line.split(":")[0].strip() for line in native[:2]] == ["core", "torch"]
    if importlib.util.find_spec("cudnn") is None:
        assert "package nvidia-cudnn-frontend not installed" in native[0]


def test_build_names_what_is_missing(capsys, monkeypatch):
    from fusedattn.backends.cudnn.native import build
    from fusedattn.cli import main

    def missing(kind):
        raise RuntimeError("package nvidia-cudnn-frontend not installed (import cudnn: no module)")

    monkeypatch.setattr(build, "built_path", missing)
    assert main(["build", "--kinds", "core"]) == 1
    assert "core: cannot be built: RuntimeError: package nvidia-cudnn-frontend not installed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["build", "--kinds", "nonsense"])
