"""Runs the transformers (torch) reference in its own interpreter and reads back results."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).parent / "reference" / "hf_reference.py"


@dataclasses.dataclass(frozen=True)
class Reference:
    python: pathlib.Path

    @classmethod
    def find(cls, root: pathlib.Path) -> "Reference | None":
        python = root / ".venv-ref" / "bin" / "python"
        return cls(python) if python.exists() else None

    def run(self, op: str, **request) -> dict:
        """Runs `op` of tests/reference/hf_reference.py; returns its JSON reply."""
        payload = json.dumps({"op": op, **request})
        proc = subprocess.run(
            [str(self.python), str(SCRIPT)], input=payload, capture_output=True, text=True,
            env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PATH": "/usr/bin:/bin",
                 "OMP_NUM_THREADS": "2"},
            timeout=600,
        )
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise RuntimeError(f"reference op {op!r} failed:\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])
