"""The objective math must import without the heavy stack."""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_objectives_import_only_torch():
    code = (
        "import sys, lit_grpo.objectives\n"
        "heavy = ('lightning', 'pytorch_lightning', 'transformers', 'peft')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
