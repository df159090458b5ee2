"""GPU check of the vLLM backend against the HF backend (issue 6; never run here: no GPU).

On a GPU machine, from the repository root: ``pip install 'rollout-trees[gpu]'`` then
``python scripts/gpu_check_vllm.py [CHECKPOINT]``. Exits non-zero if any check fails.
"""

from __future__ import annotations

import sys

import numpy as np

from train.policies import load_policy
from train.policies.base import STOP_STRINGS, SampleConfig
from train.policies.tiny_train import make_tasks
from train.sampling.evaluation import success_report


def main() -> int:
    ckpt = sys.argv[1] if len(sys.argv) > 1 else "train/policies/checkpoints/calc"
    failures: list[str] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}")
        if not ok:
            failures.append(name)

    hf = load_policy(f"hf:{ckpt}", "calc", device="cuda", dtype="float32")
    vl = load_policy(f"vllm:{ckpt}", "calc", dtype="float32", gpu_memory_utilization=0.3,
                     max_model_len=2048, seed=0)
    check("same policy_version", hf.policy_version == vl.policy_version,
          f"{hf.policy_version} {vl.policy_version}")
    tasks = make_tasks("calc", 32, seed=2_000_000)
    transcripts = [[("prompt", t.prompt)] for t in tasks]
    # 1. greedy agrees token for token
    greedy = SampleConfig(n=1, max_new_tokens=48, top_p=1e-9, seed=0)
    g_hf, g_vl = hf.sample(transcripts, greedy), vl.sample(transcripts, greedy)
    same = sum(a[0].token_ids == b[0].token_ids for a, b in zip(g_hf, g_vl, strict=True))
    check("greedy tokens equal", same >= 30, f"{same}/32")
    # 2. sampled logprobs and score agree with the HF backend's score
    conts = vl.sample(transcripts, SampleConfig(n=8, max_new_tokens=48, seed=1))
    pairs = [(t, c) for t, cs in zip(transcripts, conts, strict=True) for c in cs
             if hf.encode(c.text) == c.token_ids]  # type: ignore[attr-defined]
    s_hf = hf.score([t for t, _ in pairs], [c.text for _, c in pairs])
    s_vl = vl.score([t for t, _ in pairs], [c.text for _, c in pairs])
    d_sample = max(np.abs(np.array(c.logprobs) - s).max()
                   for (_, c), s in zip(pairs, s_hf, strict=True))
    d_score = max(np.abs(a - b).max() for a, b in zip(s_vl, s_hf, strict=True))
    check("vllm sample logprobs == hf score", d_sample < 1e-3, f"max diff {d_sample:.2e}")
    check("vllm score == hf score", d_score < 1e-3, f"max diff {d_score:.2e}")
    # 3. top-k entropies are lower bounds of the exact ones
    e_hf = hf.sample(transcripts[:4], SampleConfig(n=1, max_new_tokens=48, top_p=1e-9))
    e_vl = vl.sample(transcripts[:4], SampleConfig(n=1, max_new_tokens=48, top_p=1e-9))
    gap = min(np.min(np.array(a[0].entropies[:len(b[0].entropies)]) - np.array(b[0].entropies))
              for a, b in zip(e_hf, e_vl, strict=True) if a[0].token_ids == b[0].token_ids)
    check("topk entropy <= exact entropy", gap > -1e-3, f"min(exact - topk) {gap:.2e}")
    # 4. stop strings, shared prefill, distinct branches, prefix-cache hit
    bad = [c for cs in conts for c in cs
           if c.finished and not any(c.text.endswith(s) for s in STOP_STRINGS)]
    check("finished text ends with a stop string", not bad)
    first = [c.prefill_tokens for c in conts[0]]
    check("branches 2..n report 0 prefill", first[1:] == [0] * 7, str(first))
    check("the 8 branches are not all the same",
          len({tuple(c.token_ids) for c in conts[0]}) > 1)
    long = [*transcripts[0], ("action", g_hf[0][0].text),
            ("observation", "<tool_response>12345</tool_response>")]
    vl.sample([long], SampleConfig(n=2, max_new_tokens=8, seed=3))
    again = vl.sample([long], SampleConfig(n=2, max_new_tokens=8, seed=4))[0]
    prompt_len = len(hf.prompt_ids(long))  # type: ignore[attr-defined]
    check("prefix cache hit on a repeated transcript", again[0].prefill_tokens < prompt_len,
          f"{again[0].prefill_tokens} of {prompt_len} prompt tokens computed")
    # 5. the trained policy's sampled success through vLLM is in band
    report = success_report(vl, "calc", make_tasks("calc", 300, seed=2_000_000), seed=0)
    print("\n".join(report.lines()))
    check("vllm sampled success in 20-80%", 0.2 <= report.overall <= 0.8,
          f"{report.overall:.1%}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
