"""Which declaration of a one-value-per-batch score_mod tensor ((B,1,1,1), (B,H,1,1)) cuDNN 9.19 reads right:
the fuzz case of tests/gpu/test_fuzz_gpu.py with score_mods.core's declaration replaced by (B, ., Sq, 1) as a
zero-stride view (torch) and as a dense array (what JAX passes), beside the shipped (B, ., Sq, Skv) view."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from fuzz_cases import Case, run_case  # noqa: E402

from fusedattn.cache import clear_all  # noqa: E402
from fusedattn.score_mods import core  # noqa: E402

BASE = Case(layout="sbhd", dtype="float16", batch=2, seqlen_q=127, seqlen_kv=127, heads_q=8, heads_kv=2,
            head_dim=160, head_dim_v=160, mask="causal", window=(56, 0), softmax_type="off_by_one",
            score_mod=("additive_bias", "b111", False), scale=1.703, seed=362881)
SHIPPED = core._normalize


def declared(how: str):
    def normalize(*args, **kwargs):
        array = SHIPPED(*args, **kwargs)
        if isinstance(array, torch.Tensor) and array.ndim == 4 and array.shape[0] > 1 and array.stride()[2:] == (0, 0):
            if how == "(B,.,Sq,1) view":
                return array[:, :, :, :1]
            if how == "(B,.,Sq,1) dense":
                return array[:, :, :, :1].contiguous()
            if how == "(B,.,Sq,Skv) dense":
                return array.contiguous()
        return array
    return normalize


def main() -> None:
    for how in ("shipped (B,.,Sq,Skv) view", "(B,.,Sq,1) view", "(B,.,Sq,1) dense", "(B,.,Sq,Skv) dense"):
        core._normalize = declared(how)
        clear_all()  # no plan or binding of another declaration is reused
        for shape in ("b111", "bh11"):
            for seed in (362881, 7):
                case = dataclasses.replace(BASE, score_mod=("additive_bias", shape, False), seed=seed)
                result = run_case(case, device="cuda", framework="torch")
                first = result.problems[0].splitlines()[0][:110] if result.problems else "ok"
                print(f"{how:>26} {shape} seed {seed}: {len(result.problems)} problems; {first}", flush=True)
    core._normalize = SHIPPED


if __name__ == "__main__":
    main()
