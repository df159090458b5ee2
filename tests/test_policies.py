"""Policy backends (issue 6): tiny tokenizer and model, HF sampling with shared-prefix
branching, scoring, stop strings, ``hf:PATH``, the tabular policy, ``load_policy``
errors, and the ``rtrees policy`` commands.

Real models and tokenizers throughout, no mocks. Where training is not the point the
tiny model has fresh random weights (fast); tests of trained behaviour use the
committed checkpoints (``train/policies/checkpoints/<env>``) and skip without them;
the test that trains is ``slow``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import random
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cli.main import app
from train.envs.calc import CalcEnv
from train.envs.sgls import render_prompt
from train.envs.sgls_worlds import WORLDS
from train.envs.workflow import WorkflowEnv
from train.envs.workflow_model import ACTION_TEXTS, ObsKey, WorkflowModel
from train.envs.workflow_policy import TabularPolicy
from train.policies import (
    PolicyRefError,
    PolicyUnavailableError,
    is_tiny_checkpoint,
    load_policy,
    load_policy_ref,
)
from train.policies.base import STOP_STRINGS, Policy, SampleConfig, Transcript
from train.policies.hf import HFPolicy, state_dict_version, weights_version
from train.policies.tabular import ACTION_VOCAB, TabularBackend, model_from_prompt
from train.policies.tiny import (
    CALC_CALL_PREFIX,
    CALC_CALL_SUFFIX,
    COMMITTED_DIR,
    PHRASE_TOKENS,
    SGLS_PHRASE_TOKENS,
    SGLS_TEXT_TOKENS,
    WORKFLOW_ACTION_TOKENS,
    build_tokenizer,
    committed_checkpoint,
    init_model,
    load_tiny_policy,
    random_tiny_policy,
    render,
    render_segments,
    save_checkpoint,
    warm_start_model,
)
from train.policies.tiny_train import encode_episode, expert_episode, make_tasks
from train.sampling.evaluation import rollout_rewards, success_report

GREEDY = 1e-9  # top_p this small keeps only the most likely token: greedy decoding
CALC_CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "(5-10)*19"}}</tool_call>'


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    torch.set_num_threads(2)  # the machine has 2 shared cores


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return build_tokenizer()


@pytest.fixture(scope="module")
def policy() -> HFPolicy:
    return random_tiny_policy(seed=0)


def calc_transcripts() -> list[Transcript]:
    """Three transcripts of different lengths (left padding is exercised)."""
    tasks = CalcEnv.generate_tasks(3, seed=0)
    return [
        [("prompt", tasks[0].prompt)],
        [("prompt", tasks[1].prompt), ("action", CALC_CALL),
         ("observation", "<tool_response>-95</tool_response>")],
        [("prompt", tasks[2].prompt), ("action", "<answer>7</answer"),
         ("observation", "<tool_response>error: expected <tool_call>{...}</tool_call> or "
                         "<answer>...</answer></tool_response>")],
    ]


def episode_texts() -> list[str]:
    """Rendered episodes of both environments with many mistakes (every phrase shows)."""
    rng = random.Random(0)
    texts = []
    for task in CalcEnv.generate_tasks(40, seed=1):
        texts.append(render(expert_episode("calc", task, rng, p_error=0.5).turns, False))
    for task in WorkflowEnv.generate_tasks(150, seed=1):
        env = WorkflowEnv()
        turns: list[tuple[str, str]] = [("prompt", env.reset(task))]
        done = False
        while not done:
            action = (rng.choice(env.valid_actions()) if rng.random() < 0.9
                      else rng.choice(["<answer>1</answer>", "fast"]))
            result = env.step(action)
            turns += [("action", action), ("observation", result.observation)]
            done = result.done
        texts.append(render(turns, False))  # type: ignore[arg-type]
    return texts


# ---------------------------------------------------------------------------
# Tokenizer and model


def test_tokenizer_round_trip_on_episodes(tokenizer) -> None:  # type: ignore[no-untyped-def]
    texts = episode_texts()
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert tokenizer.unk_token_id not in ids
    joined = "".join(texts)
    missing = [p for p in PHRASE_TOKENS if p not in joined]
    assert not missing, f"phrases that no longer occur in environment text: {missing}"


def test_boilerplate_is_single_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    for phrase in (CALC_CALL_PREFIX, CALC_CALL_SUFFIX, "<tool_response>", "</tool_response>",
                   "<answer>", "</answer>", *WORKFLOW_ACTION_TOKENS):
        assert len(tokenizer(phrase, add_special_tokens=False)["input_ids"]) == 1, phrase
    ids = tokenizer(CALC_CALL, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == [CALC_CALL_PREFIX, "(", "5", "-", "1", "0",
                                                    ")", "*", "1", "9", CALC_CALL_SUFFIX]
    assert tokenizer(ACTION_TEXTS["careful"], add_special_tokens=False)["input_ids"] == [
        tokenizer.convert_tokens_to_ids(ACTION_TEXTS["careful"])]
    # outside printable ASCII: <unk>, one per character
    assert tokenizer.decode(tokenizer("é€", add_special_tokens=False)["input_ids"]) == \
        "<unk><unk>"


def test_segments_tokenize_like_the_whole(tokenizer) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(3)
    for task in CalcEnv.generate_tasks(20, seed=3):
        episode = expert_episode("calc", task, rng, p_error=0.5)
        turns = episode.turns
        ids, is_action = encode_episode(tokenizer, turns)
        assert ids == tokenizer(render(turns, False), add_special_tokens=False)["input_ids"]
        actions = [text for role, text in turns if role == "action"]
        action_ids = [i for i, a in zip(ids, is_action, strict=True) if a]
        assert tokenizer.decode(action_ids) == "".join(actions)


def test_mistakes_can_be_left_out_of_the_loss(tokenizer) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(4)
    n_mistakes = 0
    for task in WorkflowEnv.generate_tasks(10, seed=4):
        episode = expert_episode("workflow", task, rng, p_error=0.5)
        actions = [text for role, text in episode.turns if role == "action"]
        assert len(actions) == len(episode.mistakes)
        n_mistakes += sum(episode.mistakes)
        ids, has_loss = encode_episode(tokenizer, episode.turns,
                                       [not m for m in episode.mistakes])
        trained = [i for i, loss in zip(ids, has_loss, strict=True) if loss]
        expected = [a for a, m in zip(actions, episode.mistakes, strict=True) if not m]
        assert tokenizer.decode(trained) == "".join(expected)  # one token per action
    assert n_mistakes > 5


def test_chat_template_renders_like_tiny(tokenizer, policy) -> None:  # type: ignore[no-untyped-def]
    for transcript in calc_transcripts():
        assert policy.render(transcript) == render(transcript)
        assert policy.render(transcript, add_generation_prompt=False) == render(transcript, False)
        assert "".join(p for p, _ in render_segments(transcript)) == render(transcript, False)


def test_piecewise_prompt_ids_equal_the_whole_transcript_tokenized() -> None:
    """The renderer's fast path (each message's ids cached, ``ChatRenderer.piecewise``)
    gives exactly the ids of the whole rendering tokenized at once, for every tiny
    tokenizer and both observation roles, on transcripts built from the tokenizers' own
    added tokens, pieces of role tokens and plain characters; another template never
    takes it."""
    from transformers import AutoTokenizer

    from train.policies.hf import ChatRenderer

    rng = random.Random(11)
    for env in ("calc", "workflow", "sgls"):
        tok = build_tokenizer(env)
        added = [str(t.content) for t in tok.added_tokens_decoder.values()]
        fragments = [*added, "<|", "|>", "<|user", "user|>", "<", ">", "|", " ", "\n",
                     "a", "7", "{", '"', "<tool_response>"]
        for role in ("user", "tool"):
            renderer = ChatRenderer(tok, observation_role=role)  # type: ignore[arg-type]
            assert renderer.piecewise
            for _ in range(150):
                transcript: Transcript = [("prompt", "".join(
                    rng.choice(fragments) for _ in range(rng.randint(0, 12))))]
                for _ in range(rng.randint(0, 4)):
                    transcript += [(kind, "".join(rng.choice(fragments) for _ in range(
                        rng.randint(0, 8)))) for kind in ("action", "observation")]
                expected = tok(renderer.render(transcript), add_special_tokens=False)
                assert renderer.prompt_ids(transcript) == expected["input_ids"]
                assert renderer.prompt_ids(transcript) == expected["input_ids"]  # cached
    other = build_tokenizer("calc")
    other.chat_template = other.chat_template.replace("<|assistant|>", "<|assistant|>\n")
    assert not ChatRenderer(other).piecewise
    assert not ChatRenderer(build_tokenizer("calc"), system="be brief").piecewise
    hf = AutoTokenizer.from_pretrained(COMMITTED_DIR / "calc")
    assert ChatRenderer(hf).piecewise


def test_save_pretrained_round_trip(tmp_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = init_model(tokenizer, seed=1)
    path = save_checkpoint(model, tokenizer, tmp_path / "ckpt", {"env": "calc", "seed": 1})
    model2 = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tokenizer2 = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert type(model2).__name__ == "LlamaForCausalLM"
    assert 0.7e6 < sum(p.numel() for p in model2.parameters()) < 1.0e6
    text = render(calc_transcripts()[1])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer2(text, add_special_tokens=False)["input_ids"] == ids
    assert tokenizer2.decode(ids) == text
    with torch.no_grad():
        a = model(input_ids=torch.tensor([ids])).logits
        b = model2(input_ids=torch.tensor([ids])).logits
    assert torch.equal(a, b)
    assert json.loads((path / "rtrees_policy.json").read_text())["seed"] == 1


# ---------------------------------------------------------------------------
# Sampling and scoring


def _greedy_by_recomputation(policy: HFPolicy, transcript: Transcript, steps: int) -> list[int]:
    """Greedy tokens with no cache at all: the whole prefix is recomputed every step."""
    ids = policy.prompt_ids(transcript)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = policy.model(input_ids=torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def test_shared_prefix_greedy_equals_recomputation(policy) -> None:  # type: ignore[no-untyped-def]
    transcripts = calc_transcripts()
    config = SampleConfig(n=4, max_new_tokens=12, top_p=GREEDY, seed=0)
    shared = policy.sample(transcripts, config)
    # every branch its own row, prefix and all, in one batch
    separate = policy.sample([t for t in transcripts for _ in range(4)],
                             SampleConfig(n=1, max_new_tokens=12, top_p=GREEDY, seed=0))
    for i, transcript in enumerate(transcripts):
        prompt_len = len(policy.prompt_ids(transcript))
        assert [c.prefill_tokens for c in shared[i]] == [prompt_len, 0, 0, 0]
        reference = _greedy_by_recomputation(policy, transcript, 12)
        for k in range(4):
            branch = shared[i][k]
            assert branch.token_ids == reference[:len(branch.token_ids)]
            assert branch.token_ids == separate[i * 4 + k][0].token_ids
            np.testing.assert_allclose(branch.logprobs, separate[i * 4 + k][0].logprobs,
                                       atol=1e-5)
            assert separate[i * 4 + k][0].prefill_tokens == prompt_len
        alone = policy.sample([transcript], config)[0]  # one row: no padding, no mask
        assert [c.token_ids for c in alone] == [c.token_ids for c in shared[i]]


def test_buffer_layer_holds_what_the_growing_cache_holds() -> None:
    """``BufferLayer`` (preallocated, written in place) against transformers'
    ``DynamicLayer`` (``torch.cat`` per update) through prefill, expansion, decode
    steps past the capacity, and row selection: the same keys and values, bit for bit."""
    from transformers.cache_utils import DynamicLayer

    from train.policies.hf import BufferLayer

    gen = torch.Generator().manual_seed(0)
    ours, theirs = BufferLayer(capacity=6), DynamicLayer()

    def both(k: torch.Tensor) -> None:
        got = ours.update(k, k + 1.0)
        want = theirs.update(k, k + 1.0)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    both(torch.randn(2, 3, 5, 4, generator=gen))
    ours.batch_repeat_interleave(3)
    theirs.batch_repeat_interleave(3)
    for step in range(9):  # runs past the capacity: the buffer grows
        both(torch.randn(6, 3, 1, 4, generator=gen))
        if step == 4:
            index = torch.tensor([5, 0, 2])
            ours.batch_select_indices(index)
            theirs.batch_select_indices(index)
            both(torch.randn(3, 3, 1, 4, generator=gen))
            break
    assert ours.get_seq_length() == theirs.get_seq_length() == 11


def test_lazy_compaction_changes_no_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding keeps finished rows in the batch until few are live
    (``hf.COMPACT_BELOW``, ``hf.FEW_ROWS``): the same tokens, logprobs and entropies, bit
    for bit, as compacting at every step where a row finishes (``COMPACT_BELOW = 1``).
    With one torch thread, the tiny model's setting (``auto_threads``); this module runs
    on two, where BLAS splits a product's rows over the threads by the batch size."""
    import train.policies.hf as hf

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _compare_compactions(monkeypatch, hf)
    finally:
        torch.set_num_threads(threads)


def _compare_compactions(monkeypatch: pytest.MonkeyPatch, hf: Any) -> None:
    policy = load_tiny_policy("calc", prefix_cache_mib=0)
    env = CalcEnv()
    transcripts: list[Transcript] = [[("prompt", env.reset(t))]
                                     for t in CalcEnv.generate_tasks(24, seed=5)]
    config = SampleConfig(n=4, max_new_tokens=48, seed=3)

    def draws() -> list[tuple[list[int], list[float], list[float]]]:
        return [(c.token_ids, c.logprobs, c.entropies)
                for conts in policy.sample(transcripts, config) for c in conts]

    lazy = draws()
    monkeypatch.setattr(hf.decode, "COMPACT_BELOW", 1.0)
    eager = draws()
    assert len({len(t) for t, _, _ in eager}) > 3  # rows finish at many different steps
    assert lazy == eager


def test_sample_logprobs_equal_score(policy) -> None:  # type: ignore[no-untyped-def]
    transcripts = calc_transcripts()
    samples = policy.sample(transcripts, SampleConfig(n=6, max_new_tokens=24, seed=5))
    pairs = [(t, c) for t, conts in zip(transcripts, samples, strict=True) for c in conts]
    scores = policy.score([t for t, _ in pairs], [c.text for _, c in pairs])
    canonical = 0
    log_vocab = math.log(len(policy.tokenizer))
    for (_, cont), score in zip(pairs, scores, strict=True):
        assert len(cont.token_ids) == len(cont.logprobs) == len(cont.entropies)
        assert all(0.0 <= e <= log_vocab + 1e-5 for e in cont.entropies)
        if policy.encode(cont.text) == cont.token_ids:  # canonical tokenization
            canonical += 1
            assert score.dtype == np.float64
            np.testing.assert_allclose(score, cont.logprobs, atol=1e-4)
    assert canonical >= len(pairs) // 2
    # a given action scores the same alone and in a batch
    alone = policy.score([transcripts[1]], [CALC_CALL])[0]
    batch = policy.score(transcripts, [CALC_CALL] * 3)[1]
    np.testing.assert_allclose(alone, batch, atol=1e-5)
    assert policy.score([transcripts[0]], [""])[0].shape == (0,)


def test_stop_strings_end_generation(policy) -> None:  # type: ignore[no-untyped-def]
    # random weights put ~5% of the mass on tokens that hold a stop string (or <eos>):
    # of 64 branches of up to 24 tokens, many stop and many run to the cap
    conts = policy.sample(calc_transcripts()[:1], SampleConfig(n=64, max_new_tokens=24,
                                                                seed=2))[0]
    stopped = [c for c in conts if c.finished]
    assert 5 <= len(stopped) <= 59
    for c in conts:
        hits = [s for s in STOP_STRINGS if s in c.text]
        if c.finished and c.token_ids[-1] == policy.tokenizer.eos_token_id:
            assert not hits and c.text == policy.tokenizer.decode(c.token_ids[:-1])
        elif c.finished:
            # the stop string is complete in the last token and nowhere earlier
            assert hits
            prefix = policy.tokenizer.decode(c.token_ids[:-1])
            assert not any(s in prefix for s in STOP_STRINGS)
        else:
            assert not hits and len(c.token_ids) == 24


def test_sampling_is_seeded(policy) -> None:  # type: ignore[no-untyped-def]
    config = SampleConfig(n=3, max_new_tokens=10, seed=11)
    a = policy.sample(calc_transcripts(), config)
    b = policy.sample(calc_transcripts(), config)
    assert [[c.token_ids for c in conts] for conts in a] == \
        [[c.token_ids for c in conts] for conts in b]
    assert isinstance(policy, Policy)


def test_hf_backend_on_saved_tiny_model(tmp_path: Path, policy) -> None:  # type: ignore[no-untyped-def]
    path = save_checkpoint(policy.model, policy.tokenizer, tmp_path / "tiny",
                           {"env": "calc", "seed": 0})
    hf = load_policy(f"hf:{path}", "calc", device="cpu")
    assert isinstance(hf, HFPolicy)
    digest = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()[:12]
    assert hf.policy_version == digest
    assert hf.policy_ref == str(path.resolve())
    transcripts = calc_transcripts()
    config = SampleConfig(n=2, max_new_tokens=10, top_p=GREEDY, seed=0)
    a, b = policy.sample(transcripts, config), hf.sample(transcripts, config)
    for ca, cb in zip(a, b, strict=True):
        assert [c.token_ids for c in ca] == [c.token_ids for c in cb]
        np.testing.assert_allclose(ca[0].logprobs, cb[0].logprobs, atol=1e-5)
    np.testing.assert_allclose(hf.score(transcripts, [CALC_CALL] * 3)[2],
                               policy.score(transcripts, [CALC_CALL] * 3)[2], atol=1e-5)
    # observations as tool messages: the env's wrapper is removed, the template adds none
    as_tool = load_policy(f"hf:{path}", "calc", device="cpu", observation_role="tool")
    assert "<|tool|>-95<|assistant|>" in as_tool.render(transcripts[1])  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------
# Trained checkpoints (committed)


def _committed(env: str) -> Path:
    path = committed_checkpoint(env, 0)
    if path is None:
        pytest.skip(f"no committed {env} checkpoint under {COMMITTED_DIR}")
    return path


def test_trained_calc_policy_calls_the_tool_and_stops() -> None:
    path = _committed("calc")
    trained = load_policy("tiny", "calc", checkpoint=path)
    task = make_tasks("calc", 1, seed=2_000_001)[0]
    cont = trained.sample([[("prompt", task.prompt)]],
                          SampleConfig(n=1, max_new_tokens=48, top_p=GREEDY))[0][0]
    assert cont.finished and cont.text.startswith(CALC_CALL_PREFIX)
    assert cont.text.endswith("</tool_call>") and len(cont.token_ids) < 48


@pytest.mark.parametrize("env", ["calc", "workflow"])
def test_trained_policy_success_in_band(env: str) -> None:
    path = _committed(env)
    trained = load_policy("tiny", env, checkpoint=path)
    tasks = make_tasks(env, 90, seed=3_000_000)
    report = success_report(trained, env, tasks, seed=0, max_new_tokens=48)
    assert 0.2 <= report.overall <= 0.8, report.lines()


# ---------------------------------------------------------------------------
# Tabular


def _skewed_policy(task_seed: int = 0) -> TabularPolicy:
    task = WorkflowEnv.generate_tasks(1, seed=task_seed)[0]
    policy = TabularPolicy(WorkflowModel.from_config(task.config))
    policy.set_logits(ObsKey(0, 0, False), {"fast": 1.5, "careful": -0.5, "skip": 0.2})
    policy.set_logits(ObsKey(0, 1, True), {"repair": 2.0, "skip": -1.0})
    return policy


def test_tabular_probabilities_are_exact() -> None:
    table = _skewed_policy()
    backend = TabularBackend([table])
    model = table.model
    prompt = model.prompt()
    transcripts: list[Transcript] = [[("prompt", prompt)]]
    broken = ("<tool_response>fast on 'x': failure. The stage is broken.\n"
              + model.state_text(ObsKey(0, 1, True)) + "</tool_response>")
    transcripts.append([("prompt", prompt), ("action", ACTION_TEXTS["fast"]),
                        ("observation", broken)])
    for transcript, key in zip(transcripts, [ObsKey(0, 0, False), ObsKey(0, 1, True)],
                               strict=True):
        actions = model.valid_actions(key)
        scores = backend.score([transcript] * len(actions), actions)
        for action, score in zip(actions, scores, strict=True):
            assert score.tolist() == [table.log_prob(key, action)]
        conts = backend.sample([transcript], SampleConfig(n=4000, seed=1))[0]
        assert all(c.entropies == [table.entropy(key)] for c in conts)
        assert all(c.token_ids == [ACTION_VOCAB.index(c.text)] for c in conts)
        assert all(c.logprobs == [table.log_prob(key, c.text)] for c in conts)
        counts = Counter(c.text for c in conts)
        for action, p in zip(actions, table.probs(key), strict=True):
            assert abs(counts[action] / 4000 - p) < 0.03, (action, counts[action], p)
    invalid = backend.score(transcripts[1:], [ACTION_TEXTS["fast"]])[0]
    assert invalid.tolist() == [-math.inf]
    assert backend.policy_version.startswith("tabular-")
    assert backend.policy_version != TabularBackend().policy_version


def test_tabular_uniform_rollouts_match_exact_values() -> None:
    """End to end through ``rollout_rewards``: the uniform tabular policy's success
    over 400 tasks matches the mean of its exact values V(s0)."""
    tasks = WorkflowEnv.generate_tasks(400, seed=7, horizons=(6,))
    exact = np.mean([TabularPolicy(WorkflowModel.from_config(t.config)).values()
                     .v(WorkflowModel.from_config(t.config).initial_state()) for t in tasks])
    rewards = rollout_rewards(load_policy("tabular", "workflow"), "workflow", tasks, seed=3)
    assert abs(np.mean(rewards) - exact) < 4 * math.sqrt(exact * (1 - exact) / len(tasks))


def test_model_from_prompt_matches_the_task() -> None:
    for task in WorkflowEnv.generate_tasks(20, seed=4):
        model = WorkflowModel.from_config(task.config)
        parsed = model_from_prompt(task.prompt)
        assert parsed.prompt() == task.prompt
        assert parsed.required == model.required
    with pytest.raises(ValueError, match="not a workflow prompt"):
        model_from_prompt("Compute 1+2.")


def test_tabular_rejects_finished_episodes() -> None:
    backend = TabularBackend()
    prompt = WorkflowEnv.generate_tasks(1, seed=0)[0].prompt
    done = [("prompt", prompt), ("action", ACTION_TEXTS["fast"]),
            ("observation", "<tool_response>x\nWorkflow complete. Reward 1.</tool_response>")]
    with pytest.raises(ValueError, match="no workflow state"):
        backend.sample([done], SampleConfig())  # type: ignore[list-item]


# ---------------------------------------------------------------------------
# load_policy and the command line


def test_load_policy_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown policy spec"):
        load_policy("gpt", "calc")
    with pytest.raises(ValueError, match="needs a checkpoint path"):
        load_policy("hf:", "calc")
    with pytest.raises(ValueError, match="unknown environment"):
        load_policy("tiny", "chess")
    with pytest.raises(ValueError, match="workflow environment only"):
        load_policy("tabular", "calc")
    with pytest.raises(FileNotFoundError):
        load_policy(f"hf:{tmp_path}", "calc")
    monkeypatch.setenv("RTREES_CACHE_DIR", str(tmp_path))
    with pytest.raises(PolicyUnavailableError, match="rtrees policy init --env calc --seed 9"):
        load_policy("tiny", "calc", seed=9)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_missing_is_a_clear_error(tmp_path: Path) -> None:
    import train.policies.vllm_backend  # noqa: F401  (imports without vllm)

    with pytest.raises(PolicyUnavailableError, match=r"pip install 'rollout-trees\[gpu\]'"):
        load_policy(f"vllm:{tmp_path}", "calc")


def test_cli_policy_info_tabular() -> None:
    result = CliRunner().invoke(app, ["policy", "info", "--env", "workflow",
                                      "--policy", "tabular", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["backend"] == "TabularBackend" and data["action_vocab"] == list(ACTION_VOCAB)


def test_cli_policy_info_missing_checkpoint(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RTREES_CACHE_DIR", str(tmp_path))
    result = CliRunner().invoke(app, ["policy", "info", "--env", "calc", "--seed", "5"])
    assert result.exit_code == 1
    assert "rtrees policy init --env calc --seed 5" in result.output


def test_cli_policy_init_reuses_a_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "calc"
    shutil.copytree(_committed("calc"), out)
    result = CliRunner().invoke(app, ["policy", "init", "--env", "calc", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "reusing the checkpoint" in result.output
    assert "difficulty 1:" in result.output and "difficulty 2:" in result.output
    assert "(in the 20%-80% target band)" in result.output
    info = CliRunner().invoke(app, ["policy", "info", "--env", "calc", "--policy", f"hf:{out}"])
    assert info.exit_code == 0 and "policy_version" in info.output


def test_policy_init_task_params_reach_every_split_and_need_out(tmp_path: Path) -> None:
    """``--task-param`` sets the generator's options of the SFT data and of the check and
    test tasks (calc ``one_op``: one-operation episodes of the expert); a bad option or a
    missing ``--out`` is one line before anything trains."""
    tasks = make_tasks("calc", 5, seed=3, one_op=True)
    assert all(t.config["one_op"] and t.max_steps == t.config["difficulty"] + 1
               for t in tasks)
    episode = expert_episode("calc", tasks[0], random.Random(0), p_error=0.0)
    calls = [text for role, text in episode.turns if role == "action"][:-1]
    assert len(calls) == tasks[0].config["difficulty"]  # one call per operation
    runner = CliRunner()
    for args, message in [
            ([], "needs --out"), (["--out", str(tmp_path / "p")], "unknown calc task option"),
    ]:
        bad = "one_op=true" if not args else "bogus=1"
        result = runner.invoke(app, ["policy", "init", "--env", "calc", "--task-param", bad,
                                     *args])
        assert result.exit_code == 2 and message in result.output, result.output
        assert "Traceback" not in result.output
    assert not (tmp_path / "p").exists()


@pytest.mark.slow
@pytest.mark.parametrize("env", ["calc", "workflow"])
def test_cli_policy_init_trains_into_band(tmp_path: Path, env: str) -> None:
    """The real thing: SFT from scratch (a few minutes on 2 cores)."""
    result = CliRunner().invoke(app, ["policy", "init", "--env", env, "--seed", "1",
                                      "--out", str(tmp_path / env), "--minutes", "10"])
    print(result.output)  # the per-group numbers, shown with -s
    assert result.exit_code == 0, result.output
    assert "(in the 20%-80% target band)" in result.output, result.output
    trained = load_policy("tiny", env, checkpoint=tmp_path / env)
    assert trained.policy_ref == str((tmp_path / env).resolve())


# ---------------------------------------------------------------------------
# Stored policy_ref: reload the exact weights that made a tree (issue 10 item 1)


def test_policy_ref_resolver(tmp_path: Path, policy) -> None:  # type: ignore[no-untyped-def]
    # A tiny checkpoint directory (what the tiny backend records as policy_ref) reloads
    # as tiny, with exactly its weights; so does a trainer-style checkpoint carrying
    # rtrees_policy.json with its policy_version.
    tiny_dir = save_checkpoint(policy.model, policy.tokenizer, tmp_path / "tiny",
                               {"env": "calc", "seed": 0})
    assert is_tiny_checkpoint(tiny_dir)
    loaded = load_policy(str(tiny_dir), "calc", device="cpu")  # the stored ref as a spec
    assert loaded.policy_ref == str(tiny_dir.resolve())
    assert loaded.policy_version == weights_version(tiny_dir)
    again = load_policy_ref(loaded.policy_ref, "calc", version=loaded.policy_version,
                            device="cpu")
    assert again.policy_version == loaded.policy_version
    for a, b in zip(policy.model.state_dict().values(),
                    again.model.state_dict().values(), strict=True):  # type: ignore[attr-defined]
        assert torch.equal(a, b)
    # (the version is recomputed from the weights, never taken from the file on trust)
    run_version = f"run-a-{state_dict_version(policy.model)}"
    trainer_dir = save_checkpoint(policy.model, policy.tokenizer, tmp_path / "step-3",
                                  {"env": "calc", "policy_version": run_version})
    assert load_policy_ref(str(trainer_dir), "calc", version=run_version,
                           device="cpu").policy_version == run_version
    label_dir = save_checkpoint(policy.model, policy.tokenizer, tmp_path / "step-4",
                                {"env": "calc", "policy_version": "run-a/v4"})
    with pytest.raises(PolicyRefError, match="the weights hash to"):
        load_policy_ref(str(label_dir), "calc", version="run-a/v4", device="cpu")
    # A non-tiny HF checkpoint (another chat template) reloads as hf:PATH with env tools.
    other = tmp_path / "hf"
    shutil.copytree(tiny_dir, other)
    (other / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    with pytest.raises(PolicyRefError, match=r"chat_template\.jinja does not match"):
        load_policy_ref(str(other), "calc", device="cpu")  # an edited rtrees checkpoint
    (other / "rtrees_policy.json").unlink()  # a plain HF directory
    assert not is_tiny_checkpoint(other)
    hf = load_policy_ref(str(other), "calc", device="cpu")
    assert isinstance(hf, HFPolicy) and hf.renderer.tools  # the hf:PATH default
    # Specs pass through; tabular records "tabular" while its policies are uniform.
    tab = TabularBackend()
    assert tab.policy_ref == "tabular"
    assert load_policy_ref("tabular", "workflow", version=tab.policy_version
                           ).policy_version == tab.policy_version
    assert TabularBackend([_skewed_policy()]).policy_ref is None
    # Named errors: other weights now, a rotated-away checkpoint, not a checkpoint.
    with pytest.raises(PolicyRefError, match=r"now loads policy version .* not the 'v-old'"):
        load_policy_ref(str(tiny_dir), "calc", version="v-old", device="cpu")
    with pytest.raises(PolicyRefError, match=r"\(policy version 'run-a/v1'\) does not exist"):
        load_policy_ref(str(tmp_path / "step-1"), "calc", version="run-a/v1")
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        load_policy_ref(str(tmp_path), "calc")


@pytest.mark.slow
def test_cli_audit_ranking_default_policy_on_a_fresh_tiny_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The default path: collect with the tiny policy, credit, audit WITHOUT --policy, so
    # the reference rollouts reload each tree's stored policy_ref (the committed checkpoint).
    _committed("calc")
    monkeypatch.setenv("RTREES_CACHE_DIR", str(tmp_path / "cache"))
    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    steps = [["collect", "--store", store, "--env", "calc", "--policy", "tiny", "--sampler",
              "random", "--tasks", "3", "--n-total", "6", "--no-progress"],
             ["credit", "--store", store, "--method", "grpo"],
             ["audit", "ranking", "--store", store, "--methods", "grpo", "--k", "2",
              "--out", out, "--bootstrap", "20"]]
    for args in steps:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, (args[0], result.output)
    from rollout_store import Store, connect

    con = connect(Store(store))
    refs, trees = con.sql("SELECT count(*), count(DISTINCT r.policy_version) FROM "
                          "mc_references r JOIN trees t USING (tree_id) "
                          "WHERE r.policy_version = t.policy_version").fetchall()[0]
    assert refs > 0 and trees == 1
    assert con.sql("SELECT DISTINCT policy_ref FROM trees").fetchall() == [
        (str(COMMITTED_DIR / "calc"),)]
    assert (Path(out) / "report.md").is_file()


# ---------------------------------------------------------------------------
# sgls: the tokenizer with the sgls phrases, and the committed checkpoint


def _sgls_episodes(n: int, seed: int, p_error: float = 0.5) -> list[Transcript]:
    """Noisy-expert sgls episodes (``p_error``: the chance of one detour per episode)."""
    rng = random.Random(seed)
    return [expert_episode("sgls", task, rng, p_error).turns
            for task in make_tasks("sgls", n, seed)]


def test_sgls_tokenizer_extends_the_shared_one() -> None:
    shared, sgls = build_tokenizer(), build_tokenizer("sgls")
    vocab = sgls.get_vocab()
    assert {t: i for t, i in vocab.items() if i < len(shared)} == shared.get_vocab()
    assert len(sgls) == len(shared) + len(SGLS_PHRASE_TOKENS)
    turns = _sgls_episodes(60, seed=5)
    texts = [render(t, False) for t in turns]
    for episode, text in zip(turns, texts, strict=True):
        ids, is_action = encode_episode(sgls, episode)
        assert ids == sgls(text, add_special_tokens=False)["input_ids"]
        assert sgls.decode(ids) == text and sgls.unk_token_id not in ids
        actions = "".join(a for role, a in episode if role == "action")
        assert sgls.decode([i for i, a in zip(ids, is_action, strict=True) if a]) == actions
        assert len(ids) < 2048  # fits the model's positions
    joined = "".join(texts)
    # the fixed text (schema blocks, questions, replies, the calls the expert makes) still
    # occurs in episodes; JSON-key variants and calls of other tools may go unused
    fixed = [*SGLS_TEXT_TOKENS, *(render_prompt(w, "") for w in WORLDS.values()),
             *(f'<tool_call>{{"name": "{c["name"]}", "arguments": {{'
               for task in make_tasks("sgls", 60, 5) for step in task.config["gold"]
               for c in step)]
    assert [p for p in fixed if p not in joined] == []
    assert set(fixed) <= set(SGLS_PHRASE_TOKENS)
    # the whole prompt after the question is one token
    prompt = turns[0][0][1]
    assert len(sgls(prompt, add_special_tokens=False)["input_ids"]) < len(prompt) // 4


def test_sgls_demonstrations_recover_from_detours() -> None:
    from train.envs.sgls import SglsEnv

    rng = random.Random(7)
    n_detours = 0
    for task in make_tasks("sgls", 40, seed=7):
        episode = expert_episode("sgls", task, rng, p_error=0.5)
        n_detours += sum(episode.mistakes)
        assert sum(episode.mistakes) <= 1
        env = SglsEnv()
        env.reset(task)
        result = None
        for role, text in episode.turns[1:]:
            if role == "action":
                result = env.step(text)
        assert result is not None and result.reward_parts["success"] == 1.0
    assert n_detours >= 10


def test_trained_sgls_policy_loads_and_calls_a_tool(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = _committed("sgls")
    monkeypatch.setenv("RTREES_CACHE_DIR", str(tmp_path))  # no cached one: the committed
    trained = load_policy("tiny", "sgls")
    assert trained.policy_ref is not None
    assert Path(trained.policy_ref).resolve() == path.resolve()
    task = make_tasks("sgls", 1, seed=2_000_001)[0]
    cont = trained.sample([[("prompt", task.prompt)]],
                          SampleConfig(n=1, max_new_tokens=64, top_p=GREEDY))[0][0]
    assert cont.finished and cont.text.startswith("<tool_call>{")


@pytest.mark.slow
def test_trained_sgls_policy_success_in_band() -> None:
    trained = load_policy("tiny", "sgls", checkpoint=_committed("sgls"))
    tasks = make_tasks("sgls", 100, seed=3_000_000)
    report = success_report(trained, "sgls", tasks, seed=0, max_new_tokens=64)
    assert 0.2 <= report.overall <= 0.8, report.lines()


def test_warm_start_keeps_the_source_policy_and_grows_its_vocabulary(tmp_path: Path) -> None:
    """sgls SFT starts from the calc policy (``SFTConfig.init_from``): the shared tokens keep
    their embeddings, so on calc text the old tokens' logits are the calc policy's."""
    from transformers import AutoModelForCausalLM

    calc_path = _committed("calc")
    sgls_tokenizer = build_tokenizer("sgls")
    model = warm_start_model(sgls_tokenizer, calc_path, seed=3)
    source = AutoModelForCausalLM.from_pretrained(str(calc_path)).eval()
    n_old = len(build_tokenizer("calc"))
    assert model.get_input_embeddings().weight.shape[0] == len(sgls_tokenizer) > n_old
    ids = sgls_tokenizer(make_tasks("calc", 1, seed=4)[0].prompt, return_tensors="pt")
    with torch.no_grad():
        new = model(**ids).logits[..., :n_old]
        old = source(**ids).logits
    torch.testing.assert_close(new, old)
    again = warm_start_model(sgls_tokenizer, calc_path, seed=3)
    assert torch.equal(again.get_input_embeddings().weight, model.get_input_embeddings().weight)
    # a source whose vocabulary is not a prefix of the target's is refused
    bigger = tmp_path / "sgls-random"
    init_model(sgls_tokenizer).save_pretrained(bigger)
    sgls_tokenizer.save_pretrained(bigger)
    with pytest.raises(ValueError, match="not a prefix"):
        warm_start_model(build_tokenizer("calc"), bigger)


def test_cli_policy_init_refuses_an_unwritable_out_before_training(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = CliRunner().invoke(app, ["policy", "init", "--env", "calc", "--force",
                                      "--out", str(blocker / "ckpt")])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: cannot write the checkpoint to")
    assert "episodes" not in result.output  # nothing was trained


def test_a_policy_directory_that_does_not_exist_is_named_without_the_policy_ref_hint(
        tmp_path: Path) -> None:
    """A spec naming a missing directory is a typo, not a rotated-away checkpoint of stored
    trees: the message says so and does not suggest --policy (which the user just gave)."""
    with pytest.raises(FileNotFoundError) as info:
        load_policy(str(tmp_path / "gone"), "calc")
    assert str(info.value) == (f"no such directory {str(tmp_path / 'gone')!r} (a policy is "
                               "tiny, tiny:ENV, hf:PATH, vllm:PATH, tabular, or a checkpoint "
                               "directory)")
