"""Print the flag tables of `pagedllm serve` in Markdown, as docs/serving.md holds them between its
`<!-- serve-flags -->` markers (tests/test_docs.py checks they match: regenerate with
`python tools/serve_flags_doc.py --write` after adding a flag)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "serving.md"
BEGIN, END = "<!-- serve-flags -->", "<!-- /serve-flags -->"


def serve_parser() -> argparse.ArgumentParser:
    from pagedllm.entrypoints.openai import serve_cmd

    subparsers = argparse.ArgumentParser().add_subparsers()
    serve_cmd.add_parser(subparsers)
    return subparsers.choices["serve"]


def flag_tables() -> str:
    lines: list[str] = []
    for group in serve_parser()._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.dest != "help"]
        if not actions:
            continue
        lines += ["", f"**{group.title}**", "", "| flag | meaning |", "|---|---|"]
        for action in actions:
            text = " ".join((action.help or "").split()).replace("%(default)s", str(action.default))
            if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
                text += f" (default: {action.default})"
            flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
            lines.append(f"| {flags} | {text.replace('|', '&#124;')} |")
    return "\n".join(lines[1:]) + "\n"


def documented_tables(text: str) -> str:
    match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    return match.group(1) if match else ""


def main() -> int:
    tables = flag_tables()
    if "--write" in sys.argv[1:]:
        text = DOC.read_text()
        span = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
        assert span.search(text), f"{DOC} has no {BEGIN} ... {END} markers"
        DOC.write_text(span.sub(lambda _: f"{BEGIN}\n{tables}{END}", text, count=1))
    else:
        print(tables, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
