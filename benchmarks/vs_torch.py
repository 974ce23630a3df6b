"""autopar's runtime beside PyTorch's own, on the same model, batch, optimizer and split.

Two native CPU ranks of this machine (``device: cpu``: gloo, one core and one torch thread each; no
emulation, no clock), AdamW, the same global batch. Each row pairs an autopar plan with the PyTorch
program that does the same work:

| row | autopar | PyTorch |
|---|---|---|
| ddp | ``uniform-dp``, ZeRO-0 | ``DistributedDataParallel`` |
| fsdp2-keep | ``uniform-dp``, ZeRO-2 | FSDP2 (``fully_shard`` per block, ``reshard_after_forward=False``) |
| fsdp2 | ``uniform-dp``, ZeRO-3 | FSDP2 (``fully_shard`` per block) |
| pp | a pinned 2-stage pipeline, 1F1B, 8 micro-batches | ``torch.distributed.pipelining.Schedule1F1B``, the same cut |
| tp | a pinned TP 2 | DTensor ``ColwiseParallel`` / ``RowwiseParallel`` on every MLP |
| hf-fsdp2 | ZeRO-3 on a Hugging Face GPT-2 built from a config | FSDP2 per ``GPT2Block`` (needs ``transformers``) |

``--model`` picks the model of the first five rows: ``resmlp`` (the 9.5M-parameter residual MLP, batch 112)
or ``llama`` (a 13.8M-parameter Llama of the zoo's family at a size no other benchmark or table uses:
6 layers, hidden 384, 6 heads, SwiGLU 1024, vocabulary 4096, 64 tokens; batch 16). On the Llama, the TP
row shards attention (q, k, v by column, o by row, the heads split) and the SwiGLU (gate and up by
column, down by row) on both sides. Each autopar row also reports the plan's predicted step beside the
measured one.

Time: both sides step in one launch, interleaved step by step (``_common.interleaved_steps``), the
slowest rank's wall time per step; each side's median over ``--steps`` after ``--warmup``; the whole
launch repeated ``--runs`` times, so the ratio autopar / PyTorch is reported per run (its spread).
The timing launches run with glibc's heap trimming off for both sides (``STEADY_MALLOC``: the page
faults it causes otherwise land on one side of the interleaved pair).
Memory: each side alone in a fresh launch, the peak resident set of the slowest rank above what it had
before building the model (``ru_maxrss``), over warm-up steps.

    python benchmarks/vs_torch.py [--model resmlp|llama] [--rows ddp,fsdp2-keep,fsdp2,pp,tp,hf-fsdp2]
                                  [--steps 10] [--warmup 3] [--runs 2] [--name vs-torch]

Writes ``benchmarks/results/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

# the benchmarks folder only: the repository's root on the path would make its kernels/ folder the
# top-level ``kernels`` package that transformers imports
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROWS = ("ddp", "fsdp2-keep", "fsdp2", "pp", "tp", "hf-fsdp2")
MODELS = ("resmlp", "llama")
BATCHES = {"resmlp": 112, "llama": 16, "hf-gpt2": 112}
MICRO = 8
CLUSTER = {"name": "two-cpu", "nodes": [{"device": "cpu", "count": 2}]}


# -- models -------------------------------------------------------------------------------------------
def _resmlp():
    from bench_accuracy import resmlp

    return resmlp()


def _llama():
    from autopar.models.llama import LlamaConfig, make_case

    cfg = LlamaConfig(num_layers=6, hidden_size=384, num_heads=6, ffn_hidden_size=1024, vocab_size=4096, seq_len=64)
    return make_case("llama-13m", cfg, seed=0)


def _hf_gpt2():
    import torch
    from torch import nn
    from transformers import GPT2Config, GPT2LMHeadModel

    from autopar.models import ModelCase

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2048, n_positions=64, resid_pdrop=0.0,
                             embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
            self.lm = GPT2LMHeadModel(cfg)

        def forward(self, ids):
            return self.lm(input_ids=ids).logits

    def loss_fn(logits, targets):
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def make_batch(n, seed, device):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 2048, (n, 32), generator=g)
        return (ids,), torch.roll(ids, -1, dims=1)

    return ModelCase(name="hf-gpt2", model=Logits(), example_inputs=make_batch(4, 0, None)[0], loss_fn=loss_fn,
                     make_batch=make_batch)


def _case(row: str, model: str):
    if row == "hf-fsdp2":
        return _hf_gpt2()
    return _llama() if model == "llama" else _resmlp()


def _batch(row: str, model: str) -> int:
    return BATCHES["hf-gpt2" if row == "hf-fsdp2" else model]


def _blocks(model) -> list:
    """The repeated blocks FSDP2 wraps one by one."""
    return list(model.lm.transformer.h) if hasattr(model, "lm") else list(model.layers)


# -- the PyTorch side ---------------------------------------------------------------------------------
class _Torch:
    """One PyTorch program with autopar's ``step(inputs, targets)`` on the global batch."""

    def __init__(self, row: str, case, rank: int, world: int):
        import torch
        import torch.distributed as dist

        self.row, self.rank, self.world, self.loss_fn = row, rank, world, case.loss_fn
        model = case.model
        if row == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(model)
        elif row in ("fsdp2", "fsdp2-keep", "hf-fsdp2"):
            from torch.distributed.fsdp import fully_shard

            keep = row == "fsdp2-keep"
            for block in _blocks(model):
                fully_shard(block, reshard_after_forward=not keep)
            self.model = fully_shard(model, reshard_after_forward=not keep)
        elif row == "tp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = init_device_mesh("cpu", (world,))
            for block in model.layers:
                if hasattr(block, "attn"):          # the Llama: attention heads and the SwiGLU
                    parallelize_module(block, mesh, {
                        "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
                        "attn.v_proj": ColwiseParallel(), "attn.o_proj": RowwiseParallel(),
                        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                        "mlp.down_proj": RowwiseParallel()})
                    block.attn.n_heads //= world    # each rank's local heads, as torchtitan sets them
                    block.attn.n_kv_heads //= world
                else:
                    parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            self.model = model
        elif row == "pp":
            from torch import nn
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B

            cut = len(model.layers) // 2
            embed = [model.embed_tokens] if hasattr(model, "embed_tokens") else []
            head = model.lm_head if hasattr(model, "lm_head") else model.head
            if rank == 0:
                part = nn.Sequential(*embed, *model.layers[:cut])
            else:
                part = nn.Sequential(*model.layers[cut:], model.norm, head)
            self.model = part
            stage = PipelineStage(part, rank, world, torch.device("cpu"))
            scale = 1.0 / MICRO       # each micro-batch's mean loss, summed: the global mean's gradient
            self.schedule = Schedule1F1B(stage, n_microbatches=MICRO,
                                         loss_fn=lambda out, y: self.loss_fn(out, y) * scale)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=False)
        self._dist = dist

    def step(self, inputs, targets) -> float:
        import torch

        x, y = inputs[0], targets
        self.opt.zero_grad(set_to_none=True)
        if self.row == "pp":
            losses: list = []
            if self.rank == 0:
                self.schedule.step(x)
            else:
                self.schedule.step(target=y, losses=losses)
            loss = torch.stack(losses).sum() if losses else torch.zeros(())
        elif self.row == "tp":
            loss = self.loss_fn(self.model(x), y)
            loss.backward()
        else:                       # data parallel: this rank's half of the global batch
            n = x.shape[0] // self.world
            rows = slice(self.rank * n, (self.rank + 1) * n)
            loss = self.loss_fn(self.model(x[rows]), y[rows])
            loss.backward()
        self.opt.step()
        return float(loss.detach())


# -- the autopar side ---------------------------------------------------------------------------------
def _autopar(row: str, case, cluster, batch: int):
    import torch

    import autopar

    run = autopar.RunConfig(optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False))
    kw: dict = dict(strategy="uniform-dp")
    if row == "ddp":
        kw["zero_stage"] = 0
    elif row == "fsdp2-keep":
        kw["zero_stage"] = 2
    elif row in ("fsdp2", "hf-fsdp2"):
        kw["zero_stage"] = 3
    elif row == "pp":
        # the planner's cut of the pinned pipeline is torch's (checked below): blocks embed (the input),
        # layers.0..7, head (norm + head), 5 and 5
        kw = dict(strategy="auto", pin=autopar.Pin(pp=2, num_micro_batches=MICRO, schedule="1f1b"))
    elif row == "tp":
        kw = dict(strategy="tp", pin=autopar.Pin(tp=2))
    compiled = autopar.compile(case.model, cluster, case.example_inputs, batch, case.loss_fn, run=run, **kw)
    if row == "pp":
        cut = len(case.model.layers) // 2
        layers = [st.num_layers for st in compiled.plan.stages]
        if layers != [1 + cut, len(case.model.layers) - cut + 1]:
            raise RuntimeError(f"pp: the pinned plan cut the model {layers}, not as PyTorch's side does")
    return compiled


# -- ranks ----------------------------------------------------------------------------------------------
def _timing_rank(rank: int, row: str, model: str, warmup: int, steps: int):
    import torch.distributed as dist

    import autopar
    from _common import interleaved_steps

    cluster, batch = autopar.current_cluster(), _batch(row, model)
    ours = dict(case=_case(row, model), times=[], losses=[])
    ours["engine"] = _autopar(row, ours["case"], cluster, batch)
    theirs = dict(case=_case(row, model), times=[], losses=[])
    theirs["engine"] = _Torch(row, theirs["case"], rank, dist.get_world_size())
    interleaved_steps([ours, theirs], batch, warmup, steps)
    plan = ours["engine"].plan
    return {"autopar": ours["times"], "torch": theirs["times"], "plan": plan.summary(),
            "predicted_s": plan.predicted.step_time_s,
            "predicted_memory_bytes": max(plan.predicted.memory_bytes.values(), default=0)}


def _memory_rank(rank: int, row: str, model: str, side: str, warmup: int):
    import resource

    import torch.distributed as dist

    import autopar
    import autopar.api, autopar.passes.analyze, autopar.runtime.engine  # noqa: F401,E401 - code both sides
    import torch.distributed.fsdp, torch.distributed.pipelining, torch.distributed.tensor.parallel  # noqa
    # load before the baseline, so that the peak above it is tensors and buffers, not modules

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    case, batch = _case(row, model), _batch(row, model)
    job = _autopar(row, case, autopar.current_cluster(), batch) if side == "autopar" else \
        _Torch(row, case, rank, dist.get_world_size())
    for step in range(warmup):
        job.step(*case.batch(batch, seed=step))
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024


# glibc trims its heap and unmaps large blocks as they are freed. With both sides in one process, the
# pages that then fault back in land on whichever side allocates next: autopar's ZeRO-0 steps took 2-20k
# minor faults each beside DDP's 0 in the same processes, while launched alone both sides take them.
# The timing launches keep freed memory in the process, for both sides alike; the memory launches run
# the default allocator.
STEADY_MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(2**30), "MALLOC_MMAP_THRESHOLD_": str(2**30)}


def _launch(fn, *args, env: dict | None = None):
    import os

    import autopar

    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})         # the spawned ranks inherit it
    try:
        return autopar.launch(fn, autopar.Cluster.from_dict(CLUSTER), *args, timeout_s=900)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="autopar beside DDP, FSDP2, pipelining and DTensor TP on 2 CPU ranks")
    ap.add_argument("--model", choices=MODELS, default="resmlp",
                    help="the model of the ddp, fsdp2-keep, fsdp2, pp and tp rows (default: resmlp)")
    ap.add_argument("--rows", default=None, help=f"comma-separated rows (default: {','.join(ROWS)} with "
                    "resmlp; without hf-fsdp2 with llama)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--name", default="vs-torch")
    args = ap.parse_args(argv)
    if args.rows is None:
        args.rows = ",".join(r for r in ROWS if args.model == "resmlp" or r != "hf-fsdp2")
    from _common import md_table, write_results

    out: dict = {"rows": {}, "config": dict(vars(args), batch=BATCHES[args.model], micro_batches=MICRO,
                                            cluster=CLUSTER)}
    for row in args.rows.split(","):
        if row == "hf-fsdp2":
            try:
                import transformers  # noqa: F401
            except ImportError:
                print("hf-fsdp2: transformers is not installed; row left out", flush=True)
                continue
        runs = []
        for _ in range(args.runs):
            got = _launch(_timing_rank, row, args.model, args.warmup, args.steps, env=STEADY_MALLOC)[0]
            runs.append({"autopar_s": statistics.median(got["autopar"]), "torch_s": statistics.median(got["torch"]),
                         "autopar_steps": got["autopar"], "torch_steps": got["torch"], "plan": got["plan"],
                         "predicted_s": got["predicted_s"], "predicted_memory_bytes": got["predicted_memory_bytes"]})
        mem = {side: max(_launch(_memory_rank, row, args.model, side, args.warmup)) for side in ("autopar", "torch")}
        ratios = [r["autopar_s"] / r["torch_s"] for r in runs]
        gaps = [r["autopar_s"] / r["predicted_s"] for r in runs]
        out["rows"][row] = {"runs": runs, "ratios": ratios, "measured_over_predicted": gaps, "peak_rss_bytes": mem,
                            "memory_ratio": mem["autopar"] / mem["torch"] if mem["torch"] > 0 else None}
        print(f"{row}: autopar / torch {', '.join(f'{x:.2f}' for x in ratios)}; measured / predicted "
              f"{', '.join(f'{x:.2f}' for x in gaps)}; memory "
              f"{mem['autopar'] / 2**20:.0f} / {mem['torch'] / 2**20:.0f} MiB", flush=True)

    def span(xs):
        return f"{min(xs):.2f}-{max(xs):.2f}"

    table = [[row, ", ".join(f"{r['autopar_s'] * 1e3:.1f}" for r in d["runs"]),
              ", ".join(f"{r['predicted_s'] * 1e3:.1f}" for r in d["runs"]), span(d["measured_over_predicted"]),
              ", ".join(f"{r['torch_s'] * 1e3:.1f}" for r in d["runs"]), span(d["ratios"]),
              f"{d['peak_rss_bytes']['autopar'] / 2**20:.0f}", f"{d['peak_rss_bytes']['torch'] / 2**20:.0f}"]
             for row, d in out["rows"].items()]
    md = (f"# autopar beside PyTorch: 2 native CPU ranks, AdamW, {args.model} (batch {BATCHES[args.model]})\n\n"
          f"`python benchmarks/vs_torch.py --model {args.model} --rows {args.rows} --steps {args.steps} "
          f"--warmup {args.warmup} --runs {args.runs}`. Measured on this machine's CPUs (not emulated); median "
          f"step of the slowest rank per run, both sides interleaved in one launch (glibc's heap trimming off, `STEADY_MALLOC`); predicted: the plan's "
          f"step; memory: peak RSS above the start, each side alone (the slowest rank).\n\n"
          + md_table(["row", "autopar ms (per run)", "predicted ms", "measured / predicted", "PyTorch ms (per run)",
                      "autopar / PyTorch", "autopar peak MiB", "PyTorch peak MiB"], table))
    write_results(args.name, out, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
