"""The ``autopar`` command line (also ``python -m autopar``). See ``autopar --help``.

Errors on bad input are one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from autopar.cli.parser import build_parser   # re-exported: the command line main parses

__all__ = ["main", "build_parser", "run"]


def _load_model(spec: str, device: str | None = None):
    from autopar.models import load

    return load(spec, device=device)


def _planning_case(spec: str):
    """The model to plan, built once: a zoo model of 50M parameters or more on the meta device (its meta
    build is the case), anything smaller with real weights, so that it can be measured."""
    from autopar.models import names

    if spec in names():
        case = _load_model(spec, device="meta")
        if case.num_params_expected >= 50_000_000:
            return case
    if spec.startswith("hf:"):          # a config: no weights to measure with (api.md)
        return _load_model(spec, device="meta")
    return _load_model(spec, device="cpu")


def _load_cluster(arg: str | None):
    from autopar.cluster.model import Cluster, load

    return Cluster.detect() if arg is None else load(arg)


def _progress(total: int, label: str):
    """A rich progress bar on stderr; returns (advance callback, stop callback)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn(label), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), transient=True)
    task = prog.add_task(label, total=total)
    prog.start()
    return (lambda: prog.advance(task)), prog.stop


def _write_json(obj, dest: str) -> None:
    text = json.dumps(obj, indent=2)
    if dest == "-":
        print(text)
    else:
        with open(dest, "w") as f:
            f.write(text + "\n")


def _prepare(model_spec: str, cluster, need_measure: bool = True, precision: str | None = None,
             example_batch: int | None = None, seq_len: int | None = None):
    from autopar.api import planning_analysis_options, prepare

    from autopar.cost.profile import DEFAULT_SAMPLE_BATCHES
    from autopar.passes.analyze import analyze
    from autopar.passes.inputs import flat_inputs

    case = _planning_case(model_spec)   # one build (a 140B model on meta takes ~0.7 s)
    if seq_len is not None:             # tokens per sample of a language model
        from autopar.models.case import with_seq_len

        case = with_seq_len(case, seq_len)
    if example_batch is not None:       # the model captured and analysed at this many rows
        if example_batch < 1:
            from autopar.errors import PlanError

            raise PlanError(f"--example-batch: need N >= 1 rows, got {example_batch}")
        case = dataclasses.replace(case, example_inputs=case.batch(example_batch)[0])
    view, flat, _ = flat_inputs(case.model, case.example_inputs)     # pytree and derived inputs
    case = dataclasses.replace(case, model=view, example_inputs=flat)
    t0 = time.perf_counter()
    analysis = analyze(case.model, case.example_inputs, **planning_analysis_options())
    analyze_s = time.perf_counter() - t0
    advance, stop = (lambda: None), (lambda: None)
    if need_measure and sys.stderr.isatty():
        total = len(analysis.distinct_blocks()) * len(DEFAULT_SAMPLE_BATCHES)
        advance, stop = _progress(total, "profiling blocks")
    try:
        targets = case.batch(int(case.example_inputs[0].shape[0]))[1] if case.loss_fn is not None else None
        prep = prepare(case.model, cluster, case.example_inputs, progress=advance, analysis=analysis,
                       precision=precision, loss_fn=case.loss_fn, example_targets=targets)
    finally:
        stop()
    prep.analyze_s = analyze_s
    return case, prep


def _block_counts(text: str, option: str) -> list[int]:
    from autopar.errors import PlanError

    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise PlanError(f"{option}: {text!r} is not a comma-separated list of block counts, e.g. 8,4") from None


# -- commands ------------------------------------------------------------------------------------
def cmd_models(args) -> int:
    from autopar.models import load, names
    from autopar.ir.report import fmt_count, render
    from rich.table import Table

    t = Table(title="model zoo")
    for c in ("name", "parameters", "fwd FLOPs / sample"):
        t.add_column(c, justify="left" if c == "name" else "right")
    for n in names():
        case = load(n, device="meta")
        fl = case.fwd_flops_per_sample_expected
        t.add_row(n, fmt_count(case.num_params_expected), fmt_count(fl) if fl else "-")
    print(render(t), end="")
    return 0


def cmd_analyze(args) -> int:
    from autopar.ir.report import analysis_table

    cluster = _load_cluster(args.cluster)
    case, prep = _prepare(args.model, cluster)
    a, costs = prep.analysis, prep.costs
    batch = args.batch or a.batch_size
    if args.json != "-":
        print(analysis_table(a, costs, batch), end="")
        print(f"capture: {a.method}; analysis {prep.analyze_s:.2f} s, profiling {prep.profile_s:.2f} s")
    if args.json:
        per = a.batch_size
        blocks = []
        for s in a.stats:
            blocks.append(dict(
                name=s.name, params=s.params, fwd_flops=s.fwd_flops * batch / per,
                bwd_flops=s.bwd_flops * batch / per, activation_bytes=s.saved_bytes * batch / per,
                param_bytes=s.param_bytes, cut_bytes=s.cut_bytes * batch / per, struct_hash=s.struct_hash,
                time_s={t: {"fwd": float(costs.fwd_time(t, batch)[s.index]), "bwd": float(costs.bwd_time(t, batch)[s.index])}
                        for t in costs.device_types}))
        _write_json(dict(
            model=args.model, capture=a.method, batch=batch, blocks=blocks,
            total=dict(params=a.total_params, fwd_flops=a.fwd_flops * batch / per,
                       bwd_flops=sum(s.bwd_flops for s in a.stats) * batch / per,
                       activation_bytes=sum(s.saved_bytes for s in a.stats) * batch / per),
            tied_blocks=[list(g) for g in a.tied_groups], time_sources=costs.sources,
        ), args.json)
    return 0


def cmd_plan(args) -> int:
    from autopar.ir.pauses import gc_paused

    with gc_paused():   # a short process: importing torch and building the tables set off collections too
        return _plan_command(args)


def _plan_command(args) -> int:
    from autopar.api import model_num_heads, plan_from_costs
    from autopar.config import Pin

    pp_layers = _block_counts(args.pp_layers, "--pp-layers") if args.pp_layers else None
    from autopar.planner.entry import check_request

    pin = Pin.parse(args.pin) if args.pin else None
    cluster = _load_cluster(args.cluster)
    check_request(cluster, args.global_batch)   # before the analysis and the profiling
    case, prep = _prepare(args.model, cluster, precision=args.precision, example_batch=args.example_batch,
                          seq_len=args.seq_len)
    timings: dict = {}
    p = plan_from_costs(prep.costs, cluster, args.global_batch, strategy=args.strategy,
                        zero_stage=args.zero if args.zero == "auto" else int(args.zero), schedule=args.schedule,
                        pp_layers=pp_layers, num_heads=model_num_heads(case.model),
                        replicated_fraction=prep.replicated_fraction, recompute=args.recompute, timings=timings,
                        pin=pin)
    if args.json != "-":
        print(p.summary(cluster), end="")
        if args.explain:
            from autopar.ir.report import render
            from autopar.planner.explain import explain_table

            print(render(explain_table(p, prep.costs, cluster)), end="")
        from autopar.planning.side_bounds import side_process_worthwhile

        side = " left after the planning (searched alongside it in a second process)" \
            if side_process_worthwhile(cluster) else ""
        print(f"planning {timings['plan_s']:.2f} s, bounds {timings['bounds_s']:.2f} s{side} "
              f"(analysis {prep.analyze_s:.2f} s, cost tables {prep.profile_s:.2f} s; "
              f"time sources: {', '.join(sorted(set(prep.costs.sources.values())))})")
    if args.json:
        d = p.to_dict()
        d["planning_s"] = timings["plan_s"]
        d["bounds_s"] = timings["bounds_s"]
        _write_json(d, args.json)
    if args.timeline:
        from autopar.planner.pp import save_plan_timeline

        save_plan_timeline(p, prep.costs, cluster, args.timeline)
        if args.json != "-":
            print(f"timeline written to {args.timeline}")
    return 0


def _ms(sp) -> str:
    """A step-time ``Spread`` in ms: the median, the IQR and the range."""
    return (f"{sp.median * 1e3:.1f} ms median (IQR {sp.q1 * 1e3:.1f}-{sp.q3 * 1e3:.1f}, "
            f"range {sp.min * 1e3:.1f}-{sp.max * 1e3:.1f})")


def _print_run(results, cluster, baseline: str | None) -> dict:
    """Print and return (for --json) every strategy's measured steps and the speedup of the first over
    ``baseline``: medians with their spread, over the measured steps only (``autopar.cli.trainer``)."""
    from autopar.cli.trainer import gap_lines, paired_speedup
    from autopar.ir.plan import Plan

    emu = " (emulated devices)" if cluster.is_emulated else ""
    summary = {}
    for r in results:
        p = Plan.from_json(r.plan_json)
        gb = p.global_batch_size
        sp = r.step_spread
        meas = sp.median
        ratio = sp.scaled(1 / r.predicted_step_s)
        print(f"\n== strategy {r.strategy}: {p.strategy}, ZeRO-{p.zero_stage}, rank batch {p.rank_batch}")
        if r.warmup_times_s:
            print(f"  warm-up steps, excluded: {', '.join(f'{t * 1e3:.1f}' for t in r.warmup_times_s)} ms")
        for i, (loss, t) in enumerate(zip(r.losses, r.step_times_s)):
            print(f"  step {i + 1:3d}  loss {loss:.4f}  {t * 1e3:8.1f} ms")
        print(f"  measured{emu} over {sp.num} steps: {_ms(sp)}, {gb / meas:.2f} samples/s")
        print(f"  predicted {r.predicted_step_s * 1e3:.1f} ms, {gb / r.predicted_step_s:.2f} samples/s; "
              f"measured/predicted step time {ratio.median:.2f} (IQR {ratio.q1:.2f}-{ratio.q3:.2f})")
        for line in gap_lines(r.profile):
            print(line)
        clocks = [c for c in r.clock_stats if c is not None and c.speed is not None]
        if clocks:
            print("  emulated clocks: " + "; ".join(
                f"rank {i} x{c.speed:g}: {c.compute_s * 1e3:.0f} ms CPU, {c.slept_s * 1e3:.0f} ms slept, "
                f"{c.num_overruns}/{c.num_blocks} blocks overran (+{c.overrun_s * 1e3:.0f} ms)"
                for i, c in enumerate(r.clock_stats) if c is not None and c.speed is not None))
        summary[r.strategy] = dict(
            measured_samples_per_s=gb / meas, predicted_samples_per_s=gb / r.predicted_step_s,
            measured_over_predicted=ratio.median, measured_over_predicted_spread=ratio.as_dict(),
            step_time_s=sp.as_dict(), predicted_step_s=r.predicted_step_s, step_times_s=list(r.step_times_s),
            warmup_times_s=list(r.warmup_times_s), losses=list(r.losses),
            clocks=[None if c is None else dict(speed=c.speed, compute_s=c.compute_s, slept_s=c.slept_s,
                                                num_blocks=c.num_blocks, overrun_s=c.overrun_s,
                                                num_overruns=c.num_overruns) for c in r.clock_stats],
            phases=_phase_summary(r.profile))
    if baseline and baseline in summary and len(summary) > 1:
        first = next(r for r in results if r.strategy != baseline)
        base = next(r for r in results if r.strategy == baseline)
        paired = paired_speedup(first.step_times_s, base.step_times_s)
        of_medians = base.measured_step_s / first.measured_step_s
        pr = base.predicted_step_s / first.predicted_step_s
        print(f"\nspeedup of {first.strategy} over {baseline}, measured in the same run{emu}: "
              f"{paired.median:.2f}x, median over {paired.num} paired steps (IQR {paired.q1:.2f}-{paired.q3:.2f}x, "
              f"range {paired.min:.2f}-{paired.max:.2f}x; ratio of the median step times {of_medians:.2f}x); "
              f"predicted {pr:.2f}x")
        summary["speedup"] = dict(measured=paired.median, spread=paired.as_dict(), of_medians=of_medians,
                                  predicted=pr, strategy=first.strategy, baseline=baseline)
    return summary


def _phase_summary(profile) -> list[dict]:
    """Per rank and phase: measured (median over steps, sleep folded) and predicted seconds."""
    if profile is None:
        return []
    return [dict(rank=i.rank, device_type=i.device_type, measured_memory_bytes=i.measured_memory_bytes,
                 predicted_memory_bytes=i.predicted_memory_bytes,
                 phases={g.key: dict(measured_s=g.measured_s, predicted_s=g.predicted_s)
                         for g in profile.compare(i.rank)}) for i in profile.ranks]


def _calibrate(results, cluster) -> None:
    """Fit this machine's calibration factors from every strategy's profile and save them."""
    from autopar.cluster.emulation import emulation_time_scale
    from autopar.cost.calibrate import device_key, fit_machine_factors, samples
    from autopar.measure.cache import calibration_path, save_calibration
    from autopar.ir.plan import Plan

    scale = emulation_time_scale(len(cluster))
    keys = {r: device_key(d.spec, scale) for r, d in enumerate(cluster.devices)}
    data = [x for r in results if r.profile_json
            for x in samples(r.profile, keys, Plan.from_json(r.plan_json), pooled=True)]
    factors = fit_machine_factors(data)
    save_calibration(factors)
    print(f"\ncalibration factors of this machine, saved to {calibration_path()} (later plans use them):")
    for k, f in factors.items():
        print(f"  {k}: " + ", ".join(f"{t} {'+%.2f ms/call' % (v * 1e3) if t == 'call' else 'x%.3f' % v}"
                                     for t, v in f.items()))


def cmd_train(args) -> int:
    from autopar.cli.trainer import RunSpec, order_text, run_comparison, strategy_variant
    from autopar.config import STRATEGIES
    from autopar.errors import PlanError

    from autopar.models.zoo import factory_of

    factory_of(args.model)   # a model that cannot be built fails here, before any process starts
    cluster = _load_cluster(args.cluster)
    from autopar.planner.entry import check_request

    check_request(cluster, args.global_batch)   # before any process starts
    strategies = (args.strategy,) + tuple(s for s in (args.compare or "").split(",") if s)
    for s in strategies[1:]:   # before any process starts
        try:
            name, _ = strategy_variant(s, "auto")
        except ValueError as exc:
            raise PlanError(f"--compare: {exc}") from None
        if name not in STRATEGIES:
            raise PlanError(f"--compare: {name!r} is not one of {', '.join(STRATEGIES)}")
    if getattr(args, "consecutive", 1) < 0:     # before any process starts
        raise PlanError(f"--consecutive: must be 0 (one strategy after the other) or more, got {args.consecutive}")
    spec = RunSpec(model=args.model, cluster_dict=cluster.to_dict(), global_batch=args.global_batch,
                   steps=args.steps, strategies=strategies, warmup_steps=args.warmup,
                   zero_stage=args.zero if args.zero == "auto" else int(args.zero),
                   recompute=getattr(args, "recompute", True), replan=getattr(args, "replan", "off"),
                   max_restarts=getattr(args, "max_restarts", 0), checkpoint_dir=getattr(args, "checkpoint_dir", None),
                   checkpoint_every=getattr(args, "checkpoint_every", None),
                   checkpoint_keep=getattr(args, "checkpoint_keep", None),
                   consecutive=getattr(args, "consecutive", 1))
    print(f"training {args.model} on {cluster.name or args.cluster} ({len(cluster)} devices"
          f"{', emulated' if cluster.is_emulated else ''}), global batch {args.global_batch}, {args.warmup} warm-up "
          f"+ {args.steps} measured steps" + (f", {order_text(spec.consecutive)}" if len(strategies) > 1 else ""))
    if getattr(args, "calibrate", False):   # predict without the old factors, so the new ones do not compound
        import os

        from autopar.measure.cache import CALIBRATION_ENV

        os.environ[CALIBRATION_ENV] = "off"
    results = run_comparison(spec, cluster)
    from autopar.ir.plan import Plan

    print(Plan.from_json(results[0].plan_json).summary(cluster), end="")
    summary = _print_run(results, cluster, strategies[1] if len(strategies) > 1 else None)
    for r in results:        # --replan auto: what each strategy's check found (emulated where the cluster is)
        for line in r.replans:
            print(f"{r.strategy}: {line}")
    if args.json:
        _write_json(summary, args.json)
    if getattr(args, "timeline", None):
        from autopar.cli.trainer import plot_profiles

        plot_profiles(results, cluster, args.timeline)
        print(f"measured timeline of the last step of every strategy written to {args.timeline}"
              f"{' (emulated devices)' if cluster.is_emulated else ''}")
    if getattr(args, "calibrate", False):
        _calibrate(results, cluster)
    return 0


def cmd_demo(args) -> int:
    args.model = args.model or "gpt-tiny"
    args.cluster = args.cluster or "demo"
    args.strategy = "auto"
    args.compare = "uniform-dp"
    args.zero = "auto"
    return cmd_train(args)


BENCHES = ("published", "published_layouts")   # benchmarks/NAME.py scripts ``autopar bench NAME`` runs


def cmd_env(args) -> int:
    from autopar import env

    print(env.table())
    return 0


def cmd_bench(rest: list[str]) -> int:
    """``autopar bench NAME [ARGS]``: ``main(ARGS)`` of ``benchmarks/NAME.py`` in the source tree this
    package was installed from (an editable install or a checkout; a wheel carries no benchmarks)."""
    import importlib.util
    from pathlib import Path

    if not rest or rest[0] in ("-h", "--help") or rest[0] not in BENCHES:
        known = ", ".join(BENCHES)
        if rest and rest[0] not in ("-h", "--help"):
            print(f"autopar bench: error: unknown benchmark {rest[0]!r}; one of: {known}", file=sys.stderr)
            return 2
        print(f"usage: autopar bench NAME [ARGS]\n\nbenchmarks: {known} (autopar bench NAME --help)")
        return 0 if rest else 2
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{rest[0]}.py"
    if not path.is_file():
        print(f"autopar bench: error: {path} is missing: the benchmarks live in the source tree; install autopar "
              "from a checkout (pip install -e .) to run them", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location(f"autopar_bench_{rest[0]}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # dataclasses of the script look their module up
    spec.loader.exec_module(module)
    return module.main(rest[1:])


def cmd_tune(args, rest: list[str]) -> int:
    from autopar.kernels import tune

    def shapes_for_model(name):
        from autopar.passes.triton_patterns import find_kernel_patterns, kernel_shapes
        from autopar.passes.analyze import analyze

        case = _load_model(name, device="meta")
        gm = analyze(case.model, case.example_inputs).captured.gm  # nodes carry "autopar.tensor" shapes
        return kernel_shapes(find_kernel_patterns(gm))

    from autopar.cluster.devices import match_preset

    # The fraction of peak in the tuning table comes from the one preset table (kernels keeps none).
    return tune.main(rest, shapes_for_model=shapes_for_model, peak_for=match_preset)


def _cmd_checkpoint(args) -> int:
    from autopar.cli.checkpoint import cmd_checkpoint

    return cmd_checkpoint(args)


def _cmd_check(args) -> int:
    from autopar.cli.check import cmd_check

    return cmd_check(args, _load_cluster)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    if argv and argv[0] == "tune":
        try:
            return cmd_tune(None, argv[1:])
        except ValueError as exc:
            print(f"autopar tune: error: {exc}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    handler = {"models": cmd_models, "env": cmd_env, "analyze": cmd_analyze, "plan": cmd_plan, "train": cmd_train,
               "demo": cmd_demo, "checkpoint": _cmd_checkpoint, "check": _cmd_check}[args.command]
    try:
        return handler(args)
    except (ValueError, FileNotFoundError) as exc:   # AutoparError is a ValueError
        # One line: a launch failure's rank tracebacks were already printed by the ranks themselves.
        msg = " ".join(str(exc).split("Traceback of rank")[0].split())
        print(f"autopar {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


_QUICK_EXIT = ("plan", "analyze", "models", "env")   # commands that only compute and print


def run() -> None:
    """The program's entry point (``python -m autopar``, the ``autopar`` script): ``main()`` on the
    command line, then, for the commands that only compute and print (``_QUICK_EXIT``), an exit that
    skips tearing the interpreter down: freeing an analysed 140B graph and torch's modules takes
    ~1.2 s of a cold ``autopar plan``'s ~15 s (llama-140b on hethub-768), after the last line is out.
    Output streams are flushed first; files were closed where they were written."""
    import os

    rc = main()
    if len(sys.argv) > 1 and sys.argv[1] in _QUICK_EXIT:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if rc is None else rc if isinstance(rc, int) else 1)
    raise SystemExit(rc)
