"""The README's usage example runs as written and prints what its comment says."""

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


# What each python example of the README prints, in order: the usage example, loading a checkpoint.
EXPECTED_OUTPUTS = ["(16, 64) 32", "(2, 8, 32)"]


def test_readme_examples_run_as_written(monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == len(EXPECTED_OUTPUTS), f"expected {len(EXPECTED_OUTPUTS)} python examples in README.md"
    monkeypatch.chdir(README.parent)  # the examples' paths are relative to the repository root
    for block, expected in zip(blocks, EXPECTED_OUTPUTS):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(block, str(README), "exec"), {"__name__": "readme"})
        assert printed.getvalue().strip() == expected
