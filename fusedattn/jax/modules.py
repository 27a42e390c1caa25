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

from fusedattn.arguments import host_slopes
from fusedattn.checks import check_backend, check_count, check_probability, check_scale, check_window
from fusedattn.config import Layout, Mask, SoftmaxType
from fusedattn.jax.functional import _describe_value, attention

__all__ = ["DotProductAttention", "MultiHeadAttention", "TransformerLayer"]


# Modules check their fields when constructed (in __post_init__, after Flax's own), so a
# mistake is reported at the line that made the module and under the module's field name.

def _check_attention_fields(module: str, *, mask, window, softmax_type, dropout_name: str, dropout_p,
                            backend) -> None:
    """The fields every module here hands to attention, checked under the module's own names."""
    Mask.parse(mask, f"{module}: mask")
    check_window(window, f"{module}: window")
    SoftmaxType.parse(softmax_type, f"{module}: softmax_type")
    check_probability(dropout_p, f"{module}: {dropout_name}")
    check_backend(backend, f"{module}: backend")


def _shown(value) -> str:
    """repr for small settings; type, shape and dtype for arrays (never their contents)."""
    return repr(value) if isinstance(value, str | int | float | tuple | dict) else _describe_value(value)


def _owned_keywords(module: str) -> dict:
    """Keywords of `attention` that the module sets itself (name -> how), never given per call."""
    return {"softmax_type": f"{module}(softmax_type=...)",
            "dropout_p": f"{module}(dropout_p=...), applied when deterministic=False",
            "sink": "its 'sink' parameter, made with softmax_type='learnable'",
            "dropout_rng": "drawn from the 'dropout' RNG stream: apply(..., rngs={'dropout': key})"}


def _call_keywords(module: str, kwargs: dict, *, fields: dict, owned: dict) -> dict:
    """kwargs with the module's fields merged in, or a TypeError naming a keyword the module sets itself.

    fields (name -> value) merge as flax.linen.merge_param merges: the one of module and call that is
    not None is taken, both set raise. owned (see _owned_keywords) are never call keywords. Without
    this, Python's "got multiple values for keyword argument" was the error.
    """
    for name, how in owned.items():
        if name in kwargs:
            raise TypeError(f"{module}: {name}: expected no {name} at call time (the module sets it: {how}), "
                            f"got {name}={_shown(kwargs[name])}")
    merged = dict(kwargs)
    for name, value in fields.items():
        given = kwargs.get(name)
        if value is not None and given is not None:
            raise TypeError(f"{module}: {name}: expected it once, on the module or at call time, got "
                            f"{name}={_shown(value)} on the module and {name}={_shown(given)} at call "
                            f"time; leave the module's {name} None to pass it per call")
        merged[name] = value if given is None else given
    return merged


def _slopes(module: str, kwargs: dict) -> dict:
    """Call keywords with list/tuple/NumPy alibi_slopes checked and made a float64 NumPy array, which
    `attention` makes an array of the precision of q's dtype."""
    slopes = host_slopes(f"{module}: alibi_slopes", kwargs.get("alibi_slopes"))
    return kwargs if slopes is None else {**kwargs, "alibi_slopes": slopes}


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

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        Layout.parse(self.layout, f"{name}: layout")
        _check_attention_fields(name, mask=self.mask, window=self.window, softmax_type=self.softmax_type,
                                dropout_name="dropout_p", dropout_p=self.dropout_p, backend=self.backend)
        if self.softmax_type == "learnable":
            check_count(self.num_heads, f"{name}: num_heads (needed by softmax_type='learnable')")
        check_count(self.num_heads, f"{name}: num_heads", optional=True)
        check_scale(self.scale, f"{name}: scale")

    @nn.compact
    def __call__(self, q, k=None, v=None, *, deterministic: bool = True, mask: str | None = None,
                 layout: str | None = None, **kwargs):
        """mask and layout override the module's for this call; other keywords go to `attention`.

        window, scale, backend and shard_axes may be given here when the module leaves them None
        (as flax.linen.merge_param: once, on the module or per call); softmax_type, dropout_p, the
        sink and the dropout RNG are the module's, and raise a TypeError here.

        alibi_slopes may be a JAX array, or a list, tuple or NumPy array (such as
        `fusedattn.standard_alibi_slopes(Hq)`), made an array of q's precision.
        """
        name = type(self).__name__
        fields = {"window": self.window, "scale": self.scale, "backend": self.backend, "shard_axes": self.shard_axes}
        kwargs = _call_keywords(name, _slopes(name, kwargs), fields=fields, owned=_owned_keywords(name))
        sink = None
        if self.softmax_type == "learnable":
            sink = self.param("sink", nn.initializers.zeros, (self.num_heads,), jnp.float32)
        dropout = 0.0 if deterministic else self.dropout_p
        rng = self.make_rng("dropout") if dropout > 0.0 else None
        layout, mask = (self.layout if layout is None else layout), (self.mask if mask is None else mask)  # ("": bad)
        return attention(q, k, v, layout=layout, mask=mask, softmax_type=self.softmax_type, sink=sink,
                         dropout_p=dropout, dropout_rng=rng, deterministic=self.deterministic_backward, **kwargs)


class MultiHeadAttention(nn.Module):
    """Projections, attention and the output projection for (B, S, E) inputs.

    num_kv_heads < num_heads gives GQA/MQA. fused_qkv projects q, k and v with one matmul
    (self-attention); with `kv_input` (cross-attention) q and kv are projected separately.
    x is (B, S, E); kv_input (B, Skv, E_kv) with x's B. Call keywords go to DotProductAttention
    (scale, mask, alibi_slopes, ...; window, backend, shard_axes where the module leaves them None).
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

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        check_count(self.num_heads, f"{name}: num_heads")
        check_count(self.head_dim, f"{name}: head_dim")
        check_count(self.num_kv_heads, f"{name}: num_kv_heads", optional=True)
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"{name}: num_kv_heads: expected a divisor of num_heads={self.num_heads}, "
                             f"got {self.num_kv_heads}")
        _check_attention_fields(name, mask=self.mask, window=self.window, softmax_type=self.softmax_type,
                                dropout_name="dropout_p", dropout_p=self.dropout_p, backend=self.backend)

    def _check_inputs(self, x, kv_input) -> None:
        """Shapes the projections' reshapes rely on, refused by name before a bare reshape error."""
        name = type(self).__name__
        if jnp.ndim(x) != 3:
            raise ValueError(f"{name}: x: expected a 3-D array (B, S, E), got shape {jnp.shape(x)}")
        if kv_input is not None and (jnp.ndim(kv_input) != 3 or jnp.shape(kv_input)[0] != jnp.shape(x)[0]):
            raise ValueError(f"{name}: kv_input: expected a 3-D array (B, Skv, E_kv) with x's batch "
                             f"B={jnp.shape(x)[0]}, got shape {jnp.shape(kv_input)}")

    def _dense(self, features: int, name: str):
        return nn.Dense(features, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype, name=name)

    @nn.compact
    def __call__(self, x, kv_input=None, *, deterministic: bool = True, **kwargs):
        heads, dim = self.num_heads, self.head_dim
        kv_heads = self.num_kv_heads or heads
        name = type(self).__name__
        self._check_inputs(x, kv_input)
        # Checked here, not only in the inner module, so that errors name this module; its fields reach the
        # inner module as fields, so only the call's keywords go on.
        owned = {**_owned_keywords(name), "layout": "'bs3hd' or 'bshd_bs2hd' from its fused projection, else 'bshd'"}
        _call_keywords(name, kwargs, fields={"window": self.window, "backend": self.backend,
                                             "shard_axes": self.shard_axes}, owned=owned)
        kwargs = _slopes(name, kwargs)
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

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        check_count(self.hidden_size, f"{name}: hidden_size")
        check_count(self.num_heads, f"{name}: num_heads")
        check_count(self.head_dim, f"{name}: head_dim", optional=True)
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"{name}: hidden_size: expected a multiple of num_heads={self.num_heads} (head_dim is "
                             f"hidden_size // num_heads), got {self.hidden_size}; change one, or pass head_dim")
        check_count(self.num_kv_heads, f"{name}: num_kv_heads", optional=True)
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise ValueError(f"{name}: num_kv_heads: expected a divisor of num_heads={self.num_heads}, "
                             f"got {self.num_kv_heads}")
        check_count(self.mlp_hidden_size, f"{name}: mlp_hidden_size", optional=True)
        if self.layernorm not in ("pre", "post"):
            raise ValueError(f"{name}: layernorm: expected 'pre' or 'post', got {self.layernorm!r}")
        _check_attention_fields(name, mask=self.mask, window=self.window, softmax_type="vanilla",
                                dropout_name="attention_dropout", dropout_p=self.attention_dropout,
                                backend=self.backend)
        check_probability(self.hidden_dropout, f"{name}: hidden_dropout")
        if not callable(self.activation):
            raise ValueError(f"{name}: activation: expected a callable such as nn.gelu, got {self.activation!r}")

    @nn.compact
    def __call__(self, x, *, deterministic: bool = True, **kwargs):
        if x.shape[-1] != self.hidden_size:
            raise ValueError(f"TransformerLayer: x: expected a last axis of hidden_size={self.hidden_size}, "
                             f"got shape {tuple(x.shape)}")
        head_dim = self.head_dim or self.hidden_size // self.num_heads
        kwargs = _slopes(type(self).__name__, kwargs)
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
