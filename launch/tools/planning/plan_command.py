"""``python -m launch.plan``'s command line: sizes and rates with their units, pretrain's flags passed on,
the search's progress on stderr, and the table (or JSON) of the layouts ``launch.tools.planning.plan``
finds."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace

from launch.tools.planning.devices import DGX_LINKS, PROFILES, load_profile
from launch.tools.planning.link_model import Device, Links, parse_bandwidth
from launch.tools.planning import plan as planner
from models.counting import kv_cache_values_per_token, num_parameters
from parallel.pipeline.partition import rank_layer_counts
from parallel.zero import gradient_bytes
from pretrain.config.arguments import ConfigError, build_parser, parse_config
from pretrain.config.megatron_flags import split_request
from launch.help_text import help_description

UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20,
         "GiB": 2**30, "TiB": 2**40}


def parse_bytes(text: str) -> int:
    """'80GiB', '40 GB', '512mib' -> bytes. A number alone is refused (ValueError saying so): '80' would
    be 80 bytes, never what a device holds."""
    stripped = text.replace(" ", "")
    for unit in sorted(UNITS, key=len, reverse=True):
        if stripped.lower().endswith(unit.lower()) and stripped[:-len(unit)]:
            try:
                return int(float(stripped[:-len(unit)]) * UNITS[unit])
            except ValueError:
                break
    try:
        float(stripped)
    except ValueError:
        raise ValueError(f"{text!r} is not a size: give a number and a unit, e.g. 80GiB or 40GB "
                         f"(units: {', '.join(UNITS)})") from None
    raise ValueError(f"{text!r} has no unit: write {stripped}GiB (or {stripped}GB); a number alone would be "
                     f"{stripped} bytes") from None


PROGRESS_INTERVAL = 5.0  # seconds between the search's progress lines on stderr
# pretrain's flags that the plan depends on, shown in --help (every other one is accepted as well), with
# what they mean here where pretrain's help says something else
PLAN_FLAGS = {
    "--config": None, "--num-layers": None, "--hidden-size": None, "--num-attention-heads": None,
    "--ffn-hidden-size": None, "--seq-length": None,
    "--vocab-size": "tokenizer vocabulary (default: --default-corpus-vocab-size, the built-in corpus's)",
    "--global-batch-size": "samples per optimizer step; given, micro-batches of 1, 2, 4 and 8 are tried "
                           "(default: --micro-batch-size x dp in each layout, Megatron's)",
    "--micro-batch-size": "samples per forward/backward when --global-batch-size is not given",
    "--bf16": None, "--fp16": None, "--grad-reduce-in-bf16": None,
    "--tensor-model-parallel-size": "tp: only this one is tried (default: each divisor of --gpus-per-node)",
    "--pipeline-model-parallel-size": "pp: only this one is tried (default: each divisor of the layers)",
    "--context-parallel-size": "cp: only this one is tried (default: each that cuts the sequence into 2 x cp "
                               "chunks)",
    "--pipeline-layers-per-stage": None, "--decoder-first-pipeline-num-layers": None,
    "--decoder-last-pipeline-num-layers": None, "--account-for-embedding-in-pipeline-split": None,
    "--account-for-loss-in-pipeline-split": None, "--pipeline-model-parallel-layout": None,
    "--virtual-pipeline-size": "chunks per stage: interleaved layouts are priced (default: 1F1B, ZB-H1, ZBV)",
    "--pipeline-schedule": "only this schedule is tried",
    "--zero-stage": "only this ZeRO stage is tried (default: 0, 1, 2 and 3)",
    "--zero-bucket-size": None, "--zero-persistence-threshold": None,
    "--optimizer": "adam, sgd or muon: Muon's one momentum per matrix element, its owners' workspace, "
                   "exchange and Newton-Schulz time are priced",
}
TEXT_METAVARS = {"--config": "FILE", "--pipeline-model-parallel-layout": "LAYOUT", "--optimizer": "NAME"}


class _ToPretrain(argparse.Action):
    """A pretrain flag listed in ``--help``: its words go on to pretrain's parser as given."""

    def __call__(self, parser, namespace, values, option_string=None):
        words = [values] if isinstance(values, str) else list(values or [])
        namespace.pretrain_flags = [*getattr(namespace, "pretrain_flags", []), option_string, *words]


def _add_pretrain_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "the model and the run (python -m pretrain's flags)",
        "Every flag of python -m pretrain and every key of a --config YAML is accepted and read as pretrain "
        "reads it (python -m pretrain --help lists them); the model's whole architecture counts (e.g. "
        "--swiglu, --group-query-attention --num-query-groups, --untie-embeddings-and-output-weights). "
        "A --config's layout keys (tensor_model_parallel_size, pipeline_model_parallel_size, "
        "context_parallel_size, expert_model_parallel_size, zero_stage, pipeline_schedule) restrict the "
        "search as their flags do (a flag given replaces its key). These are the ones the plan depends on:")
    actions = {option: action for action in build_parser()._actions for option in action.option_strings}
    for flag, text in PLAN_FLAGS.items():
        action = actions[flag]
        group.add_argument(*action.option_strings, action=_ToPretrain, dest="pretrain_flags",
                           default=argparse.SUPPRESS, nargs=action.nargs, metavar=_metavar(flag, action),
                           help=text or action.help)


def _metavar(flag: str, action: argparse.Action) -> str | None:
    """How ``--help`` shows a pretrain flag's value: N for a number, its choices, else a word for its text."""
    if action.nargs == 0:
        return None
    if action.type in (int, float):
        return "N"
    if action.choices:
        return "{" + ",".join(map(str, action.choices)) + "}"
    return TEXT_METAVARS.get(flag, "TEXT")


def _bandwidth(flag: str, text: str | None) -> float | None:
    """``parse_bandwidth`` of a flag's value, refused in one line without a unit (a number alone would be
    bytes per second) or when it is no bandwidth."""
    if text is None:
        return None
    bare = text.replace(" ", "")
    try:
        float(bare)
    except ValueError:
        pass
    else:
        sys.exit(f"error: {flag} {text!r} has no unit: write {bare}Gbit (or {bare}GB/s); a number alone "
                 "would be bytes per second")
    try:
        return parse_bandwidth(text)
    except ValueError:
        sys.exit(f"error: {flag} {text!r} is not a bandwidth: give a number and a unit, e.g. 100Gbit, "
                 "400Gbit/s, 25GB/s")


LAYOUT_KEYS = (("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"),
               ("cp", "context_parallel_size"), ("ep", "expert_model_parallel_size"))


class _Spelled:
    """A layout size as a refusal names it: its flag, and the --config file that set it where one did."""

    def __init__(self, model_flags: list[str]):
        given = vars(build_parser().parse_args(model_flags))  # the settings the command line itself gave
        self.config_file, self.on_command_line = given.get("config"), set(given)

    def __call__(self, key: str, size: int) -> str:
        name = dict(LAYOUT_KEYS)[key]
        flag = "--" + name.replace("_", "-")
        if name in self.on_command_line or self.config_file is None:
            return f"{flag} {size}"
        return f"{flag} {size} (from --config {self.config_file})"


class _Progress:
    """Says on stderr how far the layout search is, every ``PROGRESS_INTERVAL`` seconds (a search over
    ZeRO++'s options can take a minute), and once at the end if it said anything."""

    def __init__(self):
        self.started = self.said = time.monotonic()
        self.spoke = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.said >= PROGRESS_INTERVAL or (done == total and self.spoke):
            elapsed = now - self.started
            left = f" (about {elapsed * (total - done) / done:.0f} s left)" if 0 < done < total else ""
            sys.stderr.write(f"launch.plan: {done} / {total} layouts priced, {elapsed:.0f} s{left}\n")
            sys.stderr.flush()
            self.said, self.spoke = now, True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m launch.plan", description=help_description(planner.__doc__),
        usage="%(prog)s [--config FILE] [pretrain flags] --world-size N [--gpus-per-node N]\n"
              "       [--memory-per-device SIZE] [--inter-node-bandwidth RATE] [options]")
    parser.add_argument("--world-size", type=int, required=True, metavar="N", help="devices in all")
    parser.add_argument("--gpus-per-node", type=int, metavar="N",
                        help="devices per node: tp stays within one (default: the --config's gpus_per_node, "
                             "else 8)")
    parser.add_argument("--memory-per-device", default="80GiB", metavar="SIZE",
                        help="with a unit: 80GiB, 40GB, 512MiB (default: 80GiB)")
    parser.add_argument("--top", type=int, default=10, metavar="N", help="layouts to print (default: 10)")
    parser.add_argument("--any-layout", action="store_true",
                        help="search every layout for the --config's model: its layout keys are ignored "
                             "(the flags given still restrict); e.g. a preset checked on another cluster")
    parser.add_argument("--json", action="store_true", help="print the layouts as JSON")
    parser.add_argument("--inter-node-bandwidth", metavar="RATE",
                        help="a node's link to the others, e.g. 400Gbit, 50GB/s: rank layouts by predicted "
                             "step time (launch.tools.planning.link_model), ZeRO++ and shard groups included "
                             "(a longer search: its progress goes to stderr)")
    parser.add_argument("--intra-node-bandwidth", metavar="RATE",
                        help="between two ranks of a node (default: 200GB/s, or --device's DGX node's)")
    parser.add_argument("--device", metavar="NAME|FILE",
                        help="price the compute by a device's achieved rates, shape by shape: a built-in "
                             f"profile ({', '.join(PROFILES)}; their DGX node's links unless bandwidths are "
                             "given) or a profile file from `python -m launch.tools.gpu_check --sections "
                             "rates`; with links, layouts are ranked by predicted step time")
    parser.add_argument("--link-latency", type=float, default=10e-6, metavar="SECONDS",
                        help="per message step (default: 1e-05)")
    parser.add_argument("--device-flops", type=float, default=Device.flops, metavar="FLOPS",
                        help=f"model FLOP/s one device sustains, e.g. 40%% of a bf16 peak (default: "
                             f"{Device.flops:g})")
    parser.add_argument("--quantize-rate", type=float, default=Device.quantize_rate, metavar="RATE",
                        help="elements a device quantizes or dequantizes per second, ZeRO++'s passes "
                             f"(default: {Device.quantize_rate:g})")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                        help="collective backend: how much communication hides behind compute (default: "
                             "nccl)")
    _add_pretrain_flags(parser)
    args, rest = parser.parse_known_args(argv)
    model_flags = [*getattr(args, "pretrain_flags", []), *rest]
    try:
        memory_per_device = parse_bytes(args.memory_per_device)
    except ValueError as error:
        sys.exit(f"error: --memory-per-device {error}")
    profile = None
    if args.device is not None:
        try:
            profile = load_profile(args.device)
        except ValueError as error:
            sys.exit(f"error: --device {error}")
    node = DGX_LINKS.get(args.device.lower()) if args.device else None
    intra = _bandwidth("--intra-node-bandwidth", args.intra_node_bandwidth) if args.intra_node_bandwidth \
        else node[0] if node else 200e9
    inter = _bandwidth("--inter-node-bandwidth", args.inter_node_bandwidth) if args.inter_node_bandwidth \
        else node[1] if node else None
    try:
        config = parse_config(model_flags)
    except ConfigError as error:
        sys.exit(f"error: {error}")
    if config.model.vocab_size is None:
        config.model.vocab_size = config.data.default_corpus_vocab_size
    train, parallel = config.training, config.parallel
    if args.gpus_per_node is None:
        args.gpus_per_node = parallel.gpus_per_node or 8
    for flag, value, what in (("--world-size", args.world_size, "devices"),
                              ("--gpus-per-node", args.gpus_per_node, "devices per node"),
                              ("--top", args.top, "layouts to print")):
        if value < 1:
            sys.exit(f"error: {flag} {value}: give the {what}, at least 1")
    # the sizes the flags or the --config give restrict the search (ZeRO stage, schedule: None unless given;
    # with --any-layout the command line's alone)
    spelled = _Spelled(model_flags)
    restricts = spelled.on_command_line if args.any_layout else config.given
    fixed = {"zero_stage": config.zero.zero_stage if "zero_stage" in restricts else None,
             "schedule": parallel.pipeline_schedule if "pipeline_schedule" in restricts else None,
             **{key: getattr(parallel, name) if name in restricts else None for key, name in LAYOUT_KEYS},
             "etp": parallel.expert_tensor_parallel_size, "vp": parallel.virtual_pipeline_size}
    try:  # the model's own rules at tp 1 and the experts' at the ep asked for, before any layout is tried
        for note in config.model.resolve_pattern("num_layers" in config.given):
            print(note)
        pattern = config.model.parsed_pattern()
        if pattern is not None and pattern.cut:  # the search chooses the pipeline cut itself
            print(f"--hybrid-layer-pattern {pattern.text!r}: priced without its | (the layouts searched cut "
                  "the layers themselves)")
            config.model.hybrid_layer_pattern = pattern.uncut
        config.model.validate()
        config.model.validate_moe(config.model.num_layers, config.model.ffn_size,
                                  parallel.expert_tensor_parallel_size or 1,
                                  parallel.expert_model_parallel_size)
        model_parallel = 1
        for key, size in (("tp", fixed["tp"]), ("pp", fixed["pp"]), ("cp", fixed["cp"])):
            if size is None:
                continue
            if size < 1:
                raise ValueError(f"{spelled(key, size)}: give at least 1")
            model_parallel *= size
            if args.world_size % model_parallel:
                raise ValueError(f"--world-size {args.world_size} is not divisible by {spelled(key, size)} "
                                 f"(with the other sizes given, {model_parallel}): give sizes that divide it")
        if fixed["tp"] and args.gpus_per_node % fixed["tp"]:
            raise ValueError(f"{spelled('tp', fixed['tp'])} does not fit in a node of --gpus-per-node "
                             f"{args.gpus_per_node}: tp stays within one node; give a divisor of "
                             f"{args.gpus_per_node} (or the --gpus-per-node your nodes have)")
        if fixed["tp"]:
            config.model.validate(fixed["tp"])
        if train.global_batch_size is not None and train.global_batch_size < 1:
            raise ValueError(f"--global-batch-size {train.global_batch_size}: give at least 1 sequence a "
                             "step")
    except ValueError as error:
        sys.exit(f"error: {error}")
    links = Links(intra, inter, args.link_latency) if inter is not None else None
    try:
        plans = _plans(config, args, fixed, memory_per_device, links, profile)
    except ValueError as error:
        sys.exit(f"error: {error}")
    _report(config, args, plans, links)


def _plans(config, args, fixed: dict, memory_per_device: float, links, profile) -> list:
    train, zero, parallel = config.training, config.zero, config.parallel
    compute_bytes = 2 if train.bf16 or train.fp16 else 4
    return planner.plan(config.model, args.world_size, args.gpus_per_node, memory_per_device,
                 train.global_batch_size, compute_bytes, **fixed, bucket_size=zero.zero_bucket_size,
                 persistence_threshold=zero.zero_persistence_threshold,
                 grad_bytes=gradient_bytes(compute_bytes, not zero.grad_reduce_in_bf16),
                 request=split_request(parallel), links=links,
                 device=Device(args.device_flops, profile.quantize_rate if profile else args.quantize_rate,
                               args.backend, profile),
                 micro_batch_size=train.micro_batch_size, progress=_Progress(),
                 optimizer=config.optimizer.optimizer)


def _report(config, args, plans: list, links) -> None:
    """The layouts found, as a table (or JSON), best first, and the link model's ZeRO advice."""
    compute_bytes = 2 if config.training.bf16 or config.training.fp16 else 4
    advice = planner.zero_advice(plans) if links is not None else None
    plans = plans[:args.top]
    if args.json:
        print(json.dumps([{**asdict(p.layout), "model_state_bytes": p.model_state_bytes,
                           "activation_bytes": p.activation_bytes, "buffer_bytes": p.buffer_bytes,
                           "total_bytes": p.total_bytes, "bubble": p.bubble,
                           "comm_stage": p.comm_stage, "comm_bytes_per_step": p.comm_bytes,
                           "comm_bytes_inter_node_per_step": p.comm_bytes_inter_node, "score": p.score,
                           "step_seconds": p.step_seconds} for p in plans], indent=1))
        return
    params = num_parameters(config.model)
    model = f"hybrid {config.model.hybrid_layer_pattern!r}" if config.model.hybrid_layer_pattern else "GPT"
    print(f"{model} of {params / 1e9:.2f}B parameters on {args.world_size} devices ({args.gpus_per_node} "
          "per node, "
          f"{args.memory_per_device} each): {len(plans)} best layouts that fit")
    print(kv_cache_line(config.model, compute_bytes))
    axes = ("dp", "tp", "pp", "cp") + (("ep",) if config.model.num_experts else ())
    print(f"{'tp':>3} {'pp':>3} {'cp':>3} {'dp':>4} " + (f"{'ep':>3} " if config.model.num_experts else "")
          + f"{'zero':>4} {'recompute':>13} {'mbs':>3} "
          f"{'offload':>7} {'schedule':>8} {'layers per stage':>16} {'bubble':>6} | "
          f"{'states GiB':>10} {'activ GiB':>9} "
          f"{'buffers GiB':>11} {'total GiB':>9} | "
          f"comm GiB/step of a rank of the stage sending most (stage: {' / '.join(axes)}, to another node)"
          + (" | ZeRO++ / MiCS | step s" if links else ""))
    for p in plans:
        layout, gib = p.layout, 2**30
        print(f"{layout.tp:>3} {layout.pp:>3} {layout.cp:>3} {layout.dp:>4} "
              + (f"{layout.ep:>3} " if config.model.num_experts else "") + f"{layout.zero_stage:>4} "
              f"{layout.recompute_label:>13} "
              f"{layout.micro_batch_size:>3} {layout.offload_optimizer:>7} {layout.schedule:>8} "
              f"{split_label(layout, config.model.num_layers):>16} "
              f"{p.bubble:>6.1%} | "
              f"{p.model_state_bytes / gib:>10.2f} "
              f"{p.activation_bytes / gib:>9.2f} {p.buffer_bytes / gib:>11.2f} {p.total_bytes / gib:>9.2f} | "
              f"{p.comm_stage}: " + " / ".join(f"{p.comm_bytes.get(axis, 0.0) / gib:.2f} "
                                               f"({p.comm_bytes_inter_node.get(axis, 0.0) / gib:.2f})"
                                               for axis in axes)
              + (f" | {layout.zero.label():>14} | {p.step_seconds:.3f}" if links else ""))
    if advice:
        print(advice)
    if not plans:
        print("nothing fits: add devices, or allow more memory per device")


if __name__ == "__main__":
    main()


def split_label(layout, num_layers: int) -> str:
    """The layers of each pipeline stage, first, middle ones (as many times) and last: "even" for the even
    cut, e.g. "7,8x14,7"."""
    if layout.split is None:
        return "even"
    counts = rank_layer_counts(layout.split, layout.pp, layout.v)
    middle = counts[1:-1]
    inner = (f"{middle[0]}x{len(middle)}" if len(set(middle)) == 1 and len(middle) > 2
             else ",".join(map(str, middle)))
    return ",".join(part for part in (str(counts[0]), inner, str(counts[-1])) if part)


def kv_cache_line(model, value_bytes: int) -> str:
    """The inference key/value cache a token costs, and (with latent attention) what grouped-query
    attention of the same width would cost: as many groups as heads (multi-head) and 8."""
    def kib(config) -> str:
        return f"{kv_cache_values_per_token(config) * value_bytes / 1024:.1f} KiB"

    line = f"key/value cache per token ({value_bytes}-byte values, all layers): {kib(model)}"
    if not model.multi_latent_attention:
        return line
    width = {"multi_latent_attention": False, "q_lora_rank": None}
    mha = replace(model, **width)
    gqa = replace(model, **width, group_query_attention=True,
                  num_query_groups=min(8, model.num_attention_heads))
    return (line + f" (latent attention: {model.kv_lora_rank} + {model.qk_pos_emb_head_dim} values a layer); "
            f"grouped-query attention at --hidden-size {model.hidden_size}: {kib(gqa)} with "
            f"{gqa.query_groups} groups, {kib(mha)} with one per head")
