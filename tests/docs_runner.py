"""Run the command blocks of the project's Markdown files as a person would (tests/test_docs.py).

A fenced block (```sh, ```bash, ```python) runs when an HTML comment right before it (blank lines
allowed between) says so; every other such block says why not:

    <!-- runnable
    background "kvsched serve" until "kvsched listening on"
    expect "kvsched status" "gpu0 +mixed +ready"
    timeout 90
    -->

    <!-- not runnable: needs a GPU and vLLM -->

The markers are invisible on a rendered page. A file's runnable blocks form one session, run in
the order of the file, like one person with several terminals open: a command named by
`background` keeps running (its own terminal) until the file's last block is done, and the next
command starts once a line of its output matches the `until` regex; every other command must
exit 0 (a `python` block: saved to a file and run with this Python). Then, at the end of the
file, every background command is stopped (SIGTERM to its process group, SIGKILL after 15 s).
A background command that exits before that is a failure: it is what a person would see die.

Directives (one a line, words quoted shell-style; CMD is a substring of the command line):
- `background CMD until REGEX`: start CMD in the background, wait for REGEX in its output.
- `expect CMD REGEX`: CMD's output (stdout and stderr) must match REGEX (repeatable).
- `exit CMD N`: CMD must exit with status N (default 0).
- `timeout S`: seconds for the whole block, waits included (default 60).
- `cwd DIR`: run the block's commands in DIR, relative to the repository (default: its root).
- `needs PROGRAM ...`: programs the block needs on PATH; missing ones fail the test with
  that name (CI installs them; see .ci/run).

What runs is the text a person copies, with two documented substitutions so that the run never
clashes with anything else on the machine and stays on loopback:
- ports: each port number written in a runnable block of the file after a `:`
  (`127.0.0.1:50051`, `nats://127.0.0.1:4222`) or after a `...-port ` flag (`smg --port 30080`)
  is replaced, everywhere in that file's blocks,
  by one free loopback port chosen for the run; `0.0.0.0:` becomes `127.0.0.1:`. The daemon's
  default metrics address 127.0.0.1:9464 is given to every command as KVSCHED_METRICS_LISTEN
  with 9464's substitute, so a daemon that relies on the default (or a config file's
  `metrics_listen`) binds that port, and a page's `curl 127.0.0.1:9464` reaches it.
- scratch paths: every `/tmp/NAME` (a name right in /tmp, nothing after it) becomes a fresh
  folder of the run, removed at its end.
The commands find `kvsched` and `python` on PATH (the running Python's folder comes first), as
in an activated virtualenv; `.venv/bin/kvsched` is used as written.

`python -m tests.docs_runner FILE.md ...` runs the blocks of those files and prints each command
and its output: what an author runs after editing a page.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LANGUAGES = ("sh", "bash", "python")
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARK = re.compile(r"<!--\s*(runnable|not runnable)\b(.*?)-->", re.S)
_PORT = re.compile(r"(?:(?<=:)|(?<=-port ))(\d{4,5})\b")
_SCRATCH = re.compile(r"(?<![\w/.-])/tmp/[\w.-]+(?![\w/.-])")
METRICS_PORT = "9464"


class DocRunError(AssertionError):
    """A runnable block did not do what its page says."""


@dataclasses.dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    language: str
    text: str
    marker: str | None  # "runnable", "not runnable" or None
    options: str  # the marker's text after its keyword

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


@dataclasses.dataclass
class Directives:
    background: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    expect: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    exit: dict[str, int] = dataclasses.field(default_factory=dict)
    timeout: float = 60.0
    cwd: str = ""
    needs: list[str] = dataclasses.field(default_factory=list)


def blocks(path: Path) -> list[Block]:
    """Every fenced block of `path` whose language is one of LANGUAGES, with its marker."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m.group(1):
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        body = "\n".join(lines[i + 1 : j]) + "\n"
        i = j + 1
        if lang not in LANGUAGES:
            continue
        marker, options = _marker_before(lines, start)
        out.append(Block(path, start + 1, lang, body, marker, options))
    return out


def _marker_before(lines: list[str], fence: int) -> tuple[str | None, str]:
    """The HTML comment that ends right before line `fence` (blank lines between allowed)."""
    k = fence - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    if k < 0 or not lines[k].rstrip().endswith("-->"):
        return None, ""
    first = k
    while first >= 0 and "<!--" not in lines[first]:
        first -= 1
    m = _MARK.search("\n".join(lines[max(first, 0) : k + 1]))
    if m is None:
        return None, ""
    return m.group(1), m.group(2).strip().lstrip(":").strip()


def parse_directives(block: Block) -> Directives:
    d = Directives()
    for raw in block.options.splitlines():
        words = shlex.split(raw)
        if not words:
            continue
        key, args = words[0], words[1:]
        if key == "background" and len(args) == 3 and args[1] == "until":
            d.background.append((args[0], args[2]))
        elif key == "expect" and len(args) == 2:
            d.expect.append((args[0], args[1]))
        elif key == "exit" and len(args) == 2:
            d.exit[args[0]] = int(args[1])
        elif key == "timeout" and len(args) == 1:
            d.timeout = float(args[0])
        elif key == "cwd" and len(args) == 1:
            d.cwd = args[0]
        elif key == "needs" and args:
            d.needs.extend(args)
        else:
            raise DocRunError(f"{block.where}: unknown runnable directive {raw.strip()!r}")
    return d


def commands(text: str) -> list[str]:
    """A shell block's commands: `\\`-continued lines joined, blank and comment lines dropped."""
    out: list[str] = []
    cur = ""
    for line in text.splitlines():
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append((cur + line).strip())
        cur = ""
    if cur:
        out.append(cur.strip())
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Proc:
    """A command's process with its output lines collected by a thread."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,  # its own process group: stopped with its children
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_line(self, rx: re.Pattern[str], deadline: float) -> bool:
        with self._cond:
            while True:
                if any(rx.search(x) for x in self.lines):
                    return True
                if self.popen.poll() is not None and not self._thread.is_alive():
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.25))

    def finish(self, deadline: float) -> int | None:
        """Wait for the exit until `deadline`; None (and the group killed) when it did not."""
        try:
            rc = self.popen.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self.stop(grace_s=2)
            return None
        self._thread.join(5)
        return rc

    def stop(self, grace_s: float = 15.0) -> None:
        if self.popen.poll() is None:
            with _quiet():
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                with _quiet():
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        else:  # the leader is gone; anything it left in its group goes too
            with _quiet():
                os.killpg(self.popen.pid, signal.SIGKILL)
        self._thread.join(5)


def _quiet() -> contextlib.suppress:
    return contextlib.suppress(ProcessLookupError, PermissionError)


def _tail(text: str, n: int = 40) -> str:
    return "\n".join(text.splitlines()[-n:])


class Session:
    """One file's runnable blocks, run in order (module docstring)."""

    def __init__(self, path: Path, echo: bool = False) -> None:
        self.path = path
        self.echo = echo
        self.blocks = [b for b in blocks(path) if b.marker == "runnable"]
        self.tmp = Path(tempfile.mkdtemp(prefix="kvsched-docs-"))
        self.ports: dict[str, str] = {}
        self.scratch: dict[str, str] = {}
        for b in self.blocks:
            for p in _PORT.findall(b.text):
                self.ports.setdefault(p, str(_free_port()))
            for s in _SCRATCH.findall(b.text):
                self.scratch.setdefault(s, str(self.tmp / s.rsplit("/", 1)[1]))
        self.ports.setdefault(METRICS_PORT, str(_free_port()))  # the daemon's default
        self.background: list[tuple[str, _Proc]] = []
        self.env = dict(os.environ)
        self.env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + self.env["PATH"]
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env.setdefault("OPENBLAS_NUM_THREADS", "1")
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.env["KVSCHED_METRICS_LISTEN"] = f"127.0.0.1:{self.ports[METRICS_PORT]}"

    def substitute(self, text: str) -> str:
        text = text.replace("0.0.0.0:", "127.0.0.1:")
        text = _PORT.sub(lambda m: self.ports.get(m.group(1), m.group(1)), text)
        return _SCRATCH.sub(lambda m: self.scratch.get(m.group(0), m.group(0)), text)

    def run(self) -> None:
        try:
            for block in self.blocks:
                self.run_block(block)
        finally:
            self.close()

    def close(self) -> None:
        for _, proc in reversed(self.background):
            proc.stop()
        self.background.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _log(self, text: str) -> None:
        if self.echo:
            print(text, flush=True)

    def run_block(self, block: Block) -> None:
        d = parse_directives(block)
        missing = [p for p in d.needs if _which(p, self.env) is None]
        if missing:
            raise DocRunError(
                f"{block.where}: needs {', '.join(missing)} on PATH (.ci/run installs it)"
            )
        cwd = REPO / d.cwd
        deadline = time.monotonic() + d.timeout
        if block.language == "python":
            script = self.tmp / f"block_{block.line}.py"
            script.write_text(self.substitute(block.text))
            cmds = [(f"python {script.name}", [sys.executable, str(script)])]
        else:
            cmds = [(c, ["bash", "-c", self.substitute(c)]) for c in commands(block.text)]
        for shown, argv in cmds:
            self._log(f"$ {shown}")
            bg = next((rx for sub, rx in d.background if sub in shown), None)
            proc = _Proc(argv, cwd, self.env)
            if bg is not None:
                self.background.append((shown, proc))
                if not proc.wait_line(re.compile(bg), deadline):
                    state = "exited" if proc.popen.poll() is not None else "still running"
                    raise DocRunError(
                        f"{block.where}: `{shown}` ({state}) printed no line matching {bg!r} "
                        f"within the block's {d.timeout:g} s:\n{_tail(proc.output())}"
                    )
                self._log(_tail(proc.output(), 5))
            else:
                rc = proc.finish(deadline)
                out = proc.output()
                self._log(_tail(out, 15))
                want = next((n for sub, n in d.exit.items() if sub in shown), 0)
                if rc is None:
                    raise DocRunError(
                        f"{block.where}: `{shown}` did not finish within the block's "
                        f"{d.timeout:g} s:\n{_tail(out)}"
                    )
                if rc != want:
                    raise DocRunError(
                        f"{block.where}: `{shown}` exited {rc} (expected {want}):\n{_tail(out)}"
                    )
                for sub, rx in d.expect:
                    if sub in shown and not re.search(rx, out, re.M):
                        raise DocRunError(
                            f"{block.where}: `{shown}` printed nothing matching {rx!r}:\n"
                            f"{_tail(out)}"
                        )
            self._check_alive(block)

    def _check_alive(self, block: Block) -> None:
        for shown, proc in self.background:
            if proc.popen.poll() is not None:
                raise DocRunError(
                    f"{block.where}: background command `{shown}` exited "
                    f"({proc.popen.returncode}) while the page still needs it:\n"
                    f"{_tail(proc.output())}"
                )


def _which(program: str, env: dict[str, str]) -> str | None:
    return shutil.which(program, path=env.get("PATH"))


def runnable_files() -> Iterator[Path]:
    """README.md and docs/*.md files that have at least one runnable block."""
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        if any(b.marker == "runnable" for b in blocks(path)):
            yield path


def main(argv: list[str]) -> int:
    for name in argv:
        path = Path(name).resolve()
        print(f"== {path.relative_to(REPO)}", flush=True)
        Session(path, echo=True).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
