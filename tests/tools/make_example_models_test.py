"""tools_make_example_models_test: models/ is what tools/make_example_models.py writes.

The script is deterministic (models/README.md: running it again must leave
`git diff models/` empty); this runs it into a fresh directory and compares
every file byte for byte with models/, so a change to the script that moves
an existing model's weights (a new model drawn before the old ones, say), or
a model file edited by hand, fails here.

    /usr/bin/python3 tests/tools/make_example_models_test.py
"""

import pathlib
import subprocess
import sys
import tempfile
import unittest

SOURCE_DIR = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = SOURCE_DIR / "tools" / "make_example_models.py"
MODELS = SOURCE_DIR / "models"


class MakeExampleModelsTest(unittest.TestCase):
    def test_regenerates_models_byte_for_byte(self):
        with tempfile.TemporaryDirectory() as out:
            subprocess.run([sys.executable, str(SCRIPT), "--out", out], check=True,
                           capture_output=True, timeout=300)
            written = sorted(path.name for path in pathlib.Path(out).glob("*.safetensors"))
            committed = sorted(path.name for path in MODELS.glob("*.safetensors"))
            self.assertEqual(written, committed)
            for name in written:
                self.assertEqual((pathlib.Path(out) / name).read_bytes(),
                                 (MODELS / name).read_bytes(), f"{name} differs from models/")


if __name__ == "__main__":
    unittest.main()
