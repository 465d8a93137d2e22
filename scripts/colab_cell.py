"""The one setup cell every notebook starts with (tests check it is exactly this).

In Colab it installs course_lib from the course repository; pyproject's loose
``torch>=2.6`` is satisfied by Colab's torch, so pip keeps it. Anywhere else it
does nothing: ``pip install -r requirements.txt`` has installed course_lib already.
"""
REPO_URL = "https://github.com/nd-parallelism/course"
BRANCH = "main"

COLAB_CELL = f'''# Setup: in Colab, install course_lib from the course repository (Colab's torch is kept).
# Elsewhere this cell does nothing: `pip install -r requirements.txt` already installed it.
import subprocess, sys
if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "git+{REPO_URL}@{BRANCH}"], check=True)'''

if __name__ == "__main__":
    print(COLAB_CELL)
