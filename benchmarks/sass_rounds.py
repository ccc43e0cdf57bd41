"""Counts, per kernel of a SASS listing (benchmarks/sass.sh writes /tmp/sass/<file>.sass), the global-load round
trips after the programmatic wait (ACQBULK) that the code itself puts in a row: a "round" begins where an instruction
reads the destination of a global load still in flight and a later global load follows. Eight loads issued together
and then used count one round; the same loads each used before the next one is issued count eight. Found the QKV
finish's loads going out a pair at a time (four rounds where one would do: NOTES, "CUDA, session 28").

It reads the listing in address order, so alternative paths (a kernel's modes, the vector and scalar branches of a
load) and loop bodies add to the count: compare a kernel with itself before and after a change, or read the path in
question (`grep -n ACQBULK`, then its LDG / BAR.SYNC / uses) before trusting a number.

    bash benchmarks/sass.sh BUILD_DIR shaders/cuda/arch.cu x > /dev/null
    python3 benchmarks/sass_rounds.py /tmp/sass/arch.cu.sass [NAME_SUBSTRING]
"""
import re
import sys

FUNC = re.compile(r"Function : (\S+)")
INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
REG = re.compile(r"\bR\d+\b")


def rounds_after_wait(lines):
    """(rounds, global loads) after the last ACQBULK of one function's listing, or None without one."""
    insns = [m.group(2).strip() for m in map(INSN.search, lines) if m]
    waits = [i for i, t in enumerate(insns) if t.startswith("ACQBULK")]
    if not waits:
        return None
    pending, rounds, loads, waited = set(), 0, 0, False
    for text in insns[waits[-1] + 1:]:
        body = re.sub(r"^@!?U?P\w+\s+", "", text)
        op, _, operands = body.partition(" ")
        parts = [p.strip() for p in operands.split(",")]
        # Stores read every operand; other instructions read all but the first (their destination).
        sources = operands if op.startswith("ST") else ",".join(parts[1:])
        if pending & set(REG.findall(sources)):
            waited = True
            pending -= set(REG.findall(sources))
        if op.startswith("LDG"):
            if waited:
                rounds += 1
                waited = False
            loads += 1
            m = re.match(r"R(\d+)", parts[0]) if parts and parts[0] else None
            if m:
                width = 4 if ".128" in op else 2 if ".64" in op else 1
                pending |= {f"R{int(m.group(1)) + j}" for j in range(width)}
    return rounds, loads


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    pattern = sys.argv[2] if len(sys.argv) > 2 else ""
    name, body, rows = None, [], []
    for line in list(open(sys.argv[1])) + ["Function : <end>"]:
        m = FUNC.search(line)
        if not m:
            body.append(line)
            continue
        if name and pattern in name:
            r = rounds_after_wait(body)
            if r is not None:
                rows.append((r[0], r[1], name))
        name, body = m.group(1), []
    for rounds, loads, fn in sorted(rows, reverse=True):
        print(f"{rounds:4d} rounds {loads:5d} loads  {fn}")


if __name__ == "__main__":
    main()
