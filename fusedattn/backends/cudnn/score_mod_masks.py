"""What a score_mod graph binds besides the user's callbacks: the names of its aux tensors and the
masks cuDNN cannot combine with a score_mod, written after it (score_mod_graph.py builds them).
Also the order a plan binds a score_mod's operands in (`operands`). No cudnn import here: the torch
operator's plans (native/torch_plans.py) and JAX's custom calls (jax/cudnn_call.py) read it too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from fusedattn.config import UNBOUNDED, AttentionConfig
from fusedattn.score_mods.core import MASKED

__all__ = ["MaskPlan", "mask_plan", "aux_name", "Operands", "operands"]

_SCALAR_KINDS = {"float32": 0, "int32": 1}  # the native libraries' scalar type codes


def aux_name(name: str) -> str:
    return "mod:" + name


@dataclass(frozen=True)
class MaskPlan:
    """Which masks the graph writes after the score_mod, and with which inputs.

    Measured on cuDNN 9.19 (H200): comparisons against (B, 1, 1, 1) tensors inside a
    score_mod give wrong masks, and so do chains of more than one logical_and; added
    (B, 1, Sq, 1) and (B, 1, 1, Skv) tensors, comparisons with pass-by-value scalars and a
    single logical_and are right. Hence:
      padding   added penalties sm_row_penalty (B, 1, Sq, 1) and sm_col_penalty (B, 1, 1, Skv):
                0 inside the sequence, MASKED outside;
      window    key + sm_col_shift <= query + sm_right and query + sm_row_shift <= key + sm_left
                (pass-by-value ints, all >= 0). The diagonal must be the same for every
                sequence: spec.py declines padding masks with a bottom-right window.
    """

    padding: bool
    left: bool
    right: bool

    def scalar_bounds(self, cfg: AttentionConfig) -> dict:
        """Pass-by-value window inputs when every sequence has the diagonal at col = row + o."""
        left, right = cfg.window
        offset = cfg.seqlen_kv - cfg.seqlen_q if cfg.diagonal_bottom_right else 0
        row_shift, col_shift = max(offset, 0), max(-offset, 0)
        bounds = {}
        if self.left:
            bounds.update(sm_row_shift=row_shift, sm_left=col_shift + left)
        if self.right:
            bounds.update(sm_col_shift=col_shift, sm_right=row_shift + right)
        return bounds

    def constants(self, cfg: AttentionConfig) -> list[tuple[str, float, str]]:
        """Every pass-by-value input of the window masks: (graph name, value, dtype)."""
        found = [("sm_masked", MASKED, "float32")] if self.left or self.right else []
        return found + [(name, value, "int32") for name, value in self.scalar_bounds(cfg).items()]


def mask_plan(cfg: AttentionConfig) -> MaskPlan:
    left, right = cfg.window
    return MaskPlan(padding=cfg.mask.is_padding, left=left != UNBOUNDED, right=right != UNBOUNDED)


class Operands(NamedTuple):
    """A plan's score_mod operands, bound after each graph's own slots in this order: the bound
    values' arrays (`aux`), their runtime scalars (`scalars`), then the pass-by-value inputs of the
    masks written after the score_mod (`constants`: (graph name, value, dtype), fixed by the config)."""

    aux: tuple = ()
    scalars: tuple = ()
    scalar_types: tuple = ()
    constants: tuple = ()

    def graph_names(self) -> tuple:
        return (*map(aux_name, self.aux), *self.value_names())

    def value_names(self) -> tuple:
        """The graph names passed by value (the scalars', then the constants'): 4 bytes each."""
        return (*map(aux_name, self.scalars), *(name for name, _, _ in self.constants))

    def types(self) -> list[int]:
        return [_SCALAR_KINDS[t] for t in (*self.scalar_types, *(dtype for _, _, dtype in self.constants))]

    def values(self, bound: dict) -> tuple[list, list]:
        """(aux tensors, scalars) of one call from its bound values (score_mods.core.bind)."""
        return [bound[name] for name in self.aux], [value for _, value, _ in self.by_value(bound)]

    def by_value(self, bound: dict) -> list[tuple[str, object, str]]:
        """The pass-by-value inputs of one call in binding order: (graph name, value, dtype)."""
        scalars = [(aux_name(name), bound[name].value, dtype) for name, dtype in zip(self.scalars, self.scalar_types)]
        return [*scalars, *self.constants]


def operands(cfg: AttentionConfig) -> Operands:
    """The score_mod operands of a config's plan (none without a score_mod)."""
    recipe = cfg.score_mod_recipe
    if cfg.score_mod_key is None or recipe is None:
        return Operands()
    aux = tuple(name for name, description in recipe.aux if description[0] != "scalar")
    scalars = tuple((name, description[1]) for name, description in recipe.aux if description[0] == "scalar")
    constants = tuple(mask_plan(cfg).constants(cfg))
    return Operands(aux, tuple(name for name, _ in scalars), tuple(dtype for _, dtype in scalars), constants)
