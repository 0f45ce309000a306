"""``relayrl inspect``: the rollouts a real run saves, and the page over them driven in headless Chromium.

Two short runs of the tiny model are the data: a synchronous single-turn GRPO run whose reward (a
digit anywhere in the completion) a random model earns about half the time, and an asynchronous
multi-turn run (feedback turns masked out of the loss, decoupled PPO: the trainer's proximal
logprobs are saved next to the generator's, one version behind).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from relayrl.api.config import RunConfig, load_config
from relayrl.inspector.headless import CHROMIUM, chromium
from relayrl.trainer import train
from relayrl.utils.rollouts import read_index, read_step

RUN = [
    "rollout.batch_size=3",
    "rollout.group_size=4",
    "gconfig.max_new_tokens=10",
    "data.n_train=64",
    "data.n_eval=4",
    "train.optimizer.lr=1e-3",
    "logging.tensorboard=false",
    "logging.progress=off",
    "eval.gconfig.max_new_tokens=6",
    "total_steps=3",
    "eval.every_n_steps=3",
]
needs_browser = pytest.mark.skipif(
    not Path(CHROMIUM).exists() or importlib.util.find_spec("playwright") is None,
    reason="Debian's chromium (scripts/test.sh installs it) or playwright (the dev extra) is missing",
)


def digit_reward(completions: str, **_: object) -> float:
    """1 when the completion holds a digit: a random tiny model earns it about half the time."""
    return float(any(c.isdigit() for c in completions))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("inspect")
    single = load_config(RunConfig, None, [f"run_dir={root / 'single'}", *RUN])
    train(single, reward_fn=digit_reward)
    multi = load_config(
        RunConfig,
        None,
        [
            f"run_dir={root / 'multi'}",
            *RUN,
            "workflow=multi_turn",
            "rollout.max_staleness=1",
            "actor.loss=decoupled_ppo",
            "actor.n_minibatches=2",
            "actor.entropy_coef=0.01",  # no reward, no advantage: the entropy bonus moves the weights
        ],
    )
    train(multi, reward_fn=lambda **_: 0.0)  # never right: every episode takes both turns
    return Path(single.run_dir), Path(multi.run_dir)


def test_saved_rollouts_carry_every_token_quantity(runs: tuple[Path, Path]) -> None:
    single, multi = runs
    assert [e["step"] for e in read_index(single)] == [1, 2, 3]
    for step in (1, 2, 3):
        rows = list(read_step(single, step))
        assert len(rows) == 12  # the default sample keeps every rollout of a small run
        for r in rows:
            t = r["tokens"]
            n = len(t["ids"])
            assert len(t["text"]) == len(t["mask"]) == len(t["logp"]) == len(t["ver"]) == n == r["len"]
            assert "".join(t["text"]) == r["completion"]
            assert r["reward"] == digit_reward(r["completion"])
            assert r["versions"] == [step - 1] and r["lag"] == 0  # synchronous
            assert r["stop"] == ("length" if n == 10 else "stop")
            assert all(lp <= 0 for lp in t["logp"])
            gaps = [abs(a - b) for a, b, m in zip(t["tlogp"], t["logp"], t["mask"], strict=True) if m]
            assert max(gaps) < 2e-3  # the update's own logprobs, saved by default: same weights, fp32
        for g in {r["group_id"] for r in rows}:  # GRPO: each member's advantage against its group's mean reward
            members = [r for r in rows if r["group_id"] == g]
            mean = sum(r["reward"] for r in members) / len(members)
            for r in members:
                assert isinstance(r["tokens"]["adv"], float)  # one value for every token: stored once
                assert (r["tokens"]["adv"] > 0) == (r["reward"] > mean) and (r["tokens"]["adv"] < 0) == (
                    r["reward"] < mean
                )
            assert abs(sum(r["tokens"]["adv"] for r in members)) < 1e-3
    rows = [r for s in (2, 3) for r in read_step(multi, s)]
    assert any(0 in r["tokens"]["mask"] for r in rows)  # the feedback turn, masked
    assert all(r["num_turns"] == 2 for r in rows)
    assert max(r["lag"] for r in rows) == 1  # generated one version behind
    for r in rows:
        t = r["tokens"]
        assert len(t["tlogp"]) == len(t["ids"])  # the trainer's (proximal) logprobs next to the generator's
        assert all(v == -1 for v, m in zip(t["ver"], t["mask"], strict=True) if not m)
    gap: dict[bool, list[float]] = {True: [], False: []}  # generator vs trainer (the weights of step - 1)
    for step in (1, 2, 3):
        for r in read_step(multi, step):
            t = r["tokens"]
            for a, b, v, m in zip(t["tlogp"], t["logp"], t["ver"], t["mask"], strict=True):
                if m:
                    gap[v == step - 1].append(abs(a - b))
    assert max(gap[True]) < 2e-3  # the same weights: the same logprobs (fp32)
    assert max(gap[False]) > 1e-2  # a version behind: the entropy bonus moved the trainer's weights since


def test_show_prints_the_saved_rollouts(runs: tuple[Path, Path]) -> None:
    single, _ = runs
    out = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "show", str(single), "--step", "2"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    first = next(read_step(single, 2))
    assert f"completion: {first['completion']!r}" in out.stdout and out.stdout.count("--- reward") == 12


def test_a_parent_directory_is_refused_naming_the_runs_inside(runs: tuple[Path, Path]) -> None:
    single, _ = runs
    out = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "inspect", str(single.parent)], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert out.stderr.strip().startswith("relayrl inspect:") and str(single) in out.stderr


# ---------------------------------------------------------------------- the page in Chromium


@pytest.fixture(scope="module")
def browser(runs: tuple[Path, Path]) -> Iterator[object]:
    """Started after the runs are trained: playwright's sync API keeps an event loop in this thread, and
    training runs one of its own (a test selected alone would otherwise fail in set-up)."""
    with chromium() as ctx:
        yield ctx


@pytest.fixture(scope="module")
def served(runs: tuple[Path, Path]) -> Iterator[str]:
    """``relayrl inspect`` over both runs, a real server process on a free port."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "inspect", *map(str, runs), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    url = re.search(r"http://127\.0\.0\.1:\d+/", line)
    assert url, line
    yield url.group(0)
    proc.terminate()
    proc.wait(timeout=10)


def open_page(browser, url: str):  # type: ignore[no-untyped-def]
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=20_000)
    page.errors = errors
    return page


def shown(page) -> list[int]:  # type: ignore[no-untyped-def]
    return [int(i) for i in page.eval_on_selector_all(".rollout", "els => els.map(e => e.dataset.i)")]


def test_server_answers_unknown_paths_with_404(served: str) -> None:
    import urllib.error
    import urllib.request

    with urllib.request.urlopen(served + "data/manifest.json") as ok:
        assert ok.headers["Content-Type"] == "application/json" and "runs" in json.loads(ok.read())
    for path in (
        "data/manifest.js",  # served, data are JSON only (tests/test_security_http.py)
        "data/r0/step_000003.js",
        "data/r7/step_000001.json",
        "data/r0/step_000099.json",
        "..%2fpyproject.toml",
        "static/../app.js",
        "x",
    ):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(served + path)
        assert e.value.code == 404, path


@needs_browser
def test_filters_change_the_rows_shown(browser, served: str, runs: tuple[Path, Path]) -> None:
    rows = list(read_step(runs[0], 3))
    page = open_page(browser, served)
    assert page.text_content("#step-label").startswith("step 3")
    assert sorted(shown(page)) == sorted(r["i"] for r in rows)
    page.select_option("#f-correct", "correct")
    assert sorted(shown(page)) == sorted(r["i"] for r in rows if r["reward"] > 0)
    page.select_option("#f-correct", "wrong")
    assert sorted(shown(page)) == sorted(r["i"] for r in rows if r["reward"] == 0)
    page.select_option("#f-correct", "")
    page.fill("#f-len-max", "9")
    assert sorted(shown(page)) == sorted(r["i"] for r in rows if r["len"] <= 9)
    page.fill("#f-len-max", "")
    page.select_option("#f-stop", "length")
    assert sorted(shown(page)) == sorted(r["i"] for r in rows if r["stop"] == "length")
    page.select_option("#f-stop", "")
    needle = rows[5]["completion"][2:6]
    page.fill("#f-search", needle)
    found = [r["i"] for r in rows if needle.lower() in (r["prompt"] + "\n" + r["completion"]).lower()]
    assert sorted(shown(page)) == sorted(found) and len(found) < len(rows)
    page.fill("#f-search", "")
    page.uncheck("#grouped")
    page.select_option("#sort", "len")
    by_i = {r["i"]: r for r in rows}
    assert [by_i[i]["len"] for i in shown(page)] == sorted((r["len"] for r in rows), reverse=True)
    assert page.text_content("#count") == f"{len(rows)} of {len(rows)} rollouts"
    assert page.errors == []
    # version lag: the asynchronous run's step with completions generated one version behind
    step = next(s for s in (2, 3) if any(r["lag"] == 1 for r in read_step(runs[1], s)))
    rows = list(read_step(runs[1], step))
    page = open_page(browser, served + f"#run=1&step={step}")
    assert sorted(shown(page)) == sorted(r["i"] for r in rows)
    page.fill("#f-lag-max", "0")
    assert sorted(shown(page)) == sorted(r["i"] for r in rows if r["lag"] == 0)
    assert page.errors == []


@needs_browser
def test_a_token_hover_shows_its_values(browser, served: str, runs: tuple[Path, Path]) -> None:
    page = open_page(browser, served + "#run=1&step=3")
    r = next(read_step(runs[1], 3))
    card = page.locator(f".rollout[data-i='{r['i']}']")
    k = r["tokens"]["mask"].index(1) + 1
    card.locator(f".tok[data-k='{k}']").hover()
    tip = page.text_content("#tip")
    t = r["tokens"]
    assert page.is_visible("#tip")
    assert f"id {t['ids'][k]}" in tip and "trained (loss mask 1)" in tip
    assert re.search(rf"logprob \(gen\)\s+{t['logp'][k]:.4f}", tip), tip
    assert re.search(rf"logprob \(train\)\s+{t['tlogp'][k]:.4f}", tip), tip
    assert re.search(rf"version\s+{t['ver'][k]}\b", tip), tip
    masked = t["mask"].index(0)
    card.locator(f".tok[data-k='{masked}']").hover()
    assert "masked: not trained" in page.text_content("#tip")
    assert page.locator(".rollout .turn").count() >= 1  # the second turn is marked


@needs_browser
def test_a_curve_click_opens_that_step(browser, served: str, runs: tuple[Path, Path]) -> None:
    page = open_page(browser, served)
    chart = page.locator(".chart[data-metric='rollout/reward']")
    assert chart.locator("polyline").count() == 2  # both runs overlaid
    chart.locator("circle[data-run='0'][data-step='1']").click()
    page.wait_for_function("document.querySelector('#step-label').textContent.startsWith('step 1')")
    assert sorted(shown(page)) == sorted(r["i"] for r in read_step(runs[0], 1))
    prompts = {r["prompt"] for r in read_step(runs[0], 1)}
    assert set(page.eval_on_selector_all(".group .head .prompt", "els => els.map(e => e.textContent)")) == prompts
    chart.locator("circle[data-run='1'][data-step='2']").click()
    page.wait_for_function("document.querySelector('#step-label').textContent.startsWith('step 2')")
    assert page.input_value("#run") == "1"


def _coloured_pixels(png: bytes) -> int:
    """Pixels clearly tinted (the token colouring), as opposed to white, grey and black."""
    import io

    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    return sum(1 for r, g, b in img.getdata() if max(r, g, b) - min(r, g, b) > 40)


@needs_browser
def test_exported_page_works_from_files_and_screenshot_shows_tokens_and_curves(
    browser, runs: tuple[Path, Path], tmp_path: Path
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "inspect", *map(str, runs), "--export", str(tmp_path / "site")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    index = tmp_path / "site" / "index.html"
    assert sorted(p.name for p in (tmp_path / "site" / "data" / "r0").iterdir()) == [
        "step_000001.js",
        "step_000002.js",
        "step_000003.js",
    ]
    page = open_page(browser, index.as_uri())
    assert len(shown(page)) == 12
    page.select_option("#colour", "adv")
    page.fill("#f-reward-min", "1")
    assert sorted(shown(page)) == sorted(r["i"] for r in read_step(runs[0], 3) if r["reward"] >= 1)
    page.fill("#f-reward-min", "")
    page.locator("#step").fill("0")  # the slider to the first saved step
    page.wait_for_function("document.querySelector('#step-label').textContent.startsWith('step 1')")
    assert page.errors == []
    assert page.locator(".chart").count() >= 4 and page.locator(".tok").count() > 50
    scored = max(read_step(runs[0], 1), key=lambda r: abs(r["tokens"]["adv"]))
    assert abs(scored["tokens"]["adv"]) > 0.3
    tokens = page.locator(f".rollout[data-i='{scored['i']}'] .tokens").screenshot()
    assert _coloured_pixels(tokens) > 100  # coloured by advantage
    page.select_option("#f-correct", "wrong")
    page.select_option("#f-correct", "")
    shot = page.screenshot(full_page=True)
    assert _coloured_pixels(shot) > 2000  # curves and tokens


@needs_browser
@pytest.mark.slow
def test_the_demo_run_shows_its_rollouts_token_by_token(browser, tmp_path: Path) -> None:
    """The README's promise: `relayrl inspect runs/demo/grpo` after the demo (here its --quick run)."""
    from tests.reliability.audit import run_cli

    # `relayrl demo --quick` in a real process forked with the trainer imported (~10 s of imports saved)
    demo = run_cli(["demo", "--quick", "--run-dir", str(tmp_path / "demo")], timeout=600)
    assert demo.returncode == 0, demo.stderr[-2000:]
    refused = subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "inspect", str(tmp_path / "demo")], capture_output=True, text=True
    )
    assert refused.returncode == 2 and str(tmp_path / "demo" / "grpo") in refused.stderr  # the hint names it
    proc = subprocess.Popen(
        [sys.executable, "-m", "relayrl.cli", "inspect", str(tmp_path / "demo" / "grpo"), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = re.search(r"http://127\.0\.0\.1:\d+/", proc.stdout.readline())
        assert url
        page = open_page(browser, url.group(0))
        saved = list(read_step(tmp_path / "demo" / "grpo", 4))
        assert page.text_content("#step-label").startswith("step 4") and len(shown(page)) == len(saved) == 16
        colours = page.eval_on_selector_all(".tok:not(.masked)", "els => els.map(e => e.style.background)")
        assert len(colours) == sum(len(r["tokens"]["ids"]) for r in saved)
        assert len({c for c in colours if c}) > 5  # coloured by logprob, shade by shade
        assert page.errors == []
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@needs_browser
@pytest.mark.slow
def test_open_time_benchmark_runs_quick(tmp_path: Path) -> None:
    """bench/inspect_load.py --quick end to end (its figure is recorded, not asserted: timings are noisy)."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "inspect_load.py"
    out = subprocess.run(
        [sys.executable, str(bench), "--quick"],
        capture_output=True,
        text=True,
        env={**os.environ, "BENCH_RESULTS_DIR": str(tmp_path)},
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "inspect.json").read_text())
    assert result["rollouts"] == 1000 and len(result["browser_open_s"]) == 2 and result["figure"] > 0


@needs_browser
def test_a_partial_rollout_shows_where_the_weights_changed(browser, tokenizer, tmp_path: Path) -> None:
    """A completion whose first 3 tokens came from version 4 and the rest from version 5 (generation
    interrupted by a weight update), saved by the trainer's writer and coloured by version."""
    import torch

    from relayrl.utils.rollouts import RolloutWriter

    ids = tokenizer.encode("<|user|>1+1=<|assistant|>", add_special_tokens=False)
    out = tokenizer.encode("2 and 2", add_special_tokens=False)
    n, p = len(ids) + len(out), len(ids)
    versions = torch.full((1, n), -1)
    versions[0, p : p + 3], versions[0, p + 3 :] = 4, 5
    batch = {
        "input_ids": torch.tensor([ids + out]),
        "attention_mask": torch.ones(1, n, dtype=torch.bool),
        "loss_mask": (versions >= 0).long(),
        "logprobs": torch.where(versions >= 0, -0.5, 0.0),
        "versions": versions,
        "advantages": torch.where(versions >= 0, 1.0, 0.0),
        "rewards": torch.tensor([1.0]),
        "trainer_logp": torch.where(versions >= 0, -0.25, 0.0),  # the update's forward: preferred
        "prox_logp": torch.where(versions >= 0, -0.75, 0.0),
        "entropy": torch.linspace(0.0, 1.0, n)[None],
    }
    RolloutWriter(tmp_path, tokenizer).write(6, batch, 8)
    (row,) = read_step(tmp_path, 6)
    assert row["tokens"]["tlogp"] == [-0.25] * len(out) and row["tokens"]["logp"] == [-0.5] * len(out)
    assert row["tokens"]["ent"] == [round(float(v), 4) for v in batch["entropy"][0, p:]]
    assert row["versions"] == [4, 5] and row["lag"] == 1 and row["tokens"]["ver"] == [4, 4, 4] + [5] * (len(out) - 3)
    subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "inspect", str(tmp_path), "--export", str(tmp_path / "site")], check=True
    )
    page = open_page(browser, (tmp_path / "site" / "index.html").as_uri())
    page.select_option("#colour", "ver")
    assert page.eval_on_selector_all(".tok.verchange", "els => els.map(e => Number(e.dataset.k))") == [3]
    backgrounds = page.eval_on_selector_all(".tok", "els => els.map(e => e.style.background)")
    assert len(set(backgrounds[:3])) == 1 and len(set(backgrounds[3:])) == 1 and backgrounds[0] != backgrounds[3]


@needs_browser
def test_rollouts_saved_in_the_older_format_still_open(browser, tmp_path: Path) -> None:
    """Runs saved before per-token fields (prompt, completion, reward, versions only) list and filter."""
    (tmp_path / "rollouts").mkdir()
    rows = [
        {"prompt": "1+1=", "completion": "2", "reward": 1.0, "versions": [0]},
        {"prompt": "1+2=", "completion": "4", "reward": 0.0, "versions": [0]},
    ]
    (tmp_path / "rollouts" / "step_000001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "inspect", str(tmp_path), "--export", str(tmp_path / "site")], check=True
    )
    page = open_page(browser, (tmp_path / "site" / "index.html").as_uri())
    assert page.text_content("#count") == "2 of 2 rollouts"
    page.select_option("#f-correct", "correct")
    assert page.eval_on_selector_all(".rollout .tok", "els => els.map(e => e.textContent)") == ["2"]
    assert page.errors == []


@needs_browser
def test_vision_episodes_show_the_images_the_model_saw(browser, tmp_path: Path) -> None:
    """A tiny Qwen2-VL run on count_squares: each step saves each prompt's picture once, rebuilt from the
    processor's patches pixel for pixel, and the page shows it above the group."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    from relayrl.data.tasks import make_task
    from relayrl.data.vision import load_image

    cfg = load_config(
        RunConfig,
        None,
        [
            f"run_dir={tmp_path / 'vl'}",
            "model.path=tiny-vl",
            "data.task=count_squares",
            "data.n_train=16",
            "data.n_eval=2",
            "total_steps=2",
            "rollout.batch_size=2",
            "rollout.group_size=2",
            "gconfig.max_new_tokens=2",
            "eval.gconfig.max_new_tokens=2",
            "logging.tensorboard=false",
            "logging.progress=off",
            "checkpoint.save_final=false",
        ],
    )
    train(cfg)
    d = cfg.data  # the run's rows, as relayrl.wiring makes them
    pictures = [
        np.asarray(load_image(row["images"][0])) for row in make_task(d.task, d.n_train, 0, d.difficulty, cfg.seed)[0]
    ]
    rows = list(read_step(Path(cfg.run_dir), 2))
    owners = [r for r in rows if "images" in r]
    assert len(owners) == len({r["group_id"] for r in rows}) == 2  # once per prompt
    assert all(r["images_of"] in {o["i"] for o in owners} for r in rows if r not in owners)
    for r in owners:
        (url,) = r["images"]
        saved = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))
        assert any(saved.shape == p.shape and (saved == p).all() for p in pictures)
    subprocess.run(
        [sys.executable, "-m", "relayrl.cli", "inspect", cfg.run_dir, "--export", str(tmp_path / "site")], check=True
    )
    page = open_page(browser, (tmp_path / "site" / "index.html").as_uri())
    widths = page.eval_on_selector_all(".group .head .images img", "els => els.map(e => e.naturalWidth)")
    assert widths == [56, 56]
    page.uncheck("#grouped")  # flat: every card shows its prompt's picture
    assert page.locator(".rollout .images img").count() == len(rows)
    assert page.errors == []
