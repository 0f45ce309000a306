"""On-policy distillation: the per-token reverse KL (full vocabulary and top-k) against plain-torch loops
over unpacked rows, the teacher's distributions against a plain forward of the teacher, and the loss
alone (``actor.loss=distill``) and added to an RL loss (``actor.distill_coef``) in the actor and trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relayrl.api.config import ActorConfig, ConfigError, ModelConfig, RunConfig, TrainEngineConfig, load_config
from relayrl.data.models import load_model
from relayrl.train import algorithms as A
from relayrl.train.actor import PPOActor
from relayrl.train.algorithms import distill_loss
from relayrl.train.distill import reverse_kl, teacher_targets, token_reverse_kl
from relayrl.train.engine import TorchTrainEngine

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
V = 11


def packed_case(seed: int, temperature: float = 1.0):
    """Three sequences packed: random student logits [T, V], a prompt then loss tokens (a few masked out),
    and a teacher log-distribution per token (token-aligned: row p is about token p)."""
    g = torch.Generator().manual_seed(seed)
    lens, prompts = [5, 3, 7], [2, 1, 3]
    mask = torch.cat([torch.tensor([0] * p + [1] * (n - p)) for n, p in zip(lens, prompts, strict=True)]).bool()
    mask[7] = False  # a generated token outside the loss (e.g. a tool's output)
    cu = torch.tensor([0, 5, 8, 15], dtype=torch.int32)
    logits = torch.randn(15, V, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(15, V, generator=g, dtype=torch.float64), -1)
    packed = {"loss_mask": mask, "cu_seqlens": cu, "teacher_logp": teacher}
    return logits, packed


def loop_kl(logits: torch.Tensor, packed: dict, temperature: float = 1.0, k: int = 0) -> list[list[float]]:
    """Per sequence, per token: KL(student || teacher) by explicit sums over the vocabulary, row by row."""
    cu, mask, teacher = packed["cu_seqlens"].tolist(), packed["loss_mask"].tolist(), packed["teacher_logp"]
    out = []
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        row = []
        for p in range(s, e):
            if not mask[p] or p == s:
                row.append(0.0)
                continue
            z = logits[p - 1].detach() / temperature  # the logits before token p
            probs = [float(torch.exp(z[v] - torch.logsumexp(z, 0))) for v in range(V)]
            t = [float(torch.exp(teacher[p, v])) for v in range(V)]
            support = range(V) if not k else sorted(range(V), key=lambda v: -t[v])[:k]
            ps, pt = sum(probs[v] for v in support), sum(t[v] for v in support)
            row.append(
                sum(
                    probs[v] / ps * (torch.log(torch.tensor(probs[v] / ps)) - torch.log(torch.tensor(t[v] / pt))).item()
                    for v in support
                )
            )
        out.append(row)
    return out


@pytest.mark.parametrize("seed, temperature", [(0, 1.0), (1, 0.7), (2, 1.3)])
def test_full_vocabulary_reverse_kl_matches_a_loop(seed: int, temperature: float) -> None:
    logits, packed = packed_case(seed)
    kl = token_reverse_kl(logits, packed, temperature)
    want = loop_kl(logits, packed, temperature)
    assert torch.allclose(kl.double(), torch.tensor([x for r in want for x in r], dtype=torch.float64), atol=1e-5)
    kl = kl.detach()
    assert bool((kl >= -1e-6).all()) and float(kl[~packed["loss_mask"]].abs().sum()) == 0.0
    # aggregated as the policy losses are: token mean, and per sequence
    cu, m = packed["cu_seqlens"], packed["loss_mask"]
    flat = [(x, bool(b)) for x, b in zip([x for r in want for x in r], m.tolist(), strict=True)]
    token_mean = sum(x for x, b in flat if b) / sum(b for _, b in flat)
    loss, _ = distill_loss(logits, None, None, m, cu, distill_kl=kl, loss_agg_mode="token-mean")
    assert abs(float(loss) - token_mean) < 1e-5
    seq_means = [
        sum(x for x, b in zip(r, m[s:e].tolist(), strict=True) if b) / max(1, int(m[s:e].sum()))
        for r, s, e in zip(want, cu[:-1].tolist(), cu[1:].tolist(), strict=True)
    ]
    loss, _ = distill_loss(logits, None, None, m, cu, distill_kl=kl, loss_agg_mode="seq-mean-token-mean")
    assert abs(float(loss) - sum(seq_means) / 3) < 1e-5


def test_the_gradient_is_the_exact_reverse_kl_gradient() -> None:
    """d KL / d z for softmax s = softmax(z): s * (log s - log q - KL), checked per loss token."""
    logits, packed = packed_case(3)
    token_reverse_kl(logits, packed).sum().backward()
    s = torch.softmax(logits.detach(), -1)
    for p in [3, 4, 6, 11, 12, 13, 14]:  # loss tokens with a predecessor
        ls, lq = torch.log(s[p - 1]), packed["teacher_logp"][p]
        kl = float((s[p - 1] * (ls - lq)).sum())
        assert torch.allclose(logits.grad[p - 1], s[p - 1] * (ls - lq - kl), atol=1e-6)
    assert float(logits.grad[14].abs().sum()) == 0.0  # the last logits predict nothing in the batch


@pytest.mark.parametrize("k", [1, 3, V])
def test_top_k_estimate_matches_a_loop_and_is_exact_at_full_k(k: int) -> None:
    logits, packed = packed_case(4)
    values, ids = packed["teacher_logp"].topk(k, -1)
    kl = token_reverse_kl(logits, {**packed, "teacher_logp": values, "teacher_ids": ids})
    want = torch.tensor([x for r in loop_kl(logits, packed, k=k) for x in r], dtype=torch.float64)
    assert torch.allclose(kl.double(), want, atol=1e-5) and bool((kl >= -1e-6).all())
    if k == 1:
        assert float(kl.detach().abs().max()) < 1e-6  # one token: both renormalise to 1 there
    if k == V:
        assert torch.allclose(kl, token_reverse_kl(logits, packed), atol=1e-6)
    with pytest.raises(ValueError, match="teacher_ids"):
        reverse_kl(torch.zeros(2, V), torch.zeros(2, V - 1))


def test_teacher_targets_are_the_teachers_own_distributions() -> None:
    """The trainer-side teacher pass against a plain forward of the teacher, row by row."""
    model = load_model(ModelConfig(path="tiny"), seed=5)
    engine = TorchTrainEngine(TrainEngineConfig(), ModelConfig(path="tiny"), model=model, trainable=False)
    engine.initialize()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 90, (3, 9), generator=g)
    attn = torch.ones(3, 9, dtype=torch.bool)
    attn[1, 6:] = False
    batch = {"input_ids": ids, "attention_mask": attn}
    full = teacher_targets(engine, batch, top_k=0, temperature=0.8)["teacher_logp"]
    top = teacher_targets(engine, batch, top_k=4, temperature=0.8)
    for b in range(3):
        n = int(attn[b].sum())
        with torch.no_grad():
            ref = torch.log_softmax(model(ids[b : b + 1, :n]).logits[0].float() / 0.8, -1)
        assert torch.allclose(full[b, 1:n], ref[: n - 1], atol=1e-4)  # token t is drawn from the logits at t - 1
        assert float(full[b, 0].abs().sum()) == 0.0 and float(full[b, n:].abs().sum()) == 0.0
        want_v, want_i = ref[: n - 1].topk(4, -1)
        assert torch.equal(top["teacher_ids"][b, 1:n], want_i)
        assert torch.allclose(top["teacher_logp"][b, 1:n], want_v, atol=1e-4)


def _actor(loss: str, **over: object) -> tuple[PPOActor, TorchTrainEngine]:
    cfg = ActorConfig(loss=loss, loss_agg_mode="token-mean", **over)  # type: ignore[arg-type]
    student = TorchTrainEngine(
        TrainEngineConfig(), ModelConfig(path="tiny"), model=load_model(ModelConfig(path="tiny"), 1)
    )
    teacher = TorchTrainEngine(
        TrainEngineConfig(), ModelConfig(path="tiny"), model=load_model(ModelConfig(path="tiny"), 2), trainable=False
    )
    student.initialize()
    teacher.initialize()
    return PPOActor(cfg, student, seed=0, teacher_engine=teacher), teacher


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (4, 10), generator=g)
    loss_mask = torch.zeros(4, 10, dtype=torch.bool)
    loss_mask[:, 4:] = True
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(4, 10, dtype=torch.bool),
        "loss_mask": loss_mask,
        "logprobs": torch.where(loss_mask, -2.0, 0.0),
        "versions": torch.where(loss_mask, 0, -1),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
        "group_id": torch.tensor([0, 0, 1, 1]),
    }


def test_distill_alone_and_added_to_ppo_in_the_actor() -> None:
    """actor.loss=distill trains on the KL alone and lowers it; actor.distill_coef adds coef x KL to ppo."""
    actor, teacher = _actor("distill", teacher=_teacher_cfg(0))
    batch = actor.prepare(_batch())
    assert batch["teacher_logp"].shape == (4, 10, 103)
    student_logits = actor.engine.forward(batch, post_fn=lambda logits, packed: _kl_post(logits, packed, batch))
    first = actor.ppo_update(batch)[0]
    assert abs(first["distill_kl"] - float(student_logits[batch["loss_mask"]].mean())) < 1e-4
    assert first["distill_kl"] == pytest.approx(first["policy_loss"], abs=1e-6)
    kls = [first["distill_kl"]] + [actor.ppo_update(batch)[0]["distill_kl"] for _ in range(4)]
    assert kls[-1] < 0.8 * kls[0], kls
    # the same batch with ppo plus the KL: the loss is ppo's plus coef x the KL
    rl, _ = _actor("ppo", distill_coef=0.5, teacher=_teacher_cfg(3))
    b = rl.prepare(_batch())
    assert b["teacher_ids"].shape == (4, 10, 3)
    stats = rl.ppo_update(b)[0]
    assert stats["loss"] == pytest.approx(stats["policy_loss"] + 0.5 * stats["distill_kl"], abs=1e-5)
    assert stats["distill_kl"] > 0


def _teacher_cfg(top_k: int):
    from relayrl.api.distill import TeacherConfig

    return TeacherConfig(path="tiny", top_k=top_k)


def _kl_post(logits: torch.Tensor, packed: dict, batch: dict) -> torch.Tensor:
    return token_reverse_kl(logits, packed, 1.0).detach()


def test_distillation_needs_a_teacher_and_a_shared_vocabulary(tmp_path: Path) -> None:
    actor = PPOActor(
        ActorConfig(loss="distill"),
        TorchTrainEngine(TrainEngineConfig(), ModelConfig(path="tiny"), model=load_model(ModelConfig(path="tiny"), 1)),
    )
    actor.engine.initialize()
    batch = actor.prepare(_batch())
    with pytest.raises(ValueError, match=r"teacher_logp.*actor.teacher.path"):
        actor.ppo_update(batch)
    assert A.loss_entry("distill").needs_teacher and not A.loss_entry("ppo").needs_teacher
    from relayrl.trainer import train

    over = [f"run_dir={tmp_path}", "actor.distill_coef=0.1", "actor.teacher.path=tiny", "model.vocab_size=128"]
    with pytest.raises(ConfigError, match=r"actor.teacher.path='tiny' has a vocabulary of 103 tokens.*128"):
        train(load_config(RunConfig, None, over))
    with pytest.raises(ConfigError, match=r"actor.teacher.path='/no/such/dir': no such directory"):
        train(load_config(RunConfig, None, [f"run_dir={tmp_path}", "actor.teacher.path=/no/such/dir"]))
    with pytest.raises(ConfigError, match=r"actor.teacher.path and actor.teacher.url are exclusive"):
        load_config(
            RunConfig, None, ["actor.teacher.path=tiny", "actor.teacher.url=127.0.0.1:1", "actor.teacher.top_k=5"]
        )
    with pytest.raises(
        ConfigError, match=r"actor.teacher.url gives the server.s top-k logprobs: set actor.teacher.top_k >= 1"
    ):
        load_config(RunConfig, None, ["actor.teacher.url=127.0.0.1:1"])


def test_trainer_distills_from_a_checkpoint_teacher(tmp_path: Path) -> None:
    """`relayrl train` with actor.loss=distill and a checkpoint directory as the teacher: the KL falls."""
    from relayrl.trainer import train

    over = [
        f"run_dir={tmp_path}",
        "actor.loss=distill",
        "actor.teacher.path=tests/data/demo_sft",
        "rollout.batch_size=4",
        "rollout.group_size=2",
        "gconfig.max_new_tokens=6",
        "data.n_train=32",
        "data.n_eval=4",
        "total_steps=3",
        "train.optimizer.lr=1e-3",
        "logging.tensorboard=false",
        "logging.progress=off",
        "checkpoint.save_final=false",
        "eval.gconfig.max_new_tokens=6",
    ]
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        train(load_config(RunConfig, None, over))
    finally:
        os.chdir(cwd)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    kl = [r["actor/distill_kl"] for r in rows if "actor/distill_kl" in r]
    assert len(kl) == 3 and kl[-1] < kl[0]


@pytest.mark.long  # ~30 s of CPU, minutes on a loaded machine; test_trainer_distills_from_a_checkpoint_teacher is its short counterpart
def test_distill_recipe_closes_the_stated_part_of_the_gap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """recipes/distill.yaml as shipped (student demo_sft, teacher demo_grpo) reaches its stated step-20 figure
    (the 3-step run above checks, in the normal suite, that the KL to the same teacher falls)."""
    from relayrl.trainer import train
    from tests.test_recipes import QUIET, _evals, check_outcome

    monkeypatch.chdir(ROOT)
    recipe = ROOT / "recipes" / "distill.yaml"
    cfg = load_config(RunConfig, recipe, [f"run_dir={tmp_path}", "total_steps=20", *QUIET])
    assert cfg.actor.loss == "distill" and cfg.actor.teacher.path == "tests/data/demo_grpo"
    train(cfg)
    acc = _evals(tmp_path)
    assert len(acc) == 2, acc
    check_outcome(recipe.read_text(), acc[0], acc[1], 20)


def test_a_rollout_correction_reweights_the_kl_like_the_advantages() -> None:
    """With actor.rollout_correction the per-token KL is multiplied by the correction's weight: with the
    generator's logprobs 1 nat below the trainer's, truncate at high=2 weights every token by 2."""
    from relayrl.api.mismatch import RolloutCorrectionConfig

    plain, _ = _actor("ppo", distill_coef=1.0, teacher=_teacher_cfg(0))
    corr = RolloutCorrectionConfig(mode="truncate", high=2.0)
    weighted, _ = _actor("ppo", distill_coef=1.0, teacher=_teacher_cfg(0), rollout_correction=corr)
    b1, b2 = _batch(), _batch()
    before = plain.compute_logp(b1)
    for b in (b1, b2):
        b["logprobs"] = torch.where(b["loss_mask"], before - 1.0, 0.0)  # pi_trainer / pi_generator = e > 2
    s1 = plain.ppo_update(plain.prepare(b1))[0]
    s2 = weighted.ppo_update(weighted.prepare(b2))[0]
    assert s2["correction_weight_mean"] == pytest.approx(2.0)
    assert s2["distill_kl"] == pytest.approx(2 * s1["distill_kl"], rel=1e-4)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
def test_a_served_teacher_is_asked_for_each_rows_tokens_with_its_key(protocol: str, monkeypatch) -> None:
    """``actor.teacher.url``: each row's tokens (padding cut) go to the server in its protocol, with the key
    from ``api_key_env`` as a Bearer token, and its top-k answer becomes ``teacher_logp`` / ``teacher_ids``
    at the positions it names (a vLLM entry ranked past k is dropped; zeros at the first token and padding).
    A local HTTP server answering as the real ones do (their own tests: tests/real_peers/)."""
    import http.server
    import threading

    from relayrl.api.distill import TeacherConfig

    seen: list[tuple[str, str, list[int]]] = []

    class Peer(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._send({"data": [{"id": "teacher"}]})

        def do_POST(self) -> None:
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = req.get("input_ids", req.get("prompt"))
            seen.append((self.path, self.headers.get("Authorization", ""), ids))
            if self.path == "/generate":
                top = [None] + [[[-0.5, t, None], [-1.5, t + 1, None]] for t in ids[1:]]
                self._send({"meta_info": {"input_top_logprobs": top}})
            else:
                ranked = [None] + [
                    {str(t): {"logprob": -0.5, "rank": 1}, str(t + 1): {"logprob": -1.5, "rank": 2},
                     "99": {"logprob": -9.0, "rank": 40}}
                    for t in ids[1:]
                ]  # fmt: skip
                self._send({"choices": [{"prompt_logprobs": ranked}]})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Peer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("TEACHER_KEY", "sekrit")
    teacher = TeacherConfig(url=f"127.0.0.1:{server.server_address[1]}", protocol=protocol, top_k=2,
                            api_key_env="TEACHER_KEY", timeout=30.0)  # fmt: skip
    actor = PPOActor(ActorConfig(loss="distill", teacher=teacher), engine=None)  # type: ignore[arg-type]
    batch = {
        "input_ids": torch.tensor([[3, 10, 11, 12], [4, 20, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool),
    }
    try:
        actor.fill_teacher(batch)
    finally:
        server.shutdown()
    route = "/generate" if protocol == "sglang" else "/v1/completions"
    assert sorted(s[2] for s in seen) == [[3, 10, 11, 12], [4, 20]]
    assert {s[:2] for s in seen} == {(route, "Bearer sekrit")}
    logp, ids = batch["teacher_logp"], batch["teacher_ids"]
    assert ids.shape == logp.shape == (2, 4, 2)
    assert ids[0, 1:].tolist() == [[10, 11], [11, 12], [12, 13]] and ids[1, 1].tolist() == [20, 21]
    assert logp[0, 1:].tolist() == [[-0.5, -1.5]] * 3 and logp[1, 1].tolist() == [-0.5, -1.5]
    assert not logp[:, 0].any() and not logp[1, 2:].any() and not ids[1, 2:].any()
