"""Bounded reads of the small text files users and runs hand us: recipes, accelerate configs, JSON reports.

A path may name anything: a folder, a FIFO that blocks the first read forever, /dev/zero that never ends, a
60 MB file of junk, or a few hundred bytes of YAML whose aliases expand to gigabytes ("billion laughs").
Each reader here refuses these before they cost memory or time, in one line that names the file and the fix:

- the file is stat-ed before it is opened: only a regular file is read (following links, so a link to
  /dev/zero is a character device), and it is opened non-blocking and checked again on the open descriptor,
  so a file swapped for a FIFO in between cannot block either;
- at most ``limit + 1`` bytes are read, so a file that grows after the stat cannot slip past the limit;
- the bytes must be UTF-8 text without NUL bytes;
- YAML is parsed by a safe loader that refuses aliases and anchors outright (recipes and configs never need
  them), nesting deeper than ``MAX_DEPTH`` and more than ``MAX_VALUES`` values, keys that are not names, and
  a key given twice in one mapping (YAML itself keeps the last without a word);
- the top level must be a mapping (a JSON object);
- a file name read from a file (a shard an index names, a DCP record's storage path) opens only a file directly
  in its folder (plain_file_name): "../x", "/etc/passwd" or "a/../../x" would open a file elsewhere.

Standard library and pyyaml only: the checkpoint tools import this and must start without torch.
"""

from __future__ import annotations

import json
import os
import stat

import yaml

from fsdp_recipes.errors import UnreadableFile

# Recipes and accelerate configs are a few KB (the largest shipped one is 3.3 KB). The limit is far above that and
# low enough that the worst file within it parses in well under a second: the YAML parser that can refuse aliases
# as they come is pure Python, about 1.5 s per MiB.
YAML_LIMIT = 256 * 1024
# A checkpoint's or model folder's own JSON (config.json, adapter_config.json, the manifest, a safetensors index):
# a 70B model's index is about 100 KB, its manifest about 1 MB; anything near this limit is not one of ours.
JSON_LIMIT = 64 << 20
# trainer_state.json grows by about 200 bytes per logged step: a million steps fit. Every reader of it uses this.
STATE_LIMIT = 256 << 20
# fsdp_report.json: a few hundred bytes per rank
REPORT_LIMIT = 64 << 20
# recipes and configs nest two levels (fsdp_config: ...); the parser recurses once per level
MAX_DEPTH = 32
# keys, values and list items together: later checks suggest a name per unknown key, 1 ms each
MAX_VALUES = 1000

_SPECIAL = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def file_kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    if stat.S_ISDIR(mode):
        return "a directory"
    for test, name in _SPECIAL:
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "a special file"


def plain_file_name(name) -> bool:
    """``name`` opens a file directly inside its folder: no separator (Path joins an absolute name by dropping the
    folder), no "." or "..", no NUL."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def read_text(path: str | os.PathLike, what: str, limit: int) -> str:
    """The UTF-8 text of a regular file of at most ``limit`` bytes; anything else is an UnreadableFile."""
    data = read_bytes(path, what, limit)
    if b"\0" in data:
        raise UnreadableFile(path, what, "holds NUL bytes: it is binary, not text", "is this the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise UnreadableFile(
            path, what, f"is not UTF-8 text (byte {err.start})", "is this the right file? save it as UTF-8 if it is"
        ) from None


def read_bytes(path: str | os.PathLike, what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; anything else is an UnreadableFile."""

    def refuse(reason: str, fix: str) -> UnreadableFile:
        return UnreadableFile(path, what, reason, fix)

    try:
        # before opening: opening a FIFO blocks until a writer comes
        info = os.stat(path)
    except FileNotFoundError:
        raise refuse(
            "does not exist" + (" (a broken link)" if os.path.islink(path) else ""), "check the path"
        ) from None
    except OSError as err:
        raise refuse(f"cannot be read ({err.strerror})", f"give a {what} file you can read") from None
    if (kind := file_kind(info.st_mode)) is not None:
        fix = (
            f"give the {what} file itself"
            if kind == "a directory"
            else f"give a regular {what} file: a pipe or a device may block or never end"
        )
        raise refuse(f"is {kind}, not a file", fix)
    if info.st_size > limit:
        raise refuse(f"is {info.st_size:,} bytes, over the {limit:,}-byte limit", "is this the right file?")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise refuse(f"cannot be read ({err.strerror})", f"give a {what} file you can read") from None
    with os.fdopen(fd, "rb") as f:
        # replaced between the stat and the open
        if (kind := file_kind(os.fstat(fd).st_mode)) is not None:
            raise refuse(f"is {kind}, not a file", f"give a regular {what} file")
        # the size may have grown since the stat
        data = f.read(limit + 1)
    if len(data) > limit:
        raise refuse(f"is over the {limit:,}-byte limit (it grew while it was read)", "is this the right file?")
    return data


class _Refused(yaml.YAMLError):
    """A document the loader will not build, with the reason and its fix."""

    def __init__(self, reason: str, fix: str):
        super().__init__(reason)
        self.reason, self.fix = reason, fix


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader without aliases or anchors, with bounded nesting and size, and names as keys.

    An alias is refused where the parser meets it, before anything is built from it: no expansion at all, so a
    small file cannot become a large structure (nor a large error message, nor a slow check, downstream)."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = self._values = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            name = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise _Refused(
                f"uses a YAML {name}{event.anchor} (line {event.start_mark.line + 1})",
                "write the values out in full: recipes and accelerate configs never need aliases, and "
                "expanding them can turn a few hundred bytes into gigabytes",
            )
        self._values += 1
        if self._values > MAX_VALUES:
            raise _Refused(
                f"holds more than {MAX_VALUES} values (keys, values and list items)",
                "is this the right file? recipes and configs hold a few dozen",
            )
        if self._depth >= MAX_DEPTH:
            raise _Refused(
                f"nests deeper than {MAX_DEPTH} levels (line {event.start_mark.line + 1})",
                "is this the right file? recipes and configs nest two levels",
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        # key -> its line
        seen: dict[str, int] = {}
        for key_node, _ in node.value:
            line = key_node.start_mark.line + 1
            # 1:, yes:, null:, [a]: ... would be ints, bools, None, lists
            if key_node.tag != "tag:yaml.org,2002:str":
                shown = repr(key_node.value[:60]) if isinstance(key_node, yaml.ScalarNode) else "that is a collection"
                raise _Refused(
                    f"has a key {shown} at line {line} that YAML reads as "
                    f"{key_node.tag.rsplit(':', 1)[-1]}, not a name",
                    "write keys as names (quote one that looks like a value)",
                )
            # pyyaml keeps the last of two equal keys without a word: `num_processes: 2` then `num_processes: 8`
            # would launch 8, whichever of them the user edited last
            if key_node.value in seen:
                raise _Refused(
                    f"has the key {key_node.value[:60]!r} twice (lines {seen[key_node.value]} and {line})",
                    "keep one of them: YAML would silently take the last",
                )
            seen[key_node.value] = line
        return super().construct_mapping(node, deep)


def load_yaml(path: str | os.PathLike, what: str, limit: int = YAML_LIMIT) -> dict:
    """The mapping at the top of a YAML file ({} for a file of nothing but comments), read by ``read_text`` and
    ``_BoundedLoader``. An explicit top-level `null` is refused like any other value that is not a mapping."""
    text = read_text(path, what, limit)
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        data = {} if node is None else loader.construct_document(node)
    except _Refused as err:
        raise UnreadableFile(path, what, err.reason, err.fix) from None
    except yaml.MarkedYAMLError as err:
        where = f", line {err.problem_mark.line + 1} column {err.problem_mark.column + 1}" if err.problem_mark else ""
        raise UnreadableFile(path, what, f"is not valid YAML ({err.problem}{where})", "fix the YAML syntax") from None
    except yaml.YAMLError as err:
        raise UnreadableFile(
            path, what, f"is not valid YAML ({' '.join(str(err).split())})", "fix the YAML syntax"
        ) from None
    # a constructor's own: a 4301-digit integer, a 13th month in a date
    except ValueError as err:
        raise UnreadableFile(
            path, what, f"holds a value YAML cannot build ({str(err).split(';')[0]})", "is this the right file?"
        ) from None
    finally:
        loader.dispose()
    return _mapping(path, what, data, "write it as `key: value` lines")


def load_json(path: str | os.PathLike, what: str, limit: int) -> dict:
    """The object at the top of a JSON file, read by ``read_text``."""
    import json

    text = read_text(path, what, limit)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise UnreadableFile(
            path, what, f"is not valid JSON ({err.msg} at line {err.lineno})", "is the file cut off? copy it again"
        ) from None
    except RecursionError:
        raise UnreadableFile(path, what, "nests too deeply to read", "is this the right file?") from None
    # an integer of more than 4300 digits
    except ValueError as err:
        raise UnreadableFile(
            path, what, f"holds a value JSON cannot build ({str(err).split(';')[0]})", "is this the right file?"
        ) from None
    return _mapping(path, what, data, "is this the right file?")


def kind_of(value) -> str:
    """A parsed YAML or JSON value's type, in words."""
    names = {
        type(None): "null",
        bool: "true/false",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }
    return names.get(type(value), type(value).__name__)


def short_json(value) -> str:
    """A value from a JSON file as a message shows it: short, on one line."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _mapping(path, what: str, data, fix: str) -> dict:
    if not isinstance(data, dict):
        raise UnreadableFile(path, what, f"must be a mapping of keys to values, not {kind_of(data)}", fix)
    return data
