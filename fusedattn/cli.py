"""The `fusedattn` command: `info` (versions, devices, backends) and `explain` (selection for a config)."""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import os
import platform
import sys
from collections.abc import Callable, Sequence

from fusedattn.backends import BACKENDS, backend_names
from fusedattn.config import DTYPES, AttentionConfig, BiasType, Layout, Mask, SoftmaxType
from fusedattn.selection import explain

__all__ = ["main"]

# (label, import name, distribution name) of what `info` reports.
_PACKAGES = (
    ("torch", "torch", "torch"),
    ("jax", "jax", "jax"),
    ("jaxlib", "jaxlib", "jaxlib"),
    ("flax", "flax", "flax"),
    ("triton", "triton", "triton"),
    ("cudnn frontend", "cudnn", "nvidia-cudnn-frontend"),
)


def _version(import_name: str, dist_name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        pass
    try:
        module = importlib.import_module(import_name)
    except Exception:
        return "not installed"
    return getattr(module, "__version__", "installed (version unknown)")


def _devices() -> list[str]:
    lines = []
    try:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                lines.append(f"torch cuda:{i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
        else:
            lines.append("torch: no CUDA device")
    except ImportError:
        pass
    try:
        import jax

        lines.append("jax: " + ", ".join(str(d) for d in jax.devices()))
    except ImportError:
        pass
    except Exception as error:  # a broken plugin should not take `info` down
        lines.append(f"jax: no devices ({error})")
    return lines or ["no framework installed to list devices"]


def _cuda_visible() -> tuple[bool, str]:
    """Whether torch sees a CUDA device (every GPU backend launches through torch), and if not, why."""
    try:
        import torch
    except ImportError:
        return False, "no CUDA device visible (torch not installed)"
    if torch.cuda.is_available():
        return True, ""
    return False, "no CUDA device visible to torch"


def _backend_status(backend, cuda: tuple[bool, str]) -> tuple[str, list[str]]:
    """("available" or "unavailable", possibly with a note; reasons) for one backend on this machine."""
    reasons = list(backend.availability())
    visible, why = cuda
    note = ""
    if "cuda" in backend.devices and not visible:
        if "cpu" not in backend.devices:
            reasons.append(f"{why} (runs on cuda only)")
        elif any(module == "triton" for module, _ in backend.packages):
            note = f" (Triton interpreter on the CPU only: {why})"
    return ("unavailable" if reasons else "available" + note), reasons


def cmd_info(_args) -> int:
    import fusedattn

    print(f"fusedattn {fusedattn.__version__}")
    print(f"python {platform.python_version()} ({sys.executable})")
    for label, module, dist in _PACKAGES:
        print(f"{label}: {_version(module, dist)}")
    print("devices:")
    for line in _devices():
        print(f"  {line}")
    print("backends (in selection order):")
    cuda = _cuda_visible()
    for backend in BACKENDS:
        status, reasons = _backend_status(backend, cuda)
        print(f"  {backend.name}: {status}")
        for reason in reasons:
            print(f"    - {reason}")
        print(f"    runs on: {', '.join(backend.devices)}; dtypes: {', '.join(backend.dtypes)}; "
              f"frameworks: {', '.join(backend.frameworks)}")
    print("native launch libraries (cudnn backend; `fusedattn build` compiles them, else the first call does):")
    for kind in NATIVE_KINDS:
        print(f"  {kind}: {_native_status(kind)}")
    return 0


NATIVE_KINDS = ("core", "torch", "jax")  # the launch core, the torch operator over it, the XLA FFI handler


def _native_status(kind: str) -> str:
    """Whether a native library is built here, where, and why not."""
    from fusedattn.backends.cudnn.native import build

    try:
        path = build.built_path(kind)
    except Exception as error:  # a missing package or compiler: say which
        return f"cannot be built here: {type(error).__name__}: {error}"
    status = f"built: {path}" if path.exists() else f"not built yet (would go to {path})"
    if kind == "torch":  # its Python entry (a cheaper call) is built only where Python's headers are
        status += ("; with its Python entry" if build.python_headers() is not None
                   else "; without its Python entry (no Python.h for this interpreter: calls go through torch.ops)")
    return status


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: comma-separated names out of `choices` (the CLI's and the benchmarks')."""
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        if not names or any(name not in choices for name in names):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices)}, "
                                             f"got {text!r}")
        return names
    return parse


def cmd_build(args) -> int:
    from fusedattn.backends.cudnn.native import build

    kinds = args.kinds or [k for k in NATIVE_KINDS if k == "core" or importlib.util.find_spec(k) is not None]
    for kind in kinds:
        try:
            target = build.built_path(kind)
            if target.exists() and not args.force:
                print(f"{kind}: already built: {target}")
                continue
            build.build(kind, announce=print)
        except Exception as error:
            print(f"{kind}: cannot be built: {type(error).__name__}: {error}", file=sys.stderr)
            return 1
    return 0


def _default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


# Short dtype names people type, as in `torch.bfloat16` vs "bf16".
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                 "fp64": "float64", "double": "float64"}


def _dtype(text: str) -> str:
    """A dtype name or its short alias (bf16, fp16, fp32, fp64), as the canonical name."""
    return DTYPE_ALIASES.get(text.strip().lower(), text)


def _window(text: str) -> tuple[int, int]:
    try:
        left, right = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT such as 128,0 or -1,-1 (-1 = unbounded), "
                                         f"got {text!r}") from None
    return left, right


# Options whose values may start with "-" ("--window -1,-1"): argparse would read those as flags.
_NEGATIVE_VALUE_OPTIONS = ("--window",)


def _join_negative_values(argv: list[str]) -> list[str]:
    """argv with `--window -1,-1` rewritten as `--window=-1,-1`, the one spelling argparse reads."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in _NEGATIVE_VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and argv[i + 1][1:2].isdigit():
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


class _SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: its errors show its own usage and, for an unknown flag, its flags."""

    def flags(self) -> list[str]:
        return [option for action in self._actions for option in action.option_strings if option.startswith("--")]

    def unknown(self, extras: list[str]):
        """Exit 2 naming the unrecognised arguments, the closest flags, and every flag this subcommand takes."""
        flags = self.flags()
        hints = []
        for extra in extras:
            close = difflib.get_close_matches(extra.split("=", 1)[0], flags, n=1)
            if close:
                hints.append(f"{extra}: did you mean {close[0]}?")
        message = f"unrecognized arguments: {' '.join(extras)}"
        if hints:
            message += "\n  " + "\n  ".join(hints)
        self.error(message + f"\n{self.prog} takes: {', '.join(flags)} (see {self.prog} --help)")


def cmd_explain(args) -> int:
    bias_shape = None
    if args.bias in ("pre_scale", "post_scale"):
        bias_shape = (1, args.hq, args.sq, args.skv)
    elif args.bias == "alibi":
        bias_shape = (args.hq,)
    mask = Mask(args.mask)
    if Layout(args.layout).is_ragged:
        mask = mask.with_padding()
    try:
        cfg = AttentionConfig(
            dtype=args.dtype, layout=args.layout, batch=args.batch, seqlen_q=args.sq, seqlen_kv=args.skv,
            heads_q=args.hq, heads_kv=args.hkv if args.hkv is not None else args.hq,
            head_dim_qk=args.d, head_dim_v=args.dv if args.dv is not None else args.d,
            mask=mask, window=args.window, bias=args.bias, bias_shape=bias_shape, softmax=args.softmax,
            dropout_p=args.dropout, is_training=args.training, deterministic=args.deterministic,
            device=args.device or _default_device(), framework=args.framework,
        )
    except ValueError as error:
        print(f"fusedattn explain: {error}", file=sys.stderr)
        return 2
    print(explain(cfg, backend=args.backend))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fusedattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubcommandParser)
    info = sub.add_parser("info", help="versions, devices and which backends are available")
    info.set_defaults(run=cmd_info, subparser=info)
    nb = sub.add_parser("build", help="compile the native cuDNN launch libraries now (cached per machine and version)")
    nb.set_defaults(run=cmd_build, subparser=nb)
    nb.add_argument("--kinds", type=choice_list(NATIVE_KINDS), default=None,
                    help=f"comma-separated: {','.join(NATIVE_KINDS)} (default: those whose framework is installed)")
    nb.add_argument("--force", action="store_true", help="rebuild even when a cached build exists")
    ex = sub.add_parser("explain", help="which backend a call would use, and every other backend's reasons")
    ex.set_defaults(run=cmd_explain, subparser=ex)
    ex.add_argument("--layout", default="bshd", choices=[m.value for m in Layout])
    ex.add_argument("--batch", type=int, default=4, help="B (default 4)")
    ex.add_argument("--sq", type=int, default=4096, help="Sq, query length (max for THD; default 4096)")
    ex.add_argument("--skv", type=int, default=4096, help="Skv, key/value length (default 4096)")
    ex.add_argument("--hq", type=int, default=16, help="Hq, query heads (default 16)")
    ex.add_argument("--hkv", type=int, default=None, help="Hkv, key/value heads (default Hq)")
    ex.add_argument("--d", type=int, default=128, help="D, query/key head dim (default 128)")
    ex.add_argument("--dv", type=int, default=None, help="Dv, value head dim (default D)")
    ex.add_argument("--dtype", type=_dtype, default="bfloat16", choices=DTYPES,
                    help="dtype of q, k, v (aliases: bf16, fp16, fp32, fp64; default bfloat16)")
    ex.add_argument("--mask", default="none", choices=[m.value for m in Mask])
    ex.add_argument("--window", type=_window, default=(-1, -1),
                    help="LEFT,RIGHT keys visible before/after the diagonal (-1 = unbounded), "
                    "e.g. --window 128,0 or --window -1,-1")
    ex.add_argument("--bias", default="none", choices=[m.value for m in BiasType])
    ex.add_argument("--softmax", default="vanilla", choices=[m.value for m in SoftmaxType])
    ex.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
    ex.add_argument("--training", action=argparse.BooleanOptionalAction, default=True,
                    help="the call will need a backward pass (default: yes)")
    ex.add_argument("--deterministic", action="store_true")
    ex.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if torch sees one")
    ex.add_argument("--framework", choices=["torch", "jax"], default="torch")
    ex.add_argument("--backend", default=None, choices=backend_names(), help="force a backend by name")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = _join_negative_values(list(sys.argv[1:] if argv is None else argv))
    args, extras = parser.parse_known_args(argv)
    if extras and argv.index(extras[0]) < argv.index(args.command):
        parser.error(f"unrecognized arguments: {' '.join(extras)} (put a subcommand's flags after it)")
    if extras:  # the subcommand's parser says it, with its own usage and flags
        args.subparser.unknown(extras)
    try:
        code = args.run(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`fusedattn info | head -3`): stop quietly. Later writes, including
        # the interpreter's final flush, go to /dev/null instead of raising again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
