"""model suite: one GPT-style training step with fusedattn's attention against torch's, same model, same inputs.

The model is a stack of pre-LayerNorm transformer blocks without embeddings, in bf16:
    x -> LayerNorm -> one fused QKV Linear (d_model -> (Hq + 2*Hkv) * D) -> attention (causal) -> output Linear
      -> residual; LayerNorm -> MLP (4 x d_model, tanh GELU) -> residual
and the loss is the mean square of the last block's output. One step = forward, backward,
AdamW step (fused=True where torch has it; bf16 parameters and states, for every contestant
alike), zero_grad. The contestants differ only in the attention call:

fusedattn   fusedattn.torch.attention(..., mask="causal"), default selection (--ours-backend forces one):
            MHA passes the projection as one (B, S, 3, H, D) tensor (layout="bs3hd"); GQA passes q, k, v
            as head slices of the (B, S, Hq + 2*Hkv, D) projection (layout="bshd"); no copies either way
sdpa        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=Hq != Hkv) on (B, H, S, D)
            transposed views of the same slices, torch's default dispatch
sdpa_cudnn  the same under sdpa_kernel(SDPBackend.CUDNN_ATTENTION)

Modes: "eager", and "compile": torch.compile(model) (--compile-backend, default inductor), which covers
forward and loss; AOTAutograd compiles the backward, the optimizer step stays eager. fusedattn enters
the graph as its custom op (torch.ops.fusedattn.attention_fwd/_bwd), planned once at trace time.

Timing: every contestant is built (same seed, so the same weights) and warmed up (--warmup steps; the
first compiles), then --repeats rounds each time one window of --steps steps per contestant, interleaved;
the row keeps the median of the windows' ms/step (CUDA events around a window; perf_counter on CPU).
FLOPs per step count the matmuls: QKV, attention (causal: half the square), output projection and MLP,
forward x 3 for forward + backward (the usual model-FLOPs convention, attention included).
ratio_vs_best_peer = best peer ms / fusedattn ms (> 1: ours faster). params.first_step_loss holds each
contestant's loss on the first step (same weights and input: they should agree to bf16 accuracy);
params.fusedattn_selection the backend fusedattn picked and how many calls per step took it.

    python bench/bench_model.py                                   # all configs, eager and compile
    python bench/bench_model.py --configs gqa --modes compile --merge
    python bench/bench_model.py --smoke --out /tmp/model.json     # tiny sizes on CPU (reference backend)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

try:  # python -m bench.bench_model
    from . import common
except ImportError:  # python bench/bench_model.py
    import common

SUITE = "model"
DTYPE = torch.bfloat16
OURS = "fusedattn"
PEERS = ("sdpa", "sdpa_cudnn")
MODES = ("eager", "compile")
LEARNING_RATE = 1e-5  # small: the weights barely move over the timed steps, so every window does the same work
SEED = 1234
RECOMPILE_LIMIT = 64  # each contestant's model is its own graph; dynamo's default limit is 8


# --- configurations ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelConfig:
    name: str
    layers: int
    d_model: int
    Hq: int
    Hkv: int
    D: int
    B: int
    S: int

    def forward_flops(self) -> float:
        """Matmul FLOPs of one forward: projections, MLP and causal attention (half of the S x S square)."""
        tokens = self.B * self.S
        projections = 2.0 * tokens * self.d_model * ((self.Hq + 2 * self.Hkv) * self.D + self.Hq * self.D)
        mlp = 2.0 * tokens * self.d_model * 4 * self.d_model * 2
        attention = common.attention_flops(self.B, self.Hq, self.S, self.S, self.D, causal=True, mode=common.FWD)
        return self.layers * (projections + mlp + attention)

    def step_flops(self) -> float:
        return 3.0 * self.forward_flops()

    def params(self) -> dict:
        return {"layers": self.layers, "d_model": self.d_model, "B": self.B, "S": self.S, "Hq": self.Hq,
                "Hkv": self.Hkv, "D": self.D, "mlp": 4 * self.d_model, "dtype": "bfloat16", "mask": "causal"}


CONFIGS = {
    "gpt2-small": ModelConfig("gpt2-small", layers=12, d_model=768, Hq=12, Hkv=12, D=64, B=8, S=1024),
    "gqa": ModelConfig("gqa", layers=8, d_model=2048, Hq=16, Hkv=4, D=128, B=4, S=2048),
    "short": ModelConfig("short", layers=8, d_model=1024, Hq=16, Hkv=16, D=64, B=32, S=256),
}


def smoke_config(config: ModelConfig) -> ModelConfig:
    """The same head structure (MHA or GQA) at sizes a CPU runs in a second."""
    Hkv = 4 if config.Hq == config.Hkv else 2
    return dataclasses.replace(config, name=f"smoke-{config.name}", layers=2, d_model=64, Hq=4, Hkv=Hkv, D=16,
                               B=2, S=32)


# --- attention calls ---------------------------------------------------------------------------------------------

def head_slices(qkv: torch.Tensor, Hq: int, Hkv: int, D: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as views of the fused projection (B, S, Hq + 2*Hkv, D), sliced along heads (no copies)."""
    B, S, _ = qkv.shape
    heads = qkv.view(B, S, Hq + 2 * Hkv, D)
    return heads[:, :, :Hq], heads[:, :, Hq:Hq + Hkv], heads[:, :, Hq + Hkv:]


def fusedattn_attention(qkv: torch.Tensor, *, Hq: int, Hkv: int, D: int, backend: str | None) -> torch.Tensor:
    import fusedattn.torch as fat

    B, S, _ = qkv.shape
    if Hq == Hkv:  # the projection already is (B, S, 3, H, D): the packed layout needs no slicing
        out = fat.attention(qkv.view(B, S, 3, Hq, D), layout="bs3hd", mask="causal", backend=backend)
    else:
        q, k, v = head_slices(qkv, Hq, Hkv, D)
        out = fat.attention(q, k, v, layout="bshd", mask="causal", backend=backend)
    return out.reshape(B, S, Hq * D)


def sdpa_attention(qkv: torch.Tensor, *, Hq: int, Hkv: int, D: int) -> torch.Tensor:
    B, S, _ = qkv.shape
    q, k, v = head_slices(qkv, Hq, Hkv, D)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=Hq != Hkv)
    return out.transpose(1, 2).reshape(B, S, Hq * D)


def sdpa_cudnn_attention(qkv: torch.Tensor, *, Hq: int, Hkv: int, D: int) -> torch.Tensor:
    """sdpa_attention as code of its own: dynamo guards on the code, so a compiled model traces this afresh
    (under the cuDNN-only context) instead of reusing the graph traced for default dispatch."""
    return sdpa_attention(qkv, Hq=Hq, Hkv=Hkv, D=D)


def _sdpa_cudnn_context() -> contextlib.AbstractContextManager:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])


def attention_of(name: str, config: ModelConfig, ours_backend: str | None
                 ) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[], contextlib.AbstractContextManager]]:
    """(attention(qkv) -> (B, S, Hq*D), the context every step of the contestant runs in)."""
    heads = dict(Hq=config.Hq, Hkv=config.Hkv, D=config.D)
    if name == OURS:
        return partial(fusedattn_attention, backend=ours_backend, **heads), contextlib.nullcontext
    if name == "sdpa":
        return partial(sdpa_attention, **heads), contextlib.nullcontext
    # The context wraps whole steps (not the call inside the model): the compiled graph is traced under it too,
    # and AOTAutograd picks the SDPA kernel (forward and backward) at trace time.
    return partial(sdpa_cudnn_attention, **heads), _sdpa_cudnn_context


# --- the model ---------------------------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, config: ModelConfig, attention: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        d = config.d_model
        self.ln_attention = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, (config.Hq + 2 * config.Hkv) * config.D)
        self.attention = attention
        self.projection = nn.Linear(config.Hq * config.D, d)
        self.ln_mlp = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.projection(self.attention(self.qkv(self.ln_attention(x))))
        return x + self.down(F.gelu(self.up(self.ln_mlp(x)), approximate="tanh"))


class Model(nn.Module):
    """Blocks, then the loss (part of the module so torch.compile covers it)."""

    def __init__(self, config: ModelConfig, attention: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.float().square().mean()


def make_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, str]:
    """AdamW, fused where this torch has it for the device and dtype, else foreach."""
    try:
        return torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True), "fused"
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, foreach=True), "foreach"


# --- which backend fusedattn picked ------------------------------------------------------------------------------

class _SelectionRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.made: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) >= 2:  # fusedattn logs ("<config summary>", "<backend>", ...) for each decision
            self.made.append((str(args[0]), str(args[1])))


@contextlib.contextmanager
def recorded_selections():
    """Yield a list that fills with (config summary, backend) for each selection fusedattn makes in the block.

    Decisions are cleared first so each one is made (and logged, FUSEDATTN_LOG=1) anew; the
    variable, the logger's level and its handlers are restored after.
    """
    from fusedattn import selection

    handler = _SelectionRecords()
    saved_env, saved_level = os.environ.get(selection.ENV_LOG), selection.logger.level
    selection.logger.addHandler(handler)  # also keeps fusedattn from adding its own stderr handler
    os.environ[selection.ENV_LOG] = "1"
    selection.clear_decisions()
    try:
        yield handler.made
    finally:
        selection.logger.removeHandler(handler)
        selection.logger.setLevel(saved_level)
        if saved_env is None:
            os.environ.pop(selection.ENV_LOG, None)
        else:
            os.environ[selection.ENV_LOG] = saved_env


def selection_summary(made: list[tuple[str, str]], calls_per_step: int) -> dict:
    backends = sorted({backend for _, backend in made})
    summary = {"decisions": [f"{config} -> {backend}" for config, backend in made]}
    if len(backends) == 1:  # every call of a step has the same shapes, so one decision covers them all
        summary["calls_per_step"] = {backends[0]: calls_per_step}
    return summary


# --- one contestant ----------------------------------------------------------------------------------------------

@dataclass
class Contestant:
    name: str
    step: Callable[[], torch.Tensor]
    context: Callable[[], contextlib.AbstractContextManager]
    first_loss: float | None = None
    times: list[float] = field(default_factory=list)
    selections: list[tuple[str, str]] = field(default_factory=list)


def build(name: str, config: ModelConfig, mode: str, x: torch.Tensor, args, device: torch.device
          ) -> tuple[Contestant, str]:
    """A contestant's model (seeded: the same weights for all), optimizer and step; and the AdamW kind used."""
    attention, context = attention_of(name, config, args.ours_backend)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = Model(config, attention).to(DTYPE)
    optimizer, kind = make_optimizer(model)
    forward = torch.compile(model, backend=args.compile_backend) if mode == "compile" else model

    def step() -> torch.Tensor:
        loss = forward(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return Contestant(name, step, context), kind


def warm_up(contestant: Contestant, steps: int) -> None:
    """The first step (which compiles, builds graphs, selects) gives the checked loss; then more untimed steps."""
    with contestant.context():
        if contestant.name == OURS:
            with recorded_selections() as made:
                loss = contestant.step()
            contestant.selections = list(made)
        else:
            loss = contestant.step()
        contestant.first_loss = float(loss)
        for _ in range(steps):
            contestant.step()


def time_window(contestant: Contestant, steps: int, device: torch.device) -> float:
    """ms per step over `steps` back-to-back steps (one synchronize before, events around them), on one core
    on a GPU (common.one_core: a step bound by the host then reads the same from window to window)."""
    with contestant.context(), common.one_core(device):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                contestant.step()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / steps
        began = time.perf_counter()
        for _ in range(steps):
            contestant.step()
        return (time.perf_counter() - began) * 1e3 / steps


# --- one row -----------------------------------------------------------------------------------------------------

def _prepare_all(config: ModelConfig, mode: str, x: torch.Tensor, args, device: torch.device, params: dict,
                 entries: dict) -> dict[str, Contestant]:
    live = {}
    for name in args.contestants:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                contestant, params["adamw"] = build(name, config, mode, x, args, device)
                warm_up(contestant, args.warmup)
                live[name] = contestant
            except Exception as error:  # a contestant that cannot run is an entry, not the end of the run
                entries[name] = common.error_entry(error, caught)
                common.release_memory(device)
    return live


def _time_rounds(live: dict[str, Contestant], args, device: torch.device, entries: dict) -> None:
    """--repeats rounds, each one window per contestant (interleaved, so drifting clocks hit all alike)."""
    for _ in range(args.repeats):
        for name, contestant in list(live.items()):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    contestant.times.append(time_window(contestant, args.steps, device))
                except Exception as error:
                    entries[name] = common.error_entry(error, caught)
                    del live[name]
                    common.release_memory(device)


def _entry(contestant: Contestant, flops: float) -> dict:
    ms = statistics.median(contestant.times)
    return {"ms": round(ms, 4), "value": round(common.tflops(flops, ms), 2)}


def run_row(config: ModelConfig, mode: str, args, device: torch.device) -> dict:
    if mode == "compile":
        torch._dynamo.reset()  # the last row's graphs go; this row's contestants compile afresh
        dynamo = torch._dynamo.config
        limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
        setattr(dynamo, limit, max(getattr(dynamo, limit), RECOMPILE_LIMIT))
    flops = config.step_flops()
    params = {**config.params(), "mode": mode, "flops_per_step": int(flops), "steps_per_window": args.steps,
              "repeats": args.repeats, "warmup_steps": args.warmup, "learning_rate": LEARNING_RATE,
              "compile_backend": args.compile_backend if mode == "compile" else None,
              "fusedattn_layout": "bs3hd" if config.Hq == config.Hkv else "bshd"}
    generator = torch.Generator(device=device).manual_seed(SEED)
    x = torch.randn(config.B, config.S, config.d_model, device=device, dtype=DTYPE, generator=generator)

    entries: dict[str, dict] = {}
    live = _prepare_all(config, mode, x, args, device, params, entries)
    _time_rounds(live, args, device, entries)
    for name, contestant in live.items():
        entries[name] = _entry(contestant, flops)
    params["first_step_loss"] = {name: c.first_loss for name, c in live.items()}
    if OURS in live:
        params["fusedattn_selection"] = selection_summary(live[OURS].selections, config.layers)
    del live, x
    gc.collect()
    common.release_memory(device)

    backend = args.ours_backend or _chosen_backend(params)
    ours = {"backend": backend, **entries.get(OURS, {"error": "not run (--contestants)"})}
    peers = {name: entries[name] for name in PEERS if name in entries}
    ratio = common.best_peer_ratio(ours, peers)
    return {"workload": f"{config.name}-{mode}", "params": params, "metric": "tflops", "ours": ours,
            "peers": peers, "ratio_vs_best_peer": None if ratio is None else round(ratio, 4)}


def _chosen_backend(params: dict) -> str:
    decisions = params.get("fusedattn_selection", {}).get("calls_per_step", {})
    return ",".join(decisions) if decisions else "default"


# --- command line ------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="bench_model.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_run_arguments(parser, SUITE)
    parser.set_defaults(repeats=7, warmup=3)
    parser.add_argument("--configs", type=common.choice_list(tuple(CONFIGS)), default=list(CONFIGS),
                        help=f"comma-separated configurations (default all: {','.join(CONFIGS)})")
    parser.add_argument("--modes", type=common.choice_list(MODES), default=None,
                        help="comma-separated modes: eager, compile (default both; eager alone with --smoke)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per timed window (default 10; 2 with --smoke)")
    parser.add_argument("--contestants", type=common.choice_list((OURS, *PEERS)), default=[OURS, *PEERS],
                        help=f"comma-separated contestants (default all: {','.join((OURS, *PEERS))})")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    parser.add_argument("--ours-backend", default=None,
                        help="force a fusedattn backend (default: fusedattn's own selection)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny models (2 layers, d_model 64, S 32, B 2) on CPU: tests the script, not speed")
    parser.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default cuda (cpu with --smoke)")
    args = common.parse_suite_args(parser, argv, SUITE, None)
    args.steps = args.steps if args.steps is not None else 2 if args.smoke else 10
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.modes = args.modes or (["eager"] if args.smoke else list(MODES))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    configs = [smoke_config(CONFIGS[name]) if args.smoke else CONFIGS[name] for name in args.configs]
    rows = [(config, mode) for config in configs for mode in args.modes
            if common.workload_matches(args.only, f"{config.name}-{mode}")]
    return common.run_suite(
        "bench_model", args, rows, lambda config, mode, device: run_row(config, mode, args, device),
        [p for p in PEERS if p in args.contestants],
        harness_row=lambda config, mode, error: common.harness_error_row(
            f"{config.name}-{mode}", {**config.params(), "mode": mode}, args.ours_backend or "default", error),
        cpu_hint="or --smoke to test the script on CPU",
        notes=[f"ms/step: median of {args.repeats} windows of {args.steps} steps per contestant (interleaved) "
               f"after {args.warmup} warm-up steps; TF = model matmul TFLOP/s (forward x 3)"])


if __name__ == "__main__":
    sys.exit(main())
