"""The `fusedattn` command: `info` (versions, devices, backends) and `explain` (selection for a config)."""

from __future__ import annotations

import argparse
import importlib
import platform
import sys

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
    for backend in BACKENDS:
        reasons = backend.availability()
        print(f"  {backend.name}: " + ("available" if not reasons else "unavailable"))
        for reason in reasons:
            print(f"    - {reason}")
        print(f"    runs on: {', '.join(backend.devices)}; dtypes: {', '.join(backend.dtypes)}; "
              f"frameworks: {', '.join(backend.frameworks)}")
    print("native launch libraries (cudnn backend; `fusedattn build` compiles them, else the first call does):")
    for kind in NATIVE_KINDS:
        print(f"  {kind}: {_native_status(kind)}")
    return 0


NATIVE_KINDS = ("core", "torch")  # the launch core, and the torch operator over it


def _native_status(kind: str) -> str:
    """Whether a native library is built here, where, and why not."""
    from fusedattn.backends.cudnn.native import build

    try:
        path = build.built_path(kind)
    except Exception as error:  # a missing package or compiler: say which
        return f"cannot be built here: {type(error).__name__}: {error}"
    return f"built: {path}" if path.exists() else f"not built yet (would go to {path})"


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in NATIVE_KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(NATIVE_KINDS)}, got {text!r}")
    return kinds


def cmd_build(args) -> int:
    from fusedattn.backends.cudnn.native import build

    for kind in args.kinds:
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


def _window(text: str) -> tuple[int, int]:
    try:
        left, right = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT such as 128,0 or -1,-1, got {text!r}") from None
    return left, right


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
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices and which backends are available").set_defaults(run=cmd_info)
    nb = sub.add_parser("build", help="compile the native cuDNN launch libraries now (cached per machine and version)")
    nb.set_defaults(run=cmd_build)
    nb.add_argument("--kinds", type=_kinds, default=list(NATIVE_KINDS),
                    help=f"comma-separated: {','.join(NATIVE_KINDS)} (default both)")
    nb.add_argument("--force", action="store_true", help="rebuild even when a cached build exists")
    ex = sub.add_parser("explain", help="which backend a call would use, and every other backend's reasons")
    ex.set_defaults(run=cmd_explain)
    ex.add_argument("--layout", default="bshd", choices=[m.value for m in Layout])
    ex.add_argument("--batch", type=int, default=4, help="B (default 4)")
    ex.add_argument("--sq", type=int, default=4096, help="Sq, query length (max for THD; default 4096)")
    ex.add_argument("--skv", type=int, default=4096, help="Skv, key/value length (default 4096)")
    ex.add_argument("--hq", type=int, default=16, help="Hq, query heads (default 16)")
    ex.add_argument("--hkv", type=int, default=None, help="Hkv, key/value heads (default Hq)")
    ex.add_argument("--d", type=int, default=128, help="D, query/key head dim (default 128)")
    ex.add_argument("--dv", type=int, default=None, help="Dv, value head dim (default D)")
    ex.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    ex.add_argument("--mask", default="none", choices=[m.value for m in Mask])
    ex.add_argument("--window", type=_window, default=(-1, -1), help="LEFT,RIGHT (-1 = unbounded)")
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
    args = _parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
