"""Flax linen modules around `fusedattn.jax.attention`, shaped as Transformer Engine users expect.

    DotProductAttention   attention of given q, k, v (any layout); owns the learnable sink
    MultiHeadAttention    projections (one fused QKV matmul by default, GQA) + attention + output
    TransformerLayer      attention and MLP blocks with pre or post layer norm and residuals

`deterministic=True` (the default of __call__) turns dropout off, as in Flax; dropout draws
from the "dropout" RNG stream. The deterministic *backward* is `deterministic_backward`.
Packed layouts are chosen internally: a fused QKV projection feeds attention as `bs3hd`
(or `bshd_bs2hd` with fewer KV heads) without reshaping by the user.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from fusedattn.jax.functional import attention

__all__ = ["DotProductAttention", "MultiHeadAttention", "TransformerLayer"]


def _check_positive(module: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{module}: {name}: expected an int >= 1, got {value!r}")


class DotProductAttention(nn.Module):
    """Scaled-dot-product attention on the best backend, with the keywords of `attention`.

    num_heads is needed only for softmax_type='learnable' (the (Hq,) sink parameter).
    """

    layout: str = "bshd"
    mask: str = "none"
    window: tuple[int, int] | None = None
    softmax_type: str = "vanilla"
    num_heads: int | None = None
    dropout_p: float = 0.0
    scale: float | None = None
    deterministic_backward: bool = False
    backend: str | None = None
    shard_axes: Any = None  # {"batch": mesh axis, "heads": mesh axis}: see fusedattn.jax.attention

    @nn.compact
    def __call__(self, q, k=None, v=None, *, deterministic: bool = True, mask: str | None = None,
                 layout: str | None = None, **kwargs):
        """mask and layout override the module's for this call; other keywords go to `attention`."""
        sink = None
        if self.softmax_type == "learnable":
            _check_positive("DotProductAttention", "num_heads (needed by softmax_type='learnable')", self.num_heads)
            sink = self.param("sink", nn.initializers.zeros, (self.num_heads,), jnp.float32)
        dropout = 0.0 if deterministic else self.dropout_p
        rng = self.make_rng("dropout") if dropout > 0.0 else None
        return attention(q, k, v, layout=layout or self.layout, mask=mask or self.mask, window=self.window,
                         softmax_type=self.softmax_type, sink=sink, dropout_p=dropout, dropout_rng=rng,
                         scale=self.scale, deterministic=self.deterministic_backward, backend=self.backend,
                         shard_axes=self.shard_axes, **kwargs)


class MultiHeadAttention(nn.Module):
    """Projections, attention and the output projection for (B, S, E) inputs.

    num_kv_heads < num_heads gives GQA/MQA. fused_qkv projects q, k and v with one matmul
    (self-attention); with `kv_input` (cross-attention) q and kv are projected separately.
    """

    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None
    fused_qkv: bool = True
    mask: str = "causal"
    window: tuple[int, int] | None = None
    softmax_type: str = "vanilla"
    dropout_p: float = 0.0
    use_bias: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    backend: str | None = None
    shard_axes: Any = None

    def _dense(self, features: int, name: str):
        return nn.Dense(features, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

    @nn.compact
    def __call__(self, x, kv_input=None, *, deterministic: bool = True, **kwargs):
        _check_positive("MultiHeadAttention", "num_heads", self.num_heads)
        _check_positive("MultiHeadAttention", "head_dim", self.head_dim)
        heads, dim = self.num_heads, self.head_dim
        kv_heads = self.num_kv_heads or heads
        if heads % kv_heads:
            raise ValueError(f"MultiHeadAttention: num_kv_heads: expected a divisor of num_heads={heads}, "
                             f"got {kv_heads}")
        batch, seqlen = x.shape[:2]
        core = DotProductAttention(mask=self.mask, window=self.window, softmax_type=self.softmax_type,
                                   num_heads=heads, dropout_p=self.dropout_p, backend=self.backend,
                                   shard_axes=self.shard_axes, name="attention")
        if kv_input is None and self.fused_qkv:
            qkv = self._dense((heads + 2 * kv_heads) * dim, "qkv")(x)
            if kv_heads == heads:  # one packed tensor, read in place
                out = core(qkv.reshape(batch, seqlen, 3, heads, dim), layout="bs3hd", deterministic=deterministic,
                           **kwargs)
            else:
                q, kv = jnp.split(qkv, [heads * dim], axis=-1)
                out = core(q.reshape(batch, seqlen, heads, dim), kv.reshape(batch, seqlen, 2, kv_heads, dim),
                           layout="bshd_bs2hd", deterministic=deterministic, **kwargs)
        else:
            source = x if kv_input is None else kv_input
            q = self._dense(heads * dim, "query")(x).reshape(batch, seqlen, heads, dim)
            k = self._dense(kv_heads * dim, "key")(source).reshape(batch, source.shape[1], kv_heads, dim)
            v = self._dense(kv_heads * dim, "value")(source).reshape(batch, source.shape[1], kv_heads, dim)
            out = core(q, k, v, deterministic=deterministic, **kwargs)
        return self._dense(x.shape[-1], "out")(out.reshape(batch, seqlen, heads * dim))


class TransformerLayer(nn.Module):
    """A transformer block: attention then MLP, each with a residual and a layer norm.

    layernorm='pre' normalises each block's input (x + f(LN(x))); 'post' normalises after the
    residual (LN(x + f(x))), as the original transformer does.
    """

    hidden_size: int
    num_heads: int
    head_dim: int | None = None
    num_kv_heads: int | None = None
    mlp_hidden_size: int | None = None
    layernorm: str = "pre"
    mask: str = "causal"
    window: tuple[int, int] | None = None
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    activation: Callable = nn.gelu
    fused_qkv: bool = True
    dtype: Any = jnp.float32
    backend: str | None = None
    shard_axes: Any = None

    @nn.compact
    def __call__(self, x, *, deterministic: bool = True, **kwargs):
        if self.layernorm not in ("pre", "post"):
            raise ValueError(f"TransformerLayer: layernorm: expected 'pre' or 'post', got {self.layernorm!r}")
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"TransformerLayer: x: expected a last axis of hidden_size={self.hidden_size}, "
                             f"got shape {tuple(x.shape)}")
        head_dim = self.head_dim or self.hidden_size // self.num_heads
        attend = MultiHeadAttention(num_heads=self.num_heads, head_dim=head_dim, num_kv_heads=self.num_kv_heads,
                                    fused_qkv=self.fused_qkv, mask=self.mask, window=self.window,
                                    dropout_p=self.attention_dropout, dtype=self.dtype, backend=self.backend,
                                    shard_axes=self.shard_axes, name="attention")
        mlp_hidden = self.mlp_hidden_size or 4 * self.hidden_size

        def mlp(h):
            h = nn.Dense(mlp_hidden, dtype=self.dtype, name="mlp_in")(h)
            return nn.Dense(self.hidden_size, dtype=self.dtype, name="mlp_out")(self.activation(h))

        drop = nn.Dropout(self.hidden_dropout)
        norm_attention, norm_mlp = nn.LayerNorm(name="ln_attention"), nn.LayerNorm(name="ln_mlp")
        if self.layernorm == "pre":
            x = x + drop(attend(norm_attention(x), deterministic=deterministic, **kwargs), deterministic=deterministic)
            return x + drop(mlp(norm_mlp(x)), deterministic=deterministic)
        x = norm_attention(x + drop(attend(x, deterministic=deterministic, **kwargs), deterministic=deterministic))
        return norm_mlp(x + drop(mlp(x), deterministic=deterministic))
