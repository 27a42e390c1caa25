"""One failing fuzz case and its variants on the GPU, each on its own (fresh process state is not
needed: the plan cache keys each variant apart): which feature makes it fail. Prints one line a variant."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from fuzz_cases import Case, run_case  # noqa: E402

BASE = Case(layout="sbhd", dtype="float16", batch=2, seqlen_q=127, seqlen_kv=127, heads_q=8, heads_kv=2,
            head_dim=160, head_dim_v=160, mask="causal", window=(56, 0), softmax_type="off_by_one",
            score_mod=("additive_bias", "b111", False), scale=1.703, seed=362881)

VARIANTS = {
    "as found": {},
    "another seed": {"seed": 5},
    "no window": {"window": (-1, -1)},
    "vanilla softmax": {"softmax_type": "vanilla"},
    "no score_mod": {"score_mod": None},
    "no GQA": {"heads_kv": 8},
    "head_dim 128": {"head_dim": 128, "head_dim_v": 128},
    "bshd": {"layout": "bshd"},
    "bfloat16": {"dtype": "bfloat16"},
    "no scale": {"scale": None},
    "mask none, window": {"mask": "none"},
    **{f"bias {shape}": {"score_mod": ("additive_bias", shape, False)}
       for shape in ("bhqk", "bh11", "b1q1", "b11k", "1h1k", "bhq1", "11q1", "111k", "1hq1", "b1qk", "1h11")},
    "softcap": {"score_mod": ("softcap", 20.0)},
}


def main() -> None:
    for name, change in VARIANTS.items():
        case = dataclasses.replace(BASE, **change)
        result = run_case(case, device="cuda", framework="torch")
        first = result.problems[0].splitlines()[0][:150] if result.problems else "ok"
        print(f"{name:>20}: {len(result.problems)} problems; {first}", flush=True)


if __name__ == "__main__":
    main()
