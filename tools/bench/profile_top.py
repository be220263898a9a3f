"""The top costs in a py-spy profile of vacancyd, grouped the way docs/performance.md lists them.

Run by hand on the output of `py-spy record --format raw` (py-spy is not a dependency of
the project: install it into your environment to profile, e.g. `pip install py-spy`):

    py-spy record -r 250 -f raw -o /tmp/work.txt --subprocesses -- \\
        python tools/bench/proxy_latency.py --scenarios json --requests 3000 --no-pin
    python tools/bench/profile_top.py /tmp/work.txt [--top 25]

With `--subprocesses` the file holds every process of the run; only the stacks of the
vacancyd daemon (`--process`, a substring of its command line) are counted. py-spy leaves
idle threads out by default, so each sample is a moment the daemon was on a CPU.

Printed: the share of samples whose innermost frame is in each function (self), the share
of samples with each function anywhere on the stack (inclusive), and self time summed per
package (trio, hypercorn, h11, httpx, httpcore, vacancyd's modules, ...). Samples of a
thread that was really waiting (py-spy's idle detection misses trio's epoll wait and its
idle worker threads) and of module imports (start-up) are counted apart and left out.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")
# Innermost frames of a thread that is waiting, though py-spy did not see it as idle: trio's
# idle worker threads (a lock with a timeout) and its event loop's epoll wait.
WAITING = ("WorkerThread._work (trio/_core/_thread_cache.py", "EpollIOManager.get_events (")


def parse(path: Path, process: str) -> list[tuple[list[str], int]]:
    """(frames outermost first, sample count) for each stack of the matching process."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if frames[0].startswith("process "):
            owners = [f for f in frames if f.startswith("process ")]
            if process not in owners[-1]:
                continue
            frames = [f for f in frames if not f.startswith(("process ", "thread "))]
        if frames:
            stacks.append((frames, int(count)))
    return stacks


def function_of(frame: str) -> str:
    match = FRAME.match(frame)
    if match is None:
        return frame
    return f"{match['function']} ({match['file']})"


def package_of(frame: str) -> str:
    match = FRAME.match(frame)
    file = match["file"] if match else frame
    if file.startswith("vacancyd/"):
        parts = file.removesuffix(".py").split("/")
        return "/".join(parts[:2]) if parts[1] in ("proxy", "admission", "adapters") else parts[1]
    if file.startswith("<frozen") or "/" not in file:
        return f"stdlib {file}" if file.endswith(".py") else file
    return file.split("/", 1)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path, help="py-spy --format raw output")
    parser.add_argument("--process", default="vacancyd run", help="command line substring")
    parser.add_argument("--top", type=int, default=25, help="rows per table (25)")
    parser.add_argument(
        "--focus",
        action="append",
        default=[],
        help="also split this function's inclusive share by its direct callees "
        "(a substring of 'function (file)'; repeatable)",
    )
    args = parser.parse_args(argv)
    stacks = parse(args.profile, args.process)
    total = sum(count for _, count in stacks)
    if not total:
        print(f"no samples of a process matching {args.process!r}", file=sys.stderr)
        return 1
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    left_out: Counter[str] = Counter()
    callees: dict[str, Counter[str]] = {focus: Counter() for focus in args.focus}
    for frames, count in stacks:
        if frames[-1].startswith(WAITING):
            left_out["waiting (epoll, idle worker threads)"] += count
            continue
        if any(frame.startswith("_find_and_load (") for frame in frames):
            left_out["importing modules (start-up)"] += count
            continue
        own[function_of(frames[-1])] += count
        packages[package_of(frames[-1])] += count
        names = [function_of(frame) for frame in frames]
        for name in set(names):
            inclusive[name] += count
        for focus, below in callees.items():
            at = next((i for i, name in enumerate(names) if focus in name), None)
            if at is not None:
                below[names[at + 1] if at + 1 < len(names) else "(itself)"] += count
    counted = total - sum(left_out.values())
    print(f"{args.profile}: {total} samples of {args.process!r}")
    for what, count in left_out.most_common():
        print(f"  left out: {count} samples {what}")
    print(f"  {counted} samples counted; shares below are of those")
    total = counted
    for title, counter in (
        ("self (innermost frame)", own),
        ("inclusive (anywhere on the stack)", inclusive),
        ("self by package", packages),
    ):
        print(f"\n{title}")
        for name, count in counter.most_common(args.top):
            print(f"  {100 * count / total:5.1f} %  {name}")
    for focus, below in callees.items():
        print(f"\ninside {focus} ({100 * sum(below.values()) / total:.1f} % in all)")
        for name, count in below.most_common(args.top):
            print(f"  {100 * count / total:5.1f} %  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
