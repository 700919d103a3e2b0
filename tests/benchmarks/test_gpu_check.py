"""The prepared GPU run, as a machine without a GPU runs it: ``benchmarks/gpu_check.py --device cpu --quick``.

Every section it can run on a CPU runs (the test subset and the compiles are skipped and say
so), none fails, the JSON holds each section's figures and the summary says what random
weights mean. On a GPU the same script runs its full sections (``benchmarks/results/gpu.md``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_cpu_run_writes_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    sections = result["sections"]
    assert set(sections) == {"tests", "probes", "demo", "cost", "overhead", "drafting", "compile"}
    assert "skipped" in sections["tests"] and "skipped" in sections["compile"]
    assert all(row["identical_to_plain"] for name, row in sections["demo"].items() if name != "seconds")
    assert set(sections["cost"]) >= {"1B", "8B", "note"} and sections["cost"]["1B"]["ratio"]["1"] == 1.0
    assert {"eagle3_step", "mtp_module", "medusa_4_heads", "dflash_block_8", "peagle_5"} <= set(sections["drafting"])
    assert sections["probes"]["bfloat16"]["lean_forward"] in (True, False)
    assert any("random weights" in line for line in result["summary"]) and "random weights" in done.stdout
