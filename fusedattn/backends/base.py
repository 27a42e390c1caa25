"""The interface every backend implements, and the capability checks they share.

A backend answers `supports(cfg)` with human-readable reasons (empty = it can run
the call) and never raises from it. Shared rules (framework, device, dtype, head
dims, packages) are declared as class attributes and checked here once.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from fusedattn.config import AttentionConfig

__all__ = ["Backend", "AttentionInputs", "AttentionOutputs", "ARRAY_NAMES", "package_missing", "jax_needs_torch"]

DIFFERENTIABLE = ("q", "k", "v", "bias", "sink", "alibi_slopes")


@dataclass
class AttentionInputs:
    """The arrays of one call, unpacked to the layout's base form (q, k, v separate).

    Framework arrays (torch tensors or JAX arrays); optional ones are None.
    dropout_seed/offset are integer scalars arrays; cu_seqlens_* are (B+1,) integers.
    """

    q: Any
    k: Any
    v: Any
    bias: Any = None
    alibi_slopes: Any = None
    sink: Any = None
    cu_seqlens_q: Any = None
    cu_seqlens_kv: Any = None
    cu_seqlens_q_padded: Any = None
    cu_seqlens_kv_padded: Any = None
    dropout_seed: Any = None
    dropout_offset: Any = None
    score_mod: Callable | None = field(default=None, compare=False)

    def arrays(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "score_mod"}

    def replace(self, **arrays) -> AttentionInputs:
        return AttentionInputs(**{**self.arrays(), "score_mod": self.score_mod, **arrays})


# The arrays of AttentionInputs in field order: how frontends pass them positionally.
ARRAY_NAMES: tuple[str, ...] = tuple(f.name for f in fields(AttentionInputs) if f.name != "score_mod")


class AttentionOutputs(NamedTuple):
    """out contiguous in q's base layout; lse (B, Hq, Sq), or (Tq, Hq) for THD; max_logit (Hq,) when
    cfg.return_max_logit, else an empty (0,) array. Both in cfg.stats_dtype (float32; float64 for float64)."""

    out: Any
    lse: Any = None
    max_logit: Any = None


def package_missing(import_name: str) -> bool:
    """True when `import_name` cannot be imported; looks without importing it."""
    try:
        return importlib.util.find_spec(import_name) is None
    except (ImportError, ValueError):
        return True


class Backend:
    """Base class: declare capabilities as attributes, add own rules in `_reasons`."""

    name: str = ""
    frameworks: tuple[str, ...] = ("torch", "jax")
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")
    max_head_dim: int | None = None
    head_dim_multiple: int = 1
    # (import name, distribution name) pairs this backend needs installed.
    packages: tuple[tuple[str, str], ...] = ()
    # False for a backend whose kernels this version does not have yet: it says so.
    implemented: bool = True
    # "any": forward/backward work on the arrays of any framework (written with fusedattn.xp);
    # "torch": they take torch tensors, and JAX calls reach them through buffer callbacks.
    array_framework: str = "any"
    # Whether backward takes a gradient of the returned lse (grad_lse); see no_lse_gradient.
    lse_gradient: bool = True
    # Whether tensors a score_mod reads get their gradient (cfg.score_mod_learns): the framework's autodiff
    # through this backend's forward. Others give an added term its gradient only (as a bias).
    score_mod_gradient: bool = False
    # Whether its backward is itself differentiable (torch: a second derivative, create_graph=True).
    backward_differentiable: bool = False
    # Whether it runs a call of batch 0 (empty outputs): the others' kernels and graphs are not built for one.
    runs_empty_batch: bool = False

    def availability(self) -> list[str]:
        """Reasons this backend cannot run anything here, whatever the call."""
        reasons = [
            f"package {dist} not installed" + (f" (import {module})" if module != dist else "")
            for module, dist in self.packages
            if package_missing(module)
        ]
        if not self.implemented:
            reasons.append(f"the {self.name} backend is not implemented in this version of fusedattn")
        return reasons

    def supports(self, cfg: AttentionConfig) -> list[str]:
        """Reasons this backend cannot run `cfg`; empty when it can. Never raises."""
        try:
            reasons = self.availability()
            if cfg.framework not in self.frameworks:
                reasons.append(f"framework {cfg.framework} not supported (supports {', '.join(self.frameworks)})")
            if cfg.device not in self.devices:
                reasons.append(f"device {cfg.device} not supported (needs {' or '.join(self.devices)})")
            dtypes = {cfg.dtype, cfg.k_dtype, cfg.v_dtype}
            if not dtypes <= set(self.dtypes):
                got = "/".join(sorted(dtypes))
                reasons.append(f"dtype {got} not supported (supports {', '.join(self.dtypes)})")
            for label, dim in (("head_dim_qk", cfg.head_dim_qk), ("head_dim_v", cfg.head_dim_v)):
                if self.max_head_dim is not None and dim > self.max_head_dim:
                    reasons.append(f"{label}={dim} > {self.max_head_dim}")
                if dim % self.head_dim_multiple:
                    reasons.append(f"{label}={dim} is not a multiple of {self.head_dim_multiple}")
            if cfg.batch == 0 and not self.runs_empty_batch:
                reasons.append("B=0: an empty batch, nothing to compute (the reference returns the empty outputs)")
            if cfg.score_mod_learns and not self.score_mod_gradient:
                reasons.append("score_mod tensors that require grad (read other than as an added term, such as "
                               f"score * w[h]) get no gradient on {self.name}; backend='reference' gives them "
                               "one, or detach them (torch) / wrap them in jax.lax.stop_gradient (JAX)")
            if reasons:  # cheap rules failed: skip the backend's own (possibly costly) checks
                return reasons
            return list(self._reasons(cfg))
        except Exception as error:  # a probe must never take the call down
            return [f"{self.name}: support check failed: {type(error).__name__}: {error}"]

    def _reasons(self, cfg: AttentionConfig) -> list[str]:
        """Backend-specific rules, run after the shared ones pass."""
        return []

    def notes(self, cfg: AttentionConfig) -> list[str]:
        """What the backend does differently for a call it runs (a copy it makes, say), for explain."""
        return []

    def forward(self, cfg: AttentionConfig, inputs: AttentionInputs):
        """Run the forward pass: returns (AttentionOutputs, saved) for `backward`."""
        raise NotImplementedError(f"backend {self.name} has no forward")

    def backward(self, cfg: AttentionConfig, inputs: AttentionInputs, saved, outputs: AttentionOutputs,
                 grad_out, grad_lse=None) -> dict:
        """Gradients {name: array} for the differentiable inputs (see DIFFERENTIABLE)."""
        raise NotImplementedError(f"backend {self.name} has no backward")

    def forward_into(self, cfg: AttentionConfig, inputs: AttentionInputs, into: AttentionOutputs
                     ) -> AttentionOutputs:
        """The forward, writing into the preallocated `into` where the backend can (the JAX bridge
        hands over XLA's output buffers); the caller copies any output that is not `into`'s."""
        return self.forward(cfg, inputs)[0]

    def backward_into(self, cfg: AttentionConfig, inputs: AttentionInputs, outputs: AttentionOutputs,
                      grad_out, grad_lse, into: dict) -> dict:
        """The backward without saved state, writing gradients into `into` ({name: buffer}) where it can."""
        return self.backward(cfg, inputs, None, outputs, grad_out, grad_lse)

    def address_runner(self, cfg: AttentionConfig):
        """For a call the backend can run from raw device addresses (the JAX bridge's lean path):
        run(direction, device, stream, addresses); else None."""
        return None

    def __repr__(self) -> str:
        return f"<fusedattn backend {self.name}>"


def jax_needs_torch(backend_name: str, what: str) -> list[str]:
    """The reason a JAX call cannot run on a backend whose kernels reach JAX through torch (buffer
    callbacks) when torch is not installed; empty when it is."""
    if not package_missing("torch"):
        return []
    return [f"{backend_name} from JAX runs {what} through torch (buffer callbacks), and torch is not installed "
            "(pip install torch, or use another backend)"]


def no_lse_gradient(api: str, backend_name: str) -> NotImplementedError:
    """The error for a gradient reaching the LSE of a backend without one (lse_gradient False): the same
    in eager and compiled calls, torch and JAX (torch_op.cc spells it for the native operator)."""
    return NotImplementedError(f"{api}: the {backend_name} backend has no gradient through the returned lse; "
                               "use backend='reference' for losses that depend on lse")


def lse_gradient_for(backend: Backend, grad_lse, api: str):
    """grad_lse as `backend` takes it: itself when the backend has an LSE gradient; else None when it is
    absent or all zeros (a compiled graph hands every returned output a tangent, zeros when unused), and
    the refusal for any other (one host read, in that case only)."""
    if grad_lse is None or backend.lse_gradient:
        return grad_lse
    if bool((grad_lse != 0).any()):
        raise no_lse_gradient(api, backend.name)
    return None
