"""``TreeLoggerCallback`` on a real two-step TRL ``GRPOTrainer`` run of the tiny calc
policy (the committed checkpoint, an ordinary HF directory; no model hub), then
``rtrees credit``, ``rtrees audit ranking`` and the viewer on the store it wrote.

Needs the ``trl`` extra (``pip install 'rollout-trees[trl]'``); skipped without it.
"""

from __future__ import annotations

import json
import math
import urllib.request
from typing import Any

import pytest

trl = pytest.importorskip("trl", reason="TRL is not installed (the optional extra `trl`: "
                                        "pip install 'rollout-trees[trl]')")

import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from analysis import ViewerData, start  # noqa: E402
from cli.main import app  # noqa: E402
from rollout_store import Store, connect, read_trees  # noqa: E402
from train import TreeLoggerCallback  # noqa: E402
from train.envs import env_class  # noqa: E402
from train.policies import find_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow  # ~25-40 s on the 2-core machine (TRL import and setup)

G, PROMPTS, MAX_LEN = 4, 2, 12


def _answer(text: str) -> float:
    return 1.0 if "<answer>" in text else 0.0


def _rewards(completion_ids: list[list[int]], tok: Any) -> tuple[list[float], list[float]]:
    texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
    return [_answer(t) for t in texts], [-len(ids) / MAX_LEN for ids in completion_ids]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(0)
    tmp = tmp_path_factory.mktemp("trl")
    ckpt = find_checkpoint("calc", 0)
    assert ckpt is not None
    tok = AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True,
                                                 dtype=torch.float32)

    def answer(completion_ids: list[list[int]], **_: Any) -> list[float]:
        return _rewards(completion_ids, tok)[0]

    def brevity(completion_ids: list[list[int]], **_: Any) -> list[float]:
        return _rewards(completion_ids, tok)[1]

    tasks = env_class("calc").generate_tasks(PROMPTS, seed=0)
    rows = [{"prompt": [{"role": "user", "content": t.prompt}]} for t in tasks]
    config = GRPOConfig(
        output_dir=str(tmp / "out"), per_device_train_batch_size=PROMPTS * G,
        gradient_accumulation_steps=1, num_generations=G, max_completion_length=MAX_LEN,
        max_steps=2, learning_rate=1e-3, beta=0.0, bf16=False, use_cpu=True,
        gradient_checkpointing=False, save_strategy="no", report_to="none",
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, seed=0,
        reward_weights=[1.0, 0.5])
    trainer = GRPOTrainer(model=model, reward_funcs=[answer, brevity], args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=tok)
    trainer.remove_callback(PrinterCallback)
    store = tmp / "trees"
    callback = TreeLoggerCallback(store, run_id="trl-test").attach(trainer)
    trainer.train()
    return {"store": store, "tmp": tmp, "tok": tok, "ckpt": ckpt, "callback": callback,
            "trees": read_trees(Store(store))}


def test_every_group_is_a_tree_with_tokens_rewards_and_versions(run: dict[str, Any]) -> None:
    trees, tok = run["trees"], run["tok"]
    assert len(trees) == 2 * PROMPTS  # two steps, PROMPTS groups each
    assert sorted({t.policy_version for t in trees}) == ["trl-test:step-0", "trl-test:step-1"]
    assert run["callback"].logger.report.trees == len(trees)
    for t in trees:
        root = t.root()
        assert root.kind == "prompt" and root.observation_token_ids
        assert "Compute" in root.observation_text and t.meta is not None
        leaves = t.leaves()
        assert len(leaves) == G and all(n.terminal and n.parent_id == 0 for n in leaves)
        ids = [n.action_token_ids for n in leaves]
        assert all(0 < len(i) <= MAX_LEN for i in ids)
        answer, brevity = _rewards(ids, tok)
        for n, a, b in zip(leaves, answer, brevity, strict=True):
            assert n.reward_parts == pytest.approx({"answer": a, "brevity": b})
            assert n.reward == pytest.approx(a + 0.5 * b)  # TRL's reward_weights
            assert len(n.action_logprobs) == len(n.action_token_ids) \
                == len(n.action_entropies)
            assert all(lp <= 1e-6 for lp in n.action_logprobs)
            assert n.action_text == tok.decode(n.action_token_ids, skip_special_tokens=True)


def test_logprobs_are_the_sampling_policys(run: dict[str, Any]) -> None:
    """Step-0 trees were sampled by the checkpoint itself: a fresh forward of it gives
    the stored log pi of every sampled token (temperature 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run["ckpt"], local_files_only=True,
                                                 dtype=torch.float32).eval()
    checked = 0
    for t in run["trees"]:
        if t.policy_version != "trl-test:step-0":
            continue
        prompt = t.root().observation_token_ids
        for n in t.leaves():
            ids = torch.tensor([prompt + n.action_token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1:-1]
            lp = torch.log_softmax(logits, -1).gather(
                1, torch.tensor(n.action_token_ids)[:, None])[:, 0]
            # stored to ~4 significant digits (rollout_store/precision.py); a padded batch
            # and a single row also differ in float summation order
            assert lp.tolist() == pytest.approx(n.action_logprobs, rel=5e-4, abs=1e-4)
            checked += 1
    assert checked == PROMPTS * G


def test_advantages_are_trls(run: dict[str, Any]) -> None:
    """The stored source_advantage of each leaf is TRL's group-scaled advantage of the
    stored rewards: (r - mean) / (std + 1e-4), std unbiased (``scale_rewards="group"``)."""
    con = connect(Store(run["store"]))
    got = {(t, n): v for t, n, v in con.execute(
        "SELECT tree_id, node_id, value FROM credits WHERE method = 'source_advantage'"
    ).fetchall()}
    assert len(got) == 2 * PROMPTS * G
    for t in run["trees"]:
        r = [n.reward for n in t.leaves()]
        mean = sum(r) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G - 1))
        for n in t.leaves():
            assert got[(t.tree_id, n.node_id)] == pytest.approx(
                (n.reward - mean) / (std + 1e-4), abs=1e-4)


def test_credit_audit_and_viewer_open_the_store(run: dict[str, Any]) -> None:
    store, out = run["store"], run["tmp"] / "audit"
    runner = CliRunner()
    res = runner.invoke(app, ["credit", "--store", str(store), "--method", "grpo"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["audit", "ranking", "--store", str(store), "--methods",
                              "source_advantage,grpo", "--k", "1", "--bootstrap", "50",
                              "--success-threshold", "0.5", "--out", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads((out / "results.json").read_text())
    assert "source_advantage" in res.output and "grpo" in res.output
    assert result and (out / "report.md").is_file()

    tree_id = run["trees"][0].tree_id
    page = ViewerData(store).tree(tree_id)
    leaves = [n for n in page["nodes"] if n["terminal"]]
    assert len(leaves) == G and all(n["tokens"]["logprob"] for n in leaves)
    server, thread = start(store)
    try:
        req = urllib.request.Request(server.url + f"api/tree?id={tree_id}", headers={
            "Cookie": f"{server.cookie_name}={server.access_token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = json.loads(r.read().decode())
        assert r.status == 200 and len(body["nodes"]) == G + 1
    finally:
        server.shutdown()
        thread.join(timeout=10)
