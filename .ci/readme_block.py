"""Prints the Nth ```bash block of README.md (1-based), so CI runs the README's commands as the
README gives them instead of a copy that could drift: `python3 .ci/readme_block.py 1`."""
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def bash_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S)]


if __name__ == "__main__":
    blocks = bash_blocks(README.read_text())
    index = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    if not 1 <= index <= len(blocks):
        sys.exit(f"README.md has {len(blocks)} bash blocks, not a block {index}")
    print(blocks[index - 1])
