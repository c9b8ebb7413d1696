"""Docs that cannot drift: every command block of README.md and docs/*.md is either run here as a
person would run it (tests/docs_runner.py says how blocks are marked and run) or says why not.

The runner itself is tested first, on small pages written here, so that a page that passes is a
page whose commands worked: a failing command, a background command that dies, a wait line
that never comes and an expected line that is not printed each fail the run."""

from __future__ import annotations

import os
import re
import textwrap
from pathlib import Path

import pytest

from tests.docs_runner import REPO, DocRunError, Session, blocks, commands, runnable_files

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The pages issue 24 asked to be executed on every CI run.
MUST_RUN = ("README.md", "CLUSTER.md", "CLIENT.md", "WORKERS.md", "MONITORING.md")


def test_every_command_block_is_runnable_or_says_why_not() -> None:
    unmarked, reasonless = [], []
    for page in PAGES:
        for b in blocks(page):
            if b.marker is None:
                unmarked.append(b.where)
            elif b.marker == "not runnable" and len(b.options) < 10:
                reasonless.append(b.where)
    assert not unmarked, (
        f"blocks with neither <!-- runnable --> nor <!-- not runnable: why -->: {unmarked}"
    )
    assert not reasonless, f"<!-- not runnable --> without a reason: {reasonless}"


def test_the_pages_people_follow_first_are_run() -> None:
    names = {p.name for p in runnable_files()}
    assert set(MUST_RUN) <= names, set(MUST_RUN) - names


@pytest.mark.slow
@pytest.mark.parametrize("page", list(runnable_files()), ids=lambda p: p.name)
def test_page_runs_as_written(page: Path) -> None:
    Session(page).run()


# ---- the runner --------------------------------------------------------------------------------


def _page(tmp_path: Path, body: str) -> Path:
    page = tmp_path / "PAGE.md"
    page.write_text(textwrap.dedent(body).replace("'''", "```"))
    return page


def test_commands_join_continued_lines_and_drop_comments() -> None:
    text = "# a comment\nkvsched serve --a 1 \\\n    --b 2   # why\n\necho hi\n"
    assert commands(text) == ["kvsched serve --a 1      --b 2   # why", "echo hi"]


def test_a_failing_command_fails_the_page(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        """
        <!-- runnable -->
        '''sh
        true
        ls /no/such/folder
        '''
        """,
    )
    with pytest.raises(DocRunError, match=r"PAGE.md:3: `ls /no/such/folder` exited 2"):
        Session(page).run()


def test_an_expected_line_that_is_not_printed_fails_the_page(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        """
        <!-- runnable: expect "echo" "^world$" -->
        '''sh
        echo hello
        '''
        """,
    )
    with pytest.raises(DocRunError, match="printed nothing matching '\\^world\\$'"):
        Session(page).run()


def test_a_background_command_that_dies_fails_the_page(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        """
        <!-- runnable
        background "sh -c" until "up"
        -->
        '''sh
        sh -c 'echo up; sleep 1; exit 3'
        sleep 3
        '''
        """,
    )
    with pytest.raises(DocRunError, match=r"background command `sh -c .*` exited \(3\)"):
        Session(page).run()


def test_a_wait_line_that_never_comes_fails_within_the_timeout(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        """
        <!-- runnable
        background "sleep" until "never printed"
        timeout 2
        -->
        '''sh
        sleep 60
        '''
        """,
    )
    with pytest.raises(DocRunError, match=r"\(still running\) printed no line matching"):
        Session(page).run()


def test_ports_and_scratch_paths_are_substituted_and_background_stopped(tmp_path: Path) -> None:
    # Two blocks of one page: the second sees the first's port and scratch folder, the port is
    # not the one written, and the background command is gone once the page is done.
    page = _page(
        tmp_path,
        f"""
        <!-- runnable
        background "python3 -c" until "serving"
        -->
        '''sh
        python3 -c "import os, time; open('{tmp_path}/pid', 'w').write(str(os.getpid())); print('serving', flush=True); time.sleep(600)"
        echo 127.0.0.1:50051 /tmp/kvsched-docs-test > {tmp_path}/first
        '''

        <!-- runnable: expect "cat" "^127.0.0.1:" -->
        '''sh
        echo 127.0.0.1:50051 /tmp/kvsched-docs-test > {tmp_path}/second
        cat {tmp_path}/second
        '''
        """,
    )
    Session(page).run()
    first, second = (tmp_path / "first").read_text(), (tmp_path / "second").read_text()
    assert first == second, (first, second)
    assert "50051" not in first and "/tmp/kvsched-docs-test" not in first, first
    assert re.fullmatch(r"127\.0\.0\.1:\d+ \S+/kvsched-docs-test\n", first), first
    with pytest.raises(ProcessLookupError):  # stopped with the page
        os.kill(int((tmp_path / "pid").read_text()), 0)


def test_make_demo_cluster_runs_what_the_pages_promise() -> None:
    make = (REPO / "Makefile").read_text()
    (line,) = [x for x in make.splitlines() if "demo --cluster" in x]
    daemons = re.search(r"--daemons (\d+)", line)
    workers = re.search(r"--workers (\d+)", line)
    assert daemons and workers, line
    promise = f"{daemons[1]} daemons, {workers[1]} sim workers"
    assert promise in (REPO / "docs" / "CLUSTER.md").read_text(), promise
    assert (
        f"{daemons[1]} daemons in one cluster, {workers[1]} workers"
        in (REPO / "README.md").read_text()
    )
