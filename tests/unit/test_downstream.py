"""``subnetdp eval RUN --tasks``: lm-evaluation-harness on the union model, offline, on a local task.

The task is written here in lm-eval's own YAML task format over a local JSON-lines file; its
accuracy must equal the one computed by hand from the union model's log-likelihoods of the same
choices. A task whose data would need a download stops with one line naming it.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from subnetdp.cli import main
from subnetdp.core.contracts import LaunchEnv
from subnetdp.train.loop import train
from subnetdp.evaluate.export import load_union
from tests.helpers import plugin_manager, small_config

pytest.importorskip("lm_eval", reason="needs the eval extra: pip install 'subnetdp[eval]'")

QUESTIONS = [
    ("The keyword that defines a function in Python is", ["def", "class", "lambda", "with"], 0),
    ("To leave a loop early, write", ["continue", "break", "pass"], 1),
    ("A module is brought in with", ["include", "require", "import"], 2),
    ("The value of an empty list in a condition is", ["True", "False"], 1),
    ("To catch an exception, write", ["try", "catch", "rescue"], 0),
    ("A method's first argument is usually", ["this", "self", "me"], 1),
    ("Strings are joined with", ["plus", "join", "concat", "merge"], 1),
    ("A dictionary maps keys to", ["values", "indexes"], 0),
    ("The constant for nothing is", ["null", "nil", "None"], 2),
    ("A generator hands out values with", ["return", "yield", "emit"], 1),
]

TASK_YAML = """task: tiny_python_quiz
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lmeval")
    tasks = tmp / "tasks"
    tasks.mkdir()
    data = tmp / "quiz.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": a}) + "\n" for q, c, a in QUESTIONS))
    (tasks / "tiny_python_quiz.yaml").write_text(TASK_YAML.format(data=data))
    (tasks / "needs_hub.yaml").write_text("task: needs_hub\ndataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\n"
                                         "test_split: test\noutput_type: multiple_choice\ndoc_to_text: question\n"
                                         "doc_to_choice: '{{choices.text}}'\ndoc_to_target: 0\n")
    # The same task during training, at eval.every and after the last step.
    cfg = small_config("comm.name=local", "masker.coverage=1", "train.steps=3", "train.batch_size=4",
                       "eval.batches=1", "eval.every=2", "eval.tasks=[tiny_python_quiz]", f"eval.include_path={tasks}",
                       "eval.offline=true", "data.stdlib_max_mb=0.5", "data.seq_len=64", f"data.cache_dir={tmp}/data",
                       "run.name=llama", "checkpoint.enabled=true", "checkpoint.final=always", recipe="llama_tiny_stdlib", run_dir=tmp / "runs")
    run = train(cfg, LaunchEnv(), plugin_manager())
    assert set(run.result.eval_metrics) >= {"loss", "tiny_python_quiz/acc", "tiny_python_quiz/acc_norm"}
    return tmp / "runs" / "llama", tasks


def _by_hand(run_path) -> tuple[float, float]:
    """Accuracy and length-normalised accuracy from the union model's own log-likelihoods."""
    model = load_union(run_path, plugin_manager()).model.eval()
    correct = correct_norm = 0
    for question, choices, label in QUESTIONS:
        context = f"Question: {question}\nAnswer:".encode()
        lls = []
        for choice in choices:
            cont = f" {choice}".encode()  # lm-eval's target delimiter is one space
            ids = list(context) + list(cont)  # the byte tokenizer: token = byte
            with torch.no_grad():
                logp = F.log_softmax(model(torch.tensor([ids[:-1]]))[0].float(), -1)
            lls.append(sum(float(logp[len(context) - 1 + i, t]) for i, t in enumerate(cont)))
        correct += max(range(len(choices)), key=lambda i: lls[i]) == label
        correct_norm += max(range(len(choices)), key=lambda i: lls[i] / len(choices[i])) == label
    return correct / len(QUESTIONS), correct_norm / len(QUESTIONS)


def test_lm_eval_on_a_local_task_scores_what_the_log_likelihoods_say(run_dir, capsys):
    run_path, tasks = run_dir
    during = {s: json.loads((run_path / "lm_eval" / f"step_{s:08d}.json").read_text()) for s in (2, 3)}
    logged = [json.loads(line) for line in (run_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "lm_eval/tiny_python_quiz/acc" in r] == [2, 3]
    # The corpus (and its tokenizer) where the run built it: eval never takes data.cache_dir from a checkpoint.
    code = main(["eval", str(run_path), f"data.cache_dir={run_path.parents[1] / 'data'}", "--tasks", "tiny_python_quiz",
                 "--include-path", str(tasks), "--offline", "--device", "cpu", "--batch-size", "8"])
    out = capsys.readouterr().out
    assert code == 0
    print(out)  # lm-eval's own table, shown with -s
    assert "|tiny_python_quiz|" in out.replace(" ", "") and "acc" in out

    acc, acc_norm = _by_hand(run_path)
    written = json.loads((run_path / "lm_eval" / "step_00000003.json").read_text())
    scores = written["results"]["tiny_python_quiz"]
    assert scores["acc,none"] == pytest.approx(acc, abs=1e-12)
    assert scores["acc_norm,none"] == pytest.approx(acc_norm, abs=1e-12)
    # The in-training evaluation after the last step saw the same union model.
    assert during[3]["results"]["tiny_python_quiz"]["acc,none"] == scores["acc,none"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    points = events.Scalars("lm_eval/tiny_python_quiz/acc")
    assert [p.step for p in points] == [2, 3, 3]  # in training at steps 2 and 3, then `subnetdp eval`
    assert points[-1].value == pytest.approx(acc, abs=1e-6)


def test_a_task_that_needs_a_download_is_named_offline(run_dir, capsys):
    run_path, tasks = run_dir
    code = main(["eval", str(run_path), "--tasks", "tiny_python_quiz,needs_hub", "--include-path", str(tasks),
                 "--offline", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert "lm-eval task 'needs_hub' needs a download" in err and "'allenai/ai2_arc'" in err
    assert "Traceback" not in err
    code = main(["eval", str(run_path), "--tasks", "tiny_python_qiz", "--include-path", str(tasks), "--offline"])
    assert code == 2
