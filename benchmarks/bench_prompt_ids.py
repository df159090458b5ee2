"""Prompt token ids of growing transcripts: each message's ids cached against the whole
transcript rendered and tokenized at every step.

Every agent step needs the token ids of its whole transcript (``ChatRenderer.prompt_ids``:
sampling, the trainer's sequences, scoring). Rendering the chat template and tokenizing
the result at each step costs time linear in the transcript, so quadratic over an
episode; in a profile of a workflow training iteration (H = 18) it was about a quarter
of the sampling time. With the tiny policy's template (``ROLE_CONCAT_TEMPLATE``) the ids
are the concatenation of each message's ids, which the renderer caches
(``ChatRenderer.piecewise``).

Data: the prompts of every step of ``--tasks`` expert workflow episodes (``--horizon``,
30% mistakes, ``tiny_train.expert_episode``), in episode order, as the engine asks for
them. Timed alternately ``--repeat`` times, each with a fresh renderer (cold cache):
(a) ``encode(render(transcript))`` per prompt, (b) ``prompt_ids`` (the fast path). Both
must give the same ids. Informational: no target.

    .venv/bin/python benchmarks/bench_prompt_ids.py [--tasks 64 --horizon 18 --repeat 5]
"""

from __future__ import annotations

import argparse
import random
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import Timings, print_timings, timed

from train.envs.workflow import WorkflowEnv
from train.policies.base import Transcript
from train.policies.hf import ChatRenderer
from train.policies.tiny import build_tokenizer
from train.policies.tiny_train import expert_episode


def step_prompts(n_tasks: int, horizon: int, seed: int) -> list[Transcript]:
    """The transcript of every step of ``n_tasks`` expert episodes, in episode order."""
    rng = random.Random(seed)
    prompts: list[Transcript] = []
    for task in WorkflowEnv.generate_tasks(n_tasks, seed=seed, horizons=(horizon,)):
        turns = list(expert_episode("workflow", task, rng, p_error=0.3).turns)
        prompts += [turns[:end] for end in range(1, len(turns) + 1)
                    if turns[end - 1][0] != "action"]
    return prompts


def rendered_ids(renderer: ChatRenderer, prompts: list[Transcript]) -> list[list[int]]:
    return [renderer.encode(renderer.render(p)) for p in prompts]


def fast_ids(renderer: ChatRenderer, prompts: list[Transcript]) -> list[list[int]]:
    return [renderer.prompt_ids(p) for p in prompts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--horizon", type=int, default=18)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    for name in ("tasks", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    tokenizer = build_tokenizer("workflow")
    try:
        prompts = step_prompts(args.tasks, args.horizon, seed=1)
    except ValueError as exc:  # the task generator names a bad horizon
        ap.error(f"--horizon {args.horizon}: {exc}")
    tokens = sum(len(ChatRenderer(tokenizer).prompt_ids(p)) for p in prompts)
    print(f"{len(prompts)} step prompts of {args.tasks} workflow episodes (H = {args.horizon}),"
          f" {tokens / len(prompts):.0f} tokens each on average")
    whole, piecewise = Timings("render + tokenize each prompt"), Timings("piecewise (cached)")
    expected = [ChatRenderer(tokenizer).encode(ChatRenderer(tokenizer).render(p))
                for p in prompts]
    for _ in range(args.repeat):
        whole.seconds.append(timed(partial(rendered_ids, ChatRenderer(tokenizer), prompts)))
        fresh = ChatRenderer(tokenizer)  # a cold cache each time
        assert fresh.piecewise
        piecewise.seconds.append(timed(partial(fast_ids, fresh, prompts)))
        if fast_ids(fresh, prompts) != expected:
            raise SystemExit("piecewise ids differ from the whole transcript tokenized")
    print_timings([whole, piecewise], whole)
    print(f"ratio (min): {whole.min / piecewise.min:.1f}x faster per prompt "
          f"({whole.min / len(prompts) * 1e3:.3f} -> {piecewise.min / len(prompts) * 1e3:.3f} "
          "ms)")


if __name__ == "__main__":
    main()
