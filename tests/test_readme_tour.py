"""The README's five-minute tour, run: each `$ command` of the tour's blocks runs as written (at the `TINY`
sizes the README sets), in one scratch directory and in order (later commands read what earlier ones
wrote), and every line the README shows of its output must be in what it prints today, so the front page
cannot drift from the code.

What is compared is the text, not the measurements: numbers become ``#``, a finding's status (``[ok]``...)
becomes ``[status]``, the tree's box-drawing characters and runs of spaces are dropped, and this machine's
host name reads as the README's (``vm``). The README's ``...`` marks a cut: each run of lines between cuts
must appear, in order and contiguous, in the output (a line ending in ``...`` is cut there)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
README_HOST = "vm"  # the host name of the machine the README's output comes from
NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
STATUS = re.compile(r"\[(ok|warning|fault|not measured|info)\]")
BOX = re.compile(r"[│├└─]")


def tour_text() -> str:
    text = README.read_text()
    return text[text.index("## A five-minute tour"):text.index("## The demo")]


def tour_tiny(tour: str) -> str:
    """The value the README gives TINY (its bash block, continuation lines joined)."""
    match = re.search(r'TINY="(.*?)"', tour.replace("\\\n", " "), re.DOTALL)
    assert match, "the tour sets TINY in a bash block"
    return " ".join(match.group(1).split())


def tour_commands(tour: str) -> list[tuple[str, list[str]]]:
    """Each ``$ command`` of the tour's output blocks and the lines the README shows after it."""
    commands: list[tuple[str, list[str]]] = []
    fence = None  # the open block's language ("" for output blocks), None outside blocks
    for line in tour.splitlines():
        if line.startswith("```"):
            fence = line[3:] if fence is None else None
            if fence is None and commands:
                commands[-1] = (commands[-1][0], commands[-1][1] + ["..."])  # a block's end cuts the output
        elif fence == "" and line.startswith("$ "):
            commands.append((line[2:], []))
        elif fence == "" and commands:
            commands[-1][1].append(line)
    return commands


def normalized(text: str) -> str:
    host = socket.gethostname().split(".")[0]
    if host:  # the node names the doctor and the bench print, as whole words
        text = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", README_HOST, text)
    text = NUMBER.sub("#", STATUS.sub("[status]", BOX.sub(" ", text)))
    return " ".join(text.split())


def shown_runs(lines: list[str]) -> list[str]:
    """The README's lines of one command's output cut at its ``...`` marks, each run normalized."""
    runs, current = [], []
    for line in lines:
        if line.strip() == "...":
            runs.append(current)
            current = []
        elif line.rstrip().endswith("..."):
            current.append(line.rstrip()[:-3])
            runs.append(current)
            current = []
        else:
            current.append(line)
    runs.append(current)
    return [normalized(" ".join(run)) for run in runs if normalized(" ".join(run))]


TOUR = tour_text()
COMMANDS = tour_commands(TOUR)


@pytest.fixture(scope="module")
def tour_outputs(tmp_path_factory) -> list[str]:
    """Every tour command's output (stdout and stderr), run one after another in one scratch directory."""
    cwd = tmp_path_factory.mktemp("tour")
    venv_bin = str(Path(sys.executable).parent)  # scalerl, torchrun and python of this environment
    env = {**os.environ, "TINY": tour_tiny(TOUR), "OMP_NUM_THREADS": "1",
           "PATH": venv_bin + os.pathsep + os.environ.get("PATH", "")}
    outputs = []
    for command, _ in COMMANDS:
        done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=600, check=False)  # interleaved, as on a terminal
        outputs.append(done.stdout)
    return outputs


def test_the_tour_has_its_commands():
    assert [c.split()[0] for c, _ in COMMANDS][:3] == ["scalerl", "scalerl", "scalerl"]
    assert len(COMMANDS) >= 10 and all(shown for _, shown in COMMANDS)


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=[c[:60] for c, _ in COMMANDS])
def test_each_command_prints_what_the_readme_shows(tour_outputs, index):
    command, shown = COMMANDS[index]
    printed = normalized(tour_outputs[index])
    position = 0
    for run in shown_runs(shown):
        found = printed.find(run, position)
        assert found >= 0, (f"README shows, after `$ {command}`:\n  {run}\nwhich it no longer prints (in this "
                            f"order); it printed:\n{tour_outputs[index]}")
        position = found + len(run)
