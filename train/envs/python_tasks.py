"""Tasks of the ``python`` environment: built-in math word problems, user task files,
and the answer check.

``BUILTIN_PROBLEMS`` are 20 word problems with integer answers, each with a
reference solution (stdlib-only Python that prints the answer): the scripted
expert runs it through the tool. ``load_task_file`` reads user tasks from JSONL
or Parquet (``prompt`` and ``answer`` columns, optional ``task_id``,
``solution`` and ``max_steps``). ``answers_match`` is the reward's comparison:
numbers compare by exact value (``42``, ``42.0``, ``84/2``, ``1,000`` and
``\\boxed{42}`` are all numbers), anything else as whitespace-collapsed,
case-folded text.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from train.envs.base import Task

DEFAULT_MAX_STEPS = 6
INSTRUCTION = ("\n\nYou can run Python code with the `python` tool; the interpreter keeps its "
               "variables between calls. Give the final answer as an integer inside "
               "<answer></answer>.")


@dataclass(frozen=True)
class Problem:
    """A built-in problem: its question, integer answer and reference solution code."""

    problem_id: str
    question: str
    answer: int
    solution: str


BUILTIN_PROBLEMS: tuple[Problem, ...] = (
    Problem("bakery", "A bakery sells muffins for $3 each and cookies for $2 each. On Monday it "
            "sold 47 muffins and 85 cookies. How many dollars did it take in?", 311,
            "muffins, cookies = 47, 85\nprint(3 * muffins + 2 * cookies)"),
    Problem("train", "A train travels at 84 km/h for 3 hours and then at 60 km/h for 2.5 hours. "
            "How many kilometres does it travel in total?", 402,
            "print(round(84 * 3 + 60 * 2.5))"),
    Problem("multiples", "What is the sum of all positive integers below 1000 that are "
            "multiples of 3 or 5?", 233168,
            "print(sum(n for n in range(1, 1000) if n % 3 == 0 or n % 5 == 0))"),
    Problem("divisors", "How many positive divisors does 7200 have?", 54,
            "print(sum(1 for d in range(1, 7201) if 7200 % d == 0))"),
    Problem("savings", "A savings account starts with $1000 and earns 5% interest compounded "
            "once a year. What is the balance after 10 years, rounded down to whole dollars?",
            1628,
            "balance = 1000\nfor year in range(10):\n    balance *= 1.05\nprint(int(balance))"),
    Problem("fibonacci", "The Fibonacci numbers start 1, 1, 2, 3, 5, ... with each number the "
            "sum of the two before it. What is the 30th Fibonacci number?", 832040,
            "a, b = 1, 1\nfor _ in range(28):\n    a, b = b, a + b\nprint(b)"),
    Problem("primes", "How many prime numbers are there between 1 and 500?", 95,
            "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))"
            "\nprint(sum(is_prime(n) for n in range(1, 501)))"),
    Problem("rectangle", "A rectangle has a perimeter of 96 cm and its length is three times its "
            "width. What is its area in square centimetres?", 432,
            "width = 96 / 2 / 4\nprint(round(width * 3 * width))"),
    Problem("committee", "In how many ways can a committee of 4 people be chosen from a group of "
            "12?", 495, "import math\nprint(math.comb(12, 4))"),
    Problem("power-mod", "What is the remainder when 7 to the power 2024 is divided by 1000?",
            401, "print(pow(7, 2024, 1000))"),
    Problem("farm", "A farm has chickens and cows: 50 heads and 140 legs in total. How many cows "
            "are there?", 20,
            "print(next(c for c in range(51) if 4 * c + 2 * (50 - c) == 140))"),
    Problem("digit-sum", "What is the sum of the digits of 2 to the power 100?", 115,
            "print(sum(int(d) for d in str(2**100)))"),
    Problem("lcm", "What is the least common multiple of 12, 18, 30 and 45?", 180,
            "import math\nprint(math.lcm(12, 18, 30, 45))"),
    Problem("jacket", "A $250 jacket is discounted by 20%, and then 8% sales tax is added to the "
            "discounted price. How many dollars does the customer pay?", 216,
            "print(round(250 * (1 - 0.20) * 1.08))"),
    Problem("squares-cubes", "How many integers from 1 to 10000 are perfect squares or perfect "
            "cubes (or both)?", 117,
            "squares = {k * k for k in range(1, 101)}\n"
            "cubes = {k ** 3 for k in range(1, 22)}\nprint(len(squares | cubes))"),
    Problem("ages", "Anna is 4 times as old as her son. In 20 years she will be twice as old as "
            "him. How old is Anna now?", 40,
            "print(next(4 * s for s in range(1, 100) if 4 * s + 20 == 2 * (s + 20)))"),
    Problem("prime-factor", "What is the largest prime factor of 600851475143?", 6857,
            "n, f, largest = 600851475143, 2, 1\nwhile n > 1:\n    while n % f == 0:\n"
            "        largest, n = f, n // f\n    f += 1\nprint(largest)"),
    Problem("ball", "A ball is dropped from a height of 128 m. Each time it hits the ground it "
            "bounces back up to half its previous height. How many metres has it travelled "
            "when it hits the ground for the 6th time?", 376,
            "height, total = 128, 128\nfor _ in range(5):\n    height /= 2\n"
            "    total += 2 * height\nprint(round(total))"),
    Problem("trailing-zeros", "How many zeros does 100 factorial (100!) end with?", 24,
            "import math\ns = str(math.factorial(100))\nprint(len(s) - len(s.rstrip('0')))"),
    Problem("grid-paths", "How many paths are there from the top-left to the bottom-right "
            "corner of a 10 by 10 grid of squares, moving only right or down along the grid "
            "lines?", 184756, "import math\nprint(math.comb(20, 10))"),
)


def builtin_tasks(max_steps: int = DEFAULT_MAX_STEPS) -> list[Task]:
    """The built-in problems as tasks (prompt = question + tool instruction)."""
    return [Task(task_id=f"python-{p.problem_id}", env="python", prompt=p.question + INSTRUCTION,
                 answer=str(p.answer), max_steps=max_steps, config={"solution": p.solution})
            for p in BUILTIN_PROBLEMS]


# ---------------------------------------------------------------------------
# User task files


def _task_from_row(row: dict[str, Any], where: str, default_max_steps: int) -> Task:
    prompt, answer = row.get("prompt"), row.get("answer")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: 'prompt' must be a non-empty string")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(f"{where}: 'answer' must be a string or a number, got {answer!r}")
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    task_id = row.get("task_id")
    if task_id is None:
        task_id = "python-" + hashlib.sha256(prompt.encode()).hexdigest()[:12]
    elif not isinstance(task_id, str):
        raise ValueError(f"{where}: 'task_id' must be a string")
    max_steps = row.get("max_steps", default_max_steps)
    if max_steps is None:
        max_steps = default_max_steps
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"{where}: 'max_steps' must be a positive integer")
    solution = row.get("solution")
    if solution is not None and not isinstance(solution, str):
        raise ValueError(f"{where}: 'solution' must be a string (Python code)")
    config = {"solution": solution} if solution else {}
    return Task(task_id=task_id, env="python", prompt=prompt, answer=str(answer),
                max_steps=max_steps, config=config)


def load_task_file(path: str | Path, max_steps: int = DEFAULT_MAX_STEPS) -> list[Task]:
    """Tasks from a ``.jsonl`` (one JSON object a line) or ``.parquet`` file.

    Columns: ``prompt`` (str) and ``answer`` (str or number) required; ``task_id``
    (default: a hash of the prompt), ``solution`` (reference code for the expert)
    and ``max_steps`` (default ``max_steps``) optional. Bad rows raise ``ValueError``
    naming the line or row.
    """
    path = Path(path)
    rows: list[tuple[str, Any]] = []
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        rows = [(f"{path}: row {i}", row) for i, row in enumerate(table.to_pylist())]
    elif path.suffix in (".jsonl", ".json", ".ndjson"):
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"{path}:{number}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not valid JSON: {exc.msg}") from None
    else:
        raise ValueError(f"unsupported task file {path}: use .jsonl or .parquet")
    tasks = []
    for where, row in rows:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object")
        tasks.append(_task_from_row(row, where, max_steps))
    if not tasks:
        raise ValueError(f"task file {path} holds no tasks")
    return tasks


# ---------------------------------------------------------------------------
# Answers

_NUMBER_RE = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d{1,3})?(?:/\d+)?")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d*)?")
_BOXED_RE = re.compile(r"\\boxed\{(.*)\}")


def parse_number(text: str) -> Fraction | None:
    """An answer's exact value, or None if it is not a number.

    Accepts integers, decimals (with an exponent up to 3 digits), ``p/q``,
    thousands separators (``1,000``), and strips ``\\boxed{}``, ``$`` and a
    trailing period. Longer than 100 characters is not a number (bounded work).
    """
    text = text.strip()
    boxed = _BOXED_RE.fullmatch(text)
    if boxed:
        text = boxed.group(1).strip()
    text = text.strip("$ ").removesuffix(".").strip()
    if len(text) > 100:
        return None
    if _THOUSANDS_RE.fullmatch(text):
        text = text.replace(",", "")
    if not _NUMBER_RE.fullmatch(text):
        return None
    try:
        if "/" in text:
            num, den = text.split("/")
            return Fraction(num) / Fraction(den)
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str, gold: str | None) -> bool:
    """Whether an ``<answer>`` text equals the gold answer (numbers by exact value)."""
    if gold is None:
        return False
    a, b = parse_number(predicted), parse_number(gold)
    if a is not None and b is not None:
        return a == b
    if a is not None or b is not None:
        return False

    def norm(s: str) -> str:
        return " ".join(s.split()).casefold()

    return norm(predicted) == norm(gold)
