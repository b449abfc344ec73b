#!/usr/bin/env python3
"""Keeps the code in pieces a reader can hold: no source file over 600 lines, no function over
80 (bodies counted from the line that opens them to the one that closes them).

    check_sizes.py ROOT [FOLDER...]   (folders default to src include tools bench python)
"""
import pathlib
import re
import sys

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
# A line that opens a function body: a signature ending in ") ... {" (not control flow, not a
# lambda passed as an argument, not a class or namespace).
OPENS = re.compile(r"^\s*[^\s#/].*\)\s*(const\s*)?(noexcept\s*)?(override\s*)?(final\s*)?"
                   r"(->\s*[\w:<>&*, ]+)?\s*(:\s*.*)?\{\s*$")
CONTROL = re.compile(r"^\s*(if|for|while|switch|else|do|catch|try|return|\}|case)\b")


def code_only(line):
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)  # strings
    line = re.sub(r"'(\\.|[^'\\])*'", "''", line)
    return line.split("//")[0]


def functions(lines):
    """(first line number, length) of each function body opened by a signature line."""
    found = []
    for number, raw in enumerate(lines):
        line = code_only(raw)
        if not OPENS.match(line) or CONTROL.match(line) or "[" in line.split("(")[0]:
            continue
        depth = 0
        for end in range(number, len(lines)):
            text = code_only(lines[end])
            depth += text.count("{") - text.count("}")
            if depth <= 0:
                found.append((number + 1, end - number + 1))
                break
    return found


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    folders = sys.argv[2:] or ["src", "include", "tools", "bench", "python"]
    problems = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in (".h", ".cc"):
                continue
            lines = path.read_text(errors="replace").splitlines()
            name = path.relative_to(root)
            if len(lines) > MAX_FILE_LINES:
                problems.append(f"{name}: {len(lines)} lines (at most {MAX_FILE_LINES})")
            for first, length in functions(lines):
                if length > MAX_FUNCTION_LINES:
                    problems.append(f"{name}:{first}: a function of {length} lines "
                                    f"(at most {MAX_FUNCTION_LINES})")
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} file(s) or function(s) too long")
        return 1
    print("sizes: every file and function is within bounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
