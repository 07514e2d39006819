"""The scripts run by hand on the GPU machine, here on CPU (the same calls on the XLA fallbacks), so a
change of a wrapper's signature cannot leave them broken: tests/sanitize_gpu.py (under compute-sanitizer)
and tests/profile_gpu.py (the kernel-time profile)."""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import jax

SCRIPT = pathlib.Path(__file__).with_name("sanitize_gpu.py")
PROFILE_SCRIPT = pathlib.Path(__file__).with_name("profile_gpu.py")
LABELS = ("weighted", "gated")  # the words a case's name may set to False; every other False is a failed check


def test_sanitize_script_runs_every_case_and_each_check_holds():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert len(lines) >= 50, run.stdout
    failed = [line for line in lines if "False" in re.sub(rf"\b({'|'.join(LABELS)}) False\b", "", line)]
    assert not failed, "\n".join(failed)


def test_profile_script_profiles_each_case(tmp_path):
    run = subprocess.run([sys.executable, str(PROFILE_SCRIPT), str(tmp_path), "--model", "tiny", "--layers", "2",
                          "infer4", "train8"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["model"] == "tiny" and list(report["cases"]) == ["infer4", "train8"]
    for case, result in report["cases"].items():
        assert result["plan"].startswith("LayerPlan(num_tokens=" + case.removeprefix("infer").removeprefix("train"))
        assert f"== {case}: {result['plan']}" in run.stdout
        # A device's kernels where there is a GPU, sorted by time; none in a CPU trace.
        if jax.default_backend() == "gpu":
            assert result["kernels"] and result["kernels"] == sorted(result["kernels"], key=lambda k: -k[2])
        else:
            assert result["kernels"] == [] and result["kernel_us_per_layer"] == 0
