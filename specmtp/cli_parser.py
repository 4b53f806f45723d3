"""The `specmtp` command line: its subcommands, their flags and the readers of flag values.

Flags map onto config fields. A generation flag left out parses to None, so the config's own
default applies and defaults live in specmtp.config only; the training and tuning flags show
their config's defaults. What each subcommand does is in specmtp.cli, which runs the one that
the parsed `command` names.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from specmtp.api import GUARD_PREFIX
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.distill import OBJECTIVES, DistillTrainConfig
from specmtp.models import DTYPES
from specmtp.train import TrainConfig
from specmtp.tune import TuneConfig

# Config fields that train-mtp and distill both expose as --flags.
_TRAINING_FLAGS = [
    ("steps", int), ("batch_size", int), ("seq_len", int), ("lr", float),
    ("checkpoint_every", int), ("eval_every", int), ("heldout_fraction", float),
    ("limit_per_source", int), ("max_new_tokens", int), ("seed", int),
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specmtp", description="Lossless speculative decoding for Hugging Face causal LMs."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate_command(commands)
    _add_bench_command(commands)
    _add_tune_command(commands)
    _add_train_mtp_command(commands)
    _add_distill_command(commands)
    _add_export_draft_command(commands)
    _add_datastore_command(commands)
    return parser


def _add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plain-kernels",
        action="store_true",
        help="use F.linear everywhere instead of the measured faster kernel for few-row "
        "products on CPU (see specmtp.kernels)",
    )
    parser.add_argument(
        "--no-packed-weights",
        action="store_true",
        help="hold no packed copies of the weights (oneDNN's product on weights packed "
        "once, specmtp.kernels): a second copy of the linear weights saved, some speed lost",
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="weights and activations of target and draft (default %(default)s). bfloat16 "
        "verifies several tokens for little more than one on CPUs with AVX512-BF16 or AMX "
        "(measure both: `bench`); its forwards are made row-invariant (specmtp.invariant), "
        "so greedy speculative output stays identical to plain decoding",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="CPU threads for torch (default: torch's choice); 1 is steadier on a busy machine",
    )
    parser.add_argument(
        "--target",
        default="default",
        help="target model: 'default' (SmolLM2-135M-Instruct), a .gguf file, a model "
        "directory or a Hub id (default: %(default)s)",
    )


def _add_generation_flags(
    parser: argparse.ArgumentParser, *, sampled_gamma: str | None = None
) -> None:
    """The generation settings' flags; `sampled_gamma`: the --gamma a sampled run takes
    when none is given, if not the config's (generate: auto)."""
    gen, sampling = GenerationConfig(), SamplingConfig()
    default = f"default {gen.gamma}"
    if sampled_gamma is not None:
        default += f"; {sampled_gamma} at temperature > 0"
    parser.add_argument(
        "--gamma",
        type=_gamma_arg,
        help=f"draft tokens per round: N ({default}), N/M (ngram+SPEC drafters: N "
        "in lookup rounds, M in the model's), auto (adaptive, from the tuning profile if "
        "any; one schedule per arm of an ngram+SPEC drafter), best (the profile's fastest "
        "fixed γ), hf (Hugging Face's +2/-1 schedule) or guard:N, guard:N/M (fixed, but "
        "plain decoding while N drafts are predicted not to pay, with probes now and then)",
    )
    parser.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="budget for weights plus KV caches, e.g. 800M or 2G: γ shrinks to fit, and a "
        "request that cannot fit even without drafts is refused before it starts",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, help=f"most new tokens (default {gen.max_new_tokens})"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        help=f"sampling temperature; 0 is greedy (default {sampling.temperature})",
    )
    parser.add_argument("--top-k", type=int, help=f"0 keeps every token (default {sampling.top_k})")
    parser.add_argument(
        "--top-p", type=float, help=f"nucleus mass in (0, 1] (default {sampling.top_p})"
    )
    parser.add_argument("--seed", type=int, help=f"sampling seed (default {gen.seed})")


def _add_generate_command(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="generate one completion and print statistics")
    gen.add_argument("prompt", help="the prompt text")
    _add_common_flags(gen)
    gen.add_argument(
        "--draft",
        help="draft: a model spec as for --target (MODEL#vocab=N: its first N token ids; "
        "MODEL#heads=DIR, last: MTP heads trained on it by train-mtp --answers-from); "
        "ngram[:N] (prompt lookup); mtp, mtp-tree (MTP heads; mtp-tree#nodes=N: the tree's N "
        "likeliest nodes each round, #nodes=auto: N from its tune profile); general, "
        "distilled, distilled-mtp (shipped drafts); "
        "ngram[:N]+SPEC (lookup when it finds a match, SPEC otherwise); store[:FILE] "
        "(retrieval from a datastore of the target's answers; #min-p=P; #nodes=N: a tree of its "
        "N likeliest continuations), store[:FILE]+SPEC; ngram[:N]|SPEC, store[:FILE]|SPEC "
        "(SPEC mtp or mtp-tree: the copy and the heads' drafts verified as one tree); "
        "#int8 after MTP heads or a draft model: its products in int8, cheaper drafts, the "
        "same output (#int4 after a draft model: its layers in 4 bits); "
        "#nodes=N after a draft model: a token tree of its N likeliest "
        "continuations each round, gamma deep (#nodes=auto: N from its tune profile); "
        "#min-p=P after a draft model: no deeper in a round "
        "than paths it gives probability >= P; omitted: plain decoding",
    )
    _add_generation_flags(gen, sampled_gamma="auto")  # api.default_gamma
    gen.add_argument(
        "--stop",
        action="append",
        dest="stop_strings",
        metavar="STRING",
        help="stop after this string (repeatable)",
    )
    gen.add_argument(
        "--profile", type=Path, help="tuning profile from `specmtp tune` (default: the pair's own)"
    )
    gen.add_argument("--stream", action="store_true", help="print text as it is accepted")
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    gen.add_argument(
        "--json",
        action="store_true",
        help="end stdout with one JSON line: the statistics and the text",
    )


def _add_bench_command(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="compare draft methods against plain decoding")
    bench.add_argument(
        "--prompts",
        action="append",
        required=True,
        metavar="FILE|random:NxL",
        help="prompts: Spec-Bench, MT-bench, HumanEval, GSM8K or BELLE JSONL, or random:NxL "
        "(N prompts of L random tokens); repeatable",
    )
    _add_common_flags(bench)
    bench.add_argument(
        "--draft",
        action="append",
        dest="drafts",
        default=[],
        metavar="SPEC",
        help="a method to compare with plain decoding (repeatable): DRAFT[@GAMMA] with GAMMA "
        "N, auto, best, hf or guard:N; hf-assisted:MODEL[@N]; hf-prompt-lookup[:N][@N]; "
        "hf-plain (Hugging Face's plain generate, stock kernels)",
    )
    _add_generation_flags(bench)
    bench.add_argument("--limit", type=int, help="use only the first N prompts of each file")
    bench.add_argument("--per-category", type=int, help="at most the first N of each category")
    bench.add_argument(
        "--temperatures",
        help="more passes at these temperatures, comma-separated (e.g. 0.7,1.0; seeded)",
    )
    bench.add_argument(
        "--context", help="context-length sweep: prompt lengths in tokens, e.g. 256,1024,4096"
    )
    bench.add_argument(
        "--context-prompts", type=int, default=2, help="prompts per context length (default 2)"
    )
    bench.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unmeasured short generations per method (default %(default)s)",
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs per prompt and method; the median latency counts (default %(default)s)",
    )
    bench.add_argument(
        "--stored-kernels",
        action="store_true",
        help="run the kernel plan stored for this machine (as generate does; measured and "
        "stored first if there is none) instead of one measured in this run",
    )
    bench.add_argument(
        "--out", type=Path, help="write a Markdown report, PNG plots and the raw JSON here"
    )


def _add_tune_command(commands: argparse._SubParsersAction) -> None:
    tune = commands.add_parser(
        "tune", help="measure costs and acceptance, sweep γ, write a tuning profile"
    )
    defaults = _field_defaults(TuneConfig)
    tune.add_argument(
        "--prompts", type=Path, action="append", required=True, metavar="PATH",
        help="training prompts (folder or file; never the evaluation sets); repeatable",
    )  # fmt: skip
    _add_common_flags(tune)
    tune.add_argument("--draft", default=defaults["draft"], help="draft spec (default ngram)")
    _add_field_flags(tune, defaults, [
        ("max_gamma", int), ("limit", int), ("max_new_tokens", int),
        ("temperature", float), ("seed", int),
    ])  # fmt: skip
    tune.add_argument(
        "--budgets", type=_int_list, default=defaults["budgets"], metavar="N,N,...",
        help="tree drafters (mtp-tree): tree sizes in nodes to sweep; for a dynamic tree "
        "(#nodes=auto) the nodes verified a round (default "
        + ",".join(map(str, defaults["budgets"])) + ")",
    )  # fmt: skip
    tune.add_argument(
        "--out", type=Path, help="profile JSON (default: the pair's own, in the cache)"
    )
    tune.add_argument("--plot", type=Path, help="PNG plot (default: beside the profile)")


def _field_defaults(config: type) -> dict[str, Any]:
    """A config dataclass's defaults by field name, for the flags that show them."""
    return {field.name: field.default for field in dataclasses.fields(config)}


def _add_field_flags(
    parser: argparse.ArgumentParser, defaults: dict[str, Any], fields: list[tuple[str, type]]
) -> None:
    """--field-name for each config field, typed, with the config's default."""
    for name, kind in fields:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(
            flag, type=kind, default=defaults[name], help=f"default {defaults[name]}"
        )


def _add_training_run_flags(
    parser: argparse.ArgumentParser, defaults: dict[str, Any], *, data: str, data_step: str
) -> None:
    """The flags train-mtp and distill share: data, run directory, target, threads, and
    --dtype (the target's, while it makes the data) and --mixed-precision (training)."""
    parser.add_argument(
        "--data", type=Path, action="append", required=True, metavar="PATH", help=data
    )
    parser.add_argument("--out", type=Path, required=True, help="run directory (resumable)")
    parser.add_argument("--target", default="default", help="target model spec")
    parser.add_argument("--threads", type=int, help="CPU threads for torch")
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default=defaults["dtype"],
        help=f"the target's dtype while it {data_step} (default float32)",
    )  # fmt: skip
    parser.add_argument(
        "--mixed-precision", choices=["no", "bf16"], default=defaults["mixed_precision"],
        help="bf16: autocast matmuls (much faster on CPUs with AVX512-BF16 or AMX)",
    )  # fmt: skip


def _add_train_mtp_command(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser(
        "train-mtp", help="train MTP heads on a frozen target by self-distillation"
    )
    defaults = _field_defaults(TrainConfig)
    _add_training_run_flags(
        train, defaults, data="prompt folder or file (.jsonl/.json/.csv/.txt); repeatable",
        data_step="builds the data",
    )  # fmt: skip
    train.add_argument("--kind", choices=["parallel", "sequential"], default=defaults["kind"])
    train.add_argument("--cache", type=Path, help="an existing data cache with hidden states")
    train.add_argument(
        "--answers-from", type=Path, metavar="CACHE",
        help="another model's data cache (e.g. the target's, from `specmtp distill "
        "--data-only`): train on its answers with this --target's hidden states (heads for "
        "a draft model; use them as --draft MODEL#heads=OUT)",
    )  # fmt: skip
    train.add_argument(
        "--objective", choices=["tokens", "kl"], default=defaults["objective"],
        help="tokens: cross-entropy on the target's answer tokens (default); kl: KL to the "
        "target's own distribution of each future token (its cached top-20)",
    )  # fmt: skip
    train.add_argument(
        "--text", action="store_true",
        help="--data is training text (.txt folders: paragraph chunks), not prompts: the "
        "target scores the text itself and nothing is generated; needs --objective kl",
    )  # fmt: skip
    train.add_argument(
        "--init-from", type=Path, metavar="HEADS_DIR",
        help="continue training these heads (same --kind, --num-heads, --num-layers, "
        "--draft-vocab)",
    )  # fmt: skip
    train.add_argument(
        "--feature-layers", type=_int_list, metavar="I,J,K",
        help="sequential heads read these hidden states of the target, fused (EAGLE-3), "
        "e.g. 3,15,30 (0: the embeddings; the number of layers: the final state, which "
        "must come last with --init-from heads on it alone); default: the final state",
    )  # fmt: skip
    train.add_argument(
        "--joint", action="store_true",
        help="continued MTP training: train the target's layers with the heads, keeping its "
        "next-token loss, and write the new model to OUT/model (its greedy output can "
        "differ from the target's; draft for it with --target OUT/model --draft mtp:OUT)",
    )  # fmt: skip
    _add_field_flags(train, defaults, [
        ("num_heads", int), ("num_layers", int), ("draft_vocab", int), ("decay", float),
        ("trunk_lr", float), *_TRAINING_FLAGS,
    ])  # fmt: skip


def _add_distill_command(commands: argparse._SubParsersAction) -> None:
    distill = commands.add_parser(
        "distill", help="train a small draft model for a target (distillation or plain text)"
    )
    defaults = _field_defaults(DistillTrainConfig)
    _add_training_run_flags(
        distill, defaults,
        data="prompts (--objective distill) or .txt files/folders (text); repeatable",
        data_step="answers and scores the data",
    )  # fmt: skip
    distill.add_argument("--objective", choices=OBJECTIVES, default=defaults["objective"])
    distill.add_argument("--init", choices=["target", "random"], default=defaults["init"])
    distill.add_argument("--init-from", type=Path, help="a draft directory to continue training")
    distill.add_argument(
        "--cache", type=Path,
        help="data cache directory (default OUT/data); a train-mtp cache of the same prompts, "
        "answer length and top-k serves as it is",
    )  # fmt: skip
    distill.add_argument(
        "--data-only", action="store_true",
        help="build (or finish) the data cache, then stop without training",
    )  # fmt: skip
    _add_field_flags(distill, defaults, [
        ("num_layers", int), ("draft_vocab", int), ("mtp_heads", int), ("mtp_decay", float),
        ("topk", int), *_TRAINING_FLAGS,
    ])  # fmt: skip


def _add_export_draft_command(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export-draft",
        help="write a draft made by `specmtp distill` as a plain Hugging Face model directory",
    )
    export.add_argument("--target", default="default", help="the draft's target model spec")
    export.add_argument(
        "--draft", required=True,
        help="a shipped draft (general, distilled, distilled-mtp) or draft:DIR",
    )  # fmt: skip
    export.add_argument("--out", type=Path, required=True, help="a new, empty directory")
    export.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="the exported weights' dtype (default float32)")  # fmt: skip
    export.add_argument("--threads", type=int, help="CPU threads for torch")


def _add_datastore_command(commands: argparse._SubParsersAction) -> None:
    store = commands.add_parser(
        "datastore",
        help="build a retrieval datastore (--draft store:FILE) from the target's answers",
    )
    store.add_argument("--target", default="default", help="model spec (default: default)")
    store.add_argument("--out", type=Path, required=True, help="the .safetensors file to write")
    store.add_argument("--data", type=Path, action="append", default=[],
                       help="training prompts the target answers (greedy); repeatable")  # fmt: skip
    store.add_argument("--cache", type=Path, action="append", default=[],
                       help="a train-mtp / distill cache of its answers; repeatable")  # fmt: skip
    store.add_argument("--text", type=Path, action="append", default=[],
                       help=".txt files or folders, a document per file; repeatable")  # fmt: skip
    store.add_argument("--max-new-tokens", type=int, default=128, help="per answer (default 128)")
    store.add_argument("--limit-per-source", type=int, help="prompts taken from each --data")
    store.add_argument("--max-ngram", type=int, default=4,
                       help="the longest context suffix looked up (default 4)")  # fmt: skip
    store.add_argument("--dtype", choices=list(DTYPES), default="float32",
                       help="the target's dtype while it answers (default float32)")  # fmt: skip
    store.add_argument("--threads", type=int, help="CPU threads for torch")


def _gamma_arg(text: str) -> str:
    """--gamma: a number, two (N/M), either behind `guard:`, or a schedule name; argparse
    reports anything else."""
    numbers = text.removeprefix(GUARD_PREFIX)
    if all(part.isdigit() for part in numbers.split("/", 1)) or text in ("auto", "best", "hf"):
        return text
    raise argparse.ArgumentTypeError(
        f"expected a number, N/M, auto, best, hf or guard:N; got {text!r}"
    )


def _int_list(text: str) -> tuple[int, ...]:
    """--budgets, --feature-layers: comma-separated whole numbers; argparse reports anything
    else."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 2,4,8; got {text!r}") from None
