"""``autopar check``: is a plan exact on this model, and is what differs the plan's or the model's own?

api.md's exactness: after any number of steps, ``state_dict()`` equals what the same optimizer gives
on one device stepping on the whole global batch (per tensor, max |a - b| over max |b|; at most 1e-4
with SGD + momentum, 1e-3 with AdamW at eps=1e-6). Some models are not exact against themselves when
the batch is cut: bf16 grouped GEMMs of mixture-of-experts layers, kernels whose reductions depend on
the batch size. ``check`` runs four trainings from the same initial weights, on the same batches:

- reference: one device, the whole global batch per step;
- control: one device, each step's batch cut into the plan's micro-batches (stage 0's sizes, in member
  order), their losses weighted by rows / batch and their gradients summed, as the engines do;
- reordered control: one device, the whole batch with its rows in reverse order. The same sums in
  another order: what any plan does that splits a sum, a tensor-parallel plan too, whose control above
  is the reference itself (one piece). A vocabulary-parallel head sums its input's gradient over
  vocabulary shards; Qwen3-MoE's bf16 experts turn that fp32 reordering into 2.0e-2 after 3 AdamW
  steps, reversed rows into 5.2e-3, micro-batching into 2.0e-2;
- autopar: the plan, compiled and launched on the cluster (emulated devices where the cluster says so).

It reports the controls' and autopar's largest relative difference from the reference, and which of
three cases holds: exact (autopar within the bound), the model's own rounding (autopar above the
bound but within ``OWN_FACTOR`` times the larger control, which is above a tenth of the bound), or a
difference of the plan's (exit status 1: worth an issue).
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import asdict, dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map

from autopar.passes.inputs import flatten_like

__all__ = ["CheckResult", "OWN_FACTOR", "BOUNDS", "state_rel_errors", "check_worker", "run_check", "add_parser",
           "cmd_check"]

OWN_FACTOR = 10.0                           # autopar within this many times the control: the model's own
BOUNDS = {"adamw": 1e-3, "sgd": 1e-4}       # api.md's exactness bounds (fp32)
_LR = 1e-3


@dataclass(frozen=True)
class CheckResult:
    model: str
    strategy: str
    optimizer: str
    steps: int
    pieces: tuple[int, ...]          # the control's micro-batch sizes
    bound: float
    control: float                   # max relative difference, one device micro-batched vs whole batch
    autopar: float                   # max relative difference, the plan vs whole batch
    worst_tensor: str                # autopar's farthest tensor
    plan: str                        # the plan's one-line summary
    reordered: float = 0.0           # max relative difference, one device with the rows reversed vs whole batch

    @property
    def verdict(self) -> str:
        if self.autopar <= self.bound:
            return "exact"
        own = max(self.control, self.reordered)
        if own > self.bound / 10 and self.autopar <= OWN_FACTOR * own:
            return "the model's own rounding"
        return "differs"

    def lines(self) -> list[str]:
        how = {"exact": f"exact: within api.md's bound of {self.bound:g}",
               "the model's own rounding": (f"above the bound of {self.bound:g}, but within {OWN_FACTOR:g}x what "
                                            "the model itself differs by when its batch is cut or its rows "
                                            "reordered: the model's own rounding, not the plan's"),
               "differs": (f"autopar differs by more than the bound of {self.bound:g} and more than {OWN_FACTOR:g}x "
                           "the model's own micro-batching and reordering differences: the plan's, worth an "
                           "issue")}[self.verdict]
        return [f"{self.model}, {self.strategy}, {self.steps} steps of {self.optimizer}: largest relative difference "
                f"from one device on the whole batch (per tensor, max |a - b| / max |b|)",
                f"  one device, batch cut into {len(self.pieces)} micro-batch{'es' if len(self.pieces) != 1 else ''} "
                f"{list(self.pieces)}: "
                f"{self.control:.3g}   (the model's own rounding)",
                f"  one device, the whole batch with its rows reversed: {self.reordered:.3g}   (the model's own "
                f"rounding)",
                f"  autopar ({self.plan}): {self.autopar:.3g}   (farthest: {self.worst_tensor})",
                f"  verdict: {how}"]


def state_rel_errors(a: dict, b: dict) -> dict[str, float]:
    """Per key of ``b``: max |a - b| / max |b| (absolute where ``b`` is all zeros; 0 or inf for equal or
    differing integer tensors)."""
    if set(a) != set(b):
        raise ValueError(f"state keys differ: missing {sorted(set(b) - set(a))}, unexpected {sorted(set(a) - set(b))}")
    out = {}
    for k, ref in b.items():
        got, ref = a[k].detach().cpu(), ref.detach().cpu()
        if not ref.is_floating_point():
            out[k] = 0.0 if torch.equal(got, ref) else float("inf")
            continue
        if not ref.numel():
            out[k] = 0.0
            continue
        diff = (got.double() - ref.double()).abs().max().item()
        scale = ref.double().abs().max().item()
        out[k] = diff / scale if scale > 0 else diff
    return out


def _optimizer(name: str):
    if name == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=_LR, eps=1e-6)
    return lambda ps: torch.optim.SGD(ps, lr=_LR, momentum=0.9)


def _batch(case, global_batch: int, step: int):
    return case.batch(global_batch, seed=100 + step)


def check_worker(rank: int, model: str, global_batch: int, strategy: str, optimizer: str, steps: int, seed: int):
    """On every rank: compile ``strategy`` and train ``steps`` steps; rank 0 returns its initial state, the
    final state, the plan and its stage-0 micro-batch sizes."""
    import autopar
    from autopar.models import load

    case = load(model, device="cpu", seed=seed)
    initial = {k: v.detach().clone() for k, v in case.model.state_dict().items()} if rank == 0 else None
    compiled = autopar.compile(case.model, autopar.current_cluster(), case.example_inputs, global_batch,
                               case.loss_fn, run=autopar.RunConfig(optimizer=_optimizer(optimizer)),
                               strategy=strategy, seed=seed)
    for s in range(steps):
        compiled.step(*_batch(case, global_batch, s))
    state = compiled.state_dict()
    if rank != 0:
        return None
    plan = compiled.plan
    pieces = tuple(n for sizes in plan.stages[0].micro_batches for n in sizes if n > 0)
    rows = [[st.member_batch(g) for g in range(len(st.groups))] for st in plan.stages]
    text = (f"{plan.strategy}: {plan.num_stages} stage(s), ZeRO-{plan.zero_stage}, schedule {plan.schedule}, "
            f"rows per member {rows if len(rows) > 1 else rows[0]}")
    return dict(initial=initial, state={k: v.detach().cpu() for k, v in state.items()}, pieces=pieces, plan=text)


def _one_device(model: str, initial: dict, global_batch: int, pieces: tuple[int, ...], optimizer: str,
                steps: int, seed: int, reverse: bool = False) -> dict:
    """One device from ``initial``: each step's batch in ``pieces`` (one piece: the whole batch), its
    rows in reverse order with ``reverse`` (every tensor input and the targets alike)."""
    from autopar.models import load
    from autopar.runtime.base import compute_loss

    case = load(model, device="cpu", seed=seed)
    net = case.model
    net.load_state_dict(copy.deepcopy(initial))
    forward, layout = _trainable_forward(net, case.example_inputs)
    opt = _optimizer(optimizer)([p for p in net.parameters() if p.requires_grad])
    for s in range(steps):
        inputs, targets = _batch(case, global_batch, s)
        if reverse:         # before flattening: derived inputs (a flex mask) are built from the reversed rows
            inputs, targets = tree_map(_reversed_rows, (inputs, targets))
        leaves = flatten_like(inputs, layout)
        opt.zero_grad(set_to_none=True)
        start = 0
        for n in pieces:
            rows = slice(start, start + n)
            take = tuple(t[rows] if isinstance(t, torch.Tensor) and t.dim() > 0 else t for t in leaves)
            tgt = targets[rows] if isinstance(targets, torch.Tensor) else targets
            (compute_loss(forward(*take), tgt, case.loss_fn) * (n / global_batch)).backward()
            start += n
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _reversed_rows(t):
    return t.flip(0) if isinstance(t, torch.Tensor) and t.dim() > 0 else t


def _trainable_forward(net, example_inputs):
    """``(forward, layout)``: the model over the tensor leaves of its inputs (``passes.inputs``), or its
    captured graph, the same operators on the same Parameters, where this device refuses the model's
    own backward (torch's ``flex_attention`` has none on CPU; the graph's operator has)."""
    from autopar.passes.capture import capture
    from autopar.passes.inputs import flat_inputs

    view, flat, layout = flat_inputs(net, example_inputs)
    try:
        out = next(t for t in tree_flatten(view(*flat))[0] if isinstance(t, torch.Tensor) and t.is_floating_point())
        out.float().sum().backward()
        return view, layout
    except NotImplementedError:
        return capture(view, flat).gm, layout
    finally:
        for p in net.parameters():
            p.grad = None


def run_check(model: str, cluster, global_batch: int, strategy: str = "auto", optimizer: str = "adamw",
              steps: int = 3, seed: int = 0) -> CheckResult:
    """The four trainings of the module docstring and their differences."""
    import autopar

    got = autopar.launch(check_worker, cluster, model, global_batch, strategy, optimizer, steps, seed)[0]
    reference = _one_device(model, got["initial"], global_batch, (global_batch,), optimizer, steps, seed)
    control = _one_device(model, got["initial"], global_batch, got["pieces"], optimizer, steps, seed)
    reordered = _one_device(model, got["initial"], global_batch, (global_batch,), optimizer, steps, seed, reverse=True)
    ours = state_rel_errors(got["state"], reference)
    worst = max(ours, key=ours.get)
    return CheckResult(model=model, strategy=strategy, optimizer=optimizer, steps=steps, pieces=got["pieces"],
                       bound=BOUNDS[optimizer], control=max(state_rel_errors(control, reference).values()),
                       autopar=ours[worst], worst_tensor=worst, plan=got["plan"],
                       reordered=max(state_rel_errors(reordered, reference).values()))


_HELP = """\
Trains four times from the same initial weights on the same batches:
  reference  one device, the whole global batch per step
  control    one device, each batch cut into the plan's micro-batches (the model's own rounding)
  reordered  one device, the whole batch with its rows reversed (the same sums in another order)
  autopar    the plan, launched on the cluster (emulated devices where the cluster says so)
and prints the controls' and autopar's largest relative difference from the reference (per tensor,
max |a - b| / max |b|) with a verdict:
  exact                     autopar within api.md's bound (AdamW 1e-3, SGD + momentum 1e-4)
  the model's own rounding  above the bound, within 10x the larger control, above a tenth of it
  differs                   the plan's difference: exit status 1
"""


def add_parser(sub) -> None:
    from autopar.config import STRATEGIES

    c = sub.add_parser("check", help="is a plan exact on this model? autopar and the model's own micro-batching "
                                     "against one device on the whole batch",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=_HELP)
    c.add_argument("--model", required=True, help="zoo name or package.module:factory")
    c.add_argument("--cluster", required=True, help="cluster YAML file or built-in name (demo)")
    c.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    c.add_argument("--strategy", default="auto", choices=list(STRATEGIES))
    c.add_argument("--optimizer", default="adamw", choices=sorted(BOUNDS),
                   help="adamw (eps=1e-6, bound 1e-3) or sgd with momentum (bound 1e-4)")
    c.add_argument("--steps", type=int, default=3, help="optimizer steps of each training (default 3)")
    c.add_argument("--json", metavar="OUT", help="write the result as JSON to OUT ('-' for stdout)")


def cmd_check(args, load_cluster) -> int:
    from autopar.errors import PlanError
    from autopar.models.zoo import factory_of
    from autopar.planner.entry import check_request

    if args.steps < 1:
        raise PlanError(f"--steps: must be >= 1, got {args.steps}")
    factory_of(args.model)                  # before any process starts
    cluster = load_cluster(args.cluster)
    check_request(cluster, args.global_batch)
    result = run_check(args.model, cluster, args.global_batch, args.strategy, args.optimizer, args.steps)
    if args.json:
        text = json.dumps(dict(asdict(result), verdict=result.verdict), indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.json != "-":
        print("\n".join(result.lines()))
    return 1 if result.verdict == "differs" else 0
