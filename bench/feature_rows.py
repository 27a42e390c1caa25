"""The feature rows of bench_jax.py (issue "JAX without torch", Benchmarks), described without a framework:
their shapes, their inputs as NumPy arrays, fusedattn's keywords for them, and the wall-clock loop both
processes time with. bench_jax.py runs them in JAX; torch_path_peer.py, in a process of its own, runs
fusedattn.torch.attention on the same NumPy data. Imports neither JAX nor torch.

Rows (bf16; Sq = Skv = S; scale 1/sqrt(D)):
  plain      mask="causal": what every other row's host cost is compared with
  bias       a post-scale (1, H, S, S) bias (bias_type="post_scale"), no mask
  padding    mask="padding", cu_seqlens_q = cu_seqlens_kv from lengths S, 3S/4, S, 3S/4, ... (every other
             sequence padded); the output cotangent is 0 on padded query rows
  window     mask="causal", window=(min(256, S // 4), 0)
  sink       mask="causal", softmax_type="learnable", sink (H,) float32
  softcap    mask="causal", score_mod=fusedattn.score_mods.softcap(30)
  thd        layout="thd", mask="causal": the B*S tokens as 4 sequences of 2/16, 3/16, 5/16 and 6/16 of them,
             static max_seqlen_q/kv
  small_seq  q (B, 1, H, D), k and v (B, Skv, H, D) bshd, no mask (S holds Skv)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["FEATURES", "FeatureCase", "numpy_inputs", "valid_rows", "ours_keywords", "is_bf16", "sample",
           "loop_ms", "loop_calls"]

FEATURES = ("plain", "bias", "padding", "window", "sink", "softcap", "thd", "small_seq")
MASKS = {"plain": "causal", "bias": "none", "padding": "padding", "window": "causal", "sink": "causal",
         "softcap": "causal", "thd": "causal", "small_seq": "none"}
WINDOW_LEFT = 256
SOFTCAP = 30.0
THD_SIXTEENTHS = (2, 3, 5, 6)  # the 4 THD sequences' shares of the B*S tokens
SEED = 1234
POOL = (1 << 24) - 3  # normals drawn per array; a larger array repeats them (2**31 draws would take minutes)
SAMPLE = 1 << 16  # elements of each output compared across processes
MAX_CALLS = 10000  # per timed loop


@dataclass(frozen=True)
class FeatureCase:
    """One feature at one shape; each case runs in every mode."""

    feature: str
    B: int
    H: int
    S: int  # Sq = Skv; for small_seq Skv (Sq = 1)
    D: int
    timing: str = "loop"  # read by bench_jax's interleaved timing

    @property
    def name(self) -> str:
        if self.feature == "small_seq":
            return f"small_seq-b{self.B}-h{self.H}-sq1-skv{self.S}-d{self.D}"
        return f"{self.feature}-b{self.B}-h{self.H}-s{self.S}-d{self.D}"

    @property
    def mask(self) -> str:
        return MASKS[self.feature]

    @property
    def layout(self) -> str:
        return "thd" if self.feature == "thd" else "bshd"

    @property
    def window(self) -> tuple[int, int] | None:
        return (min(WINDOW_LEFT, self.S // 4), 0) if self.feature == "window" else None

    def lengths(self) -> list[int] | None:
        """Per-sequence lengths: padding's B lengths, or THD's 4 sequences; None for the others."""
        if self.feature == "padding":
            return [self.S if b % 2 == 0 else 3 * self.S // 4 for b in range(self.B)]
        if self.feature == "thd":
            tokens = self.B * self.S
            head = [tokens * share // 16 for share in THD_SIXTEENTHS[:-1]]
            return [*head, tokens - sum(head)]
        return None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        if self.feature == "thd":
            return dict.fromkeys(("q", "k", "v", "cotangent"), (self.B * self.S, self.H, self.D))
        rows = 1 if self.feature == "small_seq" else self.S
        return {"q": (self.B, rows, self.H, self.D), "k": (self.B, self.S, self.H, self.D),
                "v": (self.B, self.S, self.H, self.D), "cotangent": (self.B, rows, self.H, self.D)}

    def visible_pairs(self) -> int:
        """(query, key) pairs a head computes, summed over the batch; causal counts L*L/2 (as attention_flops)."""
        if self.feature == "small_seq":
            return self.B * self.S
        if self.feature == "window":
            left = self.window[0]
            return self.B * (left * (left + 1) // 2 + (self.S - left) * (left + 1))
        lengths = self.lengths() or [self.S] * self.B
        return sum(n * n for n in lengths) // (2 if self.mask == "causal" else 1)

    def params(self, mode: str) -> dict:
        params = {"feature": self.feature, "layout": self.layout, "B": self.B,
                  "Sq": 1 if self.feature == "small_seq" else self.S, "Skv": self.S, "Hq": self.H, "Hkv": self.H,
                  "D": self.D, "dtype": "bfloat16", "mask": self.mask, "mode": mode}
        extra = {"bias": {"bias_shape": [1, self.H, self.S, self.S], "bias_type": "post_scale"},
                 "padding": {"seqlens": self.lengths()}, "window": {"window": list(self.window or ())},
                 "sink": {"softmax_type": "learnable", "sink_shape": [self.H]}, "softcap": {"softcap": SOFTCAP},
                 "thd": {"seqlens": self.lengths(), "T": self.B * self.S, "max_seqlen": max(self.lengths() or [0])}}
        return {**params, **extra.get(self.feature, {})}


def _normal(rng: np.random.Generator, shape: tuple[int, ...], bf16: bool = True) -> np.ndarray:
    """Standard normals, float32 or (bf16) as bfloat16 bit patterns."""
    count = int(np.prod(shape))
    values = rng.standard_normal(min(count, POOL), dtype=np.float32)
    if bf16:
        values = _bf16_bits(values)
    return (values if count <= POOL else np.resize(values, count)).reshape(shape)


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest even), as uint16 bit patterns (finite values only)."""
    bits = values.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _cu_seqlens(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def numpy_inputs(case: FeatureCase) -> dict[str, np.ndarray]:
    """The case's arrays, the same in every process: q, k, v, cotangent (and bias) as bfloat16 bit patterns
    (uint16; the frameworks view the is_bf16 ones as bfloat16), sink float32, cu_seqlens and lengths int32."""
    rng = np.random.default_rng(SEED)
    arrays = {name: _normal(rng, shape) for name, shape in case.shapes().items()}
    if case.feature == "bias":
        arrays["bias"] = _normal(rng, (1, case.H, case.S, case.S))
    if case.feature == "sink":
        arrays["sink"] = _normal(rng, (case.H,), bf16=False)
    lengths = case.lengths()
    if lengths is not None:
        arrays["lengths"] = np.asarray(lengths, np.int32)
        arrays["cu_seqlens"] = _cu_seqlens(lengths)
    valid = valid_rows(case)
    if valid is not None:
        arrays["cotangent"] *= valid  # padded rows' outputs are not compared, so they feed no gradient either
    return arrays


def is_bf16(name: str) -> bool:
    """Whether numpy_inputs holds the array as bfloat16 bit patterns."""
    return name in ("q", "k", "v", "cotangent", "bias")


def valid_rows(case: FeatureCase) -> np.ndarray | None:
    """(B, S, 1, 1) True on the query rows a padded call computes; None when every row counts."""
    if case.feature != "padding":
        return None
    return (np.arange(case.S)[None, :] < np.asarray(case.lengths())[:, None])[:, :, None, None]


def ours_keywords(case: FeatureCase, arrays: dict) -> tuple[dict, dict]:
    """(static keywords, array keywords) of fusedattn's attention(q, k, v, ...) for the case, the arrays taken
    from `arrays` (the framework's, named as numpy_inputs names them); no backend."""
    static = {"layout": case.layout, "mask": case.mask, "scale": case.D ** -0.5}
    traced = {}
    if case.feature == "bias":
        static["bias_type"] = "post_scale"
        traced["bias"] = arrays["bias"]
    elif case.feature in ("padding", "thd"):
        traced.update(cu_seqlens_q=arrays["cu_seqlens"], cu_seqlens_kv=arrays["cu_seqlens"])
        if case.feature == "thd":
            static.update(max_seqlen_q=max(case.lengths()), max_seqlen_kv=max(case.lengths()))
    elif case.feature == "window":
        static["window"] = case.window
    elif case.feature == "sink":
        static["softmax_type"] = "learnable"
        traced["sink"] = arrays["sink"]
    elif case.feature == "softcap":
        from fusedattn import score_mods

        static["score_mod"] = score_mods.softcap(SOFTCAP)
    return static, traced


def sample(x):
    """At most SAMPLE evenly spaced elements of x flattened (NumPy, JAX or torch): what two processes compare."""
    flat = x.reshape(-1)
    return flat[:: max(1, flat.shape[0] // SAMPLE)][:SAMPLE]


# --- timing --------------------------------------------------------------------------------------------------------

def loop_ms(step, args, wait, samples: int, calls: int) -> float:
    """Median over `samples` of the wall time of `calls` back-to-back step(*args) then one wait(last output),
    per call, in ms."""
    times = []
    for _ in range(samples):
        began = time.perf_counter()
        for _ in range(calls):
            out = step(*args)
        wait(out)
        times.append((time.perf_counter() - began) * 1e3 / calls)
    return statistics.median(times)


def loop_calls(step, args, wait, target_ms: float) -> int:
    """How many calls fill a loop of about target_ms (the median of 3 single calls sizes it)."""
    return max(1, min(MAX_CALLS, round(target_ms / loop_ms(step, args, wait, 3, 1))))
