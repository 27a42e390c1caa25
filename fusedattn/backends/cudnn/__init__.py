"""cuDNN frontend graphs: dense layouts, causal masks and windows, bias, sinks, dropout, GQA.

Support is proven by building: `supports(cfg)` builds the forward graph (and the
backward graph for training) with the run's attributes and caches them; the run uses
those graphs. The cudnn and torch imports happen only once the cheap rules pass.
"""

from __future__ import annotations

from fusedattn.backends.base import Backend, jax_needs_torch
from fusedattn.backends.cudnn.spec import ALIGNMENT, rows_with_keys_config, unsupported


class CudnnBackend(Backend):
    name = "cudnn"
    frameworks = ("torch", "jax")  # JAX as native custom calls (fusedattn/jax/cudnn_call.py)
    devices = ("cuda",)
    dtypes = ("float16", "bfloat16")
    max_head_dim = 256
    head_dim_multiple = 8
    packages = (("cudnn", "nvidia-cudnn-frontend"),)
    array_framework = "torch"
    lse_gradient = False

    def _reasons(self, cfg):
        reasons = unsupported(cfg)
        if reasons:
            return reasons
        if cfg.framework == "jax":
            reasons = _jax_launch(cfg)
            if reasons:
                return reasons
        from fusedattn.backends.cudnn.graph_cache import current_device, probe

        built = rows_with_keys_config(cfg)
        reasons = probe(built)
        if reasons or cfg.framework != "jax":
            return reasons
        from fusedattn.jax import native

        why = native.rebuild_reason(built, current_device("jax"))
        return [why] if why else []

    def notes(self, cfg):
        if not cfg.unaligned:
            return []
        names = ", ".join(cfg.unaligned)
        return [f"copies {names} to 16-byte aligned memory before each launch: cuDNN needs every operand's "
                f"address to be a multiple of {ALIGNMENT} bytes, and {names} start elsewhere (a view a few elements "
                "into its storage); slice fused projections at multiples of 8 elements to avoid the copy"]

    def forward(self, cfg, inputs):
        from fusedattn.backends.cudnn.torch_run import forward

        saved = {}
        return forward(cfg, inputs, saved=saved), saved

    def backward(self, cfg, inputs, saved, outputs, grad_out, grad_lse=None):
        from fusedattn.backends.cudnn.torch_run import backward

        return backward(cfg, inputs, outputs, grad_out, grad_lse, saved=saved)

    def address_runner(self, cfg):
        from fusedattn.backends.cudnn import pointer_run

        return pointer_run.AddressRunner(cfg) if pointer_run.runs_from_addresses(cfg) else None

    def forward_into(self, cfg, inputs, into):
        from fusedattn.backends.cudnn.torch_run import forward

        return forward(cfg, inputs, into)

    def backward_into(self, cfg, inputs, outputs, grad_out, grad_lse, into):
        from fusedattn.backends.cudnn.torch_run import backward

        return backward(cfg, inputs, outputs, grad_out, grad_lse, into)


def _jax_launch(cfg) -> list[str]:
    """Why JAX cannot launch cuDNN graphs here: the native custom call does not load and the buffer
    callbacks' torch is missing too; empty when one of them runs."""
    from fusedattn.jax import native

    why = native.unavailable()
    if why is None:
        return []
    return [f"{reason}; the native custom call is unavailable ({why})"
            for reason in jax_needs_torch("cudnn", "its graphs")]


__all__ = ["CudnnBackend"]
