"""The README's Python and C examples are the tested files, verbatim; the Python one runs."""
import os
import re
import subprocess
import sys

from conftest import ROOT


def readme_block(section, language):
    """The first ```language block after the heading `## section`."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {section}\n")
    match = re.compile(rf"```{language}\n(.*?)```", re.S).search(text, start)
    return match.group(1)


def test_the_readme_python_example_is_the_tested_file():
    assert readme_block("Python", "python") == (ROOT / "examples/python/readme_example.py").read_text()


def test_the_readme_c_example_is_the_tested_file():
    # The C file is compiled and run as ctest `c_api_example`.
    assert readme_block("C", "c") == (ROOT / "examples/c_api_example.c").read_text()


def test_the_readme_go_example_is_the_tested_file():
    assert readme_block("Go", "go") == (ROOT / "go/example_test.go").read_text()


def test_the_readme_python_example_runs():
    result = subprocess.run([sys.executable, str(ROOT / "examples/python/readme_example.py")],
                            capture_output=True, text=True, env=dict(os.environ), check=True)
    assert result.stdout.splitlines() == [
        "KVCache::prepare_snapshots: offset 4 in [4, 9] is already passed (cache offset 12)",
        "3 tokens reused",
    ]
