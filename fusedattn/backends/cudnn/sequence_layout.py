"""What a padded or THD config fixes about its per-sequence table: which ragged offsets its graphs
read and in which units. No torch or Triton here: the torch paths (sequences.py, the native
operator) and JAX's custom calls (jax/cudnn_call.py) share it."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from fusedattn.config import AttentionConfig

__all__ = ["Layout", "layout_of", "config_layout"]

_Q_SIDE = ("q", "o", "stats", "dq")  # ragged offsets in query tokens; the others in key tokens


@dataclass(frozen=True)
class Layout:
    """What a config fixes about its table: the ragged offsets' names and units, the table's width."""

    batch: int
    width: int  # int32 entries per row: B + 1 rounded up to 16 bytes
    offsets: tuple  # ((name, unit), ...), query side first
    queries: int  # how many of `offsets` are on the query side
    ragged: bool
    limits: tuple  # (longest query sequence, longest key sequence)
    # (Sq, Skv) of a score_mod graph's padding penalties, which the table holds after the flag (see
    # penalty_rows); () where the graph has none.
    penalties: tuple = ()

    @property
    def flag_row(self) -> int:
        return 4 + len(self.offsets)

    @property
    def penalty_rows(self) -> tuple | None:
        """The first table rows of the query and key penalties, or None. The query side's B * Sq float32
        (0 inside each sequence, MASKED outside: sm_row_penalty, (B, 1, Sq, 1)), then the key side's
        B * Skv (sm_col_penalty), each from a row of its own so that both start 16-byte aligned."""
        if not self.penalties:
            return None
        first = self.flag_row + 1
        return first, first + -(-self.batch * self.penalties[0] // self.width)

    @property
    def rows(self) -> int:
        found = self.penalty_rows
        if found is None:
            return self.flag_row + 1
        return found[1] + -(-self.batch * self.penalties[1] // self.width)

    @cached_property
    def row_units(self) -> tuple:
        """Elements per token of the rows from the third on: the starts themselves, then the offsets."""
        return (1, 1) + tuple(unit for _, unit in self.offsets)

    @cached_property
    def row_sides(self) -> tuple:
        """The side (0 queries, 1 keys) whose starts each of those rows scales."""
        return (0, 1) + tuple(int(index >= self.queries) for index in range(len(self.offsets)))


def layout_of(cfg: AttentionConfig, units: dict) -> Layout:
    """units: {ragged offset name: elements per token} for THD (empty for padded layouts)."""
    query_side = [(name, unit) for name, unit in units.items() if name in _Q_SIDE]
    key_side = [(name, unit) for name, unit in units.items() if name not in _Q_SIDE]
    # A score_mod graph cannot take cuDNN's padding mask: it adds penalties (score_mod_masks.MaskPlan).
    penalties = (cfg.seqlen_q, cfg.seqlen_kv) if cfg.score_mod_key is not None else ()
    return Layout(cfg.batch, -(-(cfg.batch + 1) // 4) * 4, (*query_side, *key_side), len(query_side),
                  cfg.layout.is_ragged, (cfg.seqlen_q, cfg.seqlen_kv), penalties)


def config_layout(cfg: AttentionConfig) -> Layout:
    """A padded or THD config's table layout, for the Python path and the native operator alike."""
    from fusedattn.backends.cudnn.spec import gradient_spec, sdpa_spec

    if not cfg.layout.is_ragged:
        return layout_of(cfg, {})
    spec = sdpa_spec(cfg)  # THD: elements per token of every tensor the graphs read through ragged offsets
    units = {role: spec.token_stride(role) for role in ("q", "k", "v", "o")}
    units["stats"] = cfg.heads_q
    for role in ("q", "k", "v"):
        units["d" + role] = gradient_spec(getattr(spec, role)).stride[2]
    return layout_of(cfg, units)
