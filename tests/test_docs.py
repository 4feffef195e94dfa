"""The documentation cannot drift: every snippet and command in README.md, docs/ and specs/ runs here.

Each Markdown file runs top to bottom in a scratch directory holding links to ``examples/`` and
``specs/`` and an empty ``docs/`` (so a command that writes ``docs/split.svg`` leaves the committed
picture alone). Python blocks share one namespace per file; ``fxsplit ...`` commands run the
console script's entry point (``fxsplit.cli.main``) in this process, other commands run in bash.
What a block printed is compared with the quoted output under it. Blocks that cannot run here say
why in a marker and show up as skipped tests; ``tests/docblocks.py`` documents the markers.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import torch
from docblocks import (
    ROOT,
    RUNNABLE,
    Block,
    console_commands,
    contains,
    difference,
    documents,
    matches,
    parse,
    shell_commands,
    with_cpus,
)

BLOCKS = {path.relative_to(ROOT).as_posix(): parse(path) for path in documents()}
_FXSPLIT = re.compile(r'fxsplit (?P<args>[^;|&<>]*?)(?P<echo>; echo "exit \$\?")?')


def skip_reason(block: Block) -> str | None:
    """Why ``block`` does not run on this machine, or None when it runs."""
    if "not-run" in block.markers:
        return f"{block.where}: not run: {block.markers['not-run']}"
    need = block.markers.get("needs", "")
    if need.startswith("cuda:"):
        wanted, visible = int(need.split(":")[1]), torch.cuda.device_count()
        if visible < wanted:
            return f"{block.where}: needs {wanted} CUDA device(s), {visible} visible"
    elif need == "no-cuda" and torch.cuda.is_available():
        return f"{block.where}: shows what happens without CUDA, and CUDA is available"
    elif need == "dot" and shutil.which("dot") is None:
        return f"{block.where}: needs Graphviz's dot on the PATH"
    return None


SKIPPED = [block for blocks in BLOCKS.values() for block in blocks if not block.quotes and skip_reason(block)]


def test_every_block_is_run_or_says_why_not() -> None:
    problems = []
    for blocks in BLOCKS.values():
        for previous, block in zip([None, *blocks], blocks, strict=False):
            if "not-run" in block.markers and not block.markers["not-run"]:
                problems.append(f"{block.where}: not-run needs a reason")
            if block.quotes:
                if "output" in block.markers and (previous is None or previous.quotes):
                    problems.append(f"{block.where}: an output block must follow the block that prints it")
            elif block.lang not in RUNNABLE and "not-run" not in block.markers:
                problems.append(f"{block.where}: a ```{block.lang} block must be marked output, file: or not-run:")
    assert not problems, "\n".join(problems)
    assert sum(len(blocks) for blocks in BLOCKS.values()) > 30  # the parser found the documents' blocks


@pytest.mark.parametrize("block", SKIPPED, ids=[block.where for block in SKIPPED])
def test_block_not_run_here(block: Block) -> None:
    pytest.skip(skip_reason(block) or "")


@pytest.mark.slow  # runs every documented command, up to ~5 s a document
@pytest.mark.parametrize("document", sorted(BLOCKS))
def test_document(document: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for shared in ("examples", "specs"):
        (tmp_path / shared).symlink_to(ROOT / shared)
    (tmp_path / "docs").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    namespace: dict[str, object] = {"__name__": "__docs__"}
    printed: str | None = None
    for block in BLOCKS[document]:
        if "output" in block.markers:
            if printed is not None and not matches(block.text, printed):
                pytest.fail(f"{block.where}: the output drifted\n{difference(block.text, printed)}", pytrace=False)
            continue
        if "file" in block.markers:
            written = (tmp_path / block.markers["file"]).read_text(encoding="utf-8")
            if not contains(block.text, written):
                pytest.fail(
                    f"{block.where}: not what {block.markers['file']} holds now\n" + difference(block.text, written),
                    pytrace=False,
                )
            continue
        printed = None if skip_reason(block) else run_block(block, namespace, tmp_path)


def run_block(block: Block, namespace: dict[str, object], where: Path) -> str:
    """Run one block; returns what it printed."""
    text = with_cpus(block.text) if "cuda-as-cpu" in block.markers else block.text
    if block.lang == "python":
        return run_python(block, text, namespace)
    if block.lang == "yaml":
        import fxsplit

        fxsplit.load_spec(text)
        return ""
    if block.lang == "console":
        for command in console_commands(text):
            got = run_command(command.line, where)
            if not matches(command.expected, got):
                pytest.fail(
                    f"{block.where}: `{command.line.splitlines()[0]}` printed something else\n"
                    + difference(command.expected, got),
                    pytrace=False,
                )
        return ""
    return "".join(run_command(line, where) for line in shell_commands(text))


def run_python(block: Block, text: str, namespace: dict[str, object]) -> str:
    printed = io.StringIO()
    try:
        if "setup" in block.markers:
            setup = block.markers["setup"]
            setup = with_cpus(setup) if "cuda-as-cpu" in block.markers else setup
            exec(compile(setup, f"{block.where} (setup)", "exec"), namespace)
        with contextlib.redirect_stdout(printed):
            exec(compile(text, block.where, "exec"), namespace)
    except Exception as error:
        pytest.fail(f"{block.where}: the snippet raised\n{''.join(traceback.format_exception(error))}", pytrace=False)
    return printed.getvalue()


def run_command(line: str, where: Path) -> str:
    """Run a shell command (``fxsplit`` in this process); returns stdout and stderr together."""
    command = _FXSPLIT.fullmatch(line)
    if command:
        from fxsplit.cli import main

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            try:
                code = main(shlex.split(command["args"]), out=printed, err=printed)
            except SystemExit as exit_:  # argparse refusing the arguments
                code = int(exit_.code or 0)
        if command["echo"]:
            return printed.getvalue() + f"exit {code}\n"
        assert code == 0, f"`{line}` exited {code}:\n{printed.getvalue()}"
        return printed.getvalue()
    done = subprocess.run(["bash", "-c", line], cwd=where, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"`{line}` exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout + done.stderr


def test_the_runner_reads_markers_and_sees_drift(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        textwrap.dedent("""\
        - a list item:

          <!-- cuda-as-cpu -->
          <!-- setup: devices = ["cuda:0"]
          width = 3 -->
          ```python
          if True:
              print("cuda:1", devices, "x" * width)
          ```
          <!-- output -->
          ```text
          cpu:1 ['cpu:0'] ...
          ```

        ```console
        $ cat > a.txt <<'EOF'
        one
        EOF
        $ cat a.txt
        two
        ```
        """),
        encoding="utf-8",
    )
    code, shown, console = parse(page)
    assert code.markers == {"cuda-as-cpu": "", "setup": 'devices = ["cuda:0"]\nwidth = 3'} and shown.quotes
    assert code.text == 'if True:\n    print("cuda:1", devices, "x" * width)\n'
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    printed = run_block(code, namespace, tmp_path)
    assert printed == "cpu:1 ['cpu:0'] xxx\n" and matches(shown.text, printed)
    assert not matches(shown.text.replace("cpu:1", "cpu:2"), printed)
    assert [c.expected for c in console_commands(console.text)] == ["", "two"]
    with pytest.raises(pytest.fail.Exception, match="printed something else"):
        run_block(console, namespace, tmp_path)  # a.txt holds 'one'


def test_readme_states_the_exact_limit_the_partitioner_uses() -> None:
    from fxsplit.partition.solve import EXACT_LIMIT

    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"exact for graphs of up to {EXACT_LIMIT} ops" in readme
