"""Tuning profiles: what `specmtp tune` measured for one target, drafter and machine.

`--gamma auto` (the adaptive schedule) starts from a profile's cost model and acceptance
rates, and `--gamma best` uses its fastest fixed γ (for a lookup-first drafter, its fastest
γ pair: one γ for the lookup rounds, one for the model's, each with its own α). Profiles
live, by default, in $SPECMTP_CACHE/profiles (or ~/.cache/specmtp/profiles), one JSON file
per pair. `sweep_table` prints one as `specmtp tune` does.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from specmtp.config import SamplingConfig
from specmtp.costmodel import CostModel
from specmtp.errors import SpecMTPError
from specmtp.tree import TokenTree

PROFILE_VERSION = 2  # 2: profiles carry the weights' fingerprints (meta["weights"])
_SAMPLED_VALUES = 64  # values per tensor that go into a weights fingerprint


@dataclass(frozen=True)
class Profile:
    """What tune measured for one target, drafter and machine."""

    target: str
    draft: str
    cost_model: CostModel
    alphas: tuple[float, ...]  # conditional acceptance per draft position
    best_gamma: int  # the fastest fixed γ measured
    sweep: tuple[dict[str, Any], ...] = ()  # per γ: predicted and measured speedup, τ
    meta: dict[str, Any] = field(default_factory=dict)
    # A tree drafter's fastest tree (child-rank paths); () for chains
    tree: tuple[tuple[int, ...], ...] = ()
    # A drafter with arms (ngram+SPEC): best_gamma is the lookup rounds' γ, model_gamma the
    # model rounds', and arm_alphas the α per position of each arm (drafters.drafter_arm)
    model_gamma: int | None = None
    arm_alphas: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # A dynamic tree (`mtp-tree#nodes=auto`, alone or after ngram+ / ngram|): the fastest
    # node count of its sweep (the sweep's rows are node counts, `budget`); None otherwise
    nodes: int | None = None

    MAX_NODES: ClassVar[int] = 64  # the largest tree budget or node count tune sweeps

    def __post_init__(self) -> None:
        if not self.alphas or not all(0.0 <= a <= 1.0 for a in self.alphas):
            raise SpecMTPError("a profile needs acceptance rates alphas in [0, 1]")
        if not 1 <= self.best_gamma <= len(self.alphas):
            raise SpecMTPError(
                f"best_gamma must be in 1..{len(self.alphas)}, got {self.best_gamma}"
            )
        if not all(isinstance(row, dict) for row in self.sweep):
            raise SpecMTPError("a profile's sweep must be a list of objects")
        if self.model_gamma is not None and not 1 <= self.model_gamma <= len(self.alphas):
            raise SpecMTPError(
                f"model_gamma must be in 1..{len(self.alphas)}, got {self.model_gamma}"
            )
        for arm, alphas in self.arm_alphas.items():
            if not all(0.0 <= a <= 1.0 for a in alphas):
                raise SpecMTPError(f"the {arm} arm's alphas must be in [0, 1]")
        if self.nodes is not None and not 1 <= self.nodes <= self.MAX_NODES:
            raise SpecMTPError(
                f"a profile's node count must be in 1..{self.MAX_NODES}, got {self.nodes}"
            )
        if self.tree and self.token_tree().max_depth > len(self.alphas):
            raise SpecMTPError("a profile's tree is deeper than its acceptance rates")

    def token_tree(self) -> TokenTree | None:
        """The tuned tree, validated; None for a chain profile."""
        return TokenTree(self.tree) if self.tree else None

    def sampling(self) -> SamplingConfig:
        """The sampling its α was measured under (tune's --temperature; greedy if unsaid)."""
        return SamplingConfig(temperature=float(self.meta.get("temperature") or 0.0))

    @property
    def max_gamma(self) -> int:
        return len(self.alphas)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "target": self.target,
            "draft": self.draft,
            "best_gamma": self.best_gamma,
            "max_gamma": self.max_gamma,
            "alphas": [round(a, 4) for a in self.alphas],
            "cost_model": self.cost_model.to_dict(),
            "sweep": list(self.sweep),
            "tree": [list(p) for p in self.tree],
            "model_gamma": self.model_gamma,
            "arm_alphas": {arm: [round(a, 4) for a in v] for arm, v in self.arm_alphas.items()},
            "nodes": self.nodes,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "profile") -> Profile:
        try:
            if data.get("version") != PROFILE_VERSION:
                raise SpecMTPError(
                    f"{where} has profile version {data.get('version')!r}, this specmtp reads "
                    f"version {PROFILE_VERSION}: run `specmtp tune` again"
                )
            return cls(
                str(data["target"]),
                str(data["draft"]),
                CostModel.from_dict(data["cost_model"]),
                tuple(float(a) for a in data["alphas"]),
                int(data["best_gamma"]),
                tuple(_list(data.get("sweep", []))),
                dict(data.get("meta", {})),
                tuple(tuple(int(r) for r in p) for p in _list(data.get("tree", []))),
                _optional_int(data.get("model_gamma")),
                {
                    str(arm): tuple(float(a) for a in _list(alphas))
                    for arm, alphas in dict(data.get("arm_alphas") or {}).items()
                },
                _optional_int(data.get("nodes")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SpecMTPError(f"{where}: not a specmtp tuning profile ({e})") from None

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        part.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        part.replace(path)

    @classmethod
    def load(cls, path: Path) -> Profile:
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise SpecMTPError(f"cannot read profile {path}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise SpecMTPError(f"profile {path} is not JSON: {e.msg}") from None
        return cls.from_dict(data, str(path))


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError("sweep, tree and alphas must be lists")
    return value


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def sweep_table(profile: Profile) -> str:
    """The sweep as `specmtp tune` prints it: one line per point, then the choice."""
    if profile.nodes is not None:  # a dynamic tree's node counts
        lines = _sweep_lines(profile, "nodes", lambda row: f"{row['budget']:>5}")
        which = "every round's α by position" if profile.arm_alphas else "top-1 α by depth"
        best = f"best node count {profile.nodes}; {which}: {_alphas(profile.alphas)}"
        return "\n".join([*lines, *_arm_lines(profile), best])
    if profile.model_gamma is not None:  # γ pairs N/M: lookup rounds' γ over the model rounds'
        lines = _sweep_lines(
            profile, "N/M  ", lambda row: f"{row['gamma']}/{row['model_gamma']}".ljust(5)
        )
        best = f"best γ pair {profile.best_gamma}/{profile.model_gamma} (lookup/model)"
        return "\n".join([*lines, *_arm_lines(profile), best])
    if profile.tree:  # static tree budgets
        lines = _sweep_lines(
            profile, "nodes  depth", lambda row: f"{row['budget']:>5}  {row['gamma']:>5}"
        )
        paths = [list(p) for p in profile.tree]
        best = (f"best tree ({len(paths)} nodes, depth {profile.best_gamma}): {paths}; "
                f"top-1 α by depth: {_alphas(profile.alphas)}")  # fmt: skip
        return "\n".join([*lines, best])
    lines = _sweep_lines(profile, "  γ", lambda row: f"{row['gamma']:>3}")
    return "\n".join(
        [*lines, f"best γ {profile.best_gamma}; α by position: {_alphas(profile.alphas)}"]
    )


def _sweep_lines(profile: Profile, head: str, point: Callable[[dict[str, Any]], str]) -> list[str]:
    """The header and one line per sweep point, `point` giving its first column(s)."""
    header = f"{head}  predicted  measured  tokens/s     τ"
    lines = [header, "-" * len(header)]
    for row in profile.sweep:
        tau = row.get("mean_accepted_tokens")
        lines.append(
            f"{point(row)}  {row['predicted_speedup']:8.2f}x  {row['measured_speedup']:7.2f}x"
            f"  {row['tokens_per_s']:8.1f}  {'-' if tau is None else f'{tau:4.2f}':>4}"
        )
    return lines


def _arm_lines(profile: Profile) -> list[str]:
    return [f"α by position, {arm} rounds: {_alphas(a)}" for arm, a in profile.arm_alphas.items()]


def _alphas(values: Iterable[float]) -> str:
    return " ".join(f"{a:.2f}" for a in values)


def cache_root() -> Path:
    """$SPECMTP_CACHE, else ~/.cache/specmtp: converted models, profiles, timings."""
    return Path(os.environ.get("SPECMTP_CACHE") or "~/.cache/specmtp").expanduser()


def default_profile_path(target: str, draft: str, dtype: str = "float32") -> Path:
    """Where tune writes, and `--gamma auto` looks, by default: one file per pair and
    dtype (costs differ by dtype; float32 keeps the plain pair name). Characters a file
    name cannot hold become `_`, and then a hash of the exact names keeps pairs apart."""
    root = cache_root()
    names = (target, draft) if dtype == "float32" else (target, draft, dtype)
    parts = [re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_") for s in names]
    slug = "__".join(parts)
    if parts != list(names):  # `ngram+mtp` and `ngram|mtp` must not share a file
        slug += "-" + hashlib.sha256("\0".join(names).encode()).hexdigest()[:8]
    return root / "profiles" / f"{slug}.json"


def find_profile(
    target: str, draft: str, path: Path | None = None, *, dtype: str = "float32"
) -> Profile | None:
    """The profile at `path` (which must exist), else the default one for the pair if any."""
    if path is not None:
        profile = Profile.load(path)
        if (profile.target, profile.draft) != (target, draft):
            raise SpecMTPError(
                f"profile {path} was tuned for target {profile.target!r} with draft "
                f"{profile.draft!r}, not {target!r} with {draft!r}"
            )
        return profile
    default = default_profile_path(target, draft, dtype)
    return Profile.load(default) if default.exists() else None


def weights_fingerprint(tensors: Iterable[torch.Tensor]) -> str:
    """Shapes and evenly spaced values of every tensor: cheap, and tells two trainings of
    one architecture apart (a profile tuned for old heads must not steer new ones)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().flatten()
        step = max(1, flat.numel() // _SAMPLED_VALUES)
        values = flat[::step][:_SAMPLED_VALUES].to("cpu", torch.float32)
        digest.update(str(tuple(tensor.shape)).encode() + values.numpy().tobytes())
    return digest.hexdigest()[:16]


def check_profile_weights(profile: Profile, current: dict[str, str]) -> None:
    """Refuse a profile tuned for other weights of the same target or draft names."""
    tuned = profile.meta.get("weights", {})
    for role in ("target", "draft"):
        if role in tuned and tuned[role] != current[role]:
            raise SpecMTPError(
                f"the tuning profile for {profile.target!r} with {profile.draft!r} was made "
                f"for other {role} weights (fingerprint {tuned[role]}, now {current[role]}): "
                "run `specmtp tune` again"
            )
