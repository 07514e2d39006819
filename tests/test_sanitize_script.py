"""tests/sanitize_gpu.py is run by hand under compute-sanitizer on the GPU machine: here it runs on CPU
(the same calls on the XLA fallbacks), so a change of a wrapper's signature cannot leave it broken."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).with_name("sanitize_gpu.py")
LABELS = ("weighted", "gated")  # the words a case's name may set to False; every other False is a failed check


def test_sanitize_script_runs_every_case_and_each_check_holds():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) >= 50, run.stdout
    failed = [line for line in lines if "False" in re.sub(rf"\b({'|'.join(LABELS)}) False\b", "", line)]
    assert not failed, "\n".join(failed)
