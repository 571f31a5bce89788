"""``--dataset`` with the real ``datasets`` library: the four formats, epochs, held-out rows, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import unloadable_model
from tests.train.test_recipe import _metrics, interrupted_train, tiny_cfg
from tether.train.config import TrainConfig
from tether.train.data import check_data, dataset_task, read_rows, rows_to_problems, split_rows
from tether.train.recipe import train

ROWS = [{"prompt": f"say {i}", "answer": f"a{i}", "level": i % 3} for i in range(10)]
CHAT_ROWS = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}],
              "answer": f"a{i}"} for i in range(4)]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_all_formats(tmp_path: Path, rows: list[dict]) -> dict[str, str]:
    """The same rows as JSONL, CSV, Parquet and a save_to_disk directory (CSV only for flat rows)."""
    import datasets

    ds = datasets.Dataset.from_list(rows)
    paths = {"jsonl": write_jsonl(tmp_path / "d.jsonl", rows), "parquet": str(tmp_path / "d.parquet"),
             "saved": str(tmp_path / "saved")}
    ds.to_parquet(paths["parquet"])
    ds.save_to_disk(paths["saved"])
    if all(not isinstance(v, list) for v in rows[0].values()):
        paths["csv"] = str(tmp_path / "d.csv")
        ds.to_csv(paths["csv"], index=False)
    return paths


def data_cfg(tmp_path: Path, dataset: str, **kw) -> TrainConfig:
    rewards = tmp_path / "r.py"
    if not rewards.exists():
        rewards.write_text("def length(prompts, completions, **kw):\n"
                           "    return [len(c[0]['content'] if isinstance(c, list) else c) / 10 for c in completions]\n")
    base = dict(task="arithmetic", dataset=dataset, reward_funcs=str(rewards), prompt_format="text")
    base.update(kw)
    return tiny_cfg(Path(base.pop("out", tmp_path / "run")), **base)


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "saved"])
def test_every_format_reads_the_same_rows(tmp_path, kind):
    path = write_all_formats(tmp_path, ROWS)[kind]
    assert read_rows(path, "dataset") == ROWS


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "saved"])
def test_chat_prompts_survive_every_format(tmp_path, kind):
    path = write_all_formats(tmp_path, CHAT_ROWS)[kind]
    problems = rows_to_problems(read_rows(path, "dataset"), "prompt", "chat", "d")
    assert [p.chat for p in problems] == [r["prompt"] for r in CHAT_ROWS]
    assert [p.columns for p in problems] == [{"answer": r["answer"]} for r in CHAT_ROWS]
    assert all(p.text is None for p in problems)


def test_text_prompts_in_both_formats():
    """Chat format makes a plain-text prompt one user turn; text format keeps it raw. Other columns ride along."""
    chat = rows_to_problems(ROWS[:2], "prompt", "chat", "d")
    text = rows_to_problems(ROWS[:2], "prompt", "text", "d")
    assert [p.chat for p in chat] == [[{"role": "user", "content": "say 0"}], [{"role": "user", "content": "say 1"}]]
    assert [p.text for p in chat] == [None, None] and [p.text for p in text] == ["say 0", "say 1"]
    assert text[1].columns == {"answer": "a1", "level": 1}


def test_a_saved_dataset_dict_with_one_split_is_read_and_several_are_refused(tmp_path):
    import datasets

    one = tmp_path / "one"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(one))
    assert read_rows(str(one), "dataset") == ROWS
    two = tmp_path / "two"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}
                         ).save_to_disk(str(two))
    with pytest.raises(ValueError, match=r"dataset: .*two holds the splits \['test', 'train'\]; give one split's directory"):
        read_rows(str(two), "dataset")
    assert read_rows(str(two / "test"), "dataset") == ROWS[:2]  # the fix the message gives works


def test_training_prompts_follow_seeded_epochs(tmp_path):
    """Prompts ``0..N-1`` are a permutation of the N rows, each epoch again in another order, and
    prompt ``i`` depends on ``(seed, i)`` only."""
    task = dataset_task(data_cfg(tmp_path, write_jsonl(tmp_path / "d.jsonl", ROWS)))
    n = len(ROWS)
    epochs = [[task.train_problem(0, e * n + i).text for i in range(n)] for e in range(3)]
    assert all(sorted(epoch) == sorted(r["prompt"] for r in ROWS) for epoch in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]
    again = dataset_task(data_cfg(tmp_path, write_jsonl(tmp_path / "d.jsonl", ROWS)))
    assert [again.train_problem(0, i).text for i in range(25, 5, -1)] == [task.train_problem(0, i).text for i in range(25, 5, -1)]
    assert [task.train_problem(1, i).text for i in range(n)] != epochs[0]


@pytest.mark.parametrize("fraction,held", [(0.2, 2), (0.25, 2), (0.5, 5), (0.85, 8)])
def test_eval_split_is_disjoint_sized_and_independent_of_the_seed(tmp_path, fraction, held):
    """``round(fraction x 10)`` rows held out (0.25 -> round(2.5) = 2, banker's rounding), the rest
    trained on, the same rows whatever the seed."""
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    tasks = [dataset_task(data_cfg(tmp_path, path, eval_split=fraction, seed=s)) for s in (0, 7)]
    for task in tasks:
        train_prompts = {p.text for p in task.train}
        eval_prompts = [p.text for p in task.eval_set(100)]
        assert len(eval_prompts) == held and len(train_prompts) == 10 - held
        assert not train_prompts & set(eval_prompts)
        assert {task.train_problem(3, i).text for i in range(40)} == train_prompts
    assert [p.text for p in tasks[0].held_out] == [p.text for p in tasks[1].held_out]
    assert [p.text for p in tasks[0].eval_set(1)] == [tasks[0].held_out[0].text]


@pytest.mark.parametrize("fraction,left", [(0.96, 0), (0.04, 10)])
def test_an_eval_split_leaving_nothing_is_refused(fraction, left):
    problems = rows_to_problems(ROWS, "prompt", "text", "d")
    with pytest.raises(ValueError, match=rf"eval_split: {fraction} of 10 rows .* leaves {left} to train on"):
        split_rows(problems, fraction)


def test_eval_dataset_holds_out_its_own_rows(tmp_path):
    cfg = data_cfg(tmp_path, write_jsonl(tmp_path / "d.jsonl", ROWS),
                   eval_dataset=write_jsonl(tmp_path / "e.jsonl", ROWS[:3]))
    task = dataset_task(cfg)
    assert [p.text for p in task.held_out] == ["say 0", "say 1", "say 2"] and len(task.train) == 10


@pytest.mark.parametrize("content,match", [
    ('{"prompt": "x"\n', r"dataset: cannot read .*bad.jsonl as .jsonl \(.*\); fix the file"),
    ("", r"dataset: .*bad.jsonl holds no rows"),
])
def test_unreadable_files_name_the_file(tmp_path, content, match):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(ValueError, match=match):
        read_rows(str(tmp_path / "bad.jsonl"), "dataset")


def test_missing_files_suffixes_columns_and_prompt_types_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"eval_dataset: .*nope.jsonl does not exist"):
        read_rows(str(tmp_path / "nope.jsonl"), "eval_dataset")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ValueError, match=r"dataset: .*d.txt has the suffix '.txt', expected one of"):
        read_rows(str(tmp_path / "d.txt"), "dataset")
    with pytest.raises(KeyError, match=r"prompt_column: d has no column 'question' \(its columns: \['answer', 'level', 'prompt'\]\)"):
        rows_to_problems(ROWS, "question", "chat", "d")
    with pytest.raises(ValueError, match=r"prompt_format: d row 0, column 'prompt' holds chat messages.*--prompt-format chat"):
        rows_to_problems(CHAT_ROWS, "prompt", "text", "d")
    with pytest.raises(TypeError, match=r"prompt_column: d row 0, column 'level' is int 0, expected a string"):
        rows_to_problems(ROWS, "level", "chat", "d")
    with pytest.raises(KeyError, match="content"):
        rows_to_problems([{"prompt": [{"role": "user"}]}], "prompt", "chat", "d")


def _cached_hub_dataset(hub: Path, repo: str, files: dict[str, list[dict]]) -> None:
    """A dataset snapshot laid out as huggingface_hub caches it (refs/main -> snapshots/<commit>)."""
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    folder = hub / f"datasets--{repo.replace('/', '--')}"
    for name, rows in files.items():
        (folder / "snapshots" / commit / name).parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(folder / "snapshots" / commit / name, rows)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)


def test_a_hub_dataset_id_is_read_from_the_local_cache_without_network(tmp_path, monkeypatch, capsys):
    """``--dataset owner/name`` reads the train split of the cached snapshot (its other splits
    left alone) with every socket refused; an uncached id says how to fetch it once, in one CLI
    line before any model loads; a snapshot with no train split names what it has; a path with a
    data suffix keeps the plain "does not exist"."""
    import socket

    import huggingface_hub.constants

    from tests.train.test_run_dir import one_error_line
    from tether.train.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("tether tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    _cached_hub_dataset(tmp_path / "hub", "tether-test/sums", {"train.jsonl": ROWS, "test.jsonl": ROWS[:2]})
    _cached_hub_dataset(tmp_path / "hub", "tether-test/only-test", {"test.jsonl": ROWS[:2]})
    assert read_rows("tether-test/sums", "dataset") == ROWS
    with pytest.raises(ValueError, match=r"eval_dataset: the cached Hub dataset tether-test/only-test .*no single "
                                         r"train split.*test"):
        read_rows("tether-test/only-test", "eval_dataset")
    with pytest.raises(ValueError, match=r"eval_dataset: data/gsm8k.jsonl does not exist; give a .jsonl"):
        read_rows("data/gsm8k.jsonl", "eval_dataset")

    cfg = data_cfg(tmp_path, "openai/gsm8k", out=tmp_path / "run", model=unloadable_model(tmp_path / "model"))
    assert main(["train", "--quiet", *[f"{k}={v}" for k, v in cfg.__dict__.items()]]) == 2
    line = one_error_line(capsys)
    assert "dataset: 'openai/gsm8k' is no local path and is not in the Hugging Face cache" in line
    assert "hf download openai/gsm8k --repo-type dataset" in line and not (tmp_path / "run").exists()


@pytest.mark.parametrize("changes,fragment", [
    (dict(dataset="d.jsonl"), "dataset: a dataset run needs a reward"),
    (dict(eval_split=0.2), "eval_split: holds out rows of --dataset, but no dataset is given"),
    (dict(eval_dataset="e.jsonl"), "eval_dataset: holds out rows of --dataset"),
    (dict(prompt_format="text"), "prompt_format: 'text' applies to --dataset prompts"),
    (dict(prompt_format="raw"), "prompt_format: expected one of 'chat', 'text', got 'raw'."),
    (dict(dataset="d.jsonl", reward_model="rm", eval_split=1.0), "eval_split: expected a fraction in [0, 1), got 1.0"),
    (dict(dataset="d.jsonl", reward_model="rm", eval_split=0.1, eval_dataset="e.jsonl"), "give one source of held-out rows"),
    (dict(dataset="d.jsonl", reward_model="rm", task="x.py"), "task and dataset: give one source of prompts"),
    (dict(reward_funcs="rewards.txt"), "reward_funcs: expected an existing .py file, got 'rewards.txt'"),
    (dict(reward_model="no/such/dir"), "reward_model: expected a local model directory, got 'no/such/dir'"),
    (dict(reward_weights="1,2"), "reward_weights: weigh --reward-funcs / --reward-model, but neither is given"),
])
def test_config_refuses_inconsistent_data_and_reward_keys(changes, fragment):
    with pytest.raises(ValueError) as err:
        TrainConfig(**changes).validate()
    assert fragment in str(err.value)


def test_resume_refuses_changed_rows(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS)
    recorded = {"data": dataset_task(data_cfg(tmp_path, path)).fingerprint}
    check_data(recorded, dataset_task(data_cfg(tmp_path, path)), Path("ckpt"))  # same rows: accepted
    write_jsonl(tmp_path / "d.jsonl", ROWS[:-1] + [{**ROWS[-1], "answer": "changed"}])
    with pytest.raises(ValueError, match=r"dataset: ckpt was trained on data with fingerprint"):
        check_data(recorded, dataset_task(data_cfg(tmp_path, path)), Path("ckpt"))


@pytest.mark.parametrize("prompt_format", ["chat", "text"])
def test_interrupted_dataset_run_resumes_exactly_across_an_epoch(tmp_path, prompt_format):
    """5 training rows, 2 prompts a step: steps 3 and 4 draw from epoch 1. Stopped after step 2 and
    resumed, the run logs what an uninterrupted one does."""
    path = write_jsonl(tmp_path / "d.jsonl", ROWS[:5])
    kw = dict(steps=4, prompt_format=prompt_format, eval_dataset=write_jsonl(tmp_path / "e.jsonl", ROWS[5:7]))
    clean = data_cfg(tmp_path, path, **kw, out=str(tmp_path / "clean"))
    train(clean, progress=False)
    cut = data_cfg(tmp_path, path, **kw, out=str(tmp_path / "cut"))
    interrupted_train(cut, 2)
    train(cut, resume=True, progress=False)
    strip = _metrics
    assert strip(tmp_path / "cut") == strip(tmp_path / "clean")
    assert [r["step"] for r in strip(tmp_path / "clean")] == [1, 2, 3, 4]
    assert all("reward/length" in r and "accuracy" not in r for r in strip(tmp_path / "clean"))
    summary = json.loads((tmp_path / "clean" / "summary.json").read_text())
    assert summary["eval_size"] == 2 and summary["accuracy_after"] is None and summary["reward_after"] >= 0
