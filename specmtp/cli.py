"""The `specmtp` commands: `generate` one completion, `bench` methods against plain decoding,
`tune` γ for a pair, `train-mtp` heads, `distill` and `export-draft` a small draft.

specmtp.cli_parser builds the command line; `main` runs the command it names. Flags map onto
config fields; a flag left out keeps the config's default, so defaults live in the configs
only. Bad input ends in one `specmtp: error: ...` line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from huggingface_hub.utils import logging as hub_logging
from transformers.utils import logging as hf_logging

from specmtp.api import (
    SpecGenerator,
    default_gamma,
    gamma_settings,
    make_config,
    reads_profile,
)
from specmtp.bench import BenchConfig, log_to_stderr, run_bench
from specmtp.cli_parser import build_parser
from specmtp.cli_values import parse_numbers, parse_size
from specmtp.config import GenerationConfig
from specmtp.datastore_build import DatastoreConfig, build_datastore
from specmtp.distill import DistillTrainConfig, train_draft
from specmtp.draft_export import export_hf_draft
from specmtp.drafter_specs import load_small_draft
from specmtp.errors import SpecMTPError
from specmtp.kernels import set_packing, set_tuned_linear
from specmtp.models import DTYPES, load_model
from specmtp.plots import plot_tune
from specmtp.profile import Profile, find_profile, sweep_table
from specmtp.report import write_report
from specmtp.timings import use_stored_kernel_plan
from specmtp.train import TrainConfig, train_mtp
from specmtp.tune import TuneConfig, run_tune

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
# Flag destinations that are GenerationConfig settings (see make_config); None = not given.
# `gamma` is resolved apart, by gamma_settings: it may name a schedule.
_SETTINGS = ("max_new_tokens", "seed", "temperature", "top_k", "top_p", "stop_strings")
_TrainingConfig = TypeVar("_TrainingConfig", TrainConfig, DistillTrainConfig)


def generation_settings(
    args: argparse.Namespace, profile: Profile | None = None, *, gamma: bool = True
) -> dict[str, Any]:
    """The GenerationConfig overrides the user gave, by field name; with gamma=False the
    caller resolves --gamma itself (the bench does, per method)."""
    given = {key: getattr(args, key, None) for key in _SETTINGS}
    settings = {key: value for key, value in given.items() if value is not None}
    if gamma and getattr(args, "gamma", None) is not None:
        settings.update(gamma_settings(args.gamma, profile))
    if getattr(args, "max_memory", None) is not None:
        settings["max_memory_bytes"] = parse_size(args.max_memory)
    return settings


def _profile_for(
    target: str,
    draft: str | None,
    gamma: str | None,
    path: Path | None,
    dtype: str,
    *,
    notice: bool = True,
) -> Profile | None:
    """The tuning profile that `--gamma auto/best` starts from, if any; with `notice`, a
    line on stderr when `auto` has none. A `#nodes=auto` draft reads its node count from
    the profile whatever the γ."""
    if draft is None or (path is None and not reads_profile(draft, gamma)):
        return None
    profile = find_profile(target, draft, path, dtype=dtype)
    if profile is None and gamma == "auto" and notice:
        print(
            f"specmtp: no tuning profile for {target} with {draft}; the adaptive schedule "
            "times the target's costs (sampled runs: once per machine, then stored; run "
            "`specmtp tune` for a better start)",
            file=sys.stderr,
        )
    return profile


def _use_machine_kernels(
    generator: SpecGenerator, config: GenerationConfig, *, quiet: bool
) -> None:
    """The target's kernel plan measured once on this machine for the verify passes this
    run makes (timings.use_stored_kernel_plan; a profile's plan comes first). On this
    project's CPU, 128 tokens, medians of 3: plain decoding 58.8 ms per token with the
    loaded defaults against 49.3 ms, the MTP heads at γ 4 39.6 against 33.4 ms."""
    target = generator.target
    use_stored_kernel_plan(
        target.model,
        rows=generator.decoder.schedules.verify_rows(config),
        context_length=target.context_length,
        log=(lambda line: None) if quiet else log_to_stderr,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    asked = args.gamma
    sampled, drafts = (args.temperature or 0.0) > 0, args.draft is not None
    args.gamma = default_gamma(args.gamma, sampled=sampled, drafts=drafts)
    profile = _profile_for(
        args.target, args.draft, args.gamma, args.profile, args.dtype, notice=asked is not None
    )
    config = make_config(**generation_settings(args, profile))  # fails before any model load
    generator = SpecGenerator(
        args.target, draft=args.draft, profile=profile, dtype=DTYPES[args.dtype]
    )
    ids = generator.encode(args.prompt, chat=args.chat)
    generator.decoder.check_request(ids, config)  # bad input fails before kernels are timed
    if profile is None or not profile.meta.get("kernel_plan"):
        _use_machine_kernels(generator, config, quiet=args.json)
    if args.stream:
        for delta in generator.stream(ids, config=config):
            print(delta, end="", flush=True)
        print()
        tokenizer = generator.target.tokenizer
        text = tokenizer.decode(generator.last_tokens, skip_special_tokens=True)
        stats = generator.last_stats
    else:
        completion = generator.generate(ids, config=config)
        text, stats = completion.text, completion.stats
        print(text)
    assert stats is not None  # set by every finished generation
    print()
    print(stats.summary())
    if args.json:
        gamma = None if args.draft is None else args.gamma or str(config.gamma)
        print(json.dumps({**stats.to_dict(), "draft": args.draft, "gamma": gamma, "text": text}))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    config = BenchConfig(
        prompts=tuple(args.prompts),
        target=args.target,
        dtype=args.dtype,
        drafts=tuple(args.drafts),
        generation=make_config(**generation_settings(args, gamma=False)),
        default_gamma=args.gamma,
        temperatures=parse_numbers(args.temperatures, float, "--temperatures"),
        limit=args.limit,
        per_category=args.per_category,
        warmup=args.warmup,
        repeats=args.repeats,
        contexts=parse_numbers(args.context, int, "--context"),
        context_prompts=args.context_prompts,
        stored_kernels=args.stored_kernels,
    )
    result = run_bench(config)
    data = result.to_dict()
    print(result.table())
    if args.out is not None:
        command = "specmtp " + " ".join(sys.argv[1:]) if sys.argv[1:] else None
        paths = write_report(data, args.out, command=command)
        print(f"report: {paths[0]}", file=sys.stderr)
    print(json.dumps(data))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    config = TuneConfig(
        prompts=tuple(args.prompts),
        target=args.target,
        dtype=args.dtype,
        draft=args.draft,
        max_gamma=args.max_gamma,
        budgets=args.budgets,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        out=args.out,
        plot=args.plot,
    )
    profile = run_tune(config, log=log_to_stderr)
    plot = config.plot or config.profile_path.with_suffix(".png")
    plot_tune(profile.to_dict(), plot)
    print(sweep_table(profile))
    print(f"profile: {config.profile_path}; plot: {plot}")
    print(json.dumps(profile.to_dict()))
    return 0


def _training_config(config: type[_TrainingConfig], args: argparse.Namespace) -> _TrainingConfig:
    """train-mtp's or distill's config from its flags: --data gives the sources, and every
    other field is the flag of its name, but for TrainConfig.data (how the data is built),
    which has no flag and keeps its default."""
    names = {field.name for field in dataclasses.fields(config)} - {"sources", "data"}
    return config(sources=tuple(args.data), **{name: getattr(args, name) for name in names})


def cmd_train_mtp(args: argparse.Namespace) -> int:
    config = _training_config(TrainConfig, args)
    report = train_mtp(config)
    if report is None:  # another process of a data-parallel run: the main one reports
        return 0
    print(f"heads written to {config.out}; held-out top-1 per head: {report.heldout_accuracy}")
    if report.model is not None:
        print(
            f"model written to {report.model}: its greedy token is the target's at "
            f"{report.next_token_agreement:.1%} of held-out answer positions (trained and "
            f"scored on the {report.joint_samples} samples within --seq-len "
            f"{config.seq_len}); draft for it with --target {report.model} --draft "
            f"mtp:{config.out}"
        )
    print(json.dumps(dataclasses.asdict(report)))
    return 0


def cmd_distill(args: argparse.Namespace) -> int:
    config = _training_config(DistillTrainConfig, args)
    report = train_draft(config)
    if report is None:  # another process of a data-parallel run: the main one reports
        return 0
    if config.data_only:
        print(f"data cache {config.data_dir}: {report.tokens} tokens")
    else:
        print(f"draft written to {config.out / 'draft'}; held-out: {report.heldout}")
    print(json.dumps(dataclasses.asdict(report)))
    return 0


def cmd_export_draft(args: argparse.Namespace) -> int:
    target = load_model(args.target)
    draft = load_small_draft(args.draft, target)
    out = export_hf_draft(draft, target, args.out, dtype=DTYPES[args.dtype])
    print(f"exported {args.draft} for {args.target} to {out}: use --draft {out} or "
          f"hf-assisted:{out}")  # fmt: skip
    return 0


def cmd_datastore(args: argparse.Namespace) -> int:
    config = DatastoreConfig(
        out=args.out, target=args.target, data=tuple(args.data), caches=tuple(args.cache),
        texts=tuple(args.text), max_new_tokens=args.max_new_tokens,
        limit_per_source=args.limit_per_source, max_ngram=args.max_ngram, dtype=args.dtype,
    )  # fmt: skip
    report = build_datastore(config)
    print(f"datastore {report.out}: {report.documents} documents, {report.tokens} tokens; "
          f"draft with --draft store:{report.out} (or store:{report.out}+SPEC)")  # fmt: skip
    print(json.dumps(dataclasses.asdict(report)))
    return 0


# What each subcommand of cli_parser.build_parser runs, by the name it parses to.
_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "generate": cmd_generate,
    "bench": cmd_bench,
    "tune": cmd_tune,
    "train-mtp": cmd_train_mtp,
    "distill": cmd_distill,
    "export-draft": cmd_export_draft,
    "datastore": cmd_datastore,
}


def _quiet_libraries() -> None:
    """Keep transformers' and the Hub client's progress bars, info logs and warnings off the
    terminal (the Hub client logs each failed request before the error we report)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    hf_logging.set_verbosity_error()
    hub_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", module=r"transformers(\.|$)")


def _set_threads(threads: int | None) -> None:
    if threads is None:
        return
    if threads < 1:
        raise SpecMTPError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def _one_line(message: str) -> str:
    return " ".join(message.split()) or "unknown error"


def main(argv: Sequence[str] | None = None) -> int:
    _quiet_libraries()
    args = build_parser().parse_args(argv)
    try:
        _set_threads(args.threads)
        set_tuned_linear(not getattr(args, "plain_kernels", False))
        set_packing(not getattr(args, "no_packed_weights", False))
        return _COMMANDS[args.command](args)
    except SpecMTPError as e:
        print(f"specmtp: error: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # a path given that cannot be read or written (an --out under a file)
        where = f"{e.filename}: " if e.filename else ""
        print(f"specmtp: error: {where}{_one_line(e.strerror or str(e))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("specmtp: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
